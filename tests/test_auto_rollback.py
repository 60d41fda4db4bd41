"""`micro_batch_size="auto"`: a step that runs out of memory is put back
exactly, whatever it wrote before it failed.

A device that holds at most `ROWS` rows is played by a layer that raises
`ResourceExhaustedError` (as TensorFlow's allocator does) when it sees a
larger batch in training, unless told to let it through. It sits after
BatchNormalization, Dropout and a frozen block, so that a failing step has
already moved the moving statistics and drawn dropout masks (the seed
generator's state). "auto" fails in the first micro-batch of a window's
first step (nothing pending), then in the second micro-batch of the
window's second step (the buffers hold the first step and the step's own
first micro-batch), and halves each time. The reference is the same model
with a fixed size that never fails, changed where "auto" settled. Both
must end with the same weights, statistics, optimizer variables and logs
(float64, <= 1e-12): a write of a failed attempt that was not put back
would show. The real out-of-memory errors are in
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

    `outcomes`: whether each batch of more than `rows` rows, in turn, is
    let through; the ones after fail. `seen` records each training call as
    `(rows, passed)`."""

    def __init__(self, rows, outcomes=(), **kwargs):
        super().__init__(**kwargs)
        self.rows = rows
        self.outcomes = list(outcomes)
        self.seen = []

    def call(self, x, training=None):
        if not training:
            return x

        def check(n):
            n = int(n)
            fits = n <= self.rows or bool(
                self.outcomes and self.outcomes.pop(0)
            )
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


def net(micro_batch_size, outcomes, seed=0):
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
    x = FailAbove(ROWS, outcomes, name="fail_above")(x)
    outputs = keras.layers.Dense(3)(x)
    model = keras_accum.GradientAccumulationModel(
        inputs, outputs, gradient_accumulation_steps=2,
        micro_batch_size=micro_batch_size,
    )
    return model


def trained(micro_batch_size, run_eagerly, outcomes, callbacks=(), steps=4):
    keras.config.set_floatx("float64")
    try:
        model = net(micro_batch_size, outcomes)
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
                x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                callbacks=list(callbacks),
            )
    finally:
        keras.config.set_floatx("float32")
    return model, history.history, frozen


def state(model):
    return [v.numpy() for v in model.variables] + [
        v.numpy() for v in model.optimizer.variables
    ]


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
def test_failed_attempts_leave_no_trace(mode):
    # 4 batches of 32 rows, windows of 2 steps. Step 1 fails as one
    # micro-batch of 32 (nothing pending), then trains as two of 16. Step 2
    # fails in its second micro-batch of 16 (the buffers hold step 1 and
    # its first micro-batch), then trains at 8, and so do steps 3 and 4.
    run_eagerly = mode == "eager"
    auto, logs, frozen = trained(
        "auto", run_eagerly, outcomes=[False, True, True, True, False]
    )
    assert auto.get_layer("fail_above").seen == [
        (32, False), (16, True), (16, True), (16, True), (16, False)
    ] + [(8, True)] * 12
    assert auto.micro_batch_size == ROWS
    # The reference: 16 for step 1, then 8, never failing.
    reference, reference_logs, _ = trained(
        16, run_eagerly, outcomes=[True, True],
        callbacks=[SizeAfterFirstStep(ROWS)],
    )
    assert reference.get_layer("fail_above").seen == (
        [(16, True)] * 2 + [(8, True)] * 12
    )
    for ours, theirs in zip(state(auto), state(reference), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=EXACT, atol=EXACT)
    assert set(reference_logs) == set(logs)
    for key, values in reference_logs.items():
        np.testing.assert_allclose(logs[key], values, rtol=1e-6)
    # The frozen block was neither trained nor moved.
    after = auto.get_layer("frozen").weights
    for ours, initial in zip(after, frozen, strict=True):
        np.testing.assert_array_equal(ours.numpy(), initial)
