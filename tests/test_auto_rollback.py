"""`micro_batch_size="auto"`: a step that runs out of memory is put back
exactly, whatever it wrote before it failed.

A device that holds at most `ROWS` rows is played by a layer that raises
`ResourceExhaustedError` (as TensorFlow's allocator does) when it sees a
larger batch in training. It sits after BatchNormalization, Dropout and a
frozen block, so that a failing step has already moved the moving
statistics and drawn dropout masks (the seed generator's state). "auto"
tries the whole batch, fails, halves, and settles on `ROWS` (the failures
come in the first step of a window); the reference is the same model with
`micro_batch_size=ROWS` from the start, which never fails. Both must end
with the same weights, statistics, optimizer variables and logs (float64,
<= 1e-12): a write of a failed attempt that was not put back would show.

A second test fails a step while the gradient buffers hold the window's
earlier step and the step's own first micro-batch; its reference changes
its fixed size where "auto" settled. The real out-of-memory errors are in
tests/test_small_memory.py.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum

ROWS = 8
EXACT = 1e-12


class FailAbove(keras.layers.Layer):
    """Raises `ResourceExhaustedError` in training on a batch of more than
    `rows` rows (a `MemoryError` in a `py_function` is one); passes its
    input through otherwise.

    `passes` ({rows: times}) lets a larger batch through that many times
    first. `seen` records each training call as `(rows, passed)`."""

    def __init__(self, rows, passes=None, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows
        self.passes = dict(passes or {})
        self.seen = []

    def call(self, x, training=None):
        if not training:
            return x

        def check(n):
            n = int(n)
            fits = n <= self.rows or self.passes.get(n, 0) > 0
            if n > self.rows and fits:
                self.passes[n] -= 1
            self.seen.append((n, fits))
            if not fits:
                raise MemoryError(f"{n} rows do not fit ({self.rows} do)")
            return n

        if tf.executing_eagerly():
            try:
                check(tf.shape(x)[0])
            except MemoryError as error:
                raise tf.errors.ResourceExhaustedError(None, None, str(error))
            return x
        checked = tf.py_function(check, [tf.shape(x)[0]], tf.int32)
        with tf.control_dependencies([checked]):
            return tf.identity(x)


def net(micro_batch_size, seed=0, passes=None):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(16)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dropout(0.3, seed=3)(x)
    frozen = keras.Sequential(
        [keras.layers.Dense(16), keras.layers.BatchNormalization()],
        name="frozen",
    )
    frozen.trainable = False
    x = frozen(x)
    x = FailAbove(ROWS, passes, name="fail_above")(x)
    outputs = keras.layers.Dense(3)(x)
    model = keras_accum.GradientAccumulationModel(
        inputs, outputs, gradient_accumulation_steps=2,
        micro_batch_size=micro_batch_size,
    )
    return model


def trained(micro_batch_size, run_eagerly, epochs=1, passes=None,
            callbacks=(), steps=2):
    keras.config.set_floatx("float64")
    try:
        model = net(micro_batch_size, passes=passes)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            run_eagerly=run_eagerly,
        )
        frozen = [w.numpy() for w in model.get_layer("frozen").weights]
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32 * steps, 6))
        y = rng.integers(0, 3, size=(32 * steps,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a CPU without a memory limit
            history = model.fit(
                x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                callbacks=list(callbacks),
            )
    finally:
        keras.config.set_floatx("float32")
    return model, history.history, frozen


def state(model):
    return [v.numpy() for v in model.variables] + [
        v.numpy() for v in model.optimizer.variables
    ]


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_failed_attempts_leave_no_trace(mode):
    run_eagerly = mode == "eager"
    reference, reference_logs, _ = trained(ROWS, run_eagerly)
    auto, logs, frozen = trained("auto", run_eagerly)
    # Whole batches of 32 rows, then 16, failed: 8 fit.
    assert auto.micro_batch_size == ROWS
    for ours, theirs in zip(state(auto), state(reference), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=EXACT, atol=EXACT)
    assert set(reference_logs) == set(logs)
    for key, values in reference_logs.items():
        np.testing.assert_allclose(logs[key], values, rtol=1e-6)
    # The frozen block was neither trained nor moved.
    after = auto.get_layer("frozen").weights
    for ours, initial in zip(after, frozen, strict=True):
        np.testing.assert_array_equal(ours.numpy(), initial)


class SizeAfterFirstStep(keras.callbacks.Callback):
    """Sets the model's fixed `micro_batch_size` after the first step (the
    window in progress is kept)."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.model.micro_batch_size = self.size


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_step_failing_with_gradients_pending_is_put_back(mode):
    # Batches of 32 rows, windows of 2 steps. 32 rows pass once and 16 rows
    # once: step 1 trains as one micro-batch of 32; step 2 fails at 32
    # (the buffers hold step 1), then at 16 in its second micro-batch (the
    # buffers hold step 1 and its own first micro-batch), then trains at 8,
    # and so do steps 3 and 4.
    run_eagerly = mode == "eager"
    auto, logs, _ = trained(
        "auto", run_eagerly, passes={32: 1, 16: 1}, steps=4
    )
    layer = auto.get_layer("fail_above")
    assert layer.seen[:4] == [(32, True), (32, False), (16, True), (16, False)]
    assert layer.seen[4:] == [(8, True)] * 12
    # The reference: 32 for step 1, then 8, never failing.
    reference, reference_logs, _ = trained(
        32, run_eagerly, passes={32: 4}, steps=4,
        callbacks=[SizeAfterFirstStep(ROWS)],
    )
    assert [n for n, _ in reference.get_layer("fail_above").seen] == (
        [32] + [8] * 12
    )
    for ours, theirs in zip(state(auto), state(reference), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=EXACT, atol=EXACT)
    assert set(reference_logs) == set(logs)
    for key, values in reference_logs.items():
        np.testing.assert_allclose(logs[key], values, rtol=1e-6)
