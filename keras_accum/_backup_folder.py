"""The backup folder's format: naming, writing, listing, fallback order and
pruning (docs/design.md, "The backup folder"). No Keras here.

Every file operation goes through TensorFlow's file system
(`tf.io.gfile`), so a `backup_dir` may be any path that TensorFlow reads:
a local path, `file://`, `gs://`, `hdfs://`, `ram://`. Object stores have
no atomic rename and no fsync, and some file systems append when a file is
written again, so a backup is a folder of its own, each of its files
written once, and the last one written is its manifest: the backup's
position and the size of every other file. A folder without a manifest is
a backup that was not completed (its writer was killed); a manifest that
cannot be read, or whose sizes do not match the files, marks a damaged
backup. Nothing is rewritten in place and nothing is renamed.

Layout: `backup_dir/backup-{epoch}-{batches}-w{worker}-{time_ns}/` holding
`model.weights.h5` and `manifest.json`. Folders of the previous layout
(`backup-{epoch}-{batches}-{pid}-{time_ns}/` with `position.json`, which
was written last, and a `latest` pointer file) are still read.
"""

import contextlib
import dataclasses
import errno
import json
import numbers
import os
import re
import shutil
import tempfile
import time

import tensorflow as tf

MANIFEST = "manifest.json"
WEIGHTS = "model.weights.h5"
FORMAT = 2
_NAME = re.compile(r"backup-(\d+)-(\d+)-w(\d+)-(\d+)")
# The previous layout: `backup-{epoch}-{batches}-{pid}-{time_ns}`, its
# position in `position.json`, a pointer file `latest` beside.
_LEGACY_NAME = re.compile(r"backup-(\d+)-(\d+)-(\d+)-(\d+)")
_LEGACY_POSITION = "position.json"
_LEGACY_POINTER = "latest"
_PROBE = ".write-probe-"

# What reading or loading a damaged backup raises (h5py: `OSError`;
# TensorFlow's file system: `tf.errors.OpError`).
DAMAGE = (OSError, ValueError, KeyError, TypeError, tf.errors.OpError)


@dataclasses.dataclass
class Backup:
    """One backup folder of `root`.

    Attributes:
        root: the `backup_dir` that holds it.
        name: the folder's name.
        epoch, batches: the position it was made at (from its name).
        worker: the index of the worker that wrote it, `None` for a folder
            of the previous layout.
        time_ns: when it was made (from its name).
    """

    root: str
    name: str
    epoch: int
    batches: int
    worker: object
    time_ns: int

    @property
    def path(self):
        """The folder's path."""
        return join(self.root, self.name)

    @property
    def key(self):
        """What identifies the backup across workers: its position."""
        return self.epoch, self.batches

    @property
    def order(self):
        """Newest last: position, then time."""
        return self.epoch, self.batches, self.time_ns

    def file(self, name):
        """The path of the file `name` in the folder."""
        return join(self.path, name)


def join(root, name):
    """`root/name` for any file system's path (`os.path.join` for local
    ones; a URL keeps its `/`)."""
    if "://" in root:
        return root.rstrip("/") + "/" + name
    return os.path.join(root, name)


def is_remote(path):
    """Whether `path` is not a local path (`scheme://...`)."""
    return "://" in path


def check_writable(root, worker):
    """Creates `root` if needed and writes and deletes a small file in it.

    Args:
        root: str, the backup folder.
        worker: int, this worker's index (names the probe file).

    Raises:
        OSError or tf.errors.OpError: if `root` cannot be written to.
    """
    tf.io.gfile.makedirs(root)
    probe = join(root, f"{_PROBE}{worker}-{os.getpid()}-{time.time_ns()}")
    with tf.io.gfile.GFile(probe, "wb") as f:
        f.write(b"")
    tf.io.gfile.remove(probe)


def is_file(root):
    """Whether `root` exists and is not a folder."""
    return tf.io.gfile.exists(root) and not tf.io.gfile.isdir(root)


def write(root, epoch, batches, worker, save_weights, position,
          expected_bytes=0):
    """Writes a complete backup folder into `root`, its manifest last.

    Args:
        root: str, the backup folder (it exists).
        epoch, batches: int, the position the backup is made at.
        worker: int, this worker's index.
        save_weights: a function of a local file path that writes the
            weights file there.
        position: a JSON-serializable dict, the backup's position.
        expected_bytes: about how many bytes the backup takes: on a local
            disk with less free space, nothing is written (HDF5 can end
            the process when the disk fills up under it).

    Returns:
        The `Backup` written.

    Raises:
        WriteError: if a file system error stopped it (nothing of it is
            left).
    """
    stamp = time.time_ns()
    name = f"backup-{epoch}-{batches}-w{worker}-{stamp}"
    backup = Backup(root, name, epoch, batches, worker, stamp)
    try:
        _check_space(root, expected_bytes)
        tf.io.gfile.makedirs(backup.path)
        sizes = {}
        with _local_target(backup.file(WEIGHTS)) as local:
            save_weights(local)
        _sync(backup.file(WEIGHTS))
        sizes[WEIGHTS] = tf.io.gfile.stat(backup.file(WEIGHTS)).length
        manifest = {"format": FORMAT, "files": sizes, "position": position}
        with tf.io.gfile.GFile(backup.file(MANIFEST), "wb") as f:
            f.write(json.dumps(manifest).encode("utf-8"))
        _sync(backup.file(MANIFEST))
    except BaseException as error:
        # What was written goes (it is never restored: no manifest, or a
        # short file), so that a full disk does not stay full.
        remove(backup.path)
        # h5py reports a failed write (a full disk) as a `RuntimeError`.
        if isinstance(error, (OSError, RuntimeError, tf.errors.OpError)):
            raise WriteError(backup, error) from error
        raise
    return backup


def _check_space(root, expected_bytes):
    """Raises `OSError` (ENOSPC) where a local `root` has less free space
    than `expected_bytes`."""
    if not expected_bytes or is_remote(root):
        return
    free = shutil.disk_usage(root).free
    if free < expected_bytes:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: the backup takes about "
            f"{expected_bytes:,} bytes and {free:,} are free",
        )


class WriteError(Exception):
    """A backup that could not be written completely (and was removed).

    Attributes:
        backup: the `Backup` that was being written.
        cause: the error that stopped it (also `__cause__`).
    """

    def __init__(self, backup, cause):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.backup, self.cause = backup, cause


def _sync(path):
    """Flushes a local file to disk (the weights before the manifest, so
    that a manifest never describes data lost in a power cut); other file
    systems have no such call."""
    if is_remote(path):
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _temporary_file(path):
    """A path named as `path`, in a local temporary folder removed after."""
    folder = tempfile.mkdtemp()
    try:
        yield os.path.join(folder, os.path.basename(path))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _copy(source, target):
    """Copies the open file `source` to the open file `target`."""
    while chunk := source.read(1 << 24):
        target.write(chunk)


@contextlib.contextmanager
def _local_target(path):
    """A local path to write `path`'s content to: `path` itself if it is
    local, else a temporary file copied to `path` once written."""
    if not is_remote(path):
        yield path
        return
    with _temporary_file(path) as local:
        yield local
        with open(local, "rb") as source, tf.io.gfile.GFile(path, "wb") as f:
            _copy(source, f)


@contextlib.contextmanager
def local_copy(path):
    """A local path with `path`'s content (a temporary copy if `path` is
    not local)."""
    if not is_remote(path):
        yield path
        return
    with _temporary_file(path) as local:
        with tf.io.gfile.GFile(path, "rb") as source, open(local, "wb") as f:
            _copy(source, f)
        yield local


def listing(root):
    """The backup folders in `root`, newest first (empty if `root` does
    not exist)."""
    if not tf.io.gfile.isdir(root):
        return []
    found = []
    for entry in tf.io.gfile.listdir(root):
        entry = entry.rstrip("/")
        match = _NAME.fullmatch(entry)
        legacy = None if match else _LEGACY_NAME.fullmatch(entry)
        if match:
            epoch, batches, worker, stamp = map(int, match.groups())
        elif legacy:
            epoch, batches, _, stamp = map(int, legacy.groups())
            worker = None
        else:
            continue
        found.append(Backup(root, entry, epoch, batches, worker, stamp))
    found.sort(key=lambda b: b.order, reverse=True)
    return found


def read(backup):
    """A backup's position, its files checked against its manifest.

    Args:
        backup: a `Backup`.

    Returns:
        The position dict, or `None` if the backup was not completed (no
        manifest: its writer stopped before the end).

    Raises:
        One of `DAMAGE`, naming the problem, if the backup is damaged.
    """
    if backup.worker is None:  # the previous layout: position.json last
        path = backup.file(_LEGACY_POSITION)
        if not tf.io.gfile.exists(path):
            return None
        return check_position(_read_json(path))
    path = backup.file(MANIFEST)
    if not tf.io.gfile.exists(path):
        return None
    manifest = _read_json(path)
    if not isinstance(manifest, dict):
        raise ValueError(
            "the manifest must be a JSON object. Received: "
            f"{type(manifest).__name__} {_shown(manifest)}"
        )
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"unknown format. Received: format={manifest.get('format')!r}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        raise ValueError(
            f"`files` must list `{WEIGHTS}` and its size. Received: "
            f"files={files!r}"
        )
    for name, size in files.items():
        file = backup.file(name)
        if not tf.io.gfile.exists(file):
            raise ValueError(f"the manifest lists '{file}', which is missing")
        found = tf.io.gfile.stat(file).length
        if found != size:
            raise ValueError(
                f"'{file}' holds {found} bytes, its manifest lists {size}"
            )
    return check_position(manifest.get("position"))


def size(backup):
    """The bytes of a complete backup's weights file."""
    return tf.io.gfile.stat(backup.file(WEIGHTS)).length


def _read_json(path):
    with tf.io.gfile.GFile(path, "rb") as f:
        return json.loads(f.read().decode("utf-8"))


def prune(root, worker, keep):
    """Deletes this worker's backup folders in `root` but `keep` (names),
    the ones its killed processes left half-written included; the chief
    (worker 0) deletes the previous layout's folders and pointer too.
    Folders that other workers wrote are theirs to delete."""
    for backup in listing(root):
        if backup.name in keep:
            continue
        if backup.worker == worker or (backup.worker is None and worker == 0):
            remove(backup.path)
    pointer = join(root, _LEGACY_POINTER)
    if worker == 0 and tf.io.gfile.exists(pointer):
        with contextlib.suppress(tf.errors.OpError):
            tf.io.gfile.remove(pointer)


def remove(path):
    """Deletes the folder `path` and what it holds, if it exists."""
    with contextlib.suppress(tf.errors.OpError, OSError):
        tf.io.gfile.rmtree(path)


def check_position(position):
    """`position` (a backup's position dict), its fields checked.

    Raises:
        ValueError: naming the field and the value received.
    """
    if not isinstance(position, dict):
        raise ValueError(
            "`position` must be a JSON object. Received: "
            f"{type(position).__name__} {_shown(position)}"
        )

    def ints(value):  # `true` and `false` load as `bool`
        return isinstance(value, list) and all(type(v) is int for v in value)

    for key in ("epoch", "batches"):
        if key not in position:
            raise ValueError(f"`{key}` is missing")
    # Each field: its default when absent (`None`: may be null), what it
    # must be, and the test.
    fields = {
        # (present: checked above; not null)
        "epoch": (0, "be an integer >= 0", lambda v: type(v) is int and v >= 0),
        "batches": (0, "be an integer >= 0", lambda v: type(v) is int and v >= 0),
        "seed_generators": (
            [], "be a list of lists of integers",
            lambda v: isinstance(v, list) and all(map(ints, v)),
        ),
        "metrics": (
            [], "be a list of numbers or nested lists of numbers",
            lambda v: isinstance(v, list) and all(map(_numbers, v)),
        ),
        "fingerprint": (None, "be a list of 3 numbers", _fingerprint),
        "worker_fingerprints": (
            None, "be a list of lists of 3 numbers",
            lambda v: isinstance(v, list) and all(map(_fingerprint, v)),
        ),
        "global_seed_generator": (None, "be a list of integers or null", ints),
        "logs": (
            None, "map names to numbers",
            lambda v: isinstance(v, dict)
            and all(isinstance(k, str) and _numbers(x) for k, x in v.items()),
        ),
    }
    for key, (default, expected, valid) in fields.items():
        value = position.get(key, default)
        if (value is not None or default is not None) and not valid(value):
            raise ValueError(
                f"`{key}` must {expected}. Received: {key}={value!r}"
            )
    return position


def _shown(value):
    """`value`'s JSON, cut to 80 characters."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fingerprint(value):
    """Whether `value` is a list of 3 numbers."""
    return isinstance(value, list) and len(value) == 3 and _numbers(value)


def _numbers(value):
    """Whether `value` is a number or a nested list of numbers."""
    if isinstance(value, list):
        return all(map(_numbers, value))
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
