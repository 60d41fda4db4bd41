"""`from_model()` on every kind of `keras.Model`, and subclassing that
leaves every class as it was.

The reference is plain `keras.Model` on the big batch (float64).
"""

import keras
import numpy as np
import pytest
from conftest import RTOL
from conftest import assert_close_to_reference
from helpers import Plain
from helpers import Subclassed
from helpers import classification_data
from helpers import fit_reference

import keras_accum

GAM = keras_accum.GradientAccumulationModel


def _functional():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(7, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def _sequential():
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(7, activation="tanh"),
         keras.layers.Dense(3)]
    )


def _subclassed():
    model = Subclassed()
    model(np.zeros((1, 6), keras.config.floatx()))
    return model


BUILDERS = {
    "functional": _functional,
    "sequential": _sequential,
    "subclassed": _subclassed,
}


def _scce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_converted_model_equals_big_batch(kind, mode, compile_kwargs, float64):
    x, y = classification_data(n=16)
    keras.utils.set_random_seed(0)
    reference = _functional()
    original = BUILDERS[kind]()
    original.set_weights(reference.get_weights())
    cls = type(original)
    model = GAM.from_model(original, gradient_accumulation_steps=2)
    assert model is original and isinstance(model, cls)
    initial = [np.array(w) for w in reference.get_weights()]
    reference.compile(optimizer=keras.optimizers.Adam(0.05), loss=_scce())
    fit_reference(reference, x=x, y=y, batch_size=8, shuffle=False, verbose=0)
    model.compile(
        optimizer=keras.optimizers.Adam(0.05), loss=_scce(), **compile_kwargs
    )
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 2
    assert_close_to_reference(
        f"from_model ({kind}, {mode})",
        initial, reference.get_weights(), model.get_weights(), RTOL["float64"],
    )


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_converted_model_saved_and_loaded(kind, tmp_path):
    x, y = classification_data(n=12)
    model = GAM.from_model(BUILDERS[kind](), gradient_accumulation_steps=4)
    model.compile(optimizer="adam", loss=_scce())
    model.fit(x, y, batch_size=2, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(
        path, custom_objects={"Subclassed": Subclassed}
    )
    assert isinstance(loaded, GAM)
    expected = {"sequential": keras.Sequential, "subclassed": Subclassed}
    assert isinstance(loaded, expected.get(kind, keras.Model))
    assert loaded.gradient_accumulation_steps == 4
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(loaded.optimizer.iterations) == 2


def test_compiled_model_keeps_its_compile_state():
    x, y = classification_data(n=8)
    model = _functional()
    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer, loss=_scce(), metrics=["accuracy"])
    model.fit(x, y, batch_size=4, verbose=0)  # traced as plain Keras
    GAM.from_model(model, gradient_accumulation_steps=2)
    assert model.optimizer is optimizer
    history = model.fit(x, y, batch_size=2, verbose=0)
    assert int(optimizer.iterations) == 2 + 2
    assert set(history.history) == {"loss", "accuracy", "updates"}


def test_functional_subclasses_leave_classes_intact():
    class Net(GAM):
        pass

    bases = {cls: cls.__bases__ for cls in (GAM, Net)}
    for _ in range(2):
        inputs = keras.Input((6,))
        net = Net(inputs, keras.layers.Dense(3)(inputs))
        assert isinstance(net, Net)
    assert {cls: cls.__bases__ for cls in bases} == bases
    # A subclassed model of ours still builds afterwards.
    plain = Plain(units=3, gradient_accumulation_steps=2)
    plain(np.zeros((1, 6)))
