"""`BackupAndRestore`: resume a killed `fit()` exactly where it stopped."""

import contextlib
import json
import numbers
import os
import re
import shutil
import tempfile
import time
import warnings

import keras
import numpy as np

from keras_accum import _keras_compat as compat
from keras_accum.callbacks import _workers

_LATEST = "latest"
_WEIGHTS = "model.weights.h5"
_POSITION = "position.json"
# `backup-{epoch}-{batches}-{pid}-{time_ns}`
_FOLDER = re.compile(r"backup-(\d+)-(\d+)-(\d+)-(\d+)")
# What a damaged backup file raises when read or loaded (h5py: `OSError`).
_DAMAGE = (OSError, ValueError, KeyError, TypeError)


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training and resumes it exactly, mid-epoch and mid-window.

    Like `keras.callbacks.BackupAndRestore`, but a resumed `fit()` skips the
    batches the backup had seen and restores the pending window and the seed
    generators: with the input in the same order in every run, it ends with
    the uninterrupted run's weights. See docs/semantics.md, "Saving and
    resuming".

    Args:
        backup_dir: str or path, the folder for the backups of one training
            run; it is created at the start of `fit()`.
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
            that exact batch (with several workers, at the same batch on
            all, the first one any of them sees the signal after), and the
            process exits with status `PREEMPTION_EXIT_CODE` (42), to be
            restarted with the same command. The previous SIGTERM handler
            is put back at the end of `fit()`. Defaults to `False`.

    With several workers (`tf.distribute.MultiWorkerMirroredStrategy`),
    all of them use the same `backup_dir`, on a file system that they all
    see: the first worker (the chief) writes the backups, the others
    write theirs to temporary folders that they delete, and every worker
    restores the chief's. A restart needs all the workers restarted.

    Raises:
        ValueError: for an invalid argument; at the start of `fit()`, if the
            model is not a `GradientAccumulationModel`, if `backup_dir`
            cannot be written to, if no backup in it can be restored, or if
            the backup is past the end of an epoch of this `fit()`; in the
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
        self._sigterm = _workers.Sigterm()
        self._worker, self._workers, self._strategy = 0, 1, None
        self._backed_up_at = None
        self._epoch = self._batches_in_epoch = self._resume_at = 0
        self._since_backup = 0
        self._previous = None  # the folder `double_checkpoint` keeps

    def on_train_begin(self, logs=None):
        if not hasattr(self.model, "gradient_accumulator"):
            raise ValueError(
                "`keras_accum.callbacks.BackupAndRestore` needs a "
                "`GradientAccumulationModel` (for other models, use "
                "`keras.callbacks.BackupAndRestore`). Received: model of "
                f"type {type(self.model).__name__}"
            )
        folder = self.backup_dir
        self._strategy = self.model.distribute_strategy
        self._worker, self._workers = _workers.workers(self._strategy)
        writes = self.save_freq is not False or self.save_before_preemption
        if writes and self._worker == 0:
            try:
                os.makedirs(folder, exist_ok=True)
                with tempfile.TemporaryFile(dir=folder):
                    pass
            except OSError as error:
                raise ValueError(
                    "`backup_dir` must be a folder that this process can "
                    f"write backups to; writing to '{folder}' failed "
                    f"({type(error).__name__}: {error}). Received: "
                    f"backup_dir={folder!r}"
                ) from error
        elif os.path.exists(folder) and not os.path.isdir(folder):
            raise ValueError(
                "`backup_dir` must be a folder, but it is a file. "
                f"Received: backup_dir={folder!r}"
            )
        if self._workers > 1:
            # The chief made the folder: now every worker may read it.
            _workers.barrier(self._strategy)
        self._previous = self._backed_up_at = None
        position = self._restore()
        self._epoch = position["epoch"] if position else 0
        self._resume_at = position["batches"] if position else 0
        self._since_backup = 0
        steps = (self.params or {}).get("steps")
        if steps and self._resume_at > steps:
            raise ValueError(
                f"The backup in '{folder}' was made after batch "
                f"{self._resume_at} of epoch {self._epoch}, but an epoch of "
                f"this `fit()` has {steps} batches: the input is not the "
                "one that was backed up."
            )
        if position:
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
            self._sigterm.install()

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
            # same decision on every worker.
            self._exit_if_preempted(self._epoch, self._batches_in_epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._resume_at = 0
        if self.save_freq is not False:
            self._backup(epoch + 1, 0)
        self._exit_if_preempted(epoch + 1, 0)

    def on_train_end(self, logs=None):
        self.release_signal_handler()
        compat.set_initial_epoch(self.model, None)
        self.model.input_position.reset()
        if (
            self.delete_checkpoint
            and self._worker == 0
            and os.path.isdir(self.backup_dir)
        ):
            shutil.rmtree(self.backup_dir)

    def release_signal_handler(self):
        """Puts back the SIGTERM handler that `fit()` found (with
        `save_before_preemption=True`; also when `fit()` raised)."""
        self._sigterm.uninstall()

    def _exit_if_preempted(self, epoch, batches):
        """Backs up at `(epoch, batches)` and exits if any worker was sent
        SIGTERM (`save_before_preemption`)."""
        if not self.save_before_preemption or not _workers.any_worker(
            self._strategy, self._sigterm.seen
        ):
            return
        if self._backed_up_at != (epoch, batches):
            self._backup(epoch, batches)
        self._sigterm.uninstall()
        raise SystemExit(self.PREEMPTION_EXIT_CODE)

    def _seed_variables(self):
        """The `SeedGenerator` states: `model.variables` less weights."""
        weights = {id(w) for w in self.model.weights}
        return [v for v in self.model.variables if id(v) not in weights]

    def _backup(self, epoch, batches):
        """Writes a complete backup, then points `latest` at it."""
        self._since_backup = 0
        self._backed_up_at = (epoch, batches)
        chief = self._worker == 0
        root = self.backup_dir if chief else tempfile.mkdtemp()
        name = f"backup-{epoch}-{batches}-{os.getpid()}-{time.time_ns()}"
        folder = os.path.join(root, name)
        os.makedirs(folder)
        weights = os.path.join(folder, _WEIGHTS)
        self.model.save_weights(weights)
        with open(weights, "rb") as f:
            os.fsync(f.fileno())
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
        position["seed_generators"] = [
            np.asarray(v.numpy()).tolist() for v in self._seed_variables()
        ]
        generator = compat.global_seed_generator()
        if generator is not None:
            state = np.asarray(generator.state.numpy()).tolist()
            position["global_seed_generator"] = state
        if not chief:
            # Its part of the collective reads done, nothing to keep.
            shutil.rmtree(root, ignore_errors=True)
            _workers.barrier(self._strategy)
            return
        # Written last: a folder with a `position.json` is complete.
        _write_atomically(os.path.join(folder, _POSITION), json.dumps(position))
        _write_atomically(os.path.join(root, _LATEST), name)
        keep = {name, self._previous if self.double_checkpoint else None}
        self._previous = name
        # Earlier backups, and any a killed process left half-written.
        for entry in os.listdir(root):
            if _FOLDER.fullmatch(entry) and entry not in keep:
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        if self._workers > 1:
            # Nobody goes on (and may be stopped) before the backup is whole.
            _workers.barrier(self._strategy)

    def _restore(self):
        """Loads the newest intact backup; returns its position."""
        root = self.backup_dir
        if not os.path.isdir(root):
            return None
        folders = [
            entry
            for entry in os.listdir(root)
            if _FOLDER.fullmatch(entry)
            and os.path.isdir(os.path.join(root, entry))
        ]
        folders.sort(key=_order, reverse=True)
        complete = [
            entry
            for entry in folders
            if os.path.exists(os.path.join(root, entry, _POSITION))
        ]
        path = os.path.join(root, _LATEST)
        pointed, problems = None, []
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if not text.strip():
                problems.append(f"The pointer file '{path}' is empty")
            elif text.strip() not in folders:
                problems.append(
                    f"The pointer file '{path}' names no backup folder (it "
                    f"reads {text[:80]!r})"
                )
            else:
                pointed = text.strip()
        except FileNotFoundError:
            if not complete:
                if folders:
                    warnings.warn(
                        f"'{root}' holds only backups that were not "
                        "completed (a process killed while writing its "
                        "first one): training starts from the beginning.",
                        stacklevel=3,
                    )
                return None
            problems.append(
                f"The pointer file '{path}' is missing although the folder "
                "holds backups"
            )
        except _DAMAGE as error:
            problems.append(
                f"Could not read the pointer file '{path}' "
                f"({type(error).__name__}: {error})"
            )
        # The backup that `latest` names first, then the others newest first.
        candidates = [pointed] if pointed else []
        error = None
        for entry in candidates + [e for e in complete if e != pointed]:
            # `path`: the file that a failure of each step is reported for.
            path = os.path.join(root, entry, _POSITION)
            try:
                position = _read_position(path)
                path = os.path.join(root, entry, _WEIGHTS)
                self._load_weights(path)
                path = os.path.join(root, entry, _POSITION)
                self._restore_seeds(position)
            except _DAMAGE as damage:
                problems.append(
                    f"Could not restore the backup in '{path}' "
                    f"({type(damage).__name__}: {damage})"
                )
                error = damage
                continue
            if problems:
                if not pointed:
                    which = "the newest complete backup found,"
                elif _order(entry) < _order(pointed):
                    which = "the previous backup"
                else:
                    which = "the complete backup"
                warnings.warn(
                    f"{'; '.join(problems)}: restoring {which} "
                    f"'{os.path.join(root, entry)}' instead.",
                    stacklevel=3,
                )
            self._previous = entry
            return position
        hint = (
            ""
            if self.double_checkpoint
            else " (`double_checkpoint=True` keeps the previous backup too, "
            "to fall back to)"
        )
        raise ValueError(
            f"No backup in '{root}' can be restored. "
            f"{'. '.join(problems)}. To start training over, delete the "
            f"folder '{root}'{hint}."
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
            if "Skipping variable loading" in str(warning.message):
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


def _order(name):
    """A backup folder's (epoch, batches, time) from its name."""
    epoch, batches, _, time_ns = map(int, _FOLDER.fullmatch(name).groups())
    return epoch, batches, time_ns


def _read_position(path):
    """A backup's `position.json`, its fields checked."""
    with open(path, encoding="utf-8") as f:
        position = json.load(f)
    if not isinstance(position, dict):
        raise ValueError(
            f"expected a JSON object. Received: {type(position).__name__}"
        )

    def ints(value):  # `true` and `false` load as `bool`
        return isinstance(value, list) and all(type(v) is int for v in value)

    for key in ("epoch", "batches"):
        if key not in position:
            raise ValueError(f"`{key}` is missing")
        if type(position[key]) is not int or position[key] < 0:
            raise ValueError(
                f"`{key}` must be an integer >= 0. Received: "
                f"{key}={position[key]!r}"
            )
    states = position.get("seed_generators", [])
    if not isinstance(states, list) or not all(map(ints, states)):
        raise ValueError(
            "`seed_generators` must be a list of lists of integers. "
            f"Received: seed_generators={states!r}"
        )
    metrics = position.get("metrics", [])
    if not isinstance(metrics, list) or not all(map(_numbers, metrics)):
        raise ValueError(
            "`metrics` must be a list of numbers or nested lists of "
            f"numbers. Received: metrics={metrics!r}"
        )
    fingerprint = position.get("fingerprint")
    if fingerprint is not None and not _fingerprint(fingerprint):
        raise ValueError(
            "`fingerprint` must be a list of 3 numbers. Received: "
            f"fingerprint={fingerprint!r}"
        )
    per_worker = position.get("worker_fingerprints")
    if per_worker is not None and not (
        isinstance(per_worker, list) and all(map(_fingerprint, per_worker))
    ):
        raise ValueError(
            "`worker_fingerprints` must be a list of lists of 3 numbers. "
            f"Received: worker_fingerprints={per_worker!r}"
        )
    state = position.get("global_seed_generator")
    if state is not None and not ints(state):
        raise ValueError(
            "`global_seed_generator` must be a list of integers or null. "
            f"Received: global_seed_generator={state!r}"
        )
    return position


def _fingerprint(value):
    return isinstance(value, list) and len(value) == 3 and _numbers(value)


def _numbers(value):
    """Whether `value` is a number or a nested list of numbers."""
    if isinstance(value, list):
        return all(map(_numbers, value))
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _write_atomically(path, text):
    """Replaces `path` with a complete new file, then flushes its folder."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    with contextlib.suppress(OSError):  # Not every system syncs a folder.
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
