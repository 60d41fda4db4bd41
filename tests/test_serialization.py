"""`.keras` save/load and `get_config`/`from_config` round trips."""

import keras
import numpy as np
import pytest
from helpers import classification_data
from helpers import dense_net

import keras_accum


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _trained_model(float64_data=True):
    keras.utils.set_random_seed(0)
    model = keras_accum.GradientAccumulationModel(
        *dense_net(), gradient_accumulation_steps=3,
        flush_at_epoch_end=False, non_finite_policy="drop_micro_batch",
    )
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=_loss())
    x, y = classification_data(n=18)
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    return model, x, y


def test_save_and_load_keras_file(tmp_path, float64):
    model, x, y = _trained_model()
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)  # safe mode, no custom_objects
    assert isinstance(loaded, keras_accum.GradientAccumulationModel)
    assert loaded.gradient_accumulation_steps == 3
    assert loaded.flush_at_epoch_end is False
    assert loaded.non_finite_policy == "drop_micro_batch"
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)
    # Both go on training identically (optimizer state restored too).
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert int(loaded.optimizer.iterations) == 6


def test_exported_for_serving(tmp_path, float64):
    # `model.export()` (a SavedModel with a `serve` endpoint), reloaded by
    # TensorFlow and as `keras.layers.TFSMLayer`, with a window pending:
    # it serves what plain `keras.Model` with the same weights predicts.
    import tensorflow as tf

    model, x, y = _trained_model()
    model.train_on_batch(x[:2], y[:2])
    assert int(model.micro_step) == 1
    plain = keras.Model(*dense_net())
    plain.set_weights(model.get_weights())
    expected = plain.predict(x, verbose=0)
    path = str(tmp_path / "served")
    model.export(path, verbose=False)
    loaded = tf.saved_model.load(path)  # kept: it holds the variables
    served = loaded.serve(tf.constant(x))
    np.testing.assert_allclose(served.numpy(), expected, rtol=1e-12)
    layer = keras.layers.TFSMLayer(path, call_endpoint="serve")
    np.testing.assert_allclose(np.asarray(layer(x)), expected, rtol=1e-12)


def test_weights_are_those_of_the_plain_model():
    model, _, _ = _trained_model()
    plain = keras.Model(*dense_net())
    assert len(model.weights) == len(plain.weights)


def test_get_config_round_trip():
    model, _, _ = _trained_model()
    config = model.get_config()
    assert config["gradient_accumulation_steps"] == 3
    clone = keras_accum.GradientAccumulationModel.from_config(config)
    assert clone.get_config() == config


def test_subclassed_model_round_trip(tmp_path):
    @keras.saving.register_keras_serializable(package="tests")
    class Tiny(keras_accum.GradientAccumulationModel):
        def __init__(self, units=3, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.dense = keras.layers.Dense(units)

        def call(self, inputs):
            return self.dense(inputs)

        def get_config(self):
            return {**super().get_config(), "units": self.units}

    model = Tiny(units=2, gradient_accumulation_steps=4)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 3)), np.zeros((8, 2)), batch_size=2, verbose=0)
    path = tmp_path / "tiny.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, Tiny)
    assert loaded.gradient_accumulation_steps == 4 and loaded.units == 2
    np.testing.assert_array_equal(
        model.predict(np.ones((1, 3)), verbose=0),
        loaded.predict(np.ones((1, 3)), verbose=0),
    )


def test_functional_use_of_a_subclass_leaves_the_base_alone():
    """A subclass called with (inputs, outputs) becomes Functional; the base
    class, and subclassed models created afterwards, do not."""

    class Functionally(keras_accum.GradientAccumulationModel):
        pass

    class Subclassed(keras_accum.GradientAccumulationModel):
        def __init__(self, units, **kwargs):  # one positional argument
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(units)

        def call(self, inputs):
            return self.dense(inputs)

    bases = keras_accum.GradientAccumulationModel.__bases__
    functional_model = Functionally(*dense_net(), gradient_accumulation_steps=2)
    assert isinstance(functional_model, keras.src.models.Functional)
    assert isinstance(functional_model, Functionally)
    assert keras_accum.GradientAccumulationModel.__bases__ == bases
    assert Functionally.__bases__ == (keras_accum.GradientAccumulationModel,)
    model = Subclassed(2, gradient_accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), batch_size=2, verbose=0)
    assert int(model.optimizer.iterations) == 1


def _made(kind):
    """A model with non-default options, made as `kind` says."""
    options = dict(gradient_accumulation_steps=3, micro_batch_size=2,
                   flush_at_epoch_end=False)
    inputs, outputs = dense_net()
    if kind == "constructed":
        return keras_accum.GradientAccumulationModel(inputs, outputs,
                                                     **options)
    if kind == "functional":
        model = keras.Model(inputs, outputs)
    else:
        model = keras.Sequential(
            [keras.Input(inputs.shape[1:])]
            + [layer for layer in keras.Model(inputs, outputs).layers[1:]]
        )
    return keras_accum.GradientAccumulationModel.from_model(model, **options)


@pytest.mark.parametrize("kind", ["constructed", "functional", "sequential"])
def test_a_copy_with_the_same_options(float64, kind):
    # docs/guide.md, "Limitations": `keras.models.clone_model` keeps none of
    # the options (Keras builds a copy of a functional subclass from its
    # inputs and outputs, and of a Sequential as a plain one); the copy
    # that keeps them is `type(model).from_config(model.get_config())`.
    keras.utils.set_random_seed(0)
    model = _made(kind)
    initial = model.get_weights()
    cloned = keras.models.clone_model(model)
    assert getattr(cloned, "gradient_accumulation_steps", 1) == 1
    assert getattr(cloned, "micro_batch_size", None) is None

    copy = type(model).from_config(model.get_config())
    assert type(copy) is type(model)
    assert copy.get_config() == model.get_config()
    # The copy trains as the model does, from the same weights.
    copy.set_weights(initial)
    x, y = classification_data(n=18)
    for m in (model, copy):
        m.compile(optimizer=keras.optimizers.Adam(0.05), loss=_loss())
        m.fit(x, y, batch_size=6, shuffle=False, verbose=0)
    assert int(copy.optimizer.iterations) == int(model.optimizer.iterations)
    for a, b in zip(model.get_weights(), copy.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
