"""Helpers shared by the segmentation examples: flags, strategy, figures.

The examples' own files hold what they teach (data pipeline, model,
training); this module holds the plumbing that several of them share.
"""

import argparse
import json
import os

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


def build_parser(description):
    """The command-line flags shared by the segmentation examples."""
    parser = argparse.ArgumentParser(
        description=description,
    )
    parser.add_argument(
        "--dataset",
        choices=sorted(DATASETS),
        default="synthetic_shapes",
        help="TFDS dataset to train on (default: %(default)s).",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="TFDS data directory (default: TFDS's, ~/tensorflow_datasets).",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="Micro-batch size per replica "
        f"(default {DEFAULTS['batch_size']}).",
    )
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=None,
        help="Micro-batches per optimizer update "
        f"(default {DEFAULTS['gradient_accumulation_steps']}). The effective "
        "batch is batch-size x steps x replicas.",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"Training epochs (default {DEFAULTS['epochs']}).",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=DEFAULTS["learning_rate"],
        help="Peak learning rate of the cosine schedule "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="Square input size, a multiple of 2**depth (default: 32 for "
        "synthetic_shapes, whose images are 64x64, 128 for oxford_iiit_pet).",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"Filters of the first U-Net level (default {DEFAULTS['width']}).",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=None,
        help=f"Poolings in the U-Net (default {DEFAULTS['depth']}).",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=["none", "mixed_float16", "mixed_bfloat16"],
        default="none",
        help="Keras dtype policy; mixed_float16 adds dynamic loss scaling "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--jit-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Compile the train step with XLA (default: Keras decides, which "
        "means off on CPU-only machines).",
    )
    parser.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="Use at most this many training and validation examples each.",
    )
    parser.add_argument(
        "--strategy",
        choices=["default", "mirrored", "multiworker"],
        default="default",
        help="tf.distribute strategy (default: %(default)s). 'multiworker' "
        "reads the cluster from "
        "the TF_CONFIG environment variable.",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="Random seed (default: 42)."
    )
    parser.add_argument(
        "--output-dir",
        default=os.path.join("outputs", "segmentation"),
        help="Where figures and metrics.json go (default: %(default)s).",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="Tiny images, few examples and steps: checks that it all runs.",
    )
    parser.add_argument(
        "--verbose",
        type=int,
        default=1,
        choices=[0, 1, 2],
        help="Keras fit verbosity (default 1: progress bar).",
    )
    return parser


def resolve_settings(args):
    """Fills the flags left unset from DEFAULTS, SMOKE and the dataset."""
    fallback = dict(DEFAULTS)
    fallback["image_size"] = DATASETS[args.dataset]["image_size"]
    fallback["max_samples"] = None
    if args.smoke:
        fallback.update(SMOKE)
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
