"""Bad input gets a clear error that names the argument and the value."""

import keras
import pytest
import tensorflow as tf
from helpers import dense_net

import keras_accum
from keras_accum import model as model_module


@pytest.mark.parametrize("steps", [0, -1, 2.5, True, "4", None])
def test_invalid_gradient_accumulation_steps(steps):
    expected = (
        "`gradient_accumulation_steps` must be an integer >= 1. "
        f"Received: gradient_accumulation_steps={steps!r}"
    )
    with pytest.raises(ValueError) as info:
        keras_accum.GradientAccumulationModel(
            *dense_net(), gradient_accumulation_steps=steps
        )
    assert str(info.value) == expected
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        keras_accum.GradientAccumulator(gradient_accumulation_steps=steps)


def test_numpy_integer_steps_are_accepted():
    import numpy as np

    model = keras_accum.GradientAccumulationModel(
        *dense_net(), gradient_accumulation_steps=np.int64(3)
    )
    assert model.gradient_accumulation_steps == 3


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(gradient_accumulation_steps=2),
        lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(gradient_accumulation_steps=4)
        ),
    ],
    ids=["sgd", "loss_scale_optimizer"],
)
def test_double_accumulation_is_refused(optimizer):
    model = keras_accum.GradientAccumulationModel(
        *dense_net(), gradient_accumulation_steps=2
    )
    with pytest.raises(ValueError, match="accumulated twice.*Drop"):
        model.compile(optimizer=optimizer(), loss="mse")


def test_non_tensorflow_backend_is_refused(monkeypatch):
    monkeypatch.setattr(model_module.keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match="requires the TensorFlow backend"):
        keras_accum.GradientAccumulationModel(
            gradient_accumulation_steps=2
        )


def test_invalid_policy_and_flag():
    with pytest.raises(ValueError, match="Received: non_finite_policy='x'"):
        keras_accum.GradientAccumulationModel(
            *dense_net(), non_finite_policy="x"
        )
    with pytest.raises(ValueError, match="Received: flush_at_epoch_end=1"):
        keras_accum.GradientAccumulationModel(
            *dense_net(), flush_at_epoch_end=1
        )


def test_propagate_with_loss_scale_optimizer_is_refused():
    model = keras_accum.GradientAccumulationModel(
        *dense_net(), gradient_accumulation_steps=2,
        non_finite_policy="propagate",
    )
    with pytest.raises(ValueError, match="cannot be used with a"):
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD()
            ),
            loss="mse",
        )


@pytest.mark.parametrize(
    "case, match",
    [
        ("not_a_model", "needs a `keras.Model`"),
        ("accumulating", "already accumulates"),
        ("unknown_argument", "Unrecognized arguments"),
        ("bad_steps", "`gradient_accumulation_steps` must be an integer"),
        ("accumulating_optimizer", "accumulates gradients itself"),
    ],
)
def test_from_model_errors(case, match):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    args = dict(gradient_accumulation_steps=2)
    if case == "not_a_model":
        model = keras.layers.Dense(1)
    elif case == "accumulating":
        model = keras_accum.GradientAccumulationModel.from_model(model, 2)
    elif case == "unknown_argument":
        args["name"] = "other"
    elif case == "bad_steps":
        args["gradient_accumulation_steps"] = 0
    else:
        model.compile(
            optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2),
            loss="mse",
        )
    cls = type(model)
    with pytest.raises(ValueError, match=match):
        keras_accum.GradientAccumulationModel.from_model(model, **args)
    # A failed conversion leaves the model as it was.
    assert type(model) is cls


def test_accumulator_length_mismatch():
    accumulator = keras_accum.GradientAccumulator(2)
    variables = [tf.Variable(1.0), tf.Variable(2.0)]
    with pytest.raises(ValueError, match="same length"):
        accumulator.accumulate_and_maybe_apply(
            [tf.constant(1.0)], keras.optimizers.SGD(), variables
        )
