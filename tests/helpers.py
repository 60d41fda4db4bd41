"""Model builders and the side-by-side trainer used by the tests."""

import keras
import numpy as np

import keras_accum


def keras_version():
    """This Keras' (major, minor) version."""
    return tuple(int(part) for part in keras.__version__.split(".")[:2])


# Keras before 3.13 divides a masked mean (the "sum_over_batch_size" and
# "mean" reductions with `ignore_class` or a Keras mask) by the number of
# valid elements plus `keras.config.epsilon()` (1e-7), not by the number:
# `apply_mask()` in keras/src/losses/loss.py reads, up to Keras 3.12.4,
#     mask *= total / (valid + backend.epsilon())
# and from Keras 3.13.0
#     mask *= ops.divide_no_nan(total, valid)
# The big batch then divides its sum by `V + eps`, each micro-batch by
# `v_k + eps`, and the window's normaliser is the exact `V = sum(v_k)`: the
# two updates differ by about `eps / v_k` relative, at most `eps` when a
# micro-batch holds one valid element or more. (Measured in float64 on
# Keras 3.8 to 3.12: 1e-9 to 5e-9; with the epsilon set to 1e-300: 2e-15.)
MASKED_MEAN_ADDS_EPSILON = keras_version() < (3, 13)


def masked_mean_rtol(rtol, reduction="sum_over_batch_size"):
    """The tolerance of an update whose loss is a masked mean.

    `rtol`, unless this Keras adds its epsilon to the masked mean's divisor
    (see above): then the epsilon, the most a micro-batch with one valid
    element or more can be off by.
    """
    if MASKED_MEAN_ADDS_EPSILON and reduction in (
        "mean", "sum_over_batch_size"
    ):
        return max(rtol, keras.config.epsilon())
    return rtol


def dense_net(num_classes=3, features=6, regularizer=None):
    """A small MLP: (features,) -> logits of `num_classes`."""
    inputs = keras.Input((features,))
    h = keras.layers.Dense(
        7, activation="tanh", kernel_regularizer=regularizer
    )(inputs)
    outputs = keras.layers.Dense(num_classes)(h)
    return inputs, outputs


def segmentation_net(num_classes=3, size=8):
    """A tiny fully-convolutional net: (size, size, 3) -> per-pixel logits."""
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    outputs = keras.layers.Conv2D(num_classes, 1)(h)
    return inputs, outputs


def twins(build, steps, **kwargs):
    """Plain `keras.Model` and `GradientAccumulationModel`, same weights."""
    keras.utils.set_random_seed(0)
    reference = keras.Model(*build())
    ours = keras_accum.GradientAccumulationModel(
        *build(), gradient_accumulation_steps=steps, **kwargs
    )
    ours.set_weights(reference.get_weights())
    return reference, ours


def fit_side_by_side(
    reference,
    ours,
    x,
    y,
    micro_batch,
    steps,
    optimizer,
    loss,
    compile_kwargs,
    sample_weight=None,
    epochs=1,
    loss_weights=None,
    metrics=None,
    **fit_kwargs,
):
    """Trains `reference` on batches of `steps * micro_batch` and `ours` on
    micro-batches of `micro_batch`, same samples, same order.

    Returns:
        (initial weights, reference History, our History)
    """
    initial = [np.array(w) for w in reference.get_weights()]
    histories = []
    for model, batch in ((reference, steps * micro_batch), (ours, micro_batch)):
        model.compile(
            optimizer=optimizer(),
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            **compile_kwargs,
        )
        histories.append(
            model.fit(
                x,
                y,
                sample_weight=sample_weight,
                batch_size=batch,
                epochs=epochs,
                shuffle=False,
                verbose=0,
                **fit_kwargs,
            )
        )
    return initial, histories[0], histories[1]


def classification_data(n=40, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(keras.config.floatx())
    y = rng.integers(0, classes, size=(n,))
    return x, y


def segmentation_data(n=16, size=8, classes=3, ignore=255, seed=0):
    """Per-pixel labels with a different share of ignored pixels per sample."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, size, size, 3)).astype(keras.config.floatx())
    y = rng.integers(0, classes, size=(n, size, size))
    for i in range(n):
        share = (i % 5) / 5.0  # 0% .. 80% ignored
        y[i][rng.random((size, size)) < share] = ignore
    return x, y


def buffers(model):
    """The model's accumulation buffers, through the public `state()`."""
    state = model.gradient_accumulator.state()
    return [v for name, v in state.items() if name.startswith("buffer_")]
