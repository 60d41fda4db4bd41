"""`None` gradients, `IndexedSlices` and trainable flags changed between fits."""

import keras
import numpy as np
import tensorflow as tf
from conftest import RTOL
from conftest import assert_close_to_reference
from helpers import buffers
from helpers import classification_data
from helpers import fit_side_by_side
from helpers import twins


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_none_gradients_for_unused_variables(
    float64, mode, compile_kwargs, in_step
):
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
        in_step=in_step,
    )
    assert_close_to_reference(
        "None gradients (unused head)",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def _embedding_model():
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(50, 4)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return inputs, keras.layers.Dense(3)(h)


def _token_data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(24, 5))  # many repeated tokens
    y = rng.integers(0, 3, size=(24,))
    return x, y


def test_indexed_slices_from_embedding(float64, mode, compile_kwargs, in_step):
    x, y = _token_data()
    reference, ours = twins(_embedding_model, steps=4)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 2, 4,
        lambda: keras.optimizers.SGD(0.5, momentum=0.9), _loss(),
        compile_kwargs, epochs=2,
        in_step=in_step,
    )
    assert_close_to_reference(
        "IndexedSlices (Embedding), SGD momentum",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


class DenseGradientModel(keras.Model):
    """Plain Keras, with the embedding's `IndexedSlices` made dense."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        grads = [tf.convert_to_tensor(g) for g in grads]
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_indexed_slices_with_adam(float64, mode, compile_kwargs):
    """Adam sees the window's summed gradient per row.

    Keras' Adam, given `IndexedSlices` with repeated indices, squares each
    duplicate before summing them into its second moment, so it is compared
    with plain Keras on the big batch's dense gradient instead.
    """
    x, y = _token_data()
    keras.utils.set_random_seed(0)
    reference = DenseGradientModel(*_embedding_model())
    _, ours = twins(_embedding_model, steps=4)
    ours.set_weights(reference.get_weights())
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 2, 4,
        lambda: keras.optimizers.Adam(0.05), _loss(), compile_kwargs,
        epochs=2,
    )
    assert_close_to_reference(
        "IndexedSlices (Embedding), Adam vs dense big batch",
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
    assert len(buffers(ours)) == 4
    assert_close_to_reference(
        "trainable flags changed between fits",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )
