"""Training runs that `tests/test_small_memory.py` makes on a small device
(in `child.py`, under a memory limit) and as references (plain Keras at the
effective batch, in the test's own process, without one).

All float64, from the same initial weights, on the same samples in the same
order. `E` rows per update; images of 64x64 run out of memory at E under
the test's limit, images of 32x32 do not.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_accum

E = 32


def net(cls=keras.Model, dropout=0.0, **kwargs):
    """A small fully-convolutional net on images of any size."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, None, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    if dropout:
        h = keras.layers.Dropout(dropout)(h)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    outputs = keras.layers.Conv2D(2, 1)(h)
    return cls(inputs, outputs, **kwargs)


def images(count, side, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, side, side, 3))
    return x, rng.integers(0, 2, size=(count, side, side))


def _compile(model, **kwargs):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        # Made after `net()`: a loss takes the float type when it is made.
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], **kwargs,
    )
    return model


# The growing pipeline: windows of 3 batches, 32x32 then 64x64 images. The
# 64x64 batches start from a quarter of the 32x32 micro-batch and double:
# the third runs out of memory with two steps of its window pending.
N_GROWING = 3
GROWING_SIDES = (32, 32, 32, 64, 64, 64)


def growing_batches():
    return [images(E, side, seed) for seed, side in enumerate(GROWING_SIDES)]


def growing_dataset():
    """A `tf.data` pipeline whose spec has no image size."""
    batches = growing_batches()
    return tf.data.Dataset.from_generator(
        lambda: iter(batches),
        output_signature=(
            tf.TensorSpec((None, None, None, 3), tf.float64),
            tf.TensorSpec((None, None, None), tf.int64),
        ),
    )


def run(name, limited, micro_batch_size="auto"):
    """Trains scenario `name`; returns the model and its history dict.

    `limited`: in the child, on the small device (the references run
    without a limit)."""
    x, y = images(4 * E, 64, seed=1)
    fit = dict(epochs=2, shuffle=False, verbose=1 if limited else 0)
    if name == "plain":
        model = _compile(net())
        history = model.fit(x, y, batch_size=E, **fit)
    elif name in ("auto", "auto_jit", "fixed"):
        model = _compile(
            net(
                keras_accum.GradientAccumulationModel,
                micro_batch_size=E if name == "fixed" else "auto",
            ),
            steps_per_execution=2,
            jit_compile=name == "auto_jit",
        )
        history = model.fit(x, y, batch_size=E, **fit)
    elif name == "dropout":
        model = _compile(
            net(
                keras_accum.GradientAccumulationModel, dropout=0.3,
                micro_batch_size=micro_batch_size,
            )
        )
        history = model.fit(x, y, batch_size=E, **fit)
    elif name == "growing":
        model = _compile(
            net(
                keras_accum.GradientAccumulationModel,
                micro_batch_size="auto",
                gradient_accumulation_steps=N_GROWING,
            )
        )
        history = model.fit(growing_dataset(), epochs=1, verbose=fit["verbose"])
    else:
        raise ValueError(f"Unknown scenario: {name!r}")
    return model, history.history


def reference(name):
    """Plain Keras at the effective batch on the same samples: weights and
    history."""
    if name == "growing":
        model = _compile(net())
        batches = growing_batches()
        for start in range(0, len(batches), N_GROWING):
            window = batches[start : start + N_GROWING]
            model.train_on_batch(
                np.concatenate([x for x, _ in window]),
                np.concatenate([y for _, y in window]),
            )
        return model, None
    x, y = images(4 * E, 64, seed=1)
    model = _compile(net())
    history = model.fit(x, y, batch_size=E, epochs=2, shuffle=False, verbose=0)
    return model, history.history
