"""
Title: Small batch, accumulated batch, big batch: a side-by-side comparison
Description: Train the same U-Net from the same initial weights three ways and
compare learning curves and peak memory.

## Introduction

The three runs:

1. **batch B**: a plain `keras.Model`, micro-batches of `B` images, one update
   per micro-batch;
2. **batch B x N accumulation**: a `GradientAccumulationModel` fed the same
   micro-batches of `B`, one update every `N` of them;
3. **batch N*B**: a plain `keras.Model` fed batches of `N * B` images.

All three start from the same weights (same seed; each run saves its initial
weights and the script checks that they match), see the examples in the same
order (the pipeline shuffles with a fixed seed *before* batching) and use the
same optimizer. Run 2 applies, to float tolerance, the updates of run 3, so
their curves lie on top of each other; run 1 makes `N` times more (noisier)
updates. Run 2 needs the activation memory of run 1 (`B` images at a time),
not that of run 3 (`N * B` images), plus one float32 buffer per weight.

Each run happens in its own subprocess, so that its peak memory is its own:
on a GPU the peak of `tf.config.experimental.get_memory_info`, otherwise the
process's peak resident set size (`VmHWM` from `/proc/self/status`). On a CPU,
the resident size includes TensorFlow itself (several hundred MB), so the
table also gives the growth of the peak during training, which is where the
activations show up.

The script writes `comparison.png` (curves and memory) and `comparison.json`
to `--output-dir`, prints a Markdown table and the relative difference between
the total weight updates of runs 2 and 3.

The defaults (micro-batch 8, 4 steps, 64x64 images, 512 examples, 4 epochs)
take five to eight minutes on a two-core CPU, most of it training.

```
python examples/compare_accumulation.py
python examples/compare_accumulation.py --batch-size 4 \
    --gradient-accumulation-steps 8
python examples/compare_accumulation.py --smoke
```
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# The three configurations, in the order they run.
RUNS = ["small_batch", "accumulated", "big_batch"]

# Settings the parent passes on to each run.
SHARED_FLAGS = [
    "batch_size",
    "gradient_accumulation_steps",
    "epochs",
    "image_size",
    "max_samples",
    "width",
    "depth",
    "learning_rate",
    "seed",
]


def labels(batch_size, steps):
    return {
        "small_batch": f"batch {batch_size}",
        "accumulated": f"batch {batch_size} x {steps} accumulation",
        "big_batch": f"batch {batch_size * steps}",
    }


def build_parser():
    parser = argparse.ArgumentParser(
        description="Small batch, accumulated batch, big batch: learning "
        "curves and peak memory of the same U-Net trained three ways.",
    )
    parser.add_argument("--data-dir", default=None, help="TFDS data directory.")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="Micro-batch size B (default 8).",
    )
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=None,
        help="Accumulation steps N (default 4).",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="Epochs per run (default 4)."
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="Input size (default 64: large enough for activations to show "
        "in the memory figures).",
    )
    parser.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="Training (and validation) examples per run (default 512).",
    )
    parser.add_argument(
        "--width", type=int, default=None, help="U-Net base width (default 16)."
    )
    parser.add_argument(
        "--depth", type=int, default=None, help="U-Net levels (default 3)."
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=2e-3,
        help="Adam learning rate (default: 0.002).",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="Random seed (default: 42)."
    )
    parser.add_argument(
        "--output-dir",
        default=os.path.join("outputs", "compare_accumulation"),
        help="Where comparison.png and comparison.json go "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="Tiny sizes, a few steps per run."
    )
    # Internal: run one configuration (used by the subprocesses).
    parser.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    return parser


def resolve(args):
    defaults = dict(
        batch_size=8,
        gradient_accumulation_steps=4,
        epochs=4,
        image_size=64,
        max_samples=512,
        width=16,
        depth=3,
    )
    if args.smoke:
        defaults.update(
            batch_size=4,
            gradient_accumulation_steps=2,
            epochs=2,
            image_size=32,
            max_samples=16,
            width=8,
            depth=2,
        )
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------------------
# Memory measurement (inside the child process)
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
    value = _proc_status_mb("VmHWM")
    if value is None:  # Not Linux: ru_maxrss is in kB on Linux, bytes on macOS.
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        value /= 1024.0 * (1024.0 if sys.platform == "darwin" else 1.0)
    return value


def read_weights(path):
    """The model's arrays in a `.weights.h5` file (not the optimizer's)."""
    import h5py
    import numpy as np

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


def weight_checks(output_dir):
    """Same start for all runs? How far apart are the accumulated and big runs?

    Returns the largest absolute difference between the runs' initial weights
    and `|update_accumulated - update_big| / |update_big|`, where `update` is
    the change of all the weights over training: 0 for identical training.
    """
    import numpy as np

    initial = {
        run: read_weights(os.path.join(output_dir, f"{run}.initial.weights.h5"))
        for run in RUNS
    }
    reference = initial[RUNS[0]]
    start_gap = max(
        float(np.max(np.abs(initial[run][k] - reference[k])))
        for run in RUNS[1:]
        for k in reference
    )
    accumulated = read_weights(
        os.path.join(output_dir, "accumulated.weights.h5")
    )
    big = read_weights(os.path.join(output_dir, "big_batch.weights.h5"))
    difference = sum(np.sum((accumulated[k] - big[k]) ** 2) for k in big)
    update = sum(np.sum((big[k] - reference[k]) ** 2) for k in big)
    return start_gap, float(np.sqrt(difference / update))


# ---------------------------------------------------------------------------
# One run (child process)
# ---------------------------------------------------------------------------


def run_one(args):
    """Trains one configuration and writes its numbers to `args.result_file`."""
    sys.path.insert(0, HERE)
    import keras
    import tensorflow as tf

    import keras_accum
    import example_utils as utils  # From this folder.
    import segmentation

    keras.utils.set_random_seed(args.seed)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.experimental.set_memory_growth(gpus[0], True)

    steps = args.gradient_accumulation_steps
    batch = args.batch_size * (steps if args.run == "big_batch" else 1)
    # The data pipeline of segmentation.py, with this run's settings.
    flags = []
    for name in ("image_size", "max_samples", "seed", "width", "depth"):
        flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    flags += ["--data-dir", args.data_dir] if args.data_dir else []
    flags += ["--smoke"] if args.smoke else []
    seg_args = utils.resolve_settings(
        utils.build_parser("").parse_args(flags)
    )
    train_ds, val_ds = segmentation.load_datasets(seg_args, batch)
    num_classes = len(utils.DATASETS["synthetic_shapes"]["class_names"])

    inputs, logits = segmentation.unet_layers(
        args.image_size, num_classes, width=args.width, depth=args.depth
    )
    if args.run == "accumulated":
        model = keras_accum.GradientAccumulationModel(
            inputs, logits, gradient_accumulation_steps=steps
        )
    else:
        model = keras.Model(inputs, logits)
    # Same seed, same layers: every run starts from the same weights. They
    # are saved so that the parent process can check it.
    model.save_weights(
        os.path.join(args.output_dir, f"{args.run}.initial.weights.h5")
    )

    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=segmentation.IGNORE_LABEL
        ),
        metrics=[segmentation.make_iou_metric(num_classes)],
    )
    if gpus:
        tf.config.experimental.reset_memory_stats("GPU:0")
    rss_before = peak_rss_mb()
    start = time.perf_counter()
    history = model.fit(
        train_ds,
        validation_data=val_ds,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
    ).history
    seconds = time.perf_counter() - start
    result = {
        "run": args.run,
        "batch_size": batch,
        "accumulation_steps": steps if args.run == "accumulated" else 1,
        "updates": int(model.optimizer.iterations.numpy()),
        "history": history,
        "train_seconds": seconds,
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_growth_mb": peak_rss_mb() - rss_before,
    }
    if gpus:
        result["gpu_peak_mb"] = (
            tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
        )
    # Final weights: the parent compares the accumulated and big-batch runs.
    model.save_weights(os.path.join(args.output_dir, f"{args.run}.weights.h5"))
    with open(args.result_file, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------
# Orchestration (parent process) and reporting
# ---------------------------------------------------------------------------


def markdown_table(results, names):
    lines = [
        "| run | updates | final val loss | final val mean IoU "
        "| peak memory (MB) | peak growth in fit (MB) | train time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in RUNS:
        r = results[run]
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


def plot(results, names, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {
        "small_batch": dict(marker="o", linestyle="-"),
        "accumulated": dict(marker="s", linestyle="-", linewidth=3, alpha=0.6),
        "big_batch": dict(marker="x", linestyle="--", color="black"),
    }
    for key, ax, label in [
        ("val_loss", axes[0], "validation loss"),
        ("val_mean_iou", axes[1], "validation mean IoU"),
    ]:
        for run in RUNS:
            values = results[run]["history"][key]
            ax.plot(
                range(1, len(values) + 1),
                values,
                label=names[run],
                **styles[run],
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    gpu = all("gpu_peak_mb" in results[run] for run in RUNS)
    names_wrapped = [names[run].replace(" x ", "\nx ") for run in RUNS]
    colours = ["tab:blue", "tab:orange", "tab:gray"]
    if gpu:
        peaks = [results[run]["gpu_peak_mb"] for run in RUNS]
        bars = axes[2].bar(names_wrapped, peaks, color=colours)
        axes[2].bar_label(bars, fmt="%.0f MB")
        axes[2].set_ylabel("peak GPU memory during fit (MB)")
    else:
        # Resident size before fit (TensorFlow, data, model) and what fit adds.
        growth = [results[run]["peak_rss_growth_mb"] for run in RUNS]
        base = [results[run]["peak_rss_mb"] - g for run, g in zip(RUNS, growth)]
        axes[2].bar(names_wrapped, base, color="lightgray", label="before fit")
        bars = axes[2].bar(
            names_wrapped,
            growth,
            bottom=base,
            color=colours,
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


def main(argv=None):
    args = resolve(build_parser().parse_args(argv))
    os.makedirs(args.output_dir, exist_ok=True)
    if args.run:
        run_one(args)
        return None

    start = time.perf_counter()
    for run in RUNS:
        options = {
            "--run": run,
            "--result-file": os.path.join(args.output_dir, f"{run}.json"),
            "--output-dir": args.output_dir,
        }
        for name in SHARED_FLAGS:
            options["--" + name.replace("_", "-")] = getattr(args, name)
        command = [sys.executable, os.path.abspath(__file__)]
        for flag, value in options.items():
            command += [flag, str(value)]
        command += ["--data-dir", args.data_dir] if args.data_dir else []
        command += ["--smoke"] if args.smoke else []
        print(f"Running {run} ...", flush=True)
        # One at a time: the first run may have to generate the dataset, and
        # the training times should not disturb one another.
        subprocess.run(command, check=True)
    results = {}
    for run in RUNS:
        with open(os.path.join(args.output_dir, f"{run}.json")) as f:
            results[run] = json.load(f)
    start_gap, update_gap = weight_checks(args.output_dir)

    names = labels(args.batch_size, args.gradient_accumulation_steps)
    figure = plot(
        results, names, os.path.join(args.output_dir, "comparison.png")
    )
    summary_path = os.path.join(args.output_dir, "comparison.json")
    with open(summary_path, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "initial_weights_max_difference": start_gap,
                "update_difference_accumulated_vs_big_batch": update_gap,
                "results": results,
            },
            f,
            indent=2,
        )
    table = markdown_table(results, names)
    print()
    print(table)
    print(
        f"\nInitial weights, largest difference between runs: {start_gap:.1e}"
        f"\nTotal weight update, accumulated vs big batch: relative difference "
        f"{update_gap:.1e} (float32 rounding, compounded over "
        f"{results['big_batch']['updates']} updates)"
    )
    print(f"\nWrote figure: {figure}\nWrote numbers: {summary_path}")
    print(f"Wall time: {time.perf_counter() - start:.1f} s")
    return {
        "results": results,
        "table": table,
        "figure": figure,
        "initial_weights_max_difference": start_gap,
        "update_difference": update_gap,
    }


if __name__ == "__main__":
    main()
