"""Training on a small device: `micro_batch_size="auto"`.

A child process gets a hard memory limit (TensorFlow's CPU allocator, which
then raises `ResourceExhaustedError` as a full GPU does) and trains the
scenarios of `small_memory/scenarios.py`: plain `keras.Model` runs out of
memory at the effective batch E, so the limit is real; keras_accum with
"auto" trains E samples per update and must end where plain Keras at batch
E ends without a limit (float64), with the same metrics: the steps that ran
out of memory were rolled back without a trace in weights, optimizer,
metrics or seed generators.

The children start all at once, in the background, with the first test
(`background.py`), forked from one process that imported TensorFlow: they
spend most of their time in the allocator's waits at each out-of-memory
error.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest
from background import start
from conftest import record
from conftest import relative_difference
from small_memory import scenarios

CHILD = os.path.join(os.path.dirname(__file__), "small_memory", "child.py")
LIMIT_MB = 110
# The children, by test: each one's scenarios, one after the other in one
# process of its own, and its limit.
CHILDREN = {
    "plain_auto": (("plain", "auto"), LIMIT_MB),
    "fixed_tiny": (("fixed", "tiny"), LIMIT_MB),
    "growing": (("growing",), scenarios.HOG_LIMIT_MB),
    "dropout": (("dropout",), scenarios.HOG_LIMIT_MB),
    "validated": (("validated",), scenarios.HOG_LIMIT_MB),
    "jit_mixed": (("jit", "mixed"), LIMIT_MB),
    "mirrored": (("mirrored",), LIMIT_MB),
    "large": (("large", "large_fixed"), scenarios.LARGE_LIMIT_MB),
}


def start_background_runs(tmp_path_factory):
    """Starts every child at once, in the background (`background.py`),
    with the first test: they spend most of their time in the
    allocator's 10 s waits at each out-of-memory error. (Forked from one
    process that imports TensorFlow once: `small_memory/child.py`.)
    Returns the run."""
    return start(
        tmp_path_factory, "small_memory",
        lambda folder: [sys.executable, CHILD, str(folder)] + [
            f"{child}:{limit_mb}:{','.join(names)}"
            for child, (names, limit_mb) in CHILDREN.items()
        ],
        dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )


@pytest.fixture(scope="module")
def small_device(tmp_path_factory):
    """`wait(child)`: waits for the children and returns a reader of each
    of that child's scenarios' results (weights, history, output, error)."""
    run = start_background_runs(tmp_path_factory)

    def wait(child):
        done = run.wait()
        folder = run.folder / child
        stderr = done.stderr
        if (folder / "stderr").exists():
            stderr += (folder / "stderr").read_text()
        assert (folder / "returncode").exists(), stderr[-3000:]
        assert (folder / "returncode").read_text() == "0", stderr[-3000:]

        def read(name):
            with open(folder / f"{name}.json") as f:
                info = json.load(f)
            if "error" not in info:
                with np.load(folder / f"{name}.npz") as saved:
                    info["weights"] = [saved[k] for k in saved.files]
            predicted = folder / f"{name}_predictions.npy"
            if predicted.exists():
                info["predictions"] = np.load(predicted)
            return info

        return read

    return wait


@pytest.fixture(scope="module")
def auto_reference():
    """Plain Keras at the effective batch without a limit: weights,
    optimizer iterations and history (read by two tests)."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    try:
        model, history = scenarios.reference("auto")
        return (
            model.get_weights(), int(model.optimizer.iterations), history
        )
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
        keras.backend.clear_session()


def _assert_history_close(history, reference):
    # Keras' metric variables are float32 whatever the model's dtype: the
    # same sums in another order agree to float32 rounding. A rolled-back
    # step counted twice would be off by a whole batch.
    for key, values in reference.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-6)


@pytest.mark.background(start=start_background_runs)
def test_auto_trains_the_effective_batch_exactly(
    small_device, auto_reference, float64
):
    # Arrays, `steps_per_execution=2`, metrics.
    small_device = small_device("plain_auto")
    # Plain Keras at the effective batch runs out: the limit is real.
    assert small_device("plain")["error"] == "ResourceExhaustedError"
    info = small_device("auto")
    weights, iterations, history = auto_reference
    diff = relative_difference(weights, info["weights"])
    record(f"micro_batch_size='auto' under {LIMIT_MB} MiB vs plain Keras", diff)
    assert diff <= 1e-9
    assert info["iterations"] == iterations == 8
    assert 1 <= info["micro_batch_size"] < scenarios.E
    # The rolled-back steps left no trace in the logged metrics.
    _assert_history_close(info["history"], history)
    assert info["history"]["updates"] == [4, 8]
    lines = info["stdout"]
    e = scenarios.E
    assert f"Out of memory with micro-batches of {e} of the batch of {e}" in lines
    assert (
        f"Micro-batches of {info['micro_batch_size']} of the batch of "
        f"{scenarios.E} fit in {LIMIT_MB} MiB (peak "
    ) in lines


@pytest.mark.background(start=start_background_runs)
def test_auto_trains_a_batch_many_times_what_fits(small_device):
    # One step of 512 images into a U-Net with BatchNormalization in 256
    # MiB: tried whole first, where its graph constants alone do not fit
    # (that attempt crashed the process), then halved until the
    # micro-batches fit. The same micro-batches, chosen upfront, in the
    # same process and limit: the same weights and moving statistics, so
    # the attempts that ran out of memory left no trace. (The reference is
    # not plain Keras on the whole batch: BatchNormalization normalises
    # each micro-batch by its own moments; the window's exactness is tested
    # in tests/test_batch_norm.py. Nor a run in this process: oneDNN's
    # float32 rounding, on here, moves Adam's first step by 1 %.)
    read = small_device("large")
    info, fixed = read("large"), read("large_fixed")
    assert "error" not in info, info.get("message")
    size = info["micro_batch_size"]
    assert 1 <= size <= scenarios.LARGE // 8
    assert fixed["micro_batch_size"] == size
    assert info["iterations"] == fixed["iterations"] == 1
    assert (
        f"Out of memory with micro-batches of {scenarios.LARGE} of the batch "
        f"of {scenarios.LARGE}"
    ) in info["stdout"]
    assert "Out of memory" not in fixed["stdout"]
    diff = relative_difference(fixed["weights"], info["weights"])
    record(
        f"'auto', {scenarios.LARGE} images in {scenarios.LARGE_LIMIT_MB} MiB "
        "vs the same micro-batches chosen upfront (float32)", diff,
    )
    assert diff <= 1e-6
    _assert_history_close(info["history"], fixed["history"])


@pytest.mark.background(start=start_background_runs)
def test_sizes_that_do_not_fit_say_what_would(small_device):
    small_device = small_device("fixed_tiny")
    info = small_device("fixed")
    assert info["error"] == "ResourceExhaustedError"
    message = info["message"]
    assert f"Out of memory in a train step with micro-batches of {scenarios.E} rows" in message
    assert f"Try `micro_batch_size={scenarios.E // 2}`, or `micro_batch_size='auto'`" in message
    # "auto" when not even one row fits: what did not fit, in what.
    message = small_device("tiny")["message"]
    assert (
        "Not even one row of the batch fits: a micro-batch of 1 row of input "
        f"shape (1, 512, 512, 3) (the batch: (2, 512, 512, 3)) ran out of "
        f"{LIMIT_MB} MiB (peak "
    ) in message


@pytest.mark.background(start=start_background_runs)
def test_inputs_that_grow_within_an_epoch_are_recovered(small_device, float64):
    # A pipeline with no image size in its spec: 32x32 images, then 64x64,
    # windows of three steps.
    reference, _ = scenarios.reference("growing")
    info = small_device("growing")("growing")
    diff = relative_difference(reference.get_weights(), info["weights"])
    record("'auto', inputs growing mid-epoch, vs plain Keras", diff)
    assert diff <= 1e-9
    assert info["iterations"] == 2
    lines = info["stdout"]
    assert f"Micro-batches of {scenarios.E} of the batch of {scenarios.E} fit" in lines
    assert "Micro-batches of 16 of the batch of 32 (rows of shape (64, 64, 3)) fit" in lines
    # The third 64x64 step tried twice the second's size, ran out of
    # memory with two steps of its window pending, and was trained again.
    assert (
        "Out of memory with micro-batches of 32 of the batch of 32 (input "
        "shape (32, 64, 64, 3)): the step was rolled back"
    ) in lines
    assert info["micro_batch_size"] == 16


@pytest.mark.background(start=start_background_runs)
def test_rolled_back_steps_leave_the_seed_generators(small_device, float64):
    # Dropout draws from a seed generator in every micro-batch: a failed
    # step that advanced it would change every mask after it. The same
    # micro-batches, chosen upfront, without a limit: the same weights.
    info = small_device("dropout")("dropout")
    assert "Out of memory with micro-batches of 32" in info["stdout"]
    assert info["micro_batch_size"] == 16
    model, history = scenarios.run(
        "dropout", limited=False, micro_batch_size=info["micro_batch_size"]
    )
    diff = relative_difference(model.get_weights(), info["weights"])
    record("'auto' with Dropout vs the same micro-batches, no limit", diff)
    assert diff <= 1e-12
    _assert_history_close(info["history"], history)


@pytest.mark.background(start=start_background_runs)
def test_validation_evaluation_and_prediction_fit_too(small_device, float64):
    # `fit()` validates at its batch of 32, and `evaluate()` and
    # `predict()` run at it: `MemoryHog` lets only micro-batches of 16
    # through. The second validation batch tried twice the first's size,
    # ran out of memory, and its metrics were rolled back; prediction
    # tried it too. Against plain Keras at the same batches, no limit.
    info = small_device("validated")("validated")
    assert "error" not in info, info.get("message")
    lines = info["stdout"]
    assert (
        f"Out of memory with micro-batches of {scenarios.E} of the batch of "
        f"{scenarios.E} (input shape ({scenarios.E}, 64, 64, 3)): the "
        "evaluation step was rolled back and runs again with micro-batches "
        "of 16."
    ) in lines
    assert f"Evaluation: micro-batches of 16 of the batch of {scenarios.E} fit" in lines
    model, history = scenarios.reference("validated")
    predictions = scenarios.predictions.pop("validated")
    diff = relative_difference(model.get_weights(), info["weights"])
    record("'auto' with validation, evaluate and predict vs plain Keras", diff)
    assert diff <= 1e-9
    assert info["micro_batch_size"] == scenarios.HOG_MAX_ROWS
    for key in ("val_loss", "val_accuracy", "loss", "accuracy", "evaluate"):
        np.testing.assert_allclose(
            info["history"][key], history[key], rtol=1e-6, err_msg=key
        )
    diff = relative_difference([predictions], [info["predictions"]])
    record("'auto' predict under a limit vs plain Keras", diff)
    assert diff <= 1e-12


@pytest.mark.background(start=start_background_runs)
def test_auto_with_xla_and_mixed_precision(small_device, float64):
    # Each compared with the same micro-batches, chosen upfront, without a
    # limit (and so without a rolled-back step).
    small_device = small_device("jit_mixed")
    for name, rtol in (("jit", 1e-9), ("mixed", 1e-5)):
        info = small_device(name)
        assert "Out of memory" in info["stdout"]
        size = info["micro_batch_size"]
        assert 1 <= size < scenarios.E
        model, history = scenarios.run(name, limited=False, micro_batch_size=size)
        diff = relative_difference(model.get_weights(), info["weights"])
        record(f"'auto' ({name}) vs the same micro-batches, no limit", diff)
        assert diff <= rtol
        assert info["iterations"] == int(model.optimizer.iterations) == 8
    # A CPU with a limit trains without XLA, and says why.
    assert any(
        "trains without XLA on a CPU with a memory limit" in w
        for w in small_device("jit")["warnings"]
    )


@pytest.mark.background(start=start_background_runs)
def test_auto_per_replica(small_device, auto_reference, float64):
    # Two replicas (logical CPUs): each replica's half of the batch is
    # split as far as it must be.
    info = small_device("mirrored")("mirrored")
    assert "of the batch of 16 per replica fit in" in info["stdout"]
    weights, _, _ = auto_reference
    diff = relative_difference(weights, info["weights"])
    record("'auto' on 2 replicas vs plain Keras", diff)
    assert diff <= 1e-9
    assert info["iterations"] == 8


def test_auto_without_a_limit_says_so_and_trains_whole_batches(float64):
    import keras_accum

    x, y = scenarios.images(2 * scenarios.E, 16, seed=2)
    model = scenarios._compile(
        scenarios.net(keras_accum.GradientAccumulationModel, micro_batch_size="auto")
    )
    assert model.micro_batch_size == "auto"
    with pytest.warns(
        UserWarning,
        match="this CPU has no memory limit: each batch is trained as one "
        "micro-batch",
    ):
        model.fit(x, y, batch_size=scenarios.E, shuffle=False, verbose=0)
    assert model.micro_batch_size == scenarios.E
    reference = scenarios._compile(scenarios.net())
    reference.fit(x, y, batch_size=scenarios.E, shuffle=False, verbose=0)
    diff = relative_difference(reference.get_weights(), model.get_weights())
    assert diff <= 1e-9
    # Saved as "auto", not as the size this device chose.
    config = model.get_config()
    assert config["micro_batch_size"] == "auto"
    clone = keras_accum.GradientAccumulationModel.from_config(config)
    assert clone.micro_batch_size == "auto"
    with pytest.raises(
        ValueError,
        match="`micro_batch_size` must be an integer >= 1, 'auto' or None. "
        "Received: micro_batch_size='max'",
    ):
        keras_accum.GradientAccumulationModel(micro_batch_size="max")
