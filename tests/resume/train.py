"""A training run that the resume test kills with SIGKILL and starts again.

Usage: python train.py OUT_FILE BACKUP_DIR [options]

Trains a small float64 model (or mixed precision, `--precision`) with
BatchNormalization (micro-batches of 8, 3 epochs, Adam) with
`keras_accum.callbacks.BackupAndRestore`, on arrays (`--data known`) or on a
`tf.data` pipeline of unknown length (`--data unknown`). `--kill EPOCH:BATCH`
has the process kill itself with SIGKILL right after that train batch (Keras'
count: batches the resumed run skips count too), `--kill vEPOCH:BATCH` right
after that batch of the epoch's validation, `--kill eEPOCH` at that epoch's
end, after its backup. `--log FILE` appends where the run starts, after the
restore (or, with no epoch left to train, at the end), as a JSON line `[epoch,
updates, pending micro-batches]`. A run that ends writes the final weights to
OUT_FILE (`.npz`) and its last epoch's logs to OUT_FILE with `.json` for
`.npz`. `--metrics` compiles metrics (`mae`, `accuracy`, `mean_iou`: the mean
IoU of the signs of output and target). `--term EPOCH:BATCH` sends SIGTERM to
the process as that train batch starts (`--save-before-preemption` has the
callback back up and exit with its `PREEMPTION_EXIT_CODE`); `--multi-worker`
trains under `MultiWorkerMirroredStrategy` (one of the workers that `TF_CONFIG`
names). `--file-url` gives the callback BACKUP_DIR as a `file://` URL. `--trace
FILE` appends a JSON line at every train batch end (`["batch", epoch, batch +
1, steps, updates, pending]`) and epoch end (`["epoch", epoch, updates,
pending]`). A run that ends also writes the optimizer's variables to OUT_FILE
with `.optimizer.npz` for `.npz`. `--break-backup-dir EPOCH:BATCH` replaces
the backup folder by a file as that train batch starts. `--batch-size`,
`--epochs` and `--optimizer` (`adam` or `sgd`) change the defaults (8, 3,
Adam).
"""

import argparse
import json
import os
import shutil
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_accum  # noqa: E402


class KillAt(keras.callbacks.Callback):
    """SIGKILL after train batch `EPOCH:BATCH`, validation batch
    `vEPOCH:BATCH` (1-based batches; the first call of `steps_per_execution`
    batches that reaches it), or at the end of epoch `eEPOCH`, after its
    backup."""

    def __init__(self, spec):
        super().__init__()
        self.in_validation = spec.startswith("v")
        self.at_epoch_end = spec.startswith("e")
        self.at = tuple(map(int, spec.lstrip("ve").split(":")))
        self.epoch = None

    def on_epoch_end(self, epoch, logs=None):
        # After the callbacks before it: the epoch's backup is made.
        if self.at_epoch_end and epoch == self.at[0]:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def _kill_at(self, batch, in_validation):
        # `batch + 1` can pass the batch: calls of `steps_per_execution`.
        if self.at_epoch_end:
            return
        if in_validation == self.in_validation and (
            self.epoch == self.at[0] and batch + 1 >= self.at[1]
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        self._kill_at(batch, False)

    def on_test_batch_end(self, batch, logs=None):
        self._kill_at(batch, True)


class TermAt(keras.callbacks.Callback):
    """SIGTERM to this process as train batch `EPOCH:BATCH` (1-based)
    starts: it arrives during that batch."""

    def __init__(self, spec):
        super().__init__()
        self.at, self.epoch = tuple(map(int, spec.split(":"))), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


class LogStart(keras.callbacks.Callback):
    """Appends `[epoch, updates, pending]` of the run's start to a file."""

    def __init__(self, path):
        super().__init__()
        self.path, self.start = path, None

    def on_train_begin(self, logs=None):
        self.start = [
            int(np.asarray(self.model.optimizer.iterations)),
            int(np.asarray(self.model.micro_step)),
        ]

    def on_epoch_begin(self, epoch, logs=None):
        if self.start is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps([epoch] + self.start) + "\n")
            self.start = None

    def on_train_end(self, logs=None):
        # No epoch was left to train.
        self.on_epoch_begin(self.params["epochs"])


class BreakFolderAt(keras.callbacks.Callback):
    """As train batch `EPOCH:BATCH` (1-based) starts, the backup folder
    goes (its disk lost) and a file takes its path: the next backup cannot
    be written."""

    def __init__(self, spec, folder):
        super().__init__()
        self.at = tuple(map(int, spec.split(":")))
        self.folder, self.epoch = folder, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            shutil.rmtree(self.folder, ignore_errors=True)
            with open(self.folder, "w") as f:
                f.write("not a folder")


class Trace(keras.callbacks.Callback):
    """Appends the state at every train batch end and epoch end."""

    def __init__(self, path):
        super().__init__()
        self.path, self.epoch = path, None

    def _state(self):
        return [int(np.asarray(self.model.optimizer.iterations)),
                int(np.asarray(self.model.micro_step))]

    def _write(self, line):
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        steps = (self.params or {}).get("steps")
        self._write(["batch", self.epoch, batch + 1, steps, *self._state()])

    def on_epoch_end(self, epoch, logs=None):
        self._write(["epoch", epoch, *self._state()])


class GlobalNoise(keras.layers.Layer):
    """Adds noise drawn from Keras' global seed generator (unseeded)."""

    def call(self, x, training=False):
        if not training:
            return x
        return x + keras.random.normal(
            keras.ops.shape(x), stddev=0.1, dtype=x.dtype
        )


class SignIoU(keras.metrics.BinaryIoU):
    """The IoU of `y_pred >= 0` and `y_true > 0` (a confusion matrix)."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = keras.ops.cast(y_true > 0, y_pred.dtype)
        return super().update_state(y_true, y_pred, sample_weight)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("backup_dir")
    parser.add_argument(
        "--data", default="known",
        choices=["known", "unknown", "shuffled", "shuffled-global",
                 "shuffled-arrays", "other-order"],
        help="arrays in order; `tf.data` of unknown length; a `tf.data` "
        "pipeline reshuffled every epoch, seeded or by the global seed "
        "only; arrays with `shuffle=True`; arrays in another order than "
        "the other kinds (for a restart on other input)",
    )
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--kill", help="EPOCH:BATCH or vEPOCH:BATCH")
    parser.add_argument("--samples", type=int, default=56)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument("--steps", type=int, default=4, help="N")
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--no-flush", action="store_true",
                        help="flush_at_epoch_end=False")
    parser.add_argument("--validation", action="store_true")
    parser.add_argument("--dropout", action="store_true",
                        help="Dropout(0.5) and noise from the global seed "
                        "(not with --mirrored)")
    parser.add_argument("--double-checkpoint", action="store_true")
    parser.add_argument("--log", help="a file for where each run starts")
    parser.add_argument("--metrics", nargs="*", default=[],
                        choices=["mae", "accuracy", "mean_iou"])
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--precision", default="float64",
                        choices=["float64", "mixed_float16", "mixed_bfloat16"])
    parser.add_argument("--mirrored", action="store_true",
                        help="MirroredStrategy on 2 logical CPUs")
    # Preemption and several workers.
    parser.add_argument("--term", help="EPOCH:BATCH: SIGTERM to itself "
                        "as that train batch (1-based) starts")
    parser.add_argument("--save-before-preemption", action="store_true")
    parser.add_argument("--multi-worker", action="store_true",
                        help="MultiWorkerMirroredStrategy (TF_CONFIG)")
    parser.add_argument("--file-url", action="store_true",
                        help="BACKUP_DIR as a file:// URL")
    parser.add_argument("--break-backup-dir", help="EPOCH:BATCH: the backup "
                        "folder replaced by a file as that train batch "
                        "(1-based) starts")
    parser.add_argument("--trace", help="a file for the state at every "
                        "batch and epoch end")
    return parser.parse_args(argv)


def build(args):
    keras.config.set_floatx("float64" if args.precision == "float64"
                            else "float32")
    keras.config.set_dtype_policy(args.precision)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    if args.dropout:
        h = keras.layers.Dropout(0.5)(h)
        if not args.mirrored:
            # Keras' global seed generator makes its variable in the first
            # train step, which `MirroredStrategy` refuses (plain Keras too).
            h = GlobalNoise()(h)
    h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(1)(h)
    model = keras_accum.GradientAccumulationModel(
        inputs,
        outputs,
        gradient_accumulation_steps=args.steps,
        micro_batch_size=args.micro_batch_size,
        flush_at_epoch_end=not args.no_flush,
    )
    metrics = [
        SignIoU([0, 1], threshold=0.0, name="mean_iou")
        if name == "mean_iou" else name
        for name in args.metrics
    ]
    model.compile(
        optimizer=(
            keras.optimizers.Adam(0.01) if args.optimizer == "adam"
            else keras.optimizers.SGD(0.05, momentum=0.9)
        ),
        loss="mse", metrics=metrics,
        steps_per_execution=args.steps_per_execution,
    )
    return model


def data(args):
    """Train and validation arrays: `args.samples` and 16 rows."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(args.samples, 6))
    y = rng.normal(size=(args.samples, 1))
    return x, y, rng.normal(size=(16, 6)), rng.normal(size=(16, 1))


def fit(model, args, callbacks):
    x, y, x_val, y_val = data(args)
    kwargs = dict(epochs=args.epochs, callbacks=callbacks, verbose=0)
    if args.data in ("unknown", "shuffled", "shuffled-global"):
        def dataset(*arrays, train=True):
            pipeline = tf.data.Dataset.from_tensor_slices(arrays)
            if args.data == "unknown":
                pipeline = pipeline.filter(lambda *_: True)
            elif train:
                seed = 3 if args.data == "shuffled" else None
                pipeline = pipeline.shuffle(len(arrays[0]), seed=seed)
            return pipeline.batch(args.batch_size)

        validation = (
            dataset(x_val, y_val, train=False) if args.validation else None
        )
        model.fit(dataset(x, y), validation_data=validation, **kwargs)
    else:
        if args.data == "other-order":
            x, y = x[::-1], y[::-1]
        validation = (x_val, y_val) if args.validation else None
        model.fit(
            x, y, batch_size=args.batch_size,
            shuffle=args.data == "shuffled-arrays",
            validation_data=validation, **kwargs,
        )
    return model


def main(argv):
    args = parse(argv)
    save_freq = args.save_freq
    save_freq = save_freq if save_freq == "epoch" else int(save_freq)
    if args.mirrored:
        # Before TensorFlow starts (a forked run's first op comes later).
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    elif args.multi_worker:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tf.distribute.get_strategy()
    backup_dir = args.backup_dir
    if args.file_url:
        backup_dir = "file://" + os.path.abspath(backup_dir)
    callbacks = [
        keras_accum.callbacks.BackupAndRestore(
            backup_dir, save_freq,
            double_checkpoint=args.double_checkpoint,
            save_before_preemption=args.save_before_preemption,
        )
    ]
    if args.log:
        callbacks.append(LogStart(args.log))
    if args.kill:
        callbacks.append(KillAt(args.kill))
    if args.term:
        callbacks.append(TermAt(args.term))
    if args.trace:
        callbacks.append(Trace(args.trace))
    if args.break_backup_dir:
        callbacks.append(BreakFolderAt(args.break_backup_dir, args.backup_dir))
    with strategy.scope():
        model = build(args)
    model = fit(model, args, callbacks)
    np.savez(args.out, *model.get_weights())
    np.savez(args.out.replace(".npz", ".optimizer.npz"),
             *[np.asarray(v) for v in model.optimizer.variables])
    last = {k: float(v[-1]) for k, v in model.history.history.items()}
    with open(args.out.replace(".npz", ".json"), "w") as f:
        json.dump(last, f)


if __name__ == "__main__":
    main(sys.argv[1:])
