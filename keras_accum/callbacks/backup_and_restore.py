"""`BackupAndRestore`: resume a killed `fit()` exactly where it stopped."""

import json
import os
import shutil
import time

import keras

from keras_accum import _keras_compat as compat

_LATEST = "latest"


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training and resumes it exactly, mid-epoch and mid-window.

    Like `keras.callbacks.BackupAndRestore`, a `fit()` that was interrupted
    (an exception, a preempted machine, a process killed with `SIGKILL`)
    and is started again with the same command resumes from the last
    backup. Unlike it, the interrupted epoch is not restarted from its first
    batch: the batches that the backup had already seen are consumed
    without training, so the run ends with the weights of the uninterrupted
    one, to float tolerance. A backup holds the weights, the optimizer's
    state, the pending accumulation window (buffers, normaliser sum,
    counters, BatchNormalization window statistics) and the position in the
    epoch.

    The resume is exact when the input comes in the same order in every
    run: `fit(..., shuffle=False)` for arrays, or a `tf.data` pipeline that
    does not reshuffle between runs, of known or unknown length. Metrics
    and the epoch's logged loss start again from the resume point.

    Each backup is written to a new folder, and a small pointer file is
    replaced atomically once it is complete: a process killed while writing
    a backup resumes from the previous one.

    Args:
        backup_dir: str, the folder for the backups. One training run per
            folder.
        save_freq: `"epoch"` (default), to back up at the end of every
            epoch, or an int, to back up every `save_freq` batches (and at
            the end of every epoch). A resume replays the batches since the
            last backup, so any frequency gives the same final weights.
        delete_checkpoint: bool. If `True` (default) the folder is deleted
            when `fit()` ends normally.

    Raises:
        ValueError: for an invalid argument.

    Example:

    ```python
    # `model`: a compiled `GradientAccumulationModel`. Run the same script
    # again after a crash: it goes on from the last backup.
    backup = keras_accum.callbacks.BackupAndRestore("backups", save_freq=50)
    model.fit(x, y, shuffle=False, epochs=10, callbacks=[backup])
    ```
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__()
        if not backup_dir or not isinstance(backup_dir, (str, os.PathLike)):
            raise ValueError(
                "`backup_dir` must be a non-empty path. Received: "
                f"backup_dir={backup_dir!r}"
            )
        if save_freq != "epoch" and (
            isinstance(save_freq, bool)
            or not isinstance(save_freq, int)
            or save_freq < 1
        ):
            raise ValueError(
                "`save_freq` must be 'epoch' or an integer >= 1. Received: "
                f"save_freq={save_freq!r}"
            )
        if not isinstance(delete_checkpoint, bool):
            raise ValueError(
                "`delete_checkpoint` must be a bool. Received: "
                f"delete_checkpoint={delete_checkpoint!r}"
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self._epoch = 0
        self._batches_in_epoch = 0
        self._resume_at = 0
        self._since_backup = 0

    def on_train_begin(self, logs=None):
        position = self._restore()
        self._epoch, self._resume_at = position or (0, 0)
        self._since_backup = 0
        if position:
            # `fit()` reads this right after `on_train_begin`.
            compat.set_initial_epoch(self.model, self._epoch)
            self.model._batches_to_skip = self._resume_at

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
        if self.save_freq != "epoch" and self._since_backup >= self.save_freq:
            self._backup(self._epoch, self._batches_in_epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._resume_at = 0
        self._backup(epoch + 1, 0)

    def on_train_end(self, logs=None):
        compat.set_initial_epoch(self.model, None)
        self.model._batches_to_skip = 0
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir)

    def _backup(self, epoch, batches):
        """Writes a complete backup, then points `latest` at it."""
        self._since_backup = 0
        os.makedirs(self.backup_dir, exist_ok=True)
        name = f"backup-{epoch}-{batches}-{os.getpid()}-{time.time_ns()}"
        folder = os.path.join(self.backup_dir, name)
        os.makedirs(folder)
        self.model.save_weights(os.path.join(folder, "model.weights.h5"))
        with open(os.path.join(folder, "position.json"), "w") as f:
            json.dump({"epoch": epoch, "batches": batches}, f)
        pointer = os.path.join(self.backup_dir, _LATEST)
        with open(pointer + ".tmp", "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
        # Earlier backups, and any a killed process left half-written.
        for entry in os.listdir(self.backup_dir):
            if entry.startswith("backup-") and entry != name:
                shutil.rmtree(
                    os.path.join(self.backup_dir, entry), ignore_errors=True
                )

    def _latest(self):
        try:
            with open(os.path.join(self.backup_dir, _LATEST)) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def _restore(self):
        """Loads the latest backup; returns its (epoch, batches) or `None`."""
        name = self._latest()
        if not name:
            return None
        folder = os.path.join(self.backup_dir, name)
        self.model.load_weights(os.path.join(folder, "model.weights.h5"))
        with open(os.path.join(folder, "position.json")) as f:
            position = json.load(f)
        return int(position["epoch"]), int(position["batches"])
