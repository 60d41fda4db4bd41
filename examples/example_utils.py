"""Helpers shared by the examples: flags, strategy, figures, and the device
memory limit of the small-memory runs.

The examples' own files hold what they teach (data pipeline, model,
training); this module holds the plumbing that several of them share.
"""

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

import keras_accum

DATASET_NAMES = ("oxford_iiit_pet", "synthetic_shapes")


def _datasets():
    """Per dataset: class names and the default image size."""
    # Imported here: `synthetic_shapes` imports tensorflow-datasets, which
    # the language-model example does not need.
    import synthetic_shapes

    return {
        "synthetic_shapes": {
            "class_names": synthetic_shapes.CLASS_NAMES,
            # The dataset is 64x64; training on it downscaled to 32x32 is
            # four times cheaper and loses little (`--image-size 64` for
            # full size).
            "image_size": 32,
        },
        "oxford_iiit_pet": {
            "class_names": ["background", "pet"],
            "image_size": 128,
        },
    }


def __getattr__(name):
    # `DATASETS`, made on first use (PEP 562).
    if name == "DATASETS":
        globals()["DATASETS"] = _datasets()
        return globals()["DATASETS"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Settings of the default run, tuned so that it reaches a validation mean IoU
# above 0.75 on synthetic_shapes in well under three minutes on a two-core CPU
# (dataset generation included).
DEFAULTS = {
    "batch_size": 16,
    "gradient_accumulation_steps": 2,
    "epochs": 6,
    "learning_rate": 5e-3,
    "width": 16,
    "depth": 3,
}

# `--smoke`: tiny sizes that exercise every code path in seconds.
SMOKE = {
    "image_size": 32,
    "batch_size": 4,
    "gradient_accumulation_steps": 2,
    "epochs": 2,
    "max_samples": 24,
    "width": 8,
    "depth": 2,
}


def docstring_title(doc):
    """The `Title:` line of a keras-io style module docstring."""
    for line in doc.strip().splitlines():
        if line.startswith("Title:"):
            return line[len("Title:") :].strip()
    return doc.strip().splitlines()[0]


# The command-line flags of the segmentation examples, as `add_argument`
# keywords. "{name}" in a help text stands for the script's default `name`.
FLAGS = {
    "dataset": dict(
        choices=sorted(DATASET_NAMES),
        default="synthetic_shapes",
        help="TFDS dataset to train on (default: %(default)s).",
    ),
    "data-dir": dict(
        help="TFDS data directory (default: TFDS's, ~/tensorflow_datasets).",
    ),
    "batch-size": dict(
        type=int, help="Micro-batch size per replica (default {batch_size})."
    ),
    "gradient-accumulation-steps": dict(
        type=int,
        help="Micro-batches per optimizer update (default "
        "{gradient_accumulation_steps}). The effective batch is batch-size x "
        "steps x replicas.",
    ),
    "epochs": dict(type=int, help="Training epochs (default {epochs})."),
    "learning-rate": dict(
        type=float,
        help="Peak learning rate of the cosine schedule (default: "
        "{learning_rate}).",
    ),
    "image-size": dict(
        type=int,
        help="Square input size, a multiple of 2**depth (default: 32 for "
        "synthetic_shapes, whose images are 64x64, 128 for oxford_iiit_pet).",
    ),
    "width": dict(
        type=int, help="Filters of the first U-Net level (default {width})."
    ),
    "depth": dict(type=int, help="Poolings in the U-Net (default {depth})."),
    "mixed-precision": dict(
        choices=["none", "mixed_float16", "mixed_bfloat16"],
        default="none",
        help="Keras dtype policy; mixed_float16 adds dynamic loss scaling "
        "(default: %(default)s).",
    ),
    "jit-compile": dict(
        action=argparse.BooleanOptionalAction,
        help="Compile the train step with XLA (default: Keras decides, which "
        "means off on CPU-only machines).",
    ),
    "max-samples": dict(
        type=int,
        help="Use at most this many training and validation examples each.",
    ),
    "strategy": dict(
        choices=["default", "mirrored", "multiworker"],
        default="default",
        help="tf.distribute strategy (default: %(default)s). 'multiworker' "
        "reads the cluster from the TF_CONFIG environment variable.",
    ),
    "seed": dict(type=int, default=42, help="Random seed (default: 42)."),
    "output-dir": dict(
        default=os.path.join("outputs", "segmentation"),
        help="Where figures and metrics.json go (default: %(default)s).",
    ),
    "smoke": dict(
        action="store_true",
        help="Tiny images, few examples and steps: checks that it all runs.",
    ),
    "verbose": dict(
        type=int,
        default=1,
        choices=[0, 1, 2],
        help="Keras fit verbosity (default 1: progress bar).",
    ),
}


def build_parser(description, flags=tuple(FLAGS), defaults=DEFAULTS, **texts):
    """A parser with some of FLAGS (all by default).

    `texts` replaces help texts, by the flag's argument name ("image_size").
    """
    parser = argparse.ArgumentParser(description=description)
    for flag in flags:
        spec = dict(FLAGS[flag])
        text = texts.get(flag.replace("-", "_"), spec["help"])
        spec["help"] = text.format(**defaults)
        parser.add_argument("--" + flag, **spec)
    return parser


def resolve_settings(args, defaults=DEFAULTS, smoke=SMOKE):
    """Fills the flags left unset from `defaults`, `smoke` and the dataset."""
    fallback = {
        "image_size": _datasets()[args.dataset]["image_size"],
        "max_samples": None,
        **defaults,
    }
    if args.smoke:
        fallback.update(smoke)
    for key, value in fallback.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.image_size % 2**args.depth:
        raise ValueError(
            f"--image-size must be a multiple of 2**depth = {2**args.depth}."
        )
    return args


def make_strategy(name):
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multiworker":
        # Must be created before any other TensorFlow op runs.
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


def is_chief():
    """Whether this process writes the outputs (always, unless multi-worker)."""
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    return task.get("type", "chief") == "chief" or (
        task.get("type") == "worker" and task.get("index", 0) == 0
    )


def count_batches(dataset):
    return int(dataset.reduce(0, lambda n, _: n + 1).numpy())


def mask_to_rgb(mask, num_classes):
    """Colours a label mask; ignore pixels are white."""
    palette = np.array(
        [
            [30, 30, 60],
            [230, 90, 60],
            [70, 170, 90],
            [240, 200, 60],
            [90, 140, 230],
        ],
        dtype=np.uint8,
    )[:num_classes]
    mask = np.asarray(mask)
    rgb = np.full(mask.shape + (3,), 255, dtype=np.uint8)
    valid = mask < num_classes
    rgb[valid] = palette[mask[valid]]
    return rgb


def save_prediction_grid(model, val_ds, class_names, path, count=6,
                         batch_size=None):
    """Input, true mask and predicted mask of the first `count` validation
    images; `batch_size`: images per forward pass (default: all at once;
    1 where a memory limit holds a single image's activations only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images, masks = [], []
    for image_batch, mask_batch in val_ds:
        images.append(image_batch.numpy())
        masks.append(mask_batch.numpy())
        if sum(len(b) for b in images) >= count:
            break
    images = np.concatenate(images)[:count]
    masks = np.concatenate(masks)[:count]
    # A plain forward pass rather than `predict()`: no collective ops, so this
    # also works on the chief alone under a multi-worker strategy.
    step = batch_size or len(images)
    predicted = np.concatenate([
        np.argmax(model(images[i:i + step], training=False).numpy(), axis=-1)
        for i in range(0, len(images), step)
    ])

    num_classes = len(class_names)
    fig, axes = plt.subplots(
        len(images), 3, figsize=(6, 2 * len(images)), squeeze=False
    )
    for row, (image, mask, pred) in enumerate(zip(images, masks, predicted)):
        panels = [
            image,
            mask_to_rgb(mask, num_classes),
            mask_to_rgb(pred, num_classes),
        ]
        for col, panel in enumerate(panels):
            axes[row, col].imshow(panel, interpolation="nearest")
            axes[row, col].axis("off")
    for col, title in enumerate(
        ["input", "true mask (white: ignore)", "predicted"]
    ):
        axes[0, col].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def save_training_curves(history, path, title=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = np.arange(1, len(history["loss"]) + 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in [
        (axes[0], "loss", "loss"),
        (axes[1], "mean_iou", "mean IoU"),
    ]:
        ax.plot(epochs, history[key], "o-", label="train")
        if f"val_{key}" in history:
            ax.plot(epochs, history[f"val_{key}"], "s-", label="validation")
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(model, history, val_ds, class_names, output_dir, title,
                  results, args, predict_batch_size=None):
    """Writes the prediction grid, the curves and metrics.json (chief only).

    `predict_batch_size`: images per forward pass of the prediction grid
    (default: all of them at once).

    Returns:
        dict from output name to its path (empty on other workers).
    """
    if not is_chief():
        return {}
    os.makedirs(output_dir, exist_ok=True)
    paths = {
        "predictions": save_prediction_grid(
            model, val_ds, class_names,
            os.path.join(output_dir, "predictions.png"),
            batch_size=predict_batch_size,
        ),
        "training_curves": save_training_curves(
            history, os.path.join(output_dir, "training_curves.png"), title
        ),
        "metrics": os.path.join(output_dir, "metrics.json"),
    }
    with open(paths["metrics"], "w") as f:
        json.dump({**results, "history": history, "args": vars(args)}, f,
                  indent=2)
    for name, path in paths.items():
        print(f"Wrote {name}: {path}")
    return paths


# ---------------------------------------------------------------------------
# Resumable runs (`--backup-dir`): backups, the history of the epochs before
# a restart, and a kill for the tests
# ---------------------------------------------------------------------------

# Batches between two backups, besides the one at every epoch's end.
SAVE_FREQ = 50
# Test-only: `EPOCH:BATCH` (from 1, as the progress bar counts) makes the
# example kill itself with SIGKILL right after that batch of that epoch
# (after the backup that batch may trigger), as a crash would; only a
# `fit()` with `--backup-dir` reads it.
KILL_AFTER = "KERAS_ACCUM_EXAMPLE_KILL_AFTER"
HISTORY_FILE = "history.json"


def add_backup_flags(parser):
    """Adds `--backup-dir` and `--save-freq` to `parser`."""
    parser.add_argument(
        "--backup-dir",
        help="Back up training to this folder (keras_accum.callbacks."
        "BackupAndRestore) every --save-freq batches and at the end of every "
        "epoch. Killed, the same command run again resumes from the last "
        "backup and ends with the figures of an uninterrupted run. The "
        "folder is deleted when training ends.",
    )
    parser.add_argument(
        "--save-freq",
        type=int,
        default=SAVE_FREQ,
        help="With --backup-dir: batches (micro-batches) between backups, "
        "besides the one at the end of every epoch (default: %(default)s).",
    )
    return parser


def check_backup_flags(args):
    """Raises `ValueError` for a `--save-freq` below 1, or `--backup-dir`
    with `--memory-limit-mb`."""
    if args.save_freq < 1:
        raise ValueError("--save-freq must be an integer >= 1. Received: "
                         f"--save-freq {args.save_freq}")
    memory = getattr(args, "memory_limit_mb", None)
    if args.backup_dir and memory:
        # "auto" finds its micro-batch again in every process, by running
        # out of memory: a restart trains other micro-batches (other sums,
        # so not the same weights) and the report of out-of-memory errors
        # and peaks would be the restart's only.
        raise ValueError(
            "--backup-dir cannot be used with --memory-limit-mb: a restarted "
            "run would choose its micro-batches again and could not end "
            "with the uninterrupted run's figures. Received: --backup-dir "
            f"{args.backup_dir} --memory-limit-mb {memory}")


def write_json_atomically(path, value):
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


class EpochLogs(keras.callbacks.Callback):
    """Keeps the logs of every epoch in a JSON file, across restarts.

    After a restart, `fit()`'s `History` only holds the epochs trained since;
    `history` holds all of them: the epochs of the file that come before
    the epoch the restart begins with, then the new ones. Every epoch's
    logs are written before the backup at the end of that epoch (list this
    callback before `BackupAndRestore`), so a backup never outruns them.
    """

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.epochs, self._first = {}, True

    def on_train_begin(self, logs=None):
        self.epochs, self._first = {}, True
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.epochs = {int(k): v for k, v in json.load(f).items()}

    def on_epoch_begin(self, epoch, logs=None):
        if self._first:  # An epoch trained again is logged again.
            self._first = False
            self.epochs = {e: v for e, v in self.epochs.items() if e < epoch}

    def on_epoch_end(self, epoch, logs=None):
        self.epochs[epoch] = {
            k: np.asarray(v).item() for k, v in (logs or {}).items()}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)),
                    exist_ok=True)
        write_json_atomically(self.path, self.epochs)

    @property
    def history(self):
        """`History.history` of all the epochs: key -> per-epoch values."""
        epochs = [self.epochs[e] for e in sorted(self.epochs)]
        keys = dict.fromkeys(k for logs in epochs for k in logs)
        return {k: [logs[k] for logs in epochs] for k in keys}


class KillAfter(keras.callbacks.Callback):
    """Test-only: kills this process with SIGKILL after batch `batch` of
    epoch `epoch` (both from 1)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch, self._epoch = epoch - 1, batch - 1, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == (self.epoch, self.batch):
            print(f"{KILL_AFTER}: killed after batch {batch + 1} of epoch "
                  f"{self._epoch + 1}.", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def kill_after_from_environment():
    """`[KillAfter(...)]` if `KERAS_ACCUM_EXAMPLE_KILL_AFTER` is set, else
    `[]`."""
    value = os.environ.get(KILL_AFTER)
    if not value:
        return []
    found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", value)
    if not found or 0 in map(int, found.groups()):
        raise ValueError(f"{KILL_AFTER} must be EPOCH:BATCH, two integers "
                         f">= 1. Received: {KILL_AFTER}={value!r}")
    return [KillAfter(*map(int, found.groups()))]


def backup_callbacks(backup_dir, save_freq):
    """The callbacks of a resumable `fit()`, in their order: `EpochLogs`
    and `BackupAndRestore` with `backup_dir`, then the test-only kill of
    `KERAS_ACCUM_EXAMPLE_KILL_AFTER`; none if `backup_dir` is `None`."""
    if not backup_dir:
        return []
    return [
        EpochLogs(os.path.join(backup_dir, HISTORY_FILE)),
        keras_accum.callbacks.BackupAndRestore(backup_dir,
                                               save_freq=save_freq),
        *kill_after_from_environment(),
    ]


def whole_history(history, callbacks):
    """`fit()`'s `history`, or, resumable, that of all the epochs."""
    for callback in callbacks:
        if isinstance(callback, EpochLogs):
            return callback.history
    return history


# ---------------------------------------------------------------------------
# Small-memory runs (`--memory-limit-mb`): the device's limit, the messages
# of `micro_batch_size="auto"` and the peak of the train steps
# ---------------------------------------------------------------------------

# Set before TensorFlow starts, they give the CPU a memory limit that raises
# `ResourceExhaustedError` as a full GPU does. oneDNN's kernels crash the
# process at the limit instead of raising, so they are turned off.
CPU_LIMIT_VARIABLES = ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB",
                       "TF_ENABLE_ONEDNN_OPTS")
_CHILD = "KERAS_ACCUM_EXAMPLE_LIMITED"


def cpu_limit_environment(limit_mb):
    """The environment variables that give the CPU `limit_mb` MiB."""
    return dict(zip(CPU_LIMIT_VARIABLES, ("true", str(int(limit_mb)), "0")))


def limit_device_memory(limit_mb, script, argv):
    """Gives this process's device a memory limit of `limit_mb` MiB.

    On a GPU: a logical device of `limit_mb` MiB on every GPU, set before
    any GPU is used. On a CPU the limit comes from environment variables
    that TensorFlow reads when it starts: if they are not set already, the
    script runs again in a child process that has them.

    Args:
        limit_mb: int, the limit in MiB.
        script: path of the script to run again.
        argv: its arguments (`None`: this process's).

    Returns:
        `None` if the limit is in effect in this process; otherwise the
        child's exit code (it has done the run).
    """
    gpus = tf.config.list_physical_devices("GPU")
    env = dict(os.environ)
    if gpus:
        try:
            for gpu in gpus:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(
                        memory_limit=int(limit_mb))])
            return None
        except RuntimeError:  # A GPU is in use already: a fresh process.
            if os.environ.get(_CHILD):
                raise
    else:
        wanted = cpu_limit_environment(limit_mb)
        if all(os.environ.get(k, "").lower() == v for k, v in wanted.items()):
            return None
        env.update(wanted)
        # TensorFlow logs the allocator's state at every out-of-memory
        # error; the run prints what it means.
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        print(f"Running again with a CPU memory limit of {int(limit_mb):,} "
              "MiB: " + " ".join(f"{k}={v}" for k, v in wanted.items()),
              flush=True)
    env[_CHILD] = "1"
    argv = sys.argv[1:] if argv is None else list(argv)
    return subprocess.run([sys.executable, os.path.abspath(script), *argv],
                          env=env).returncode


def memory_device():
    """`"GPU:0"` or `"CPU:0"`: the device whose memory the runs measure."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def out_of_memory_line(error):
    """The telling line of a `ResourceExhaustedError`: what it failed to
    allocate, where (the first line of the message otherwise)."""
    message = getattr(error, "message", None) or str(error)
    found = re.search(r"OOM when allocating tensor with shape\[[^\]]*\]"
                      r"[^\n]*?(?= by allocator|\n|$)", message)
    if found:
        return found.group(0).strip()
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


class _Tee(io.TextIOBase):
    """Writes to a stream and keeps a copy."""

    def __init__(self, stream):
        super().__init__()
        self.stream, self.parts = stream, []

    def write(self, text):
        self.parts.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def isatty(self):  # Keras draws a live progress bar on a terminal.
        return self.stream.isatty()


class AutoMicroBatchLog(keras.callbacks.Callback):
    """Records, per train step, what `micro_batch_size="auto"` printed (with
    `fit(verbose>0)`) and the peak device memory of the train steps.

    Use it as a callback, inside a `with` block around `fit()` (which
    copies what is printed meanwhile):

    ```python
    log = AutoMicroBatchLog()
    with log:
        model.fit(..., callbacks=[log], verbose=2)
    log.recoveries  # [{"epoch": 0, "batch": 7, "message": "Out of ..."}]
    ```

    Attributes:
        recoveries: one dict per train step that ran out of memory and was
            rolled back (`epoch`, `batch` and the message).
        choices: the same for the messages that say which micro-batch fit.
        micro_batch_sizes: the micro-batch of each train step.
        peak: int bytes, the largest peak of a train step (its device's
            peak, reset by "auto" before every step), `None` if unknown.
    """

    PATTERNS = {
        "recoveries": re.compile(r"Out of memory with micro-batches .*?\.(?=\s|$)"),
        "choices": re.compile(r"Micro-batches of \d+ of the batch .*?\.(?=\s|$)"),
    }

    def __init__(self):
        super().__init__()
        self.recoveries, self.choices, self.micro_batch_sizes = [], [], []
        self.peak, self._epoch, self._tee, self._seen = None, 0, None, 0

    def __enter__(self):
        self._tee = _Tee(sys.stdout)
        sys.stdout = self._tee
        return self

    def __exit__(self, *exc):
        sys.stdout = self._tee.stream
        self._read(None)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.micro_batch_sizes.append(self.model.micro_batch_size)
        try:
            peak = tf.config.experimental.get_memory_info(memory_device())
        except (ValueError, RuntimeError):  # no allocator statistics
            peak = None
        if peak and peak["peak"]:
            self.peak = max(self.peak or 0, peak["peak"])
        self._read(batch)

    def describe_recoveries(self):
        """`"2 out-of-memory errors in 1 train step, each rolled back and
        trained again"`, or that none happened."""
        errors = len(self.recoveries)
        steps = len({(r["epoch"], r["batch"]) for r in self.recoveries})
        if not errors:
            return "No train step ran out of memory"
        # `remat="auto"` turns recomputation on instead of going below 1.
        how = "with smaller micro-batches"
        if any("recomputing activations" in r["message"]
               for r in self.recoveries):
            how += " or recomputing activations"
        return (f"{errors} out-of-memory error{'s' * (errors != 1)} in "
                f"{steps} train step{'s' * (steps != 1)}, each rolled back "
                f"and trained again {how}")

    def _read(self, batch):
        if self._tee is None:
            return
        new = "".join(self._tee.parts[self._seen:])
        self._seen = len(self._tee.parts)
        for kind, pattern in self.PATTERNS.items():
            for message in pattern.findall(new):
                getattr(self, kind).append(
                    {"epoch": self._epoch, "batch": batch, "message": message})
