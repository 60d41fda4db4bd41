"""Helpers shared by the segmentation examples: flags, strategy, figures,
and the peak memory, saved weights, table and figure of the comparison.

The examples' own files hold what they teach (data pipeline, model,
training); this module holds the plumbing that several of them share.
"""

import argparse
import json
import os
import resource
import sys

import numpy as np
import synthetic_shapes
import tensorflow as tf

# Per dataset: class names and the default image size.
DATASETS = {
    "synthetic_shapes": {
        "class_names": synthetic_shapes.CLASS_NAMES,
        # The dataset is 64x64; training on it downscaled to 32x32 is four
        # times cheaper and loses little (`--image-size 64` for full size).
        "image_size": 32,
    },
    "oxford_iiit_pet": {
        "class_names": ["background", "pet"],
        "image_size": 128,
    },
}

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
        choices=sorted(DATASETS),
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
        "image_size": DATASETS[args.dataset]["image_size"],
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
# compare_accumulation.py: peak memory, saved weights, figure and table
# ---------------------------------------------------------------------------


def _proc_status_mb(field):
    """`VmHWM` (peak) or `VmRSS` (current) resident size in MB, Linux only."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_rss_mb():
    """This process's peak resident set size in MB."""
    value = _proc_status_mb("VmHWM")
    if value is None:  # Not Linux: ru_maxrss is in kB on Linux, bytes on macOS.
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        value /= 1024.0 * (1024.0 if sys.platform == "darwin" else 1.0)
    return value


def read_weights(path):
    """The model's arrays in a `.weights.h5` file (not the optimizer's)."""
    import h5py

    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: (
                arrays.__setitem__(name, np.asarray(obj[()], np.float64))
                if isinstance(obj, h5py.Dataset) and name.startswith("layers/")
                else None
            )
        )
    return arrays


def save_comparison_figure(results, names, path):
    """Validation loss and mean IoU per epoch, and peak memory, of each run.

    `results` and `names` map each run, in order, to its numbers and label.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = [
        dict(marker="o", linestyle="-"),
        dict(marker="s", linestyle="-", linewidth=3, alpha=0.6),
        dict(marker="x", linestyle="--", color="black"),
    ]
    for key, ax, label in [
        ("val_loss", axes[0], "validation loss"),
        ("val_mean_iou", axes[1], "validation mean IoU"),
    ]:
        for run, style in zip(runs, styles):
            values = results[run]["history"][key]
            ax.plot(
                range(1, len(values) + 1), values, label=names[run], **style
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    wrapped = [names[run].replace(" x ", "\nx ") for run in runs]
    colours = ["tab:blue", "tab:orange", "tab:gray"]
    if all("gpu_peak_mb" in results[run] for run in runs):
        peaks = [results[run]["gpu_peak_mb"] for run in runs]
        bars = axes[2].bar(wrapped, peaks, color=colours)
        axes[2].bar_label(bars, fmt="%.0f MB")
        axes[2].set_ylabel("peak GPU memory during fit (MB)")
    else:
        # Resident size before fit (TensorFlow, data, model) and what fit adds.
        growth = [results[run]["peak_rss_growth_mb"] for run in runs]
        base = [results[run]["peak_rss_mb"] - g for run, g in zip(runs, growth)]
        axes[2].bar(wrapped, base, color="lightgray", label="before fit")
        bars = axes[2].bar(
            wrapped, growth, bottom=base, color=colours,
            label="added during fit",
        )
        axes[2].bar_label(
            bars,
            labels=[
                f"{b + g:.0f} MB\n(+{g:.0f} in fit)"
                for b, g in zip(base, growth)
            ],
        )
        axes[2].set_ylabel("peak resident memory (MB)")
        axes[2].set_ylim(0, 1.2 * max(b + g for b, g in zip(base, growth)))
        axes[2].legend(loc="lower right")
    axes[2].set_title("peak memory", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def comparison_table(results, names):
    """A Markdown table of the runs' updates, final metrics, memory, time."""
    lines = [
        "| run | updates | final val loss | final val mean IoU "
        "| peak memory (MB) | peak growth in fit (MB) | train time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run, r in results.items():
        memory = r.get("gpu_peak_mb", r["peak_rss_mb"])
        growth = (
            "n/a" if "gpu_peak_mb" in r else f"{r['peak_rss_growth_mb']:.0f}"
        )
        lines.append(
            f"| {names[run]} | {r['updates']} "
            f"| {r['history']['val_loss'][-1]:.4f} "
            f"| {r['history']['val_mean_iou'][-1]:.4f} "
            f"| {memory:.0f} | {growth} | {r['train_seconds']:.1f} |"
        )
    return "\n".join(lines)
