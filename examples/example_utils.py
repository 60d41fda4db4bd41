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
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

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


def save_prediction_grid(model, val_ds, class_names, path, count=6):
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
    predicted = np.argmax(model(images, training=False).numpy(), axis=-1)

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
                  results, args):
    """Writes the prediction grid, the curves and metrics.json (chief only).

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
        return (f"{errors} out-of-memory error{'s' * (errors != 1)} in "
                f"{steps} train step{'s' * (steps != 1)}, each rolled back "
                "and trained again with smaller micro-batches")

    def _read(self, batch):
        if self._tee is None:
            return
        new = "".join(self._tee.parts[self._seen:])
        self._seen = len(self._tee.parts)
        for kind, pattern in self.PATTERNS.items():
            for message in pattern.findall(new):
                getattr(self, kind).append(
                    {"epoch": self._epoch, "batch": batch, "message": message})
