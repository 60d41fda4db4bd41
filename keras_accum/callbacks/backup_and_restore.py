"""`BackupAndRestore`: resume a killed `fit()` exactly where it stopped."""

import json
import numbers
import os
import re
import shutil
import time
import warnings

import keras
import numpy as np

from keras_accum import _keras_compat as compat

_LATEST = "latest"
_WEIGHTS = "model.weights.h5"
_POSITION = "position.json"
# `backup-{epoch}-{batches}-{pid}-{time_ns}`
_FOLDER = re.compile(r"backup-(\d+)-(\d+)-(\d+)-(\d+)")
# What a damaged or foreign backup file raises when it is read or loaded
# (h5py: `OSError`; JSON and text decoding: `ValueError` subclasses).
_DAMAGE = (OSError, ValueError, KeyError, TypeError)


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training and resumes it exactly, mid-epoch and mid-window.

    Like `keras.callbacks.BackupAndRestore`, a `fit()` that was interrupted
    (an exception, a preempted machine, `SIGKILL`) and is started again with
    the same command resumes from the last backup; unlike it, the batches
    that the backup had already seen are skipped, not trained again, so the
    run ends with the weights of the uninterrupted one.

    A resume restores the weights, the optimizer, the pending window, the
    seed generators' states (`Dropout` draws the uninterrupted run's masks)
    and the position in the epoch; not metrics, nor the input: it is exact
    when the input comes in the same order in every run
    (`fit(..., shuffle=False)`, or a `tf.data` pipeline that does not
    reshuffle between runs). A process killed while writing a backup
    resumes from the previous one. See docs/semantics.md, "Saving and
    resuming".

    Args:
        backup_dir: str or path, the folder for the backups. One training
            run per folder; it is created at the start of `fit()`.
        save_freq: `"epoch"` (default), to back up at the end of every
            epoch; an int >= 1, to back up every `save_freq` batches (and at
            the end of every epoch); or `False`, for no backups: the
            callback only restores an existing one. A resume replays the
            batches since the last backup, so any frequency gives the same
            final weights.
        double_checkpoint: bool. If `True`, the previous backup is kept
            beside the newest one (twice the disk space), to restore if the
            newest is damaged. Defaults to `False`.
        delete_checkpoint: bool. If `True` (default) the folder is deleted
            when `fit()` ends normally.

    Raises:
        ValueError: for an invalid argument; at the start of `fit()`, if the
            model is not a `GradientAccumulationModel`, if `backup_dir`
            cannot be written to, if the folder holds backups of which none
            can be restored (each file that failed is named), or if the
            backup is past the end of an epoch of this `fit()`.

    Example:

    ```python
    # `model`: a compiled `GradientAccumulationModel`. Run the same script
    # again after a crash: it goes on from the last backup.
    backup = keras_accum.callbacks.BackupAndRestore(
        "backups", save_freq=50, double_checkpoint=True
    )
    model.fit(x, y, shuffle=False, epochs=10, callbacks=[backup])
    ```
    """

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,
        delete_checkpoint=True,
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
        self._epoch = 0
        self._batches_in_epoch = 0
        self._resume_at = 0
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
        self._check_backup_dir()
        self._previous = None
        position = self._restore()
        self._epoch, self._resume_at = position or (0, 0)
        self._since_backup = 0
        steps = (self.params or {}).get("steps")
        if steps and self._resume_at > steps:
            raise ValueError(
                f"The backup in '{self.backup_dir}' was made after batch "
                f"{self._resume_at} of epoch {self._epoch}, but an epoch of "
                f"this `fit()` has {steps} batches: the input is not the "
                "one that was backed up."
            )
        if position:
            # `fit()` reads this right after `on_train_begin`.
            compat.set_initial_epoch(self.model, self._epoch)
            self.model.batch_skip.set(self._resume_at)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._batches_in_epoch = epoch, 0

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the index of the call's last step (several with
        # `steps_per_execution`); Keras counts the skipped batches too.
        seen = batch + 1 - max(self._batches_in_epoch, self._resume_at)
        self._batches_in_epoch = batch + 1
        if seen <= 0:
            return
        self._since_backup += seen
        if self._every_batches and self._since_backup >= self.save_freq:
            self._backup(self._epoch, self._batches_in_epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._resume_at = 0
        if self.save_freq is not False:
            self._backup(epoch + 1, 0)

    def on_train_end(self, logs=None):
        compat.set_initial_epoch(self.model, None)
        self.model.batch_skip.set(0)
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir)

    def _check_backup_dir(self):
        """Creates `backup_dir` and checks that files can be written in it."""
        folder = self.backup_dir
        if self.save_freq is False:
            if os.path.exists(folder) and not os.path.isdir(folder):
                raise ValueError(
                    "`backup_dir` must be a folder, but it is a file. "
                    f"Received: backup_dir={folder!r}"
                )
            return
        probe = os.path.join(folder, f".write-test-{os.getpid()}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as error:
            raise ValueError(
                "`backup_dir` must be a folder that this process can write "
                f"backups to; writing to '{folder}' failed "
                f"({type(error).__name__}: {error}). Received: "
                f"backup_dir={folder!r}"
            ) from error

    def _backup(self, epoch, batches):
        """Writes a complete backup, then points `latest` at it."""
        self._since_backup = 0
        os.makedirs(self.backup_dir, exist_ok=True)
        name = f"backup-{epoch}-{batches}-{os.getpid()}-{time.time_ns()}"
        folder = os.path.join(self.backup_dir, name)
        os.makedirs(folder)
        weights = os.path.join(folder, _WEIGHTS)
        self.model.save_weights(weights)
        _fsync(weights)
        position = {"epoch": epoch, "batches": batches}
        position.update(_seed_values(self.model))
        # Written last: a folder with a `position.json` is complete.
        _write_atomically(
            os.path.join(folder, _POSITION), json.dumps(position)
        )
        _fsync(folder, required=False)
        _write_atomically(os.path.join(self.backup_dir, _LATEST), name)
        _fsync(self.backup_dir, required=False)
        keep = {name}
        if self.double_checkpoint and self._previous:
            keep.add(self._previous)
        self._previous = name
        # Earlier backups, and any a killed process left half-written.
        for entry in os.listdir(self.backup_dir):
            if _FOLDER.fullmatch(entry) and entry not in keep:
                shutil.rmtree(
                    os.path.join(self.backup_dir, entry), ignore_errors=True
                )

    def _folders(self):
        """The backup folders in `backup_dir`, newest first."""
        found = [
            entry
            for entry in os.listdir(self.backup_dir)
            if _FOLDER.fullmatch(entry)
            and os.path.isdir(os.path.join(self.backup_dir, entry))
        ]
        return sorted(found, key=_order, reverse=True)

    def _read_pointer(self, folders):
        """(the folder `latest` names or None, what is wrong or None)."""
        path = os.path.join(self.backup_dir, _LATEST)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return None, None
        except _DAMAGE as error:
            return None, (
                f"Could not read the pointer file '{path}' "
                f"({type(error).__name__}: {error})"
            )
        name = text.strip()
        if not name:
            return None, f"The pointer file '{path}' is empty"
        if name not in folders:
            return None, (
                f"The pointer file '{path}' names no backup folder (it "
                f"reads {text[:80]!r})"
            )
        return name, None

    def _restore(self):
        """Loads the newest intact backup; returns its (epoch, batches)."""
        if not os.path.isdir(self.backup_dir):
            return None
        folders = self._folders()
        complete = [
            entry
            for entry in folders
            if os.path.exists(os.path.join(self.backup_dir, entry, _POSITION))
        ]
        pointed, problem = self._read_pointer(folders)
        if not pointed and problem is None:
            if not complete:
                if folders:
                    warnings.warn(
                        f"'{self.backup_dir}' holds only backups that were "
                        "not completed (a process killed while writing its "
                        "first one): training starts from the beginning.",
                        stacklevel=3,
                    )
                return None
            problem = (
                "The pointer file "
                f"'{os.path.join(self.backup_dir, _LATEST)}' is missing "
                "although the folder holds backups"
            )
        problems = [problem] if problem else []
        # The backup that `latest` names first, then the others newest first.
        candidates = [pointed] if pointed else []
        candidates += [entry for entry in complete if entry != pointed]
        error = None
        for entry in candidates:
            try:
                position = self._load(entry)
            except _DamagedBackup as damaged:
                problems.append(str(damaged))
                error = damaged.error
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
                    f"'{os.path.join(self.backup_dir, entry)}' instead.",
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
            f"No backup in '{self.backup_dir}' can be restored. "
            f"{'. '.join(problems)}. To start training over, delete the "
            f"folder '{self.backup_dir}'{hint}."
        ) from error

    def _load(self, entry):
        """Restores the backup in folder `entry`; returns its position."""
        position_path = os.path.join(self.backup_dir, entry, _POSITION)
        weights_path = os.path.join(self.backup_dir, entry, _WEIGHTS)
        try:
            position = _read_position(position_path)
        except _DAMAGE as error:
            raise _DamagedBackup(position_path, error) from error
        try:
            # Assigns every variable, also after a damaged backup's load
            # assigned some of them.
            _load_all_weights(self.model, weights_path)
        except _DAMAGE as error:
            raise _DamagedBackup(weights_path, error) from error
        try:
            _restore_seeds(self.model, position)
        except ValueError as error:
            raise _DamagedBackup(position_path, error) from error
        return position["epoch"], position["batches"]


def _order(name):
    """A backup folder's (epoch, batches, time) from its name."""
    epoch, batches, _, time_ns = map(int, _FOLDER.fullmatch(name).groups())
    return epoch, batches, time_ns


class _DamagedBackup(Exception):
    def __init__(self, path, error):
        super().__init__(
            f"Could not restore the backup in '{path}' "
            f"({type(error).__name__}: {error})"
        )
        self.error = error


def _is_seed_state(value):
    """A list of JSON integers (`true` and `false` load as `bool`)."""
    return isinstance(value, list) and all(type(v) is int for v in value)


def _read_position(path):
    """A backup's `position.json`, its fields checked."""
    with open(path, encoding="utf-8") as f:
        position = json.load(f)
    if not isinstance(position, dict):
        raise ValueError(
            f"expected a JSON object. Received: {type(position).__name__}"
        )
    for key in ("epoch", "batches"):
        if key not in position:
            raise ValueError(f"`{key}` is missing")
        if type(position[key]) is not int or position[key] < 0:
            raise ValueError(
                f"`{key}` must be an integer >= 0. Received: "
                f"{key}={position[key]!r}"
            )
    states = position.get("seed_generators", [])
    if not isinstance(states, list) or not all(map(_is_seed_state, states)):
        raise ValueError(
            "`seed_generators` must be a list of lists of integers. "
            f"Received: seed_generators={states!r}"
        )
    state = position.get("global_seed_generator")
    if state is not None and not _is_seed_state(state):
        raise ValueError(
            "`global_seed_generator` must be a list of integers or null. "
            f"Received: global_seed_generator={state!r}"
        )
    return position


def _load_all_weights(model, path):
    """`model.load_weights(path)`, raising where Keras warns that it skipped."""
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built and model.built:
        # As Keras' `BackupAndRestore`: the variables to load into.
        optimizer.build(model.trainable_variables)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_weights(path)
    for warning in caught:
        if "Skipping variable loading" in str(warning.message):
            raise ValueError(str(warning.message).strip())
    for warning in caught:
        warnings.warn_explicit(
            warning.message, warning.category, warning.filename, warning.lineno
        )


def _seed_states(model):
    """The layers' `SeedGenerator` states: `model.variables` less weights."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _seed_values(model):
    """The seed generators' states, for `position.json`."""
    states = [np.asarray(v.numpy()).tolist() for v in _seed_states(model)]
    values = {"seed_generators": states}
    generator = compat.global_seed_generator()
    if generator is not None:
        state = np.asarray(generator.state.numpy()).tolist()
        values["global_seed_generator"] = state
    return values


def _restore_seeds(model, position):
    """Assigns the seed generators' states that `position` holds, if any."""
    if "seed_generators" not in position:
        return
    variables = _seed_states(model)
    saved = position["seed_generators"]
    if len(saved) != len(variables):
        raise ValueError(
            f"it holds {len(saved)} seed generator states, but the model "
            f"has {len(variables)} seed generators"
        )
    values = [np.asarray(s, dtype=v.dtype) for s, v in zip(saved, variables)]
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
        generator = compat.global_seed_generator(create=True)
        generator.state.assign(np.asarray(state, dtype=generator.state.dtype))


def _write_atomically(path, text):
    """Writes `text` to `path` by replacing it with a complete new file."""
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _fsync(path, required=True):
    """Flushes `path` to disk; if not `required`, only where the system can."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if required:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if required:
            raise
    finally:
        os.close(fd)
