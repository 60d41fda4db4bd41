"""`BackupAndRestore(save_before_preemption=True)`: SIGTERM in one process.

A training process (`resume/train.py`, 7 batches an epoch, windows of 4,
backups at epoch ends only) sends itself SIGTERM as batch 3 of epoch 1
starts: it finishes that batch, backs up there (not at the end of epoch 0,
its last `save_freq` point) and exits with
`BackupAndRestore.PREEMPTION_EXIT_CODE`; restarted, it ends with the
uninterrupted run's weights (float64). The runs are processes of their own,
forked from one that imported TensorFlow once (`resume/restarts.py`), in
the background from the first test.
"""

import importlib.util
import json
import os
import signal
import sys
import threading

import keras
import numpy as np
import pytest
from background import start
from conftest import record
from conftest import relative_difference

import keras_accum
from keras_accum.callbacks import BackupAndRestore

SCRIPT = os.path.join(os.path.dirname(__file__), "resume", "train.py")
RESTARTS = os.path.join(os.path.dirname(__file__), "resume", "restarts.py")
_spec = importlib.util.spec_from_file_location("resume_train", SCRIPT)
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

OPTIONS = ["--save-before-preemption", "--metrics", "mae"]


def start_background_runs(tmp_path_factory):
    """The run sent SIGTERM, then the restarted one (same options)."""

    def command(folder):
        argv = [str(folder / "resumed.npz"), str(folder / "backup"),
                *OPTIONS, "--log", str(folder / "starts.jsonl")]
        runs = {"term": [argv + ["--term", "1:3"], argv]}
        return [sys.executable, RESTARTS, json.dumps(runs)]

    return start(
        tmp_path_factory, "preemption_runs", command,
        dict(os.environ, CUDA_VISIBLE_DEVICES=""), timeout=600,
    )


def _weights(path):
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
def test_sigterm_backs_up_at_its_batch_and_resumes_exactly(
    tmp_path, tmp_path_factory
):
    reference = tmp_path / "reference.npz"
    train.main([str(reference), str(tmp_path / "r"), *OPTIONS])
    run = start_background_runs(tmp_path_factory)
    done = run.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    stopped, resumed = [json.loads(line) for line in done.stdout.splitlines()]
    assert stopped["returncode"] == BackupAndRestore.PREEMPTION_EXIT_CODE, (
        stopped["stderr"]
    )
    assert not stopped["out_exists"]
    assert resumed["returncode"] == 0, resumed["stderr"]
    # The restart starts after batch 3 of epoch 1: 2 updates (epoch 0's
    # windows of 4 and 3), 3 micro-batches pending.
    starts = (run.folder / "starts.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in starts] == [[0, 0, 0], [1, 2, 3]]
    diff = relative_difference(
        _weights(reference), _weights(run.folder / "resumed.npz")
    )
    record("resumed after SIGTERM (one process)", diff)
    assert diff <= 1e-12, f"resumed run differs: {diff:.3g}"
    diff = relative_difference(*(
        _weights(p.with_suffix(".optimizer.npz"))
        for p in (reference, run.folder / "resumed.npz")
    ))
    assert diff <= 1e-12, f"resumed optimizer differs: {diff:.3g}"
    logs = [json.loads(p.with_suffix(".json").read_text())
            for p in (reference, run.folder / "resumed.npz")]
    assert logs[1] == logs[0]
    assert not (run.folder / "backup").exists()


class _Handler(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.during = signal.getsignal(signal.SIGTERM)


def _fit(callbacks):
    x, y = np.ones((8, 2)), np.ones((8, 1))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model = keras_accum.GradientAccumulationModel.from_model(
        model, gradient_accumulation_steps=2
    )
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, verbose=0, callbacks=callbacks)


def test_previous_sigterm_handler_is_put_back(tmp_path):
    def previous(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, previous)
    try:
        spy = _Handler()
        _fit([BackupAndRestore(tmp_path / "b", save_before_preemption=True),
              spy])
        assert spy.during not in (previous, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)


class _Fails(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("a callback failed")


def test_sigterm_handler_is_put_back_when_fit_raises(tmp_path):
    def previous(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, previous)
    try:
        with pytest.raises(RuntimeError, match="a callback failed"):
            _fit([BackupAndRestore(tmp_path / "b",
                                   save_before_preemption=True), _Fails()])
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)


def test_save_before_preemption_is_validated(tmp_path):
    for value in ("yes", 1, None):
        with pytest.raises(
            ValueError,
            match=r"`save_before_preemption` must be a bool\. Received: "
            rf"save_before_preemption={value!r}$",
        ):
            BackupAndRestore("backup", save_before_preemption=value)
    assert BackupAndRestore.PREEMPTION_EXIT_CODE == 42
    # Only the main thread can handle a signal.
    errors = []

    def fit_in_thread():
        try:
            _fit([BackupAndRestore(tmp_path / "t",
                                   save_before_preemption=True)])
        except ValueError as error:
            errors.append(str(error))

    thread = threading.Thread(target=fit_in_thread, name="trainer")
    thread.start()
    thread.join()
    assert errors == [
        "`save_before_preemption=True` handles SIGTERM, which only the main "
        "thread can do, but `fit()` runs in thread 'trainer'. Received: "
        "save_before_preemption=True"
    ]
