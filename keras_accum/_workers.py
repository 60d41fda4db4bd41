"""The workers of a training job, for the backups: who is who, values
gathered from all of them, the backup they all hold, and SIGTERM with the
check point at which they all stop (docs/design.md, "Backups with several
workers" and "Preemption")."""

import itertools
import signal
import threading
import types
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as eager_context


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


# Positions each worker sends at a restart, and the characters of its
# folder's path (for the error that names them).
_KEYS, _PATH = 32, 1024


def held_by_all(strategy, keys, folder):
    """The backups that every worker holds, and what each holds.

    One all-gather with several workers; every worker must call it at the
    same point.

    Args:
        strategy: the model's `tf.distribute.Strategy`.
        keys: this worker's backups' `(epoch, batches)`, newest first.
        folder: str, this worker's `backup_dir`.

    Returns:
        `(common, held)`: the keys that all workers hold, newest first (in
        the order of `keys`), and per worker, `(folder, keys)`.
    """
    job = _job(strategy)
    keys = [tuple(k) for k in keys][:_KEYS]
    if job.count == 1:
        return keys, [(folder, keys)]
    path = folder.encode("utf-8")[:_PATH]
    row = np.zeros(2 + 2 * _KEYS + _PATH)
    row[0], row[1] = len(keys), len(path)
    row[2:2 + 2 * len(keys)] = np.ravel(keys) if keys else []
    row[2 + 2 * _KEYS:2 + 2 * _KEYS + len(path)] = list(path)
    rows = gather(strategy, [row] * len(job.ids))[:: len(job.ids)]
    held = []
    for row in rows:
        count, length = int(row[0]), int(row[1])
        pairs = row[2:2 + 2 * count].astype(np.int64).reshape(-1, 2)
        chars = bytes(row[2 + 2 * _KEYS:2 + 2 * _KEYS + length].astype(
            np.uint8
        ))
        held.append((
            chars.decode("utf-8", "replace"),
            [tuple(int(v) for v in p) for p in pairs],
        ))
    sets = [set(k) for _, k in held]
    common = [k for k in keys if all(k in s for s in sets)]
    return common, held


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


_STOP = "stop"
_FITS = itertools.count()


class Preemption:
    """SIGTERM, and the check point at which every worker stops for it.

    Each worker counts the same check points (`due(check)`, at its batch
    and epoch ends). In one process, SIGTERM stops it at the next check.
    With several workers, no collective runs while no signal has arrived:
    the worker that gets SIGTERM first claims it in the coordination
    service's key-value store (as `tf.distribute.experimental.
    PreemptionCheckpointHandler` does), publishes the check after its next
    one (no worker can be past it: each step waits for all workers), and
    waits until every worker has acknowledged it; a thread on each worker
    waits for that key. A check then reads local flags only. Where the job
    has no coordination service, each check all-gathers whether a worker
    saw the signal instead.
    """

    def __init__(self):
        self.sigterm = Sigterm()
        self._count = 1
        self._worker = 0
        self._target = None
        self._claimed = False
        self._thread = None
        self._prefix = ""
        self._strategy = None
        self._gather = False

    def install(self, strategy):
        """Handles SIGTERM (main thread only) and, with several workers,
        starts the thread that waits for the agreed check.

        Raises:
            ValueError: if not called from the main thread.
        """
        self.sigterm.install()
        self._worker, self._count = workers(strategy)
        self._target, self._claimed = None, False
        self._strategy = strategy
        if self._count == 1:
            return
        self._gather = not _coordination_service()
        if self._gather:
            return
        # The same `fit()` on every worker: the same prefix.
        self._prefix = f"keras_accum/preemption/{next(_FITS)}/"
        self._thread = threading.Thread(
            target=self._watch, name="keras_accum-preemption", daemon=True
        )
        self._thread.start()

    def _watch(self):
        value = _get(self._prefix + "check")
        if value is None or value == _STOP:
            return
        self._target = int(value)
        _set(self._prefix + f"ack/{self._worker}", "1")

    def due(self, check):
        """Whether the workers stop at `check` (a count of check points
        that every worker reaches in the same order)."""
        if self._count == 1:
            return self.sigterm.seen
        if self._gather:
            return any_worker(self._strategy, self.sigterm.seen)
        if self._target is not None:
            return check >= self._target
        if self.sigterm.seen and not self._claimed:
            self._claimed = True
            if _set(self._prefix + "claim", str(self._worker)):
                # The first worker to get SIGTERM.
                if _set(self._prefix + "check", str(check + 1)):
                    for worker in range(self._count):
                        _get(self._prefix + f"ack/{worker}", timeout_s=600)
        return False

    def uninstall(self):
        """Puts the previous SIGTERM handler back and ends the thread."""
        self.sigterm.uninstall()
        if self._thread is not None:
            _set(self._prefix + "check", _STOP)
            self._thread.join(timeout=10)
            self._thread = None


def report_failure(strategy, fit, text):
    """Publishes this worker's failure in the coordination service (one per
    worker and `fit`, a count of `fit()` calls the same on every worker),
    for the errors of the workers that its failure stops."""
    job = _job(strategy)
    if job.count > 1 and _coordination_service():
        _set(f"keras_accum/failure/{fit}/{job.index}", text)


def reported_failures(strategy, fit, timeout_s=5.0):
    """The failures that the other workers published for `fit`, waiting up
    to `timeout_s` for them: `[(worker, text)]` (none where the job has no
    coordination service, or it went with the chief)."""
    job = _job(strategy)
    if job.count == 1 or not _coordination_service():
        return []
    found = {}

    def read(worker):
        text = _get(f"keras_accum/failure/{fit}/{worker}", timeout_s=timeout_s)
        if text is not None:
            found[worker] = text

    threads = [
        threading.Thread(target=read, args=(worker,), daemon=True)
        for worker in range(job.count) if worker != job.index
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s + 1)
    return sorted(found.items())


def _coordination_service():
    """Whether this process's job has TensorFlow's coordination service
    (`MultiWorkerMirroredStrategy` starts it)."""
    try:
        return bool(eager_context.context().coordination_service)
    except (AttributeError, RuntimeError):
        return False


def _set(key, value):
    """Sets `key` in the coordination service; `False` if it was set."""
    try:
        eager_context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    except tf.errors.OpError:  # a worker has gone: nothing to agree with
        return False
    return True


def _get(key, timeout_s=None):
    """Waits for `key` in the coordination service; `None` on an error."""
    try:
        return eager_context.context().get_config_key_value(
            key, timeout_in_ms=int((timeout_s or 0) * 1000)
        )
    except tf.errors.OpError:
        return None
