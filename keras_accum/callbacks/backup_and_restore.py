"""`BackupAndRestore`: resume a killed `fit()` exactly where it stopped.

The callback holds Keras' hooks only: the folder's format is
`keras_accum._backup_folder`, the workers' protocol `keras_accum._workers`.
"""

import contextlib
import itertools
import numbers
import os
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_accum import _backup_folder as folders
from keras_accum import _keras_compat as compat
from keras_accum import _workers


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training and resumes it exactly, mid-epoch and mid-window.

    Like `keras.callbacks.BackupAndRestore`, but a resumed `fit()` skips the
    batches the backup had seen and restores the pending window and the seed
    generators: with the input in the same order in every run, it ends with
    the uninterrupted run's weights. See docs/semantics.md, "Saving and
    resuming".

    Args:
        backup_dir: str or path, the folder for the backups of one training
            run, on any file system that TensorFlow reads (a local path,
            `gs://`, `hdfs://`, `file://`, `ram://`); it is created at the
            start of `fit()`.
        save_freq: `"epoch"` (default), to back up at the end of every
            epoch; an int >= 1, to back up every `save_freq` batches too; or
            `False`, to only restore an existing backup (and back up on
            SIGTERM with `save_before_preemption=True`).
        double_checkpoint: bool. If `True`, the previous backup is kept too,
            to restore if the newest is damaged. Defaults to `False`.
        delete_checkpoint: bool. If `True` (default) the folder is deleted
            when `fit()` ends normally.
        strict: bool. If `True` (default), a restart whose input differs
            from the backed-up run's at the backup's position (another
            dataset, or an order that is not the same in every run) raises;
            if `False`, it warns and resumes.
        save_before_preemption: bool. If `True`, SIGTERM (what a cluster
            sends before it preempts a job) does not end the process at
            once: the train call in progress finishes, a backup is made at
            that batch (with several workers, at the same batch on all, at
            most two batches after the signal, agreed through TensorFlow's
            coordination service), and the process exits with status
            `PREEMPTION_EXIT_CODE` (42), to be restarted with the same
            command. The previous SIGTERM handler is put back at the end
            of `fit()`. Defaults to `False`.

    With several workers (`tf.distribute.MultiWorkerMirroredStrategy`),
    each worker writes its own backups into its `backup_dir`: one folder
    that all share, or a folder per worker (local disks). At a restart the
    workers restore the newest backup that all of them hold. A restart
    needs all the workers restarted.

    Raises:
        ValueError: for an invalid argument; at the start of `fit()`, if the
            model is not a `GradientAccumulationModel`, if `backup_dir`
            cannot be written to, if no backup in it can be restored, if
            the workers hold no backup in common (on every worker, naming
            each worker's backups), or if the backup is past the end of an
            epoch of this `fit()`; in the
            first train step, if the input differs from the backed-up one
            (with `strict=True`); at the start of `fit()` with
            `save_before_preemption=True`, if it runs in another thread than
            the main one.
        SystemExit: with `save_before_preemption=True`, after the backup
            that SIGTERM asked for; its code is `PREEMPTION_EXIT_CODE`.

    Example:

    ```python
    # `model`: a compiled `GradientAccumulationModel`. Run the same script
    # again after a crash: it goes on from the last backup.
    backup = keras_accum.callbacks.BackupAndRestore("backups", save_freq=50)
    model.fit(x, y, shuffle=False, epochs=10, callbacks=[backup])
    ```
    """

    # The exit status of a process that backed up on SIGTERM.
    PREEMPTION_EXIT_CODE = 42
    # What `GradientAccumulationModel.fit()` looks for (the core does not
    # import the callbacks): a backup that records the input's position.
    keras_accum_backup = True

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,
        delete_checkpoint=True,
        strict=True,
        save_before_preemption=False,
    ):
        super().__init__()
        if not backup_dir or not isinstance(backup_dir, (str, os.PathLike)):
            raise ValueError(
                "`backup_dir` must be a non-empty path. Received: "
                f"backup_dir={backup_dir!r}"
            )
        every = (
            isinstance(save_freq, numbers.Integral)
            and not isinstance(save_freq, bool)
            and save_freq >= 1
        )
        if not every and save_freq is not False and not (
            isinstance(save_freq, str) and save_freq == "epoch"
        ):
            raise ValueError(
                "`save_freq` must be 'epoch', an integer >= 1 or False. "
                f"Received: save_freq={save_freq!r}"
            )
        for name, value in (
            ("double_checkpoint", double_checkpoint),
            ("delete_checkpoint", delete_checkpoint),
            ("strict", strict),
            ("save_before_preemption", save_before_preemption),
        ):
            if not isinstance(value, bool):
                raise ValueError(
                    f"`{name}` must be a bool. Received: {name}={value!r}"
                )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = int(save_freq) if every else save_freq
        self._every_batches = every
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.strict = strict
        self.save_before_preemption = save_before_preemption
        self._preemption = _workers.Preemption()
        self._worker, self._workers, self._strategy = 0, 1, None
        self._backed_up_at = None
        self._epoch = self._batches_in_epoch = self._resume_at = 0
        self._since_backup = self._checks = 0
        self._previous = None  # the folder `double_checkpoint` keeps
        self._final_logs = None  # a restored epoch end's logs
        self._last_complete = None  # the newest complete backup known
        self._epochs_ended = 0

    def on_train_begin(self, logs=None):
        # The same count on every worker (each runs the same `fit()`s).
        self._fit = next(_FITS)
        if not hasattr(self.model, "gradient_accumulator"):
            raise ValueError(
                "`keras_accum.callbacks.BackupAndRestore` needs a "
                "`GradientAccumulationModel` (for other models, use "
                "`keras.callbacks.BackupAndRestore`). Received: model of "
                f"type {type(self.model).__name__}"
            )
        root = self.backup_dir
        self._strategy = self.model.distribute_strategy
        self._worker, self._workers = _workers.workers(self._strategy)
        with self._failing_together("restore a backup"):
            self._begin(root)

    def _begin(self, root):
        """Checks `backup_dir`, restores the newest backup (if any) and
        installs the SIGTERM handler."""
        if self.save_freq is not False or self.save_before_preemption:
            # Every worker writes its own backups.
            try:
                folders.check_writable(root, self._worker)
            except folders.DAMAGE as error:
                raise ValueError(
                    "`backup_dir` must be a folder that this process can "
                    f"write backups to; writing to '{root}' failed "
                    f"({type(error).__name__}: {error}). Received: "
                    f"backup_dir={root!r}"
                ) from error
        elif folders.is_file(root):
            raise ValueError(
                "`backup_dir` must be a folder, but it is a file. "
                f"Received: backup_dir={root!r}"
            )
        self._previous = self._backed_up_at = self._final_logs = None
        self._last_complete = None
        self._epochs_ended = self._checks = 0
        position = self._restore()
        self._epoch = position["epoch"] if position else 0
        self._resume_at = position["batches"] if position else 0
        self._since_backup = 0
        params = self.params or {}
        steps = params.get("steps")
        if steps and self._resume_at > steps:
            raise ValueError(
                f"The backup in '{root}' was made after batch "
                f"{self._resume_at} of epoch {self._epoch}, but an epoch of "
                f"this `fit()` has {steps} batches: the input is not the "
                "one that was backed up."
            )
        if position:
            if not self._resume_at and position.get("logs") is not None:
                # Returned in History if no epoch is left to train.
                self._final_logs = (self._epoch - 1, position["logs"])
            # `fit()` reads this right after `on_train_begin`.
            compat.set_initial_epoch(self.model, self._epoch)
            self.model.input_position.resume(
                self._epoch,
                self._resume_at,
                metrics=position.get("metrics"),
                expected=self._fingerprint(position),
                where=f"batch {self._resume_at} of epoch {self._epoch}",
                strict=self.strict,
            )
        if self.save_before_preemption:
            self._preemption.install(self._strategy)

    def _fingerprint(self, position):
        """The fingerprint of the last batch that this worker trained on
        before the backup (each worker reads its own part of the input),
        or `None` if the backup has none for it."""
        per_worker = position.get("worker_fingerprints")
        if per_worker is not None:
            if len(per_worker) == self._workers:
                return per_worker[self._worker]
            return None
        return position.get("fingerprint") if self._workers == 1 else None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._batches_in_epoch = epoch, 0

    @contextlib.contextmanager
    def _failing_together(self, what):
        """With several workers: this worker's error while it does `what`
        is published for the others; a collective that fails because
        another worker stopped raises an error that names that worker and
        its error (or, where none was published, says so)."""
        try:
            yield
        except Exception as error:
            if self._workers == 1 or isinstance(error, WorkerFailedError):
                raise
            if _collective(error):
                others = _workers.reported_failures(self._strategy, self._fit)
                raise WorkerFailedError(
                    _stopped_by_others(self._worker, what, others, error)
                ) from error
            _workers.report_failure(
                self._strategy, self._fit,
                f"worker {self._worker} could not {what}: "
                f"{type(error).__name__}: {error}",
            )
            raise

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the call's last step (nominal: an epoch's last call of
        # `steps_per_execution` may be shorter); Keras counts skipped
        # batches too.
        steps = (self.params or {}).get("steps")
        end = min(batch + 1, steps) if steps else batch + 1
        seen = end - max(self._batches_in_epoch, self._resume_at)
        self._batches_in_epoch = end
        if seen > 0:
            self._since_backup += seen
            if self._every_batches and self._since_backup >= self.save_freq:
                self._backup(self._epoch, self._batches_in_epoch)
            # Not while skipping the batches before a restored backup: the
            # same check points on every worker.
            self._exit_if_preempted(self._epoch, self._batches_in_epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._resume_at = 0
        self._epochs_ended += 1
        logs = _numbers(logs)
        if self.save_freq is not False:
            self._backup(epoch + 1, 0, logs)
        self._exit_if_preempted(epoch + 1, 0, logs)

    def on_train_end(self, logs=None):
        self.release_signal_handler()
        compat.set_initial_epoch(self.model, None)
        self.model.input_position.reset()
        history = getattr(self.model, "history", None)
        if (
            self._final_logs is not None
            and not self._epochs_ended
            and isinstance(history, keras.callbacks.History)
            and not getattr(history, "epoch", None)
        ):
            # Nothing was left to train: the last epoch's logs, as the
            # backed-up run logged them.
            epoch, last = self._final_logs
            history.epoch = [epoch]
            for key, value in last.items():
                history.history.setdefault(key, []).append(value)
        if self.delete_checkpoint:
            if self._workers > 1:
                # Each worker its own backups, then the folder, once all
                # are done (a folder may be shared).
                folders.prune(self.backup_dir, self._worker, keep=())
                _workers.barrier(self._strategy)
                if self._worker == 0 or not folders.listing(self.backup_dir):
                    folders.remove(self.backup_dir)
            else:
                folders.remove(self.backup_dir)

    def release_signal_handler(self):
        """Puts back the SIGTERM handler that `fit()` found (with
        `save_before_preemption=True`; also when `fit()` raised)."""
        self._preemption.uninstall()

    def _exit_if_preempted(self, epoch, batches, logs=None):
        """Backs up at `(epoch, batches)` and exits if the workers stop at
        this check point for SIGTERM (`save_before_preemption`)."""
        if not self.save_before_preemption:
            return
        self._checks += 1
        with self._failing_together("agree on where to stop for SIGTERM"):
            due = self._preemption.due(self._checks)
        if not due:
            return
        if self._backed_up_at != (epoch, batches):
            self._backup(epoch, batches, logs)
        self._preemption.uninstall()
        raise SystemExit(self.PREEMPTION_EXIT_CODE)

    def _seed_variables(self):
        """The `SeedGenerator` states: `model.variables` less weights."""
        weights = {id(w) for w in self.model.weights}
        return [v for v in self.model.variables if id(v) not in weights]

    def _backup(self, epoch, batches, logs=None):
        """Writes a complete backup of this worker, then deletes its older
        ones (once every worker holds the new one)."""
        with self._failing_together(
            f"write its backup after batch {batches} of epoch {epoch}"
        ):
            self._write_backup(epoch, batches, logs)

    def _write_backup(self, epoch, batches, logs):
        self._since_backup = 0
        self._backed_up_at = (epoch, batches)
        position = {"epoch": epoch, "batches": batches}
        if batches:
            # The epoch's loss and metrics so far (an epoch starts anew),
            # and what the last batch held, to check the restart's input.
            position["metrics"] = [
                np.asarray(v.numpy()).tolist()
                for v in self.model.metrics_variables
            ]
            fingerprint = self.model.input_position.recorded()
            if self._workers > 1 and fingerprint is not None:
                # Each worker's own (every worker gathers them).
                local = len(_workers.local_replica_ids(self._strategy))
                rows = _workers.gather(self._strategy, [fingerprint] * local)
                position["worker_fingerprints"] = rows[::local].tolist()
            elif fingerprint is not None:
                position["fingerprint"] = fingerprint
        elif logs:
            position["logs"] = logs
        position["seed_generators"] = [
            np.asarray(v.numpy()).tolist() for v in self._seed_variables()
        ]
        generator = compat.global_seed_generator()
        if generator is not None:
            state = np.asarray(generator.state.numpy()).tolist()
            position["global_seed_generator"] = state
        # `save_weights` gathers the pending window from every worker.
        backup = self._write(epoch, batches, position)
        if self._workers > 1:
            # No worker deletes a backup before all hold the new one.
            _workers.barrier(self._strategy)
        keep = {backup.name}
        if self.double_checkpoint:
            keep.add(self._previous)
        self._previous = backup.name
        folders.prune(self.backup_dir, self._worker, keep)

    def _write(self, epoch, batches, position):
        """`folders.write()`, tried again after a transient error of a
        remote file system (each try in a new folder: its files are written
        once); any other error stops training, saying which backup a
        restart will use."""
        for wait in (*_RETRY_SECONDS, None):
            try:
                backup = folders.write(
                    self.backup_dir, epoch, batches, self._worker,
                    self.model.save_weights, position, self._expected_bytes(),
                )
            except folders.WriteError as error:
                if _collective(error.cause):
                    # `save_weights` gathers from the other workers: one
                    # of them stopped, not this file system.
                    raise error.cause from None
                if wait is not None and isinstance(error.cause, _TRANSIENT):
                    warnings.warn(
                        f"Writing the backup '{error.backup.path}' failed "
                        f"({error}); trying again in {wait} s.",
                        stacklevel=4,
                    )
                    time.sleep(wait)
                    continue
                raise self._write_failed(error) from error.cause
            self._last_complete = backup
            return backup

    def _expected_bytes(self):
        """About what a backup takes: the last one's weights file, or twice
        the model's and optimizer's variables (the window's buffers too),
        and room for HDF5's own records."""
        last = self._last_complete
        if last is not None and last.worker == self._worker:
            with contextlib.suppress(*folders.DAMAGE):
                return int(folders.size(last) * 1.1) + _SLACK
        variables = list(self.model.variables)
        if self.model.optimizer is not None:
            variables += list(self.model.optimizer.variables)
        data = sum(
            int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
            for v in variables
        )
        return 2 * data + _SLACK

    def _write_failed(self, error):
        """The error of a backup that could not be written."""
        last = self._last_complete
        if last is None:
            then = (
                "There is no complete backup in it yet: a restart trains "
                "from the beginning."
            )
        else:
            then = (
                "A restart resumes from the last complete backup, "
                f"'{last.path}' (after batch {last.batches} of epoch "
                f"{last.epoch})."
            )
        return BackupWriteError(
            f"Could not write the backup '{error.backup.path}' in "
            f"`backup_dir` ({error}). Training stopped. {then} Free space or "
            "fix the folder's permissions, then run the same `fit()` again."
        )

    def _restore(self):
        """Loads the newest backup that every worker holds intact; returns
        its position (`None` if there is none: training starts over)."""
        root = self.backup_dir
        candidates, problems, partial = [], [], False
        for backup in folders.listing(root):
            try:
                position = folders.read(backup)
            except folders.DAMAGE as damage:
                which = folders.MANIFEST if backup.worker is not None else (
                    "position.json"
                )
                problems.append((backup.order, (
                    f"Could not restore the backup in "
                    f"'{backup.file(which)}' ({type(damage).__name__}: "
                    f"{damage})"
                )))
                continue
            if position is None:
                partial = True
            else:
                # This worker's own first (in a folder that workers share).
                candidates.append((backup, position))
        candidates.sort(key=lambda c: c[0].worker != self._worker)
        candidates.sort(key=lambda c: c[0].order[:2], reverse=True)
        keys = list(dict.fromkeys(b.key for b, _ in candidates))
        common, held = _workers.held_by_all(self._strategy, keys, root)
        if not common and any(k for _, k in held):
            # Several workers, and none that all hold: the same error on
            # every worker (from the same gathered values).
            raise ValueError(_no_common_backup(held))
        error = None
        for key in common:
            ok = False
            for backup, position in candidates:
                if backup.key != key:
                    continue
                path = backup.file(folders.WEIGHTS)
                try:
                    with folders.local_copy(path) as local:
                        self._load_weights(local)
                    self._restore_seeds(position)
                except folders.DAMAGE as damage:
                    problems.append((backup.order, (
                        f"Could not restore the backup in '{path}' "
                        f"({type(damage).__name__}: {damage})"
                    )))
                    error = damage
                    continue
                ok = True
                break
            if self._workers > 1 and _workers.any_worker(
                self._strategy, not ok
            ):
                if ok:
                    problems.append((backup.order, (
                        "Another worker could not restore its backup "
                        f"after batch {key[1]} of epoch {key[0]}"
                    )))
                continue
            if not ok:
                continue
            newer = [text for order, text in problems
                     if order[:2] >= backup.order[:2]]
            if newer:
                warnings.warn(
                    f"{'; '.join(newer)}: restoring the previous backup "
                    f"'{backup.path}' instead.",
                    stacklevel=3,
                )
            if backup.worker == self._worker:
                self._previous = backup.name
            self._last_complete = backup
            return position
        if not problems and not common:
            if partial:
                warnings.warn(
                    f"'{root}' holds only backups that were not "
                    "completed (a process killed while writing its "
                    "first one): training starts from the beginning.",
                    stacklevel=3,
                )
            return None
        hint = (
            ""
            if self.double_checkpoint
            else " (`double_checkpoint=True` keeps the previous backup too, "
            "to fall back to)"
        )
        raise ValueError(
            f"No backup in '{root}' can be restored. "
            f"{'. '.join(t for _, t in problems)}. To start training over, "
            f"delete the folder '{root}'{hint}."
        ) from error

    def _load_weights(self, path):
        """`load_weights(path)`, raising where Keras warns that it skipped."""
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built and self.model.built:
            # As Keras' `BackupAndRestore`: the variables to load into.
            optimizer.build(self.model.trainable_variables)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.model.load_weights(path)
        for warning in caught:
            if compat.skipped_loading(warning.message):
                raise ValueError(str(warning.message).strip())
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def _restore_seeds(self, position):
        """Assigns the seed generators' states that `position` holds."""
        if "seed_generators" not in position:
            return
        variables = self._seed_variables()
        saved = position["seed_generators"]
        if len(saved) != len(variables):
            raise ValueError(
                f"it holds {len(saved)} seed generator states, but the model "
                f"has {len(variables)} seed generators"
            )
        values = [np.asarray(s, v.dtype) for s, v in zip(saved, variables)]
        for value, variable in zip(values, variables):
            if value.shape != tuple(variable.shape):
                raise ValueError(
                    f"a seed generator state of shape {value.shape} does not "
                    f"fit the model's `{variable.path}` of shape "
                    f"{tuple(variable.shape)}"
                )
        for value, variable in zip(values, variables):
            variable.assign(value)
        state = position.get("global_seed_generator")
        if state is not None:
            state_variable = compat.global_seed_generator(create=True).state
            state_variable.assign(np.asarray(state, state_variable.dtype))


class BackupWriteError(RuntimeError):
    """A backup that could not be written: training stops."""


class WorkerFailedError(RuntimeError):
    """Another worker stopped, and so this one: the error names it."""


# `fit()` calls in this process: every worker counts the same.
_FITS = itertools.count()


def _collective(error):
    """Whether `error` is a collective's with the other workers, which
    fails when one of them stops."""
    return isinstance(error, tf.errors.OpError) and "Collective" in str(
        error.message
    )


def _stopped_by_others(worker, what, others, error):
    """The error of a worker whose collective failed because others
    stopped: `others`, `[(worker, what it published)]`."""
    lines = [line.strip() for line in str(error.message).splitlines()]
    lines = [line for line in lines if line]
    # The line that says why the collective stopped, where there is one.
    first = next(
        (line for line in lines if line.startswith("Collective ops")),
        lines[0] if lines else "",
    )
    if others:
        which = ", ".join(f"worker {w}" for w, _ in others)
        said = " ".join(
            f"{text[:1].upper()}{text[1:].rstrip('.')}." for _, text in others
        )
        return (
            f"{which.capitalize()} stopped, and so worker {worker}, while it "
            f"tried to {what}. {said} (Worker {worker}'s own error: "
            f"{type(error).__name__}: {first})"
        )
    return (
        f"A collective with the other workers failed while worker {worker} "
        f"tried to {what}: another worker stopped and published no error "
        "(the chief, whose process holds the coordination service, or a "
        "process that was killed); its log says why. (Worker "
        f"{worker}'s own error: {type(error).__name__}: {first})"
    )


# Errors of a remote file system that a new try may not meet, and the
# seconds waited before each new try.
_TRANSIENT = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
)
_RETRY_SECONDS = (1, 4)
# Bytes of HDF5's own records and the manifest, beyond the data.
_SLACK = 64 << 10


def _numbers(logs):
    """An epoch's logs that are numbers, as floats (for a backup)."""
    result = {}
    for key, value in (logs or {}).items():
        try:
            value = np.asarray(value)
        except (TypeError, ValueError):
            continue
        if value.shape == () and value.dtype.kind in "fiu":
            result[key] = value.item()
    return result


def _no_common_backup(held):
    """The error when the workers hold no backup in common."""
    parts, source = [], None
    for worker, (root, keys) in enumerate(held):
        if keys:
            newest = ", ".join(f"after batch {b} of epoch {e}"
                               for e, b in keys[:3])
            parts.append(f"worker {worker} holds backups in '{root}' "
                         f"({newest})")
            source = source or (worker, root)
        else:
            parts.append(f"worker {worker} holds none in '{root}'")
    return (
        "The workers hold no backup in common, so they cannot resume at the "
        f"same position: {'; '.join(parts)}. Every worker needs the same "
        f"backup: copy the newest backup folder of worker {source[0]}'s "
        f"'{source[1]}' into the `backup_dir` of each worker that lacks it, "
        "or, to start training over, delete the backups of all workers."
    )
