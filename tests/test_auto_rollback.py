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

import inspect
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


class CountingLayer(keras.layers.Layer):
    """Assigns a variable in `call()` (a count of its training calls) and
    reads it back."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="ones",
                                     trainable=False, name="calls")

    def call(self, x, training=None):
        if training:
            self.calls.assign_add(1.0)
        return x * (1.0 + 0.1 * self.calls)


# Layers with state that a training step writes, before the failing layer:
# a put-back that missed it would show.
STATEFUL = {
    "batch_norm": lambda: keras.layers.BatchNormalization(),
    "renorm": lambda: keras.layers.BatchNormalization(renorm=True),
    "spectral_normalization": lambda: keras.layers.SpectralNormalization(
        keras.layers.Dense(16)
    ),
    "gaussian_noise": lambda: keras.layers.GaussianNoise(0.3, seed=5),
    "assigns_in_call": CountingLayer,
}


def net(micro_batch_size, outcomes, seed=0, stateful="batch_norm",
        style="functional"):
    """Dense, a stateful layer, Dropout, a frozen block, `FailAbove` and
    the head; a functional model, or a `Sequential` without an `Input`
    (built by `fit()` from the first batch)."""
    keras.utils.set_random_seed(seed)
    frozen = keras.Sequential(
        [keras.layers.Dense(16), keras.layers.BatchNormalization()],
        name="frozen",
    )
    frozen.trainable = False
    layers = [
        keras.layers.Dense(16), STATEFUL[stateful](),
        keras.layers.Dropout(0.3, seed=3), frozen,
        FailAbove(ROWS, outcomes, name="fail_above"), keras.layers.Dense(3),
    ]
    options = dict(gradient_accumulation_steps=2,
                   micro_batch_size=micro_batch_size)
    if style == "sequential_no_input":
        return keras_accum.GradientAccumulationModel.from_model(
            keras.Sequential(layers), **options
        )
    inputs = keras.Input((6,))
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras_accum.GradientAccumulationModel(inputs, x, **options)


def trained(micro_batch_size, run_eagerly, outcomes, callbacks=(), steps=4,
            precision="float64", **kind):
    keras.config.set_dtype_policy(precision)
    if precision == "float64":
        keras.config.set_floatx("float64")
    try:
        model = net(micro_batch_size, outcomes, **kind)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            run_eagerly=run_eagerly,
        )
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32 * steps, 6))
        y = rng.integers(0, 3, size=(32 * steps,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a CPU without a memory limit
            frozen = None
            history = model.fit(
                x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                callbacks=list(callbacks) + [_FrozenAtStart()],
            )
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
    frozen = model.frozen_at_start
    return model, history.history, frozen


class _FrozenAtStart(keras.callbacks.Callback):
    """Keeps the frozen block's weights as `fit()` begins (the model may
    be built by `fit()`)."""

    def on_train_begin(self, logs=None):
        self.model.frozen_at_start = [
            w.numpy() for w in self.model.get_layer("frozen").weights
        ]


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


CASES = {
    # (run_eagerly, stateful layer, how the model is written, precision)
    "graph": (False, "batch_norm", "functional", "float64"),
    "eager": (True, "batch_norm", "functional", "float64"),
    "built_by_fit": (False, "batch_norm", "sequential_no_input", "float64"),
    "built_by_fit_mixed_float16": (
        False, "batch_norm", "sequential_no_input", "mixed_float16"
    ),
    **{
        stateful: (False, stateful, "functional", "float64")
        for stateful in STATEFUL if stateful != "batch_norm"
    },
}
# The main job runs graph mode and a model built by `fit()`; the second the
# rest.
_MAIN_JOB = {"graph", "built_by_fit"}


@pytest.mark.parametrize("case", [
    case if case in _MAIN_JOB else pytest.param(case, marks=pytest.mark.slow)
    for case in CASES
])
def test_failed_attempts_leave_no_trace(case):
    # 4 batches of 32 rows, windows of 2 steps. Step 1 fails as one
    # micro-batch of 32 (nothing pending), then trains as two of 16. Step 2
    # fails in its second micro-batch of 16 (the buffers hold step 1 and
    # its first micro-batch), then trains at 8, and so do steps 3 and 4.
    run_eagerly, stateful, style, precision = CASES[case]
    if stateful == "renorm" and "renorm" not in inspect.signature(
        keras.layers.BatchNormalization.__init__
    ).parameters:
        pytest.skip("no `renorm` in this Keras (from 3.14)")
    kind = dict(stateful=stateful, style=style, precision=precision)
    auto, logs, frozen = trained(
        "auto", run_eagerly, outcomes=[False, True, True, True, False], **kind
    )
    assert auto.get_layer("fail_above").seen == [
        (32, False), (16, True), (16, True), (16, True), (16, False)
    ] + [(8, True)] * 12
    assert auto.micro_batch_size == ROWS
    # The reference: 16 for step 1, then 8, never failing.
    reference, reference_logs, _ = trained(
        16, run_eagerly, outcomes=[True, True],
        callbacks=[SizeAfterFirstStep(ROWS)], **kind
    )
    assert reference.get_layer("fail_above").seen == (
        [(16, True)] * 2 + [(8, True)] * 12
    )
    tolerance = EXACT if precision == "float64" else 1e-6
    for ours, theirs in zip(state(auto), state(reference), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=tolerance,
                                   atol=tolerance)
    assert set(reference_logs) == set(logs)
    for key, values in reference_logs.items():
        np.testing.assert_allclose(logs[key], values, rtol=1e-6)
    # The frozen block was neither trained nor moved.
    after = auto.get_layer("frozen").weights
    for ours, initial in zip(after, frozen, strict=True):
        np.testing.assert_array_equal(ours.numpy(), initial)


class FailingUpdate(keras.optimizers.SGD):
    """SGD whose first update runs out of memory after it has written the
    weights (a `MemoryError` in a `py_function`, after `apply()`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failures = [True]

    def apply(self, grads, trainable_variables=None):
        result = super().apply(grads, trainable_variables)

        def check():
            if self.failures and self.failures.pop(0):
                raise MemoryError("the update does not fit")
            return 0

        tf.py_function(check, [], tf.int32)
        return result


def test_out_of_memory_in_the_update_is_not_retried():
    # A step that failed once the optimizer began to write cannot be put
    # back (the weights and the optimizer's variables are not copied): it
    # raises, saying so, instead of applying the update a second time.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8)(inputs))
    model = keras_accum.GradientAccumulationModel(
        inputs, outputs, gradient_accumulation_steps=2,
        micro_batch_size="auto",
    )
    model.compile(optimizer=FailingUpdate(0.1), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)), rng.normal(size=(64, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU without a memory limit
        with pytest.raises(tf.errors.ResourceExhaustedError) as error:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    message = error.value.message
    assert "began to apply the window's update" in message, message
    assert "BackupAndRestore" in message and "does not fit" in message
    assert model.optimizer.failures == []  # failed once, not run again
