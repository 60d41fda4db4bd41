"""Exact resume after a kill: `keras_accum.callbacks.BackupAndRestore`.

A training process is killed with SIGKILL in the middle of a window (and of
an epoch), started again with the same command, killed again, and started
once more; it must end with the weights of the uninterrupted run (float64),
for input of known and of unknown length. Keras' own `BackupAndRestore`
restarts the interrupted epoch from its first batch instead.
"""

import importlib.util
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import record
from conftest import relative_difference

import keras_accum
from keras_accum.callbacks import BackupAndRestore

SCRIPT = os.path.join(os.path.dirname(__file__), "resume", "train.py")
_spec = importlib.util.spec_from_file_location("resume_train", SCRIPT)
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def _run(tmp_path, name, data, save_freq, kill_at=None):
    out = tmp_path / f"{name}.npz"
    command = [
        sys.executable, SCRIPT, str(out), str(tmp_path / f"{name}_backup"),
        data, str(save_freq),
    ] + ([kill_at] if kill_at else [])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    process = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300
    )
    return process, out


def _weights(path):
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


@pytest.mark.parametrize(
    "data, save_freq, kills",
    [
        # Backups every 2 batches: the first kill replays batch 3
        # (micro_step 3), the second resumes right at a backup.
        ("known", 2, ["0:3", "1:6"]),
        # Backups at epoch ends only: the interrupted epoch replays from
        # its start, the kill at micro_step 2.
        ("unknown", "epoch", ["1:6"]),
    ],
)
def test_killed_run_resumes_exactly(tmp_path, data, save_freq, kills):
    # The uninterrupted run, in this process.
    train.main(str(tmp_path / "reference.npz"), str(tmp_path / "r"), data,
               str(save_freq))
    reference_out = tmp_path / "reference.npz"
    for kill_at in kills:
        killed, out = _run(tmp_path, "resumed", data, save_freq, kill_at)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert not out.exists()
    resumed, out = _run(tmp_path, "resumed", data, save_freq)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    diff = relative_difference(_weights(reference_out), _weights(out))
    record(f"resumed after SIGKILL ({data} length)", diff)
    assert diff <= 1e-12, f"resumed run differs: {diff:.3g}"
    # A completed run removes its backups.
    assert not (tmp_path / "resumed_backup").exists()


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("data", ["known", "unknown"])
@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_interrupted_fit_resumes_exactly(
    tmp_path, data, steps_per_execution, float64
):
    # In one process: `fit()` raises, a new model and callback resume.
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
    for epoch, batch in ((0, 4), (1, 6), (2, 2)):
        with pytest.raises(RuntimeError, match="interrupted"):
            run([BackupAndRestore(backup, save_freq=2), _Interrupt(epoch, batch)])
    resumed = run([BackupAndRestore(backup, save_freq=2)])
    diff = relative_difference(reference.get_weights(), resumed.get_weights())
    record(f"resumed after an exception ({data} length)", diff)
    assert diff <= 1e-12
    assert int(resumed.optimizer.iterations) == int(
        reference.optimizer.iterations
    )


def test_backup_arguments_are_validated():
    with pytest.raises(ValueError, match="Received: save_freq=0"):
        BackupAndRestore("backup", save_freq=0)
    with pytest.raises(ValueError, match="Received: backup_dir=''"):
        BackupAndRestore("")
