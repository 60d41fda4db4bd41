"""The workers of a training job, for `BackupAndRestore`: which one writes,
values gathered from all of them, and SIGTERM (docs/design.md, "Backups
with several workers" and "Preemption")."""

import signal
import threading
import types
import weakref

import numpy as np
import tensorflow as tf


def workers(strategy):
    """`(index, count)` of this worker among the job's workers: `(0, 1)`
    in one process (no strategy, or one worker)."""
    job = _job(strategy)
    return job.index, job.count


def local_replica_ids(strategy):
    """The ids in the sync group of this worker's replicas, in order."""
    return list(_job(strategy).ids)


def gather(strategy, local):
    """The rows of all replicas of the job, from `local`, this worker's
    (one float64 vector per local replica, of the same length on every
    worker): one all-gather over the workers, a float64 array of shape
    `[replicas, length]`. All workers must call it at the same point."""
    local = np.stack([np.asarray(v, np.float64).reshape(-1) for v in local])
    job = _job(strategy)
    if job.count == 1:
        return local
    return job.all_gather(tf.constant(local)).numpy()


_JOBS = weakref.WeakKeyDictionary()


def _job(strategy):
    """What this worker is in `strategy`'s job (found once per strategy):
    `index`, `count`, `ids` and, with several workers, `all_gather`, a
    function (traced once) from this worker's rows, `[local replicas,
    length]`, to all replicas' rows."""
    if strategy in _JOBS:
        return _JOBS[strategy]
    try:
        devices = strategy.extended.worker_devices
    except (AttributeError, RuntimeError):  # The default strategy: none.
        devices = None
    job = types.SimpleNamespace(index=0, count=1, ids=(0,), all_gather=None)
    if devices and strategy.num_replicas_in_sync > len(devices):
        ids = strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(context.replica_id_in_sync_group)
        )
        job.ids = tuple(
            int(v) for v in strategy.experimental_local_results(ids)
        )
        job.count = strategy.num_replicas_in_sync // len(devices)
        job.index = job.ids[0] // len(devices)
        first = job.ids[0]

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

        job.all_gather = all_gather
    if strategy is not None:
        _JOBS[strategy] = job
    return job


def any_worker(strategy, flag):
    """Whether `flag` is true on any worker (a one-number all-gather with
    several workers; `flag` itself in one process)."""
    job = _job(strategy)
    if job.count == 1:
        return bool(flag)
    return bool(np.any(gather(strategy, [[float(flag)]] * len(job.ids))))


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
