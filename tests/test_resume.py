"""Exact resume after a kill: `keras_accum.callbacks.BackupAndRestore`.

A training process is killed with SIGKILL in the middle of a window (and of
an epoch), in validation, and between an epoch's last batch backup and its
validation, started again with the same arguments each time; it must resume
from the backup before the kill and end with the weights of the
uninterrupted run (float64), for input of known and of unknown length,
in-step micro-batches and Dropout. (Each run is a process of its own, forked
from one that imported TensorFlow once, before any TensorFlow op ran:
`resume/restarts.py`, in the background from the first test.) Keras' own
`BackupAndRestore` restarts the interrupted epoch from its first batch
instead. Damaged backups (a truncated weights file, a garbage manifest or
position) fall back to the previous backup, with a warning that names the
file; a backup that was not completed is passed over. `backup_dir` may be
any path of TensorFlow's file system: a `file://` URL across a kill, a
`ram://` path in one process. A restart with no epoch left to train
returns the last epoch's logs.
"""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import warnings

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from background import start
from conftest import record
from conftest import relative_difference
from helpers import Interrupt

import keras_accum
from keras_accum.callbacks import BackupAndRestore

SCRIPT = os.path.join(os.path.dirname(__file__), "resume", "train.py")
RESTARTS = os.path.join(os.path.dirname(__file__), "resume", "restarts.py")
_spec = importlib.util.spec_from_file_location("resume_train", SCRIPT)
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def start_background_runs(tmp_path_factory):
    """Starts, in the background with the first test, the killed
    and resumed runs of `KILLED_RUNS`: case after case, run after run, each
    run a process of its own, forked from one that imported TensorFlow once
    (`resume/restarts.py`). Case `i`'s runs write to `OUT_FILE`
    `case<i>/resumed.npz` of the run's folder, back up into
    `case<i>/resumed_backup` and log where they start in
    `case<i>/starts.jsonl`. Returns the run."""

    def command(folder):
        groups = {}
        for i, (options, kills, _) in enumerate(KILLED_RUNS.values()):
            case = folder / f"case{i}"
            restarted = [str(case / "resumed.npz"),
                         str(case / "resumed_backup"), *options,
                         "--log", str(case / "starts.jsonl")]
            # Killed at each of `kills`, then run to its end.
            groups[f"case{i}"] = [
                restarted + ["--kill", kill_at] for kill_at in kills
            ] + [restarted]
            if "--mirrored" in options:
                # Logical devices must be set before TensorFlow starts: the
                # uninterrupted run too is a process of its own.
                groups[f"case{i}-uninterrupted"] = [[
                    str(case / "uninterrupted.npz"),
                    str(case / "uninterrupted_backup"), *options,
                ]]
        return [sys.executable, RESTARTS, json.dumps(groups)]

    return start(
        tmp_path_factory, "resume_killed_runs", command,
        dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        timeout=300 * sum(len(k) + 1 for _, k, _ in KILLED_RUNS.values()),
    )


def _killed_runs(tmp_path_factory, case):
    """The folder of `case`'s runs, and each run's exit code, whether
    `OUT_FILE` existed after it, and its stderr."""
    run = start_background_runs(tmp_path_factory)
    done = run.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    group = f"case{list(KILLED_RUNS).index(case)}"
    results = [json.loads(line) for line in done.stdout.splitlines()]
    return run.folder / group, [r for r in results if r["group"] == group]


def _weights(path):
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


# case: (options of `resume/train.py`, where the successive runs are killed,
# where each run starts: [epoch, updates, pending micro-batches])
KILLED_RUNS = {
    # Backups every 2 of 6 batches, a partial window at each epoch's end:
    # batch 3 is replayed mid-window; the process dies in validation (its
    # last backup, before the window's end, holds a pending window) and
    # right after the batch backup that ends an epoch (before validation).
    "Dropout, validation, every 2 batches": (
        ["--dropout", "--validation", "--samples", "48", "--save-freq", "2"],
        ["0:3", "v0:1", "1:6"],
        # Backups after batches 2, 6 (before its window's end) and 1:6.
        [[0, 0, 0], [0, 0, 2], [0, 1, 2], [1, 3, 2]],
    ),
    # Backups at epoch ends only: the interrupted epoch replays from its
    # start, the kill at micro_step 2.
    "unknown length, Dropout, at epoch ends": (
        ["--data", "unknown", "--dropout"],
        ["1:6"],
        [[0, 0, 0], [1, 2, 0]],
    ),
    # In-step micro-batches of 3 (8 rows: 3+3+2; the last step has 4: 3+1),
    # N=2 steps, the window carried over epochs (so the short last step of
    # epoch 0 is pending in its validation): the kill in validation and the
    # one after the short last step replay steps 5 to 7 from the backup
    # after step 4.
    "in-step, short last step, validation, Dropout": (
        ["--micro-batch-size", "3", "--steps", "2", "--samples", "52",
         "--no-flush", "--save-freq", "4", "--validation", "--dropout"],
        ["v0:2", "1:7"],
        # Backups after steps 4 (of 7) and 7 + 4: step 11 pending, its 3
        # micro-batches.
        [[0, 0, 0], [0, 2, 0], [1, 5, 3]],
    ),
    # A compiled metric of each kind (a mean, an exact-match count, a
    # confusion matrix): the skipped batches of the restart build them, the
    # backup's state continues the epoch's values.
    "metrics, killed mid-epoch": (
        ["--metrics", "mae", "accuracy", "mean_iou", "--save-freq", "3",
         "--validation"],
        ["0:4", "1:5"],
        # Backups after batch 3 of epochs 0 and 1 (3 pending).
        [[0, 0, 0], [0, 0, 3], [1, 2, 3]],
    ),
    # 9 batches in calls of 2: Keras reports the last, single-batch call
    # as ending at batch 10. Killed in validation, the restart skips the
    # whole epoch (its backup after batch 9: 2 updates, 1 pending).
    "steps_per_execution=2 on 9 batches, killed in validation": (
        ["--samples", "72", "--steps-per-execution", "2", "--save-freq", "1",
         "--validation", "--metrics", "mae"],
        ["v0:2"],  # the validation's first call, of 2 batches
        [[0, 0, 0], [0, 2, 1]],
    ),
    # A pipeline reshuffled every epoch (`.shuffle(n, seed=3)`): the
    # restart draws the orders of the epochs before the backup's, killed
    # mid-epoch, in validation, and right after an epoch's backup.
    "reshuffled pipeline, seeded": (
        ["--data", "shuffled", "--metrics", "mae", "--validation",
         "--save-freq", "2"],
        ["0:3", "v1:1", "2:1"],
        # Backups after batches 2 of epoch 0, 6 of epoch 1, end of epoch 1.
        [[0, 0, 0], [0, 0, 2], [1, 3, 2], [2, 4, 0]],
    ),
    "reshuffled pipeline, global seed only": (
        ["--data", "shuffled-global", "--save-freq", "3"],
        ["1:4"],
        [[0, 0, 0], [1, 2, 3]],
    ),
    # Under `MirroredStrategy` (2 logical CPUs), metrics of each kind,
    # a pipeline reshuffled every epoch, killed mid-epoch and in validation.
    "MirroredStrategy, reshuffled pipeline, metrics": (
        ["--mirrored", "--data", "shuffled", "--metrics", "mae", "mean_iou",
         "--validation", "--save-freq", "3"],
        ["0:5", "v1:2"],
        # Backups after batches 3 of epoch 0 and 6 of epoch 1 (2 pending).
        [[0, 0, 0], [0, 0, 3], [1, 3, 2]],
    ),
    "arrays, fit(shuffle=True)": (
        ["--data", "shuffled-arrays", "--save-freq", "3"],
        ["1:5"],
        [[0, 0, 0], [1, 2, 3]],
    ),
    # `backup_dir` a `file://` URL (TensorFlow's file system), killed
    # mid-window, in validation, and after the last epoch's backup: the
    # last restart has nothing left to train and returns the last epoch's
    # logs.
    "file:// URL, killed mid-window and after the last backup": (
        ["--file-url", "--validation", "--metrics", "mae", "--save-freq",
         "2", "--dropout"],
        ["0:3", "v1:2", "2:7", "e2"],
        # Backups after batch 2 of epoch 0, 6 of epochs 1 and 2 (2 pending
        # each), the end of epoch 2 (the last: nothing left to train).
        [[0, 0, 0], [0, 0, 2], [1, 3, 2], [2, 5, 2], [3, 6, 0]],
    ),
}


@pytest.mark.background(start=start_background_runs)
@pytest.mark.parametrize("case", list(KILLED_RUNS))
def test_killed_run_resumes_exactly(tmp_path, tmp_path_factory, case):
    options, kills, starts = KILLED_RUNS[case]
    # The killed ones and the resumed one (`start_background_runs`).
    folder, runs = _killed_runs(tmp_path_factory, case)
    # The uninterrupted run, in this process (or in the background).
    reference = tmp_path / "reference.npz"
    if "--mirrored" in options:
        reference = folder / "uninterrupted.npz"
        assert reference.exists()
    else:
        train.main([str(reference), str(tmp_path / "r"), *options])
    assert len(runs) == len(kills) + 1, runs
    *killed_runs, resumed = runs
    for killed in killed_runs:
        assert killed["returncode"] == -signal.SIGKILL, killed["stderr"]
        assert not killed["out_exists"]
    assert resumed["returncode"] == 0, resumed["stderr"]
    log, out = folder / "starts.jsonl", folder / "resumed.npz"
    # Each restart resumed from the backup before its kill.
    assert [json.loads(line) for line in log.read_text().splitlines()] == (
        starts
    )
    diff = relative_difference(_weights(reference), _weights(out))
    record(f"resumed after SIGKILL ({case})", diff)
    assert diff <= 1e-12, f"resumed run differs: {diff:.3g}"
    diff = relative_difference(*(
        _weights(p.with_suffix(".optimizer.npz")) for p in (reference, out)
    ))
    assert diff <= 1e-12, f"resumed optimizer differs: {diff:.3g}"
    # The resumed epoch logs what the uninterrupted one logged.
    logs = [json.loads(p.with_suffix(".json").read_text())
            for p in (reference, out)]
    assert logs[1] == logs[0]
    # A completed run removes its backups.
    assert not (folder / "resumed_backup").exists()



@pytest.mark.parametrize(
    "data, steps_per_execution, where",
    [("known", 1, "local"), ("known", 2, "local"), ("unknown", 1, "local"),
     ("unknown", 2, "local"), ("known", 1, "ram"), ("unknown", 2, "ram")],
)
def test_interrupted_fit_resumes_exactly(
    tmp_path, data, steps_per_execution, where, float64
):
    # In one process: `fit()` raises, a new model and callback resume
    # (`where="ram"`: `backup_dir` on TensorFlow's `ram://` file system).
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(7 * 8, 6)), rng.normal(size=(7 * 8, 1))

    def run(callbacks):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, activation="tanh")(inputs)
        model = keras_accum.GradientAccumulationModel(
            inputs, keras.layers.Dense(1)(h), gradient_accumulation_steps=4
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01), loss="mse",
            metrics=["mae", "accuracy"],
            steps_per_execution=steps_per_execution,
        )
        if data == "known":
            inputs = dict(x=x, y=y, batch_size=8, shuffle=False)
        else:
            dataset = tf.data.Dataset.from_tensor_slices((x, y))
            inputs = dict(x=dataset.filter(lambda *_: True).batch(8))
        model.fit(**inputs, epochs=3, verbose=0, callbacks=callbacks)
        return model

    reference = run([])
    backup = str(tmp_path / "backup")
    if where == "ram":
        backup = f"ram://{tmp_path.name}/backup"
    # 7 batches an epoch, windows of 4 and 3 (2 updates); backups every 2
    # batches and at epoch ends. Interrupted after batch 4 of epoch 0
    # (backed up there), 7 of epoch 1 (after 6), 2 of epoch 2 (there):
    # each run starts at the previous one's last backup, `[epoch, updates,
    # pending micro-batches]`. With calls of 2 batches, Keras reports the
    # last of 7 as batch 8: on input of unknown length, 2 more batches
    # (the epoch's length is not known), a backup after batch 7 of epoch 1.
    starts = []
    for epoch, batch in ((0, 4), (1, 7), (2, 2)):
        start = _AtStart()
        with pytest.raises(RuntimeError, match="interrupted"):
            run([BackupAndRestore(backup, save_freq=2), start,
                 Interrupt(epoch, batch)])
        starts.append([start.epoch, *start.state])
    start = _AtStart()
    resumed = run([BackupAndRestore(backup, save_freq=2), start])
    starts.append([start.epoch, *start.state])
    nominal = data == "unknown" and steps_per_execution == 2
    assert starts == [
        [0, 0, 0], [0, 1, 0], [1, 3, 3] if nominal else [1, 3, 2], [2, 4, 2]
    ]
    assert resumed.history.epoch == [2]
    diff = relative_difference(reference.get_weights(), resumed.get_weights())
    record(f"resumed after an exception ({data} length, {where})", diff)
    assert diff <= 1e-12
    diff = relative_difference(
        [np.asarray(v) for v in reference.optimizer.variables],
        [np.asarray(v) for v in resumed.optimizer.variables],
    )
    assert diff <= 1e-12, f"resumed optimizer differs: {diff:.3g}"
    last = [{k: v[-1] for k, v in m.history.history.items()}
            for m in (reference, resumed)]
    assert last[1] == last[0]
    assert not tf.io.gfile.exists(backup)


def test_restart_with_nothing_left_returns_the_last_epochs_logs(
    tmp_path, float64
):
    # The backup at the end of the last epoch kept (as after a kill right
    # after it): the restart trains nothing, and its History holds the
    # last epoch's logs, the uninterrupted run's numbers.
    folder = tmp_path / "backup"
    reference = _fit([BackupAndRestore(folder, delete_checkpoint=False)])
    assert [p.name.split("-")[:3] for p in folder.iterdir()] == [
        ["backup", "3", "0"]
    ]
    start = _AtStart()
    restarted = _fit([BackupAndRestore(folder), start])
    assert start.epoch is None  # no epoch ran
    assert restarted.history.epoch == [2]
    assert restarted.history.history == {
        k: [v[-1]] for k, v in reference.history.history.items()
    }
    assert relative_difference(
        reference.get_weights(), restarted.get_weights()
    ) == 0.0
    assert not folder.exists()


class _AtStart(keras.callbacks.Callback):
    """Records the updates and pending micro-batches that `fit()` starts
    from (after `BackupAndRestore` restored them), and its first epoch."""

    def __init__(self):
        super().__init__()
        self.epoch = None

    def on_train_begin(self, logs=None):
        self.state = (
            int(self.model.optimizer.iterations),
            int(self.model.micro_step),
        )

    def on_epoch_begin(self, epoch, logs=None):
        if self.epoch is None:
            self.epoch = epoch


def _fit(callbacks):
    """The Dropout model of `resume/train.py` (6 batches an epoch), in this
    process, started as in a new process (`_start_as_new_process`)."""
    _start_as_new_process()
    args = train.parse(["-", "-", "--dropout", "--samples", "48"])
    return train.fit(train.build(args), args, callbacks)


def _start_as_new_process():
    """Drops Keras' global state, its global `SeedGenerator` included, as a
    new process starts without it: each in-process run of `_fit` then draws
    `GlobalNoise` from the same state, as a killed and restarted process
    does, on every supported Keras. `keras.utils.set_random_seed` (in
    `train.build`) drops the global `SeedGenerator` in newer Keras (3.15
    does), not in Keras 3.11: there a second run in this process would go
    on from where the first left it, and the backups of `backups` would be
    those of another run than the uninterrupted one they are compared
    with."""
    keras.backend.clear_session(free_memory=False)


@pytest.fixture(scope="module")
def backups(tmp_path_factory):
    """The uninterrupted run's weights, and the folder of the same run
    interrupted after batch 5 of epoch 1 with `double_checkpoint=True`: the
    backups after batches 4 (the newest) and 2."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    try:
        reference = _fit([]).get_weights()
        folder = tmp_path_factory.mktemp("pristine") / "backup"
        with pytest.raises(RuntimeError, match="interrupted"):
            _fit([
                BackupAndRestore(folder, save_freq=2, double_checkpoint=True),
                Interrupt(1, 5),
            ])
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
        keras.backend.clear_session()
    names = sorted(p.name for p in folder.iterdir())
    assert [n.split("-")[:4] for n in names] == [
        ["backup", "1", "2", "w0"], ["backup", "1", "4", "w0"],
    ], names
    return reference, folder


def _copy(backups, tmp_path):
    folder = tmp_path / "backup"
    shutil.copytree(backups[1], folder)
    newest = next(p for p in folder.glob("backup-1-4-*"))
    previous = next(p for p in folder.glob("backup-1-2-*"))
    return folder, newest, previous


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_manifest(backup, edit):
    manifest = json.loads((backup / "manifest.json").read_text())
    edit(manifest)
    (backup / "manifest.json").write_text(json.dumps(manifest))


def _set_batches(backup, batches):
    _edit_manifest(
        backup, lambda m: m["position"].update(batches=batches)
    )


def _drop_optimizer(backup):
    path = backup / "model.weights.h5"
    with h5py.File(path, "a") as weights:
        del weights["optimizer/vars/0"]
        for layer in weights["layers"].values():
            for value in layer["vars"].values():
                value[...] = 100.0
    # A file that its manifest describes: only loading finds the problem.
    size = path.stat().st_size
    _edit_manifest(backup, lambda m: m["files"].update({path.name: size}))


def _half_written(folder, newest):
    # A newer folder that a process killed mid-backup left behind: its
    # weights written (cut short), no manifest.
    half_written = folder / "backup-1-5-w0-99999999999999999999"
    half_written.mkdir()
    shutil.copy(newest / "model.weights.h5", half_written)
    _truncate(half_written / "model.weights.h5")


def _previous_layout(folder, newest):
    # The layout of earlier versions: `position.json` written last, a
    # pointer file `latest`, folders named with a process id.
    for backup in list(folder.iterdir()):
        manifest = json.loads((backup / "manifest.json").read_text())
        (backup / "manifest.json").unlink()
        (backup / "position.json").write_text(
            json.dumps(manifest["position"])
        )
        old = backup.name.replace("-w0-", "-123-")
        backup.rename(folder / old)
    (folder / "latest").write_text(newest.name.replace("-w0-", "-123-"))


# damage: (what it does to the copied folder, the warning it gives (`None`:
# none), the backup restored: after batch 2 of epoch 1 (2 updates, 2
# micro-batches pending) or 4 (3 updates))
DAMAGES = {
    "truncated weights": (
        lambda folder, newest: _truncate(newest / "model.weights.h5"),
        r"Could not restore the backup in '[^']*backup-1-4-[^']*"
        r"manifest\.json' \(ValueError: '[^']*model\.weights\.h5' holds "
        r"\d+ bytes, its manifest lists \d+\): restoring the previous "
        r"backup '[^']*backup-1-2-[^']*' instead\.",
        (2, 2),
    ),
    "garbage manifest": (
        lambda folder, newest: (newest / "manifest.json").write_bytes(
            b'{"format": 2, "fil'
        ),
        r"Could not restore the backup in '[^']*backup-1-4-[^']*"
        r"manifest\.json' \(JSONDecodeError: .*\): restoring the previous "
        r"backup '[^']*backup-1-2-[^']*' instead\.",
        (2, 2),
    ),
    # A manifest that parses, but not to an object.
    "manifest [0, 6]": (
        lambda folder, newest: (newest / "manifest.json").write_text("[0, 6]"),
        r"Could not restore the backup in '[^']*backup-1-4-[^']*"
        r"manifest\.json' \(ValueError: the manifest must be a JSON object\. "
        r"Received: list \[0, 6\]\): restoring the previous backup "
        r"'[^']*backup-1-2-[^']*' instead\.",
        (2, 2),
    ),
    "batches=-5": (
        lambda folder, newest: _set_batches(newest, -5),
        r"manifest\.json' \(ValueError: `batches` must be an integer >= 0\. "
        r"Received: batches=-5\): restoring the previous backup",
        (2, 2),
    ),
    "batches=true": (
        lambda folder, newest: _set_batches(newest, True),
        r"Received: batches=True\): restoring the previous backup",
        (2, 2),
    ),
    # Keras loads the layers (and the pending window) but only warns that
    # it skips the optimizer's variables: the previous backup is loaded
    # over them.
    "weights without the optimizer's": (
        lambda folder, newest: _drop_optimizer(newest),
        r"Could not restore the backup in '[^']*backup-1-4-[^']*"
        r"model\.weights\.h5' \(ValueError: Skipping variable loading for "
        r"optimizer .*\): restoring the previous backup "
        r"'[^']*backup-1-2-[^']*' instead\.",
        (2, 2),
    ),
    # A backup that was not completed is passed over, silently: the
    # newest complete one is restored.
    "half-written newer backup": (_half_written, None, (3, 0)),
    "previous layout": (_previous_layout, None, (3, 0)),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_backup_falls_back_exactly(backups, tmp_path, damage, float64):
    folder, newest, _ = _copy(backups, tmp_path)
    make_damage, warning, restored = DAMAGES[damage]
    make_damage(folder, newest)
    start = _AtStart()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit([
            BackupAndRestore(folder, save_freq=2, double_checkpoint=True),
            start,
        ])
    messages = [str(w.message) for w in caught
                if issubclass(w.category, UserWarning)
                and "backup" in str(w.message)]
    if warning is None:
        assert messages == []
    else:
        assert any(re.search(warning, m) for m in messages), messages
    assert start.state == restored
    assert resumed.history.epoch == [1, 2]
    diff = relative_difference(backups[0], resumed.get_weights())
    record(f"resumed from a damaged backup ({damage})", diff)
    assert diff <= 1e-12, f"resumed run differs: {diff:.3g}"
    assert not folder.exists()


class _FailingSave:
    """`save_weights` that fails at its `at`-th call (1-based), after
    writing half of the file: `error` (`tries` times in a row, from that
    call on)."""

    def __init__(self, at, error, tries=1):
        self.at, self.error, self.tries, self.calls = at, error, tries, 0
        self.save = keras_accum.GradientAccumulationModel.save_weights

    def method(self):
        """As a method of the model's class."""
        return lambda model, path, *a, **k: self(model, path, *a, **k)

    def __call__(self, model, path, *args, **kwargs):
        self.calls += 1
        if self.at <= self.calls < self.at + self.tries:
            self.save(model, path, *args, **kwargs)
            _truncate(pathlib.Path(path))  # a write that stopped partway
            raise self.error
        return self.save(model, path, *args, **kwargs)


@pytest.mark.parametrize("at, last", [
    (3, r"A restart resumes from the last complete backup, "
        r"'[^']*backup-0-4-w0-[^']*' \(after batch 4 of epoch 0\)\."),
    (1, r"There is no complete backup in it yet: a restart trains from the "
        r"beginning\."),
])
def test_a_backup_that_cannot_be_written_stops_training(
    backups, tmp_path, monkeypatch, float64, at, last
):
    # The disk fills up while the third backup (after batch 6 of epoch 0),
    # or the first, is written: the error names that backup, the cause
    # and the backup a restart will use; what was written is removed; the
    # restart ends as the uninterrupted run.
    folder = tmp_path / "backup"
    full = OSError(28, "No space left on device")
    monkeypatch.setattr(keras_accum.GradientAccumulationModel,
                        "save_weights", _FailingSave(at, full).method())
    with pytest.raises(
        keras_accum.callbacks.BackupWriteError,
        match=r"Could not write the backup '[^']*backup-0-"
        rf"{2 * at}-w0-[^']*' in `backup_dir` \(OSError: \[Errno 28\] No "
        rf"space left on device\)\. Training stopped\. {last}",
    ):
        _fit([BackupAndRestore(folder, save_freq=2)])
    kept = [p.name.split("-")[:3] for p in folder.iterdir()]
    assert kept == ([["backup", "0", "4"]] if at == 3 else [])
    monkeypatch.undo()
    start = _AtStart()
    resumed = _fit([BackupAndRestore(folder, save_freq=2), start])
    assert start.epoch == 0 and start.state[0] == (1 if at == 3 else 0)
    diff = relative_difference(backups[0], resumed.get_weights())
    assert diff <= 1e-12, f"resumed run differs: {diff:.3g}"


def test_a_transient_write_error_is_tried_again(backups, tmp_path,
                                                monkeypatch, float64):
    # A remote file system's transient error (`UnavailableError`) while the
    # second backup is written, twice: tried again in a new folder, the run
    # goes on, and ends as the uninterrupted one. A third failure in a row
    # stops it.
    from keras_accum.callbacks import backup_and_restore

    monkeypatch.setattr(backup_and_restore, "_RETRY_SECONDS", (0, 0))
    unavailable = tf.errors.UnavailableError(None, None, "try again")
    monkeypatch.setattr(keras_accum.GradientAccumulationModel,
                        "save_weights",
                        _FailingSave(2, unavailable, tries=2).method())
    with pytest.warns(UserWarning, match=r"Writing the backup '[^']*"
                      r"backup-0-4-w0-[^']*' failed \(UnavailableError: try "
                      r"again\); trying again in 0 s\."):
        resumed = _fit([BackupAndRestore(tmp_path / "backup", save_freq=2)])
    diff = relative_difference(backups[0], resumed.get_weights())
    assert diff <= 1e-12, f"the run differs: {diff:.3g}"
    monkeypatch.setattr(keras_accum.GradientAccumulationModel,
                        "save_weights",
                        _FailingSave(2, unavailable, tries=3).method())
    with pytest.raises(keras_accum.callbacks.BackupWriteError,
                       match=r"\(UnavailableError: try again\)\. Training "
                       r"stopped\. A restart resumes from the last complete "
                       r"backup, '[^']*backup-0-2-w0-"):
        with pytest.warns(UserWarning, match="trying again"):
            _fit([BackupAndRestore(tmp_path / "other", save_freq=2)])


def test_no_intact_backup_is_an_error(backups, tmp_path, float64):
    # One backup (`double_checkpoint=False`), damaged.
    folder, newest, previous = _copy(backups, tmp_path)
    shutil.rmtree(previous)
    _truncate(newest / "model.weights.h5")
    with pytest.raises(
        ValueError,
        match=r"(?s)No backup in '[^']*backup' can be restored\. Could not "
        r"restore the backup in '[^']*backup-1-4-[^']*manifest\.json' "
        r"\(ValueError: .*\)\. To start training over, delete the folder "
        r"'[^']*backup' \(`double_checkpoint=True` keeps the previous "
        r"backup too, to fall back to\)\.",
    ):
        _fit([BackupAndRestore(folder, save_freq=2)])
    # Both backups damaged: both files named; nothing is deleted.
    folder, newest, previous = _copy(backups, tmp_path / "both")
    _drop_optimizer(newest)
    _set_batches(previous, "2")
    with pytest.raises(
        ValueError,
        match=r"(?s)can be restored\. Could not restore the backup in "
        r"'[^']*backup-1-2-[^']*manifest\.json' \(ValueError: `batches` "
        r"must be an integer >= 0\. Received: batches='2'\)\. Could not "
        r"restore the backup in '[^']*backup-1-4-[^']*model\.weights\.h5' "
        r"\(ValueError: Skipping variable loading .*\)\. To start training "
        r"over, delete the folder '[^']*backup'\.$",
    ):
        _fit([BackupAndRestore(folder, save_freq=2, double_checkpoint=True)])
    assert newest.exists() and previous.exists()
    # Only a half-written folder (no manifest): the first backup was cut
    # short, and training starts over.
    shutil.rmtree(previous)
    (newest / "manifest.json").unlink()
    start = _AtStart()
    with pytest.warns(
        UserWarning,
        match=r"'[^']*backup' holds only backups that were not completed "
        r"\(a process killed while writing its first one\): training "
        r"starts from the beginning\.",
    ):
        with pytest.raises(RuntimeError, match="interrupted"):
            _fit([BackupAndRestore(folder), start, Interrupt(0, 1)])
    assert start.state == (0, 0)


def test_restart_on_other_input_is_refused(backups, tmp_path, float64):
    # A backup after batch 4 of epoch 1; the restart's input comes in
    # another order: its batch 4 holds other samples.
    folder, _, _ = _copy(backups, tmp_path)
    args = train.parse(["-", "-", "--dropout", "--samples", "48",
                        "--data", "other-order"])
    message = (
        r"The input of this `fit\(\)` is not the one that was backed up: "
        r"batch 4 of epoch 1 holds other samples than the backed-up run "
        r"trained on there, so resuming would train on other samples than "
        r"it would have\. Give the input the same order in every run "
    )
    with pytest.raises(ValueError, match=message):
        train.fit(train.build(args), args, [
            BackupAndRestore(folder, save_freq=2, double_checkpoint=True),
        ])
    start = _AtStart()
    with pytest.warns(UserWarning, match=message):
        train.fit(train.build(args), args, [
            BackupAndRestore(folder, save_freq=2, strict=False), start,
        ])
    assert start.state == (3, 0)
    assert not folder.exists()


def test_save_freq_numpy_integer_and_false(backups, tmp_path, float64):
    folder = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit([
            BackupAndRestore(folder, save_freq=np.int64(3)),
            Interrupt(0, 5),
        ])
    backup = [p.name for p in folder.glob("backup-*")]
    assert [name.split("-")[:4] for name in backup] == [
        ["backup", "0", "3", "w0"]
    ]
    # `save_freq=False`: restores that backup, writes none.
    start = _AtStart()
    resumed = _fit([
        BackupAndRestore(folder, save_freq=False, delete_checkpoint=False),
        start,
    ])
    assert start.state == (0, 3)
    assert [p.name for p in folder.glob("backup-*")] == backup
    diff = relative_difference(backups[0], resumed.get_weights())
    record("resumed with save_freq=False", diff)
    assert diff <= 1e-12, f"resumed run differs: {diff:.3g}"


def test_backup_arguments_are_validated():
    with pytest.raises(ValueError, match="Received: backup_dir=''"):
        BackupAndRestore("")
    for save_freq in (True, 0, -2, "x", 2.0, np.bool_(True)):
        with pytest.raises(
            ValueError,
            match=r"`save_freq` must be 'epoch', an integer >= 1 or False\. "
            rf"Received: save_freq={re.escape(repr(save_freq))}$",
        ):
            BackupAndRestore("backup", save_freq=save_freq)
    assert BackupAndRestore("backup", save_freq=np.int64(3)).save_freq == 3
    assert type(BackupAndRestore("b", save_freq=np.int64(3)).save_freq) is int
    assert BackupAndRestore("backup", save_freq=False).save_freq is False
    with pytest.raises(
        ValueError, match="Received: double_checkpoint='yes'"
    ):
        BackupAndRestore("backup", double_checkpoint="yes")


def test_unservable_model_and_folder_are_refused_at_train_begin(tmp_path):
    x, y = np.ones((8, 2)), np.ones((8, 1))
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        ValueError,
        match=r"`keras_accum.callbacks.BackupAndRestore` needs a "
        r"`GradientAccumulationModel` \(for other models, use "
        r"`keras.callbacks.BackupAndRestore`\)\. Received: model of type "
        r"Sequential",
    ):
        plain.fit(x, y, verbose=0,
                  callbacks=[BackupAndRestore(tmp_path / "plain")])
    model = keras_accum.GradientAccumulationModel.from_model(
        plain, gradient_accumulation_steps=2
    )
    model.compile(optimizer="sgd", loss="mse")
    a_file = tmp_path / "file"
    a_file.write_text("")
    under_a_file = a_file / "backup"
    with pytest.raises(
        ValueError,
        match=r"`backup_dir` must be a folder that this process can write "
        rf"backups to; writing to '{re.escape(str(under_a_file))}' failed "
        r"\((NotADirectoryError|FileExistsError|FailedPreconditionError): "
        r".*\)\. Received: "
        r"backup_dir=",
    ):
        model.fit(x, y, verbose=0, callbacks=[BackupAndRestore(under_a_file)])
    assert int(model.optimizer.iterations) == 0
