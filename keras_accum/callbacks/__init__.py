"""Callbacks for `GradientAccumulationModel`."""

from keras_accum.callbacks.backup_and_restore import BackupAndRestore
from keras_accum.callbacks.backup_and_restore import BackupWriteError
from keras_accum.callbacks.backup_and_restore import WorkerFailedError
from keras_accum.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler

__all__ = [
    "BackupAndRestore",
    "BackupWriteError",
    "GradientAccumulationScheduler",
    "WorkerFailedError",
]
