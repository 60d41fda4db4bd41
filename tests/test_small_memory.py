"""Training on a small device: `micro_batch_size="auto"`.

A child process gets a hard memory limit (TensorFlow's CPU allocator, which
then raises `ResourceExhaustedError` as a full GPU does) and trains the
scenarios of `small_memory/scenarios.py`: plain `keras.Model` runs out of
memory at the effective batch E, so the limit is real; keras_accum with
"auto" trains E samples per update and must end where plain Keras at batch
E ends without a limit (float64), with the same metrics: the steps that ran
out of memory were rolled back without a trace in weights, optimizer,
metrics or seed generators.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import record
from conftest import relative_difference

from small_memory import scenarios

CHILD = os.path.join(os.path.dirname(__file__), "small_memory", "child.py")
LIMIT_MB = 110


@pytest.fixture(scope="module")
def small_device(tmp_path_factory):
    """Runs every scenario once on the small device; returns a reader."""
    out = tmp_path_factory.mktemp("small_memory")
    names = ["plain", "auto", "fixed", "growing", "dropout"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, CHILD, str(LIMIT_MB), str(out)] + names,
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    def read(name):
        with open(out / f"{name}.json") as f:
            info = json.load(f)
        if "error" not in info:
            with np.load(out / f"{name}.npz") as saved:
                info["weights"] = [saved[k] for k in saved.files]
        return info

    return read


def _assert_history_close(history, reference):
    # Keras' metric variables are float32 whatever the model's dtype: the
    # same sums in another order agree to float32 rounding. A rolled-back
    # step counted twice would be off by a whole batch.
    for key, values in reference.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-6)


def test_plain_keras_runs_out_of_memory_at_the_effective_batch(small_device):
    assert small_device("plain")["error"] == "ResourceExhaustedError"


def test_auto_trains_the_effective_batch_exactly(small_device, float64):
    info = small_device("auto")
    reference, history = scenarios.reference("auto")
    diff = relative_difference(reference.get_weights(), info["weights"])
    record(f"micro_batch_size='auto' under {LIMIT_MB} MiB vs plain Keras", diff)
    assert diff <= 1e-9
    assert info["iterations"] == int(reference.optimizer.iterations) == 8
    assert 1 <= info["micro_batch_size"] < scenarios.E
    # The rolled-back steps left no trace in the logged metrics.
    _assert_history_close(info["history"], history)
    assert info["history"]["updates"] == [4, 8]
    lines = info["stdout"]
    assert f"Out of memory with micro-batches of {scenarios.E} of the batch of {scenarios.E}" in lines
    assert (
        f"Micro-batches of {info['micro_batch_size']} of the batch of "
        f"{scenarios.E} fit in {LIMIT_MB} MiB (peak "
    ) in lines


def test_a_fixed_size_that_does_not_fit_says_what_would(small_device):
    info = small_device("fixed")
    assert info["error"] == "ResourceExhaustedError"
    message = info["message"]
    assert f"Out of memory in a train step with micro-batches of {scenarios.E} rows" in message
    assert f"Try `micro_batch_size={scenarios.E // 2}`, or `micro_batch_size='auto'`" in message


def test_inputs_that_grow_within_an_epoch_are_recovered(small_device, float64):
    # A pipeline with no image size in its spec: 32x32 images, then 64x64.
    info = small_device("growing")
    reference, _ = scenarios.reference("growing")
    diff = relative_difference(reference.get_weights(), info["weights"])
    record("'auto', inputs growing mid-epoch, vs plain Keras", diff)
    assert diff <= 1e-9
    assert info["iterations"] == 2
    lines = info["stdout"]
    assert f"Micro-batches of {scenarios.E} of the batch of {scenarios.E} fit" in lines
    # The third 64x64 step tried twice the second's size, ran out of
    # memory with two steps of its window pending, and was trained again.
    assert "(input shape (32, 64, 64, 3)): the step was rolled back" in lines
    assert info["micro_batch_size"] < scenarios.E


def test_rolled_back_steps_leave_the_seed_generators(small_device, float64):
    # Dropout draws from a seed generator in every micro-batch: a failed
    # step that advanced it would change every mask after it. The same
    # micro-batches, chosen upfront, without a limit: the same weights.
    info = small_device("dropout")
    assert "Out of memory" in info["stdout"]
    model, history = scenarios.run(
        "dropout", limited=False, micro_batch_size=info["micro_batch_size"]
    )
    diff = relative_difference(model.get_weights(), info["weights"])
    record("'auto' with Dropout vs the same micro-batches, no limit", diff)
    assert diff <= 1e-12
    _assert_history_close(info["history"], history)
