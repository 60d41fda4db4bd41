"""The workers of a training job, for `BackupAndRestore`: which one writes,
values gathered from all of them, and SIGTERM (docs/design.md, "Backups
with several workers" and "Preemption")."""

import signal
import threading
import weakref

import numpy as np
import tensorflow as tf


def workers(strategy):
    """`(index, count)` of this worker among the job's workers: `(0, 1)`
    in one process (no strategy, or one worker)."""
    try:
        devices = strategy.extended.worker_devices
    except (AttributeError, RuntimeError):  # The default strategy: none.
        devices = None
    if not devices or strategy.num_replicas_in_sync <= len(devices):
        return 0, 1
    count = strategy.num_replicas_in_sync // len(devices)
    index = local_replica_ids(strategy)[0] // len(devices)
    return index, count


def is_chief(strategy):
    """Whether this worker writes the job's backups: the first worker (the
    replicas with the lowest ids, as tf.keras' "chief")."""
    return workers(strategy)[0] == 0


def local_replica_ids(strategy):
    """The ids in the sync group of this worker's replicas, in order."""
    ids = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(context.replica_id_in_sync_group)
    )
    return [int(v) for v in strategy.experimental_local_results(ids)]


def gather(strategy, local):
    """The rows of all replicas of the job, from `local`, this worker's
    (one float64 vector per local replica, of the same length on every
    worker): one all-gather over the workers, a float64 array of shape
    `[replicas, length]`. All workers must call it at the same point."""
    local = [np.asarray(v, np.float64).reshape(-1) for v in local]
    if workers(strategy)[1] == 1:
        return np.stack(local)
    return _all_gather(strategy)(tf.constant(np.stack(local))).numpy()


_GATHERS = weakref.WeakKeyDictionary()


def _all_gather(strategy):
    """A function (traced once per strategy) from this worker's rows,
    `[local replicas, length]`, to all replicas' rows."""
    if strategy not in _GATHERS:
        first = local_replica_ids(strategy)[0]

        def row_of_replica(rows):
            context = tf.distribute.get_replica_context()
            row = tf.gather(rows, context.replica_id_in_sync_group - first)
            return context.all_gather(row[None], axis=0)

        @tf.function(
            input_signature=[tf.TensorSpec([None, None], tf.float64)]
        )
        def all_gather(rows):
            result = strategy.run(row_of_replica, args=(rows,))
            return strategy.experimental_local_results(result)[0]

        _GATHERS[strategy] = all_gather
    return _GATHERS[strategy]


def any_worker(strategy, flag):
    """Whether `flag` is true on any worker (a one-number all-gather with
    several workers; `flag` itself in one process)."""
    if workers(strategy)[1] == 1:
        return bool(flag)
    replicas = len(local_replica_ids(strategy))
    return bool(np.any(gather(strategy, [[float(flag)]] * replicas)))


def barrier(strategy):
    """Returns once every worker has called it (several workers)."""
    any_worker(strategy, False)


class Sigterm:
    """Notes that SIGTERM arrived, instead of the process ending.

    `install()` sets the handler (from the main thread), `uninstall()`
    puts the previous one back; `seen` tells whether the signal came.
    """

    def __init__(self):
        self.seen = False
        self._previous = None
        self._installed = False

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "`save_before_preemption=True` handles SIGTERM, which only "
                "the main thread can do, but `fit()` runs in thread "
                f"{threading.current_thread().name!r}. Received: "
                "save_before_preemption=True"
            )
        self.seen = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum, frame):
        self.seen = True

    def uninstall(self):
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed, self._previous = False, None
