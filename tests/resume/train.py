"""A training run that the resume test kills with SIGKILL and starts again.

Usage: python train.py OUT_FILE BACKUP_DIR DATA SAVE_FREQ [EPOCH:BATCH]

Trains a small float64 model with BatchNormalization (N=4 micro-batches of
8, 7 micro-batches an epoch, 3 epochs, Adam) with
`keras_accum.callbacks.BackupAndRestore`, on arrays (`DATA=known`) or on a
`tf.data` pipeline of unknown length (`DATA=unknown`). If EPOCH:BATCH is
given the process kills itself with SIGKILL right after that batch (Keras'
count: batches the resumed run skips count too). A run that ends writes the
final weights to OUT_FILE (`.npz`).
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_accum  # noqa: E402


class KillAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(out, backup_dir, data, save_freq, kill_at=None):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(1)(h)
    model = keras_accum.GradientAccumulationModel(
        inputs, outputs, gradient_accumulation_steps=4
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(56, 6)), rng.normal(size=(56, 1))
    save_freq = save_freq if save_freq == "epoch" else int(save_freq)
    callbacks = [keras_accum.callbacks.BackupAndRestore(backup_dir, save_freq)]
    if kill_at:
        callbacks.append(KillAt(*map(int, kill_at.split(":"))))
    if data == "unknown":
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .filter(lambda *_: True)
            .batch(8)
        )
        model.fit(dataset, epochs=3, callbacks=callbacks, verbose=0)
    else:
        model.fit(
            x, y, batch_size=8, epochs=3, shuffle=False, callbacks=callbacks,
            verbose=0,
        )
    np.savez(out, *model.get_weights())


if __name__ == "__main__":
    main(*sys.argv[1:])
