"""Training runs that `tests/test_small_memory.py` makes on a small device
(in `child.py`, under a memory limit) and as references (plain Keras at the
effective batch, in the test's own process, without one).

All float64 (`large`: float32), from the same initial weights, on the same
samples in the same order. `E` rows per update; images of 64x64 run out of
memory at E under the test's limit, images of 32x32 do not.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_accum

E = 32


# The `large` scenario: one step of `LARGE` 64x64 images into `unet()` in
# `LARGE_LIMIT_MB`. Tried whole, its train step's graph constants (that
# Grappler's constant folding makes, it seems of BatchNormalization's
# gradients: without it the same U-Net did not crash) do not fit:
# TensorFlow 2.21 crashed with a segmentation fault there, instead of
# raising.
LARGE = 512
LARGE_LIMIT_MB = 256
# The micro-batch that the `large` scenario chose, for `large_fixed` (the
# same micro-batches, chosen upfront, in the same process and limit).
chosen = {}

# The `validated` scenario's predictions, which the child saves.
predictions = {}

# Under `HOG_LIMIT_MB`, `MemoryHog` decides which micro-batches fit.
HOG_LIMIT_MB = 400
HOG_MAX_ROWS = 16


class MemoryHog(keras.layers.Layer):
    """Returns its input; for a micro-batch of more than `max_rows` images
    wider than `from_side`, it also asks for 800 MB while it runs: what
    runs out of memory then does not depend on the allocator's state."""

    def __init__(self, max_rows=HOG_MAX_ROWS, from_side=0, **kwargs):
        super().__init__(**kwargs)
        self.max_rows, self.from_side = max_rows, from_side

    def call(self, x):
        shape = tf.shape(x)
        over = tf.logical_and(shape[0] > self.max_rows, shape[2] > self.from_side)
        # Filled from the data, so that nothing folds it into a constant.
        value = tf.stop_gradient(tf.reduce_max(x))
        held = tf.fill([100_000_000 * tf.cast(over, tf.int32)], value)
        return x + tf.zeros((), x.dtype) * tf.reduce_sum(held)


def net(cls=keras.Model, dropout=0.0, hog_from_side=None, **kwargs):
    """A small fully-convolutional net on images of any size."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, None, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    if dropout:
        h = keras.layers.Dropout(dropout)(h)
    if hog_from_side is not None:
        # After Dropout: a step that fails here has drawn its masks.
        h = MemoryHog(from_side=hog_from_side)(h)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    outputs = keras.layers.Conv2D(2, 1)(h)
    return cls(inputs, outputs, **kwargs)


def unet(cls=keras.Model, base=8, depth=3, **kwargs):
    """A small U-Net (float32): convolution, BatchNormalization and ReLU
    blocks, max-pooling down, transposed convolutions up, skip
    concatenations."""
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    layers = keras.layers

    def block(h, filters):
        for _ in range(2):
            h = layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
            h = layers.Activation("relu")(layers.BatchNormalization()(h))
        return h

    inputs = keras.Input((None, None, 3))
    h, skips = inputs, []
    for level in range(depth):
        skips.append(block(h, base * 2**level))
        h = layers.MaxPooling2D()(skips[-1])
    h = block(h, base * 2**depth)
    for level in reversed(range(depth)):
        h = layers.Conv2DTranspose(base * 2**level, 2, strides=2)(h)
        h = block(layers.Concatenate()([h, skips[level]]), base * 2**level)
    return cls(inputs, layers.Conv2D(2, 1)(h), **kwargs)


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
# 64x64 batches start from a quarter of the 32x32 micro-batch (8) and
# double: the third (32, over `MemoryHog`'s 16) runs out of memory with two
# steps of its window pending.
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
    elif name in ("jit", "mixed"):
        # XLA (each micro-batch compiled, on a CPU), and mixed precision
        # with its loss scale: compared with the same micro-batches chosen
        # upfront, without a limit.
        if name == "mixed":
            keras.config.set_dtype_policy("mixed_float16")
        model = _compile(
            net(
                keras_accum.GradientAccumulationModel,
                micro_batch_size=micro_batch_size,
            ),
            jit_compile=name == "jit",
        )
        if name == "mixed":
            x = x.astype("float32")
        history = model.fit(x, y, batch_size=E, **fit)
    elif name == "mirrored":
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = _compile(
                net(keras_accum.GradientAccumulationModel, micro_batch_size="auto")
            )
        history = model.fit(x, y, batch_size=E, **fit)
    elif name in ("large", "large_fixed"):
        model = _compile(
            unet(
                keras_accum.GradientAccumulationModel,
                micro_batch_size=chosen["large"] if name == "large_fixed"
                else micro_batch_size,
            )
        )
        x, y = images(LARGE, 64, seed=2)
        history = model.fit(
            x.astype("float32"), y, batch_size=LARGE, **dict(fit, epochs=1)
        )
        chosen[name] = model.micro_batch_size
    elif name == "tiny":
        model = _compile(
            net(keras_accum.GradientAccumulationModel, micro_batch_size="auto")
        )
        x, y = images(2, 512, seed=1)
        history = model.fit(x, y, batch_size=2, **fit)
    elif name == "dropout":
        model = _compile(
            net(
                keras_accum.GradientAccumulationModel, dropout=0.3,
                micro_batch_size=micro_batch_size, hog_from_side=0,
            )
        )
        history = model.fit(x, y, batch_size=E, **fit)
    elif name == "validated":
        # Validation, evaluation and prediction at the training batch,
        # which `MemoryHog` lets through only in micro-batches of 16.
        cls = keras.Model if micro_batch_size is None else (
            keras_accum.GradientAccumulationModel
        )
        options = {} if micro_batch_size is None else dict(
            micro_batch_size=micro_batch_size
        )
        model = _compile(net(cls, hog_from_side=0, **options))
        x_val, y_val = images(2 * E, 64, seed=3)
        history = model.fit(
            x, y, batch_size=E, validation_data=(x_val, y_val), **fit
        )
        history.history["evaluate"] = model.evaluate(
            x_val, y_val, batch_size=E, verbose=0
        )
        predictions[name] = model.predict(x_val, batch_size=E, verbose=0)
    elif name == "growing":
        model = _compile(
            net(
                keras_accum.GradientAccumulationModel,
                micro_batch_size="auto",
                gradient_accumulation_steps=N_GROWING,
                hog_from_side=32,
            )
        )
        history = model.fit(growing_dataset(), epochs=1, verbose=fit["verbose"])
    else:
        raise ValueError(f"Unknown scenario: {name!r}")
    return model, history.history


def reference(name):
    """Plain Keras at the effective batch on the same samples: weights and
    history."""
    if name == "validated":
        return run(name, limited=False, micro_batch_size=None)
    if name == "growing":
        model = _compile(net(hog_from_side=32))
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
