"""`GradientAccumulator` in custom training loops."""

import keras
import numpy as np
import tensorflow as tf
from conftest import RTOL
from conftest import assert_close_to_reference
from helpers import classification_data
from helpers import dense_net

import keras_accum


def _two_loss(y, logits):
    """Cross-entropy plus a per-sample auxiliary penalty (both means)."""
    ce = keras.losses.sparse_categorical_crossentropy(
        y, logits, from_logits=True
    )
    return tf.reduce_mean(ce) + 0.1 * tf.reduce_mean(
        tf.reduce_sum(tf.square(logits), axis=-1)
    )


class BigBatchModel(keras.Model):
    """The reference: a user's custom `train_step` on one big batch."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = _two_loss(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


class AccumulatingModel(keras_accum.GradientAccumulationModel):
    """The same `train_step`, with the public accumulator."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = _two_loss(y, self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.gradient_accumulator.accumulate_and_maybe_apply(
            grads, self.optimizer, self.trainable_variables,
            normalizer=tf.shape(x)[0],
        )
        return {"loss": loss}


def test_custom_train_step(float64, mode, compile_kwargs):
    x, y = classification_data(n=30)
    keras.utils.set_random_seed(0)
    reference = BigBatchModel(*dense_net())
    ours = AccumulatingModel(*dense_net(), gradient_accumulation_steps=4)
    ours.set_weights(reference.get_weights())
    initial = [np.array(w) for w in reference.get_weights()]
    for model, batch in ((reference, 12), (ours, 3)):
        model.compile(optimizer=keras.optimizers.Adam(0.05), **compile_kwargs)
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    # 10 micro-batches per epoch: windows 4, 4, 2 (flushed at epoch end).
    assert int(ours.optimizer.iterations) == 6
    assert_close_to_reference(
        "custom train_step with GradientAccumulator",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def test_plain_tf_function_loop(float64):
    x, y = classification_data(n=16)
    keras.utils.set_random_seed(0)
    model = keras.Model(*dense_net())
    reference = keras.Model(*dense_net())
    reference.set_weights(model.get_weights())
    initial = [np.array(w) for w in model.get_weights()]
    optimizer = keras.optimizers.SGD(0.3, momentum=0.5)
    accumulator = keras_accum.GradientAccumulator(4)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = _two_loss(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return accumulator.accumulate_and_maybe_apply(
            grads, optimizer, model.trainable_variables, normalizer=tf.shape(xb)[0]
        )

    applied = [bool(step(x[i : i + 2], y[i : i + 2])) for i in range(0, 16, 2)]
    assert applied == [False, False, False, True] * 2
    assert int(optimizer.iterations) == 2

    ref_optimizer = keras.optimizers.SGD(0.3, momentum=0.5)
    for i in range(0, 16, 8):
        with tf.GradientTape() as tape:
            loss = _two_loss(y[i : i + 8], reference(x[i : i + 8]))
        ref_optimizer.apply(
            tape.gradient(loss, reference.trainable_variables),
            reference.trainable_variables,
        )
    assert_close_to_reference(
        "tf.function loop with GradientAccumulator",
        initial, reference.get_weights(), model.get_weights(), RTOL["float64"],
    )


def test_flush_applies_partial_window_and_reset_discards(float64):
    variable = tf.Variable([1.0, 2.0], dtype="float64")
    optimizer = keras.optimizers.SGD(1.0)
    accumulator = keras_accum.GradientAccumulator(4)
    g1 = tf.constant([1.0, 1.0], "float64")
    g2 = tf.constant([4.0, -2.0], "float64")
    accumulator.accumulate_and_maybe_apply([g1], optimizer, [variable], normalizer=1)
    accumulator.accumulate_and_maybe_apply([g2], optimizer, [variable], normalizer=3)
    assert int(accumulator.micro_step) == 2
    assert bool(accumulator.flush(optimizer, [variable]))
    # Weighted mean of the two gradients: (1*g1 + 3*g2) / 4.
    np.testing.assert_allclose(
        variable.numpy(), [1.0 - 13.0 / 4.0, 2.0 + 5.0 / 4.0], rtol=1e-15
    )
    accumulator.accumulate_and_maybe_apply([g1], optimizer, [variable])
    accumulator.reset()
    assert not bool(accumulator.flush(optimizer, [variable]))
    assert int(optimizer.iterations) == 1
    # The discarded gradient must not reach the next window.
    before = variable.numpy().copy()
    accumulator.accumulate_and_maybe_apply([g2], optimizer, [variable], normalizer=2)
    assert bool(accumulator.flush(optimizer, [variable]))
    np.testing.assert_allclose(variable.numpy(), before - g2.numpy(), rtol=1e-15)


def test_sum_losses_in_a_custom_loop(float64):
    # `normalizer=None`: each micro-batch's loss is a sum; the window's
    # update is the gradient of the big batch's sum, not divided by anything.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    reference.set_weights(model.get_weights())
    initial = [np.array(w) for w in model.get_weights()]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 3)), rng.normal(size=(12, 2))
    optimizer = keras.optimizers.SGD(0.05)
    accumulator = keras_accum.GradientAccumulator(3)
    for i in range(0, 12, 4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x[i : i + 4]) - y[i : i + 4]))
        grads = tape.gradient(loss, model.trainable_variables)
        accumulator.accumulate_and_maybe_apply(
            grads, optimizer, model.trainable_variables, normalizer=None
        )
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(reference(x) - y))
    keras.optimizers.SGD(0.05).apply(
        tape.gradient(loss, reference.trainable_variables),
        reference.trainable_variables,
    )
    assert int(optimizer.iterations) == 1
    assert_close_to_reference(
        "reduction='sum' in a custom loop",
        initial, reference.get_weights(), model.get_weights(), RTOL["float64"],
    )
