"""Saves a pending window under `MirroredStrategy` and restores it.

Each file is also loaded and its window applied at once with
`flush_gradients()`, before any train step was traced.

Run by `worker.py --case save` (the `save` case of its process under
`MirroredStrategy`) for `tests/test_distribute.py`, or on its own (two
logical CPU devices).
Trains `GradientAccumulationModel` (with BatchNormalization) on two replicas
and saves `.keras` files in the middle of windows; each is loaded (a) under
the same strategy and (b) on one device (the window merged into one
replica), trained on the rest of the epoch and compared with the
uninterrupted run. Prints one JSON line: the largest relative differences.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCH = 8  # global micro-batch
POINTS = (2, 5, 7)  # batches done when saving: micro_step 2, 1, 3


def main():
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2,
    )
    import keras

    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    print(json.dumps(run(strategy)))


def run(strategy):
    """Saves, restores and compares under `strategy` (two replicas on
    "/cpu:0" and "/cpu:1", float64); returns the largest differences."""
    import keras

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    import keras_accum

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8 * BATCH, 6)), rng.normal(size=(8 * BATCH, 1))

    def make():
        # BatchNormalization on a side branch that adds exactly zero: its
        # moving statistics are windowed (and compared), while the rest of
        # the model computes the same on one device as on two replicas.
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, activation="tanh")(inputs)
        side = keras.layers.BatchNormalization()(inputs)
        zero = keras.layers.Dense(1, kernel_initializer="zeros", trainable=False)
        outputs = keras.layers.Add()([keras.layers.Dense(1)(h), zero(side)])
        model = keras_accum.GradientAccumulationModel(
            inputs, outputs, gradient_accumulation_steps=4
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    def fit(model, start=0, callbacks=()):
        model.fit(
            x[start * BATCH :], y[start * BATCH :], batch_size=BATCH,
            shuffle=False, verbose=0, callbacks=list(callbacks),
        )

    folder = tempfile.mkdtemp()

    class Save(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 in POINTS:
                self.model.save(os.path.join(folder, f"{batch + 1}.keras"))

    with strategy.scope():
        uninterrupted = make()
    fit(uninterrupted)
    with strategy.scope():
        saving = make()
    fit(saving, callbacks=[Save()])
    expected = uninterrupted.get_weights()

    def difference(model):
        return max(
            float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))
            for a, b in zip(expected, model.get_weights())
        )

    result = {"same_replicas": 0.0, "one_device": 0.0, "micro_steps": []}
    for point in POINTS:
        path = os.path.join(folder, f"{point}.keras")
        with strategy.scope():
            model = keras.saving.load_model(path)
        result["micro_steps"].append(int(model.micro_step))
        fit(model, point)
        result["same_replicas"] = max(result["same_replicas"], difference(model))
        model = keras.saving.load_model(path)
        fit(model, point)
        result["one_device"] = max(result["one_device"], difference(model))
    # Applied at once after loading, before any train step was traced: as
    # the saving run would have applied it (a `fit()` that ends there).
    result["flushed"], result["flush_applied"] = 0.0, []
    for point in POINTS:
        with strategy.scope():
            reference = make()
        fit_part = dict(batch_size=BATCH, shuffle=False, verbose=0)
        reference.fit(x[: point * BATCH], y[: point * BATCH], **fit_part)
        with strategy.scope():
            model = keras.saving.load_model(
                os.path.join(folder, f"{point}.keras")
            )
        result["flush_applied"].append(
            model.train_function is None and model.flush_gradients()
        )
        expected = reference.get_weights()
        result["flushed"] = max(result["flushed"], difference(model))
    result["iterations"] = int(uninterrupted.optimizer.iterations.numpy())
    return result


if __name__ == "__main__":
    main()
