"""The backup folder's format (`keras_accum._backup_folder`), without Keras.

On a local path, a `file://` URL and TensorFlow's `ram://` file system
(which appends when a file is written again): each backup is a folder of
its own whose manifest is written last; a folder without a manifest is
incomplete and passed over, a manifest that does not match its files is
damage; backups list newest first; each worker prunes only its own; the
previous layout (`position.json`, a `latest` pointer) is read.
"""

import collections
import errno
import json
import os

import pytest
import tensorflow as tf

from keras_accum import _backup_folder as folders


@pytest.fixture(params=["local", "file", "ram"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "backup")
    if request.param == "file":
        return "file://" + str(tmp_path / "backup")
    return f"ram://{tmp_path.name}/backup"


def _writer(content):
    def save(path):
        with open(path, "wb") as f:
            f.write(content)

    return save


def test_write_list_read_and_prune(root):
    folders.check_writable(root, 0)
    assert folders.listing(root) == []
    first = folders.write(root, 0, 2, 0, _writer(b"w" * 10),
                          {"epoch": 0, "batches": 2})
    second = folders.write(root, 1, 0, 0, _writer(b"v" * 20),
                           {"epoch": 1, "batches": 0, "logs": {"loss": 0.5}})
    other = folders.write(root, 1, 0, 1, _writer(b"v" * 20),
                          {"epoch": 1, "batches": 0})
    listed = folders.listing(root)
    # Newest first; the two workers' backups of one position side by side.
    assert [b.key for b in listed] == [(1, 0), (1, 0), (0, 2)]
    assert {b.worker for b in listed[:2]} == {0, 1}
    assert folders.read(second) == {
        "epoch": 1, "batches": 0, "logs": {"loss": 0.5}
    }
    with tf.io.gfile.GFile(second.file(folders.WEIGHTS), "rb") as f:
        assert f.read() == b"v" * 20
    # Worker 0 prunes its own only.
    folders.prune(root, 0, keep={second.name})
    assert {b.name for b in folders.listing(root)} == {
        second.name, other.name
    }
    assert not tf.io.gfile.exists(first.path)
    folders.remove(root)
    assert not tf.io.gfile.exists(root)


def test_incomplete_and_damaged(root):
    tf.io.gfile.makedirs(root)
    backup = folders.write(root, 2, 4, 0, _writer(b"x" * 8),
                           {"epoch": 2, "batches": 4})
    # A folder whose writer was killed before the manifest.
    partial = folders.Backup(root, "backup-3-0-w0-5", 3, 0, 0, 5)
    tf.io.gfile.makedirs(partial.path)
    with tf.io.gfile.GFile(partial.file(folders.WEIGHTS), "wb") as f:
        f.write(b"half")
    newest = folders.listing(root)
    assert [b.name for b in newest] == [partial.name, backup.name]
    assert folders.read(newest[0]) is None
    # The weights file cut short after its manifest was written: damage.
    folders.remove(backup.path)
    tf.io.gfile.makedirs(backup.path)
    with tf.io.gfile.GFile(backup.file(folders.WEIGHTS), "wb") as f:
        f.write(b"x" * 3)
    with tf.io.gfile.GFile(backup.file(folders.MANIFEST), "wb") as f:
        f.write(json.dumps({
            "format": 2, "files": {folders.WEIGHTS: 8},
            "position": {"epoch": 2, "batches": 4},
        }).encode())
    with pytest.raises(
        ValueError, match=r"model\.weights\.h5' holds 3 bytes, its manifest "
        r"lists 8"
    ):
        folders.read(backup)


def test_position_fields_are_checked():
    with pytest.raises(ValueError, match=r"`batches` must be an integer >= "
                       r"0\. Received: batches=-1"):
        folders.check_position({"epoch": 0, "batches": -1})
    with pytest.raises(ValueError, match=r"`logs` must map names to "
                       r"numbers\. Received: logs=\{'loss': 'x'\}"):
        folders.check_position({"epoch": 0, "batches": 0,
                                "logs": {"loss": "x"}})
    with pytest.raises(ValueError, match="`position` must be a JSON object. "
                       "Received: list"):
        folders.check_position([])


@pytest.mark.parametrize("manifest, error", [
    # Parses, but not to an object.
    ([0, 6], r"the manifest must be a JSON object\. Received: list \[0, 6\]"),
    ("backup", r"Received: str \"backup\""),
    (7, r"Received: int 7"),
    (None, r"Received: NoneType null"),
    # An object whose position is missing, of the wrong type, or lacks or
    # mistypes a field.
    ({"format": 2, "files": {folders.WEIGHTS: 8}},
     r"`position` must be a JSON object\. Received: NoneType null"),
    ({"format": 2, "files": {folders.WEIGHTS: 8}, "position": [2, 4]},
     r"`position` must be a JSON object\. Received: list \[2, 4\]"),
    ({"format": 2, "files": {folders.WEIGHTS: 8},
      "position": {"epoch": 2}}, r"`batches` is missing"),
    ({"format": 2, "files": {folders.WEIGHTS: 8},
      "position": {"epoch": "2", "batches": 4}},
     r"`epoch` must be an integer >= 0\. Received: epoch='2'"),
    ({"format": 2, "files": {folders.WEIGHTS: 8},
      "position": {"epoch": 2, "batches": 4, "seed_generators": [[1.5]]}},
     r"`seed_generators` must be a list of lists of integers"),
    ({"format": 2, "files": [folders.WEIGHTS], "position": {}},
     r"`files` must list `model\.weights\.h5` and its size"),
])
def test_manifests_of_the_wrong_shape_are_damage(root, manifest, error):
    # Whatever a manifest parses to, reading it raises one of `DAMAGE`
    # with a message (the restore names the backup and falls back), never
    # an `AttributeError`.
    backup = folders.write(root, 2, 4, 0, _writer(b"x" * 8),
                           {"epoch": 2, "batches": 4})
    # Removed first: `ram://` appends to a file written again.
    tf.io.gfile.remove(backup.file(folders.MANIFEST))
    with tf.io.gfile.GFile(backup.file(folders.MANIFEST), "wb") as f:
        f.write(json.dumps(manifest).encode())
    with pytest.raises(folders.DAMAGE, match=error):
        folders.read(backup)


def test_previous_layout_is_read(tmp_path):
    root = tmp_path / "backup"
    old = root / "backup-1-4-123-77"
    old.mkdir(parents=True)
    (old / folders.WEIGHTS).write_bytes(b"w")
    (old / "position.json").write_text(json.dumps({"epoch": 1, "batches": 4}))
    (root / "latest").write_text(old.name)
    unfinished = root / "backup-1-6-123-78"  # no position.json: cut short
    unfinished.mkdir()
    listed = folders.listing(str(root))
    assert [(b.key, b.worker) for b in listed] == [((1, 6), None),
                                                   ((1, 4), None)]
    assert folders.read(listed[0]) is None
    assert folders.read(listed[1]) == {"epoch": 1, "batches": 4}
    # The first new backup's pruning (the chief's) deletes the old layout.
    new = folders.write(str(root), 1, 6, 0, _writer(b"n"),
                        {"epoch": 1, "batches": 6})
    folders.prune(str(root), 0, keep={new.name})
    assert sorted(os.listdir(root)) == [new.name]


def test_a_disk_without_room_for_the_backup_is_not_written(tmp_path,
                                                          monkeypatch):
    # HDF5 can end the process when a disk fills up under it: a local disk
    # with less free space than the backup takes is refused before any
    # write (ENOSPC), and nothing is left of the backup.
    root = str(tmp_path / "backup")
    tf.io.gfile.makedirs(root)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(folders.shutil, "disk_usage",
                        lambda path: usage(10_000, 9_900, 100))
    with pytest.raises(folders.WriteError, match=r"No space left on device: "
                       r"the backup takes about 1,000 bytes and 100 are free"
                       ) as error:
        folders.write(root, 0, 2, 0, _writer(b"w" * 10),
                      {"epoch": 0, "batches": 2}, expected_bytes=1000)
    assert error.value.cause.errno == errno.ENOSPC
    assert folders.listing(root) == []
    # With room, or no estimate, it is written.
    backup = folders.write(root, 0, 2, 0, _writer(b"w" * 10),
                           {"epoch": 0, "batches": 2}, expected_bytes=50)
    assert folders.read(backup) == {"epoch": 0, "batches": 2}
