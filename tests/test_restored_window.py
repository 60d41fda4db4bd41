"""A window restored from a file is complete state: it applies at once.

A model trained to the middle of a window is saved, and a new model loads the
file and calls `flush_gradients()` before any train step was traced. The
update must equal applying the pending window in the original process, and
both must equal plain Keras on one batch of the window's samples (float64).
One variable gets no gradient: the restored window must know it (Adam would
move a variable with a zero gradient, and skips one with none).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import record
from conftest import relative_difference

import keras_accum

N, B = 4, 4


@keras.saving.register_keras_serializable(package="tests")
class WithUnused(keras.layers.Layer):
    """A Dense layer with an extra weight that gets no gradient."""

    def build(self, input_shape):
        self.kernel = self.add_weight((input_shape[-1], 2), name="kernel")
        self.unused = self.add_weight((3,), name="unused")

    def call(self, x):
        return tf.matmul(x, self.kernel)


def _functional(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = cls(inputs, WithUnused()(h), **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(6 * B, 5)), rng.normal(size=(6 * B, 2))


def _reference(x, y, in_step):
    """Plain Keras on the same samples: across steps, one batch of the full
    window, then one of the rest; in the step, one batch of all."""
    model = _functional()
    if in_step:
        model.train_on_batch(x, y)
    else:
        model.train_on_batch(x[: N * B], y[: N * B])
        model.train_on_batch(x[N * B :], y[N * B :])
    return model.get_weights()


@pytest.mark.parametrize("in_step", [False, True], ids=["across", "in_step"])
@pytest.mark.parametrize("path", ["weights.h5", "keras"])
def test_restored_window_applies_before_any_trace(tmp_path, float64, in_step, path):
    x, y = _data()
    kwargs = dict(gradient_accumulation_steps=N)
    if in_step:
        # Windows of 3 steps of micro-batches of B: two steps pending.
        kwargs = dict(gradient_accumulation_steps=3, micro_batch_size=B)
    original = _functional(keras_accum.GradientAccumulationModel, **kwargs)
    if in_step:
        original.train_on_batch(x[: N * B], y[: N * B])
        original.train_on_batch(x[N * B :], y[N * B :])
    else:
        for start in range(0, len(x), B):
            original.train_on_batch(x[start : start + B], y[start : start + B])
    assert int(original.micro_step) > 0
    file = str(tmp_path / f"pending.{path}")
    if path == "keras":
        original.save(file)
    else:
        original.save_weights(file)

    if path == "keras":
        restored = keras.saving.load_model(file)
    else:
        restored = _functional(keras_accum.GradientAccumulationModel, **kwargs)
        restored.load_weights(file)
    assert restored.train_function is None
    assert restored.flush_gradients()
    assert original.flush_gradients()
    diff = relative_difference(original.get_weights(), restored.get_weights())
    record(f"flushed after load ({path}, {'in-step' if in_step else 'across'})", diff)
    assert diff <= 1e-12
    # The unused weight kept its value: no update from a zero gradient.
    np.testing.assert_array_equal(
        restored.layers[-1].unused.numpy(), original.layers[-1].unused.numpy()
    )
    assert int(restored.optimizer.iterations) == int(original.optimizer.iterations)
    diff = relative_difference(_reference(x, y, in_step), restored.get_weights())
    record("flushed after load vs plain Keras on the same samples", diff)
    assert diff <= 1e-9


def test_saved_steps_win_with_a_warning(tmp_path, float64):
    # A file saved with N=4 loaded into a model built with N=2: training
    # goes on with 4 (as saved), and the property says so.
    x, y = _data()
    saved = _functional(
        keras_accum.GradientAccumulationModel, gradient_accumulation_steps=4
    )
    saved.train_on_batch(x[:B], y[:B])
    file = str(tmp_path / "n4.weights.h5")
    saved.save_weights(file)
    model = _functional(
        keras_accum.GradientAccumulationModel, gradient_accumulation_steps=2
    )
    with pytest.warns(
        UserWarning,
        match=r"saved with `gradient_accumulation_steps=4`, and this model was "
        r"built with 2: training goes on with 4",
    ):
        model.load_weights(file)
    assert model.gradient_accumulation_steps == 4
    # The pending micro-batch and 5 more: windows of 4 -> 1 update, 2 left.
    for start in range(B, len(x), B):
        model.train_on_batch(x[start : start + B], y[start : start + B])
    assert int(model.optimizer.iterations) == 1
    assert int(model.micro_step) == 2
    # Set after loading: the next window takes it.
    model.gradient_accumulation_steps = 2
    assert model.gradient_accumulation_steps == 2


@keras.saving.register_keras_serializable(package="tests")
class OwnCompile(keras.Model):
    """A plain-Keras model whose `compile()` builds `loss` itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def compile(self, optimizer="sgd", box_loss="mse", **kwargs):
        super().compile(optimizer=optimizer, loss=box_loss, **kwargs)


def test_model_with_its_own_compile_reloads_converted(tmp_path, float64):
    x, y = _data()
    keras.utils.set_random_seed(0)
    plain = OwnCompile()
    plain.compile()
    plain.fit(x, y, batch_size=B, verbose=0)
    plain.save(tmp_path / "plain.keras")
    # Keras reloads it (not compiled: its `compile()` is custom) ...
    with pytest.warns(UserWarning, match="was not called as part of model loading"):
        keras.saving.load_model(tmp_path / "plain.keras")
    # ... and so converted, with its window and weights.
    keras.utils.set_random_seed(0)
    model = keras_accum.GradientAccumulationModel.from_model(OwnCompile(), 2)
    model.compile()
    model.fit(x, y, batch_size=B, verbose=0)
    model.save(tmp_path / "converted.keras")
    with pytest.warns(UserWarning, match="was not called as part of model loading"):
        loaded = keras.saving.load_model(tmp_path / "converted.keras")
    assert isinstance(loaded, OwnCompile)
    assert isinstance(loaded, keras_accum.GradientAccumulationModel)
    assert loaded.gradient_accumulation_steps == 2
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    loaded.compile()
    loaded.fit(x[: 4 * B], y[: 4 * B], batch_size=B, verbose=0)
    assert int(loaded.optimizer.iterations) == 2
