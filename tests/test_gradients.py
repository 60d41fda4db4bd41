"""`None` gradients, `IndexedSlices` and trainable flags changed between fits."""

import keras
import numpy as np
from conftest import RTOL
from conftest import assert_close_to_reference
from helpers import classification_data
from helpers import fit_side_by_side
from helpers import twins


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_none_gradients_for_unused_variables(float64, mode, compile_kwargs):
    """A head without a loss gets `None` gradients: Adam leaves it alone."""
    x, y = classification_data(n=24)

    def build():
        inputs = keras.Input((6,))
        h = keras.layers.Dense(5, activation="tanh")(inputs)
        return inputs, {
            "cls": keras.layers.Dense(3, name="cls")(h),
            "unused": keras.layers.Dense(2, name="unused")(h),
        }

    reference, ours = twins(build, steps=3)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, {"cls": y, "unused": np.zeros((24, 2))}, 2, 3,
        lambda: keras.optimizers.Adam(0.05), {"cls": _loss()},
        compile_kwargs,
    )
    assert_close_to_reference(
        "None gradients (unused head)",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def test_indexed_slices_from_embedding(float64, mode, compile_kwargs):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(24, 5))
    y = rng.integers(0, 3, size=(24,))

    def build():
        inputs = keras.Input((5,), dtype="int32")
        h = keras.layers.Embedding(50, 4)(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return inputs, keras.layers.Dense(3)(h)

    reference, ours = twins(build, steps=4)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 2, 4,
        lambda: keras.optimizers.Adam(0.05), _loss(), compile_kwargs,
        epochs=2,
    )
    assert_close_to_reference(
        "IndexedSlices (Embedding)",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def test_freeze_train_unfreeze_recompile(float64, mode, compile_kwargs):
    x, y = classification_data(n=24)

    def build():
        inputs = keras.Input((6,))
        h = keras.layers.Dense(5, activation="tanh", name="backbone")(inputs)
        return inputs, keras.layers.Dense(3, name="head")(h)

    reference, ours = twins(build, steps=3)
    initial = [np.array(w) for w in reference.get_weights()]
    for model, batch in ((reference, 6), (ours, 2)):
        model.get_layer("backbone").trainable = False
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss=_loss(),
                      **compile_kwargs)
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        model.get_layer("backbone").trainable = True
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss=_loss(),
                      **compile_kwargs)
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    assert len(ours.gradient_accumulator._buffers) == 4
    assert_close_to_reference(
        "trainable flags changed between fits",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )
