"""
Title: Small batch, accumulated batch, big batch: a side-by-side comparison
Description: Train the same U-Net from the same initial weights three ways and
compare learning curves and peak memory.

## Introduction

Gradient accumulation promises the updates of a big batch at the memory cost
of a small one. This example checks both halves of the promise on the U-Net
and the `synthetic_shapes` pipeline of `segmentation.py`, trained three ways:

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

## Measuring peak memory

Each run happens in its own subprocess, so that its peak memory is its own:
on a GPU the peak of `tf.config.experimental.get_memory_info`, otherwise the
process's peak resident set size (`VmHWM` from `/proc/self/status`). On a CPU,
the resident size includes TensorFlow itself (several hundred MB), so the
table also gives the growth of the peak during training, which is where the
activations show up.

## Running it

```
python examples/compare_accumulation.py
python examples/compare_accumulation.py --batch-size 4 \
    --gradient-accumulation-steps 8
python examples/compare_accumulation.py --smoke
```

The defaults (micro-batch 8, 4 steps, 64x64 images, 512 examples, 4 epochs)
take five to eight minutes on a two-core CPU, most of it training. `--smoke`
trains tiny models on a few examples, one after the other in the script's own
process (three TensorFlow start-ups would take longer than the training), so
its memory figures mean nothing.

The script writes `comparison.png` (curves and memory) and `comparison.json`
to `--output-dir`, prints a Markdown table and the relative difference between
the total weight updates of runs 2 and 3.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import keras_accum

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_utils as utils  # noqa: E402  (flags, memory, figure)
import segmentation  # noqa: E402  (data pipeline, U-Net, loss and metric)

# The three configurations, in the order they run.
RUNS = ["small_batch", "accumulated", "big_batch"]

# ---------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------

# 64x64 images: large enough for the activations to show in the memory
# figures. The learning rate is constant: no schedule to size in updates.
DEFAULTS = dict(batch_size=8, gradient_accumulation_steps=4, epochs=4,
                image_size=64, max_samples=512, width=16, depth=3,
                learning_rate=2e-3)
# `--smoke`: 16 examples, one epoch, trained eagerly (tracing the train steps
# of three models would take longer than the training).
SMOKE = dict(batch_size=4, gradient_accumulation_steps=2, epochs=1,
             image_size=32, max_samples=16, width=8, depth=2)
# What the parent passes on to each run (all of it, resolved).
RUN_FLAGS = list(DEFAULTS) + ["seed", "data_dir", "output_dir"]


def build_parser():
    parser = utils.build_parser(
        "Small batch, accumulated batch, big batch: learning curves and peak "
        "memory of the same U-Net trained three ways.",
        flags=["data-dir", "batch-size", "gradient-accumulation-steps",
               "epochs", "image-size", "max-samples", "width", "depth",
               "learning-rate", "seed", "output-dir", "smoke"],
        defaults=DEFAULTS,
        image_size="Input size, a multiple of 2**depth (default "
        "{image_size}: large enough for activations to show in the memory "
        "figures).",
        max_samples="Training (and validation) examples per run (default "
        "{max_samples}).",
        learning_rate="Adam learning rate (default: {learning_rate}).",
        output_dir="Where comparison.png and comparison.json go (default: "
        "%(default)s).",
    )
    parser.set_defaults(
        dataset="synthetic_shapes",
        output_dir=os.path.join("outputs", "compare_accumulation"),
    )
    # Internal: run one configuration (in a subprocess, or with --smoke).
    parser.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    return parser


# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------


def run_one(args):
    """Trains one configuration; writes its numbers to `args.result_file`
    and its initial and final weights to `args.output_dir`."""
    keras.utils.set_random_seed(args.seed)
    # With --smoke, in a process where other code may have set a policy.
    keras.config.set_dtype_policy("float32")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and not args.smoke:  # Too late once TensorFlow used the GPU.
        tf.config.experimental.set_memory_growth(gpus[0], True)

    steps = args.gradient_accumulation_steps
    batch = args.batch_size * (steps if args.run == "big_batch" else 1)
    # segmentation.py's pipeline: cached, shuffled before batching, prefetched.
    train_ds, val_ds = segmentation.load_datasets(args, batch)
    num_classes = len(utils.DATASETS[args.dataset]["class_names"])

    # Same seed, same layers: every run starts from the same weights.
    inputs, logits = segmentation.unet_layers(
        args.image_size, num_classes, width=args.width, depth=args.depth
    )
    if args.run == "accumulated":
        model = keras_accum.GradientAccumulationModel(
            inputs, logits, gradient_accumulation_steps=steps
        )
    else:
        model = keras.Model(inputs, logits)
    path = os.path.join(args.output_dir, args.run)
    model.save_weights(path + ".initial.weights.h5")
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=segmentation.IGNORE_LABEL
        ),
        metrics=[segmentation.make_iou_metric(num_classes)],
        run_eagerly=args.smoke,
    )

    if gpus:
        tf.config.experimental.reset_memory_stats("GPU:0")
    rss_before = utils.peak_rss_mb()
    start = time.perf_counter()
    history = model.fit(train_ds, validation_data=val_ds, epochs=args.epochs,
                        shuffle=False, verbose=0).history
    result = {
        "run": args.run,
        "batch_size": batch,
        "accumulation_steps": steps if args.run == "accumulated" else 1,
        "updates": int(model.optimizer.iterations.numpy()),
        "history": history,
        "train_seconds": time.perf_counter() - start,
        "peak_rss_mb": utils.peak_rss_mb(),
        "peak_rss_growth_mb": utils.peak_rss_mb() - rss_before,
    }
    if gpus:
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        result["gpu_peak_mb"] = peak / 2**20
    model.save_weights(path + ".weights.h5")
    with open(args.result_file, "w") as f:
        json.dump(result, f)


def run_all(args):
    """Runs the three configurations one at a time (the first may have to
    generate the dataset; training times should not disturb one another)."""
    results = {}
    for run in RUNS:
        result_file = os.path.join(args.output_dir, f"{run}.json")
        argv = ["--run", run, "--result-file", result_file]
        for name in RUN_FLAGS:
            value = getattr(args, name)
            if value is not None:
                argv += ["--" + name.replace("_", "-"), str(value)]
        print(f"Running {run} ...", flush=True)
        if args.smoke:
            main(argv + ["--smoke"])
        else:
            script = os.path.abspath(__file__)
            subprocess.run([sys.executable, script] + argv, check=True)
        with open(result_file) as f:
            results[run] = json.load(f)
    return results


# ---------------------------------------------------------------------------
# Same start, same updates?
# ---------------------------------------------------------------------------


def weight_checks(output_dir):
    """Same start for all runs? How far apart are the accumulated and big runs?

    Returns the largest absolute difference between the runs' initial weights
    and `|update_accumulated - update_big| / |update_big|`, where `update` is
    the change of all the weights over training: 0 for identical training.
    """

    def weights(name):
        path = os.path.join(output_dir, name + ".weights.h5")
        return utils.read_weights(path)

    initial = {run: weights(run + ".initial") for run in RUNS}
    reference = initial[RUNS[0]]
    start_gap = max(
        float(np.max(np.abs(initial[run][k] - reference[k])))
        for run in RUNS[1:]
        for k in reference
    )
    accumulated, big = weights("accumulated"), weights("big_batch")
    difference = sum(np.sum((accumulated[k] - big[k]) ** 2) for k in big)
    update = sum(np.sum((big[k] - reference[k]) ** 2) for k in big)
    return start_gap, float(np.sqrt(difference / update))


# ---------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------


def main(argv=None):
    args = build_parser().parse_args(argv)
    args = utils.resolve_settings(args, DEFAULTS, SMOKE)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.run:
        return run_one(args)

    start = time.perf_counter()
    results = run_all(args)
    start_gap, update_gap = weight_checks(args.output_dir)

    b, n = args.batch_size, args.gradient_accumulation_steps
    names = dict(zip(RUNS, [f"batch {b}", f"batch {b} x {n} accumulation",
                            f"batch {b * n}"]))
    table = utils.comparison_table(results, names)
    figure = utils.save_comparison_figure(
        results, names, os.path.join(args.output_dir, "comparison.png")
    )
    summary_path = os.path.join(args.output_dir, "comparison.json")
    with open(summary_path, "w") as f:
        json.dump({"args": vars(args),
                   "initial_weights_max_difference": start_gap,
                   "update_difference_accumulated_vs_big_batch": update_gap,
                   "results": results}, f, indent=2)
    print(f"\n{table}")
    print(
        f"\nInitial weights, largest difference between runs: {start_gap:.1e}"
        f"\nTotal weight update, accumulated vs big batch: relative difference "
        f"{update_gap:.1e} (float32 rounding, compounded over "
        f"{results['big_batch']['updates']} updates)"
    )
    print(f"\nWrote figure: {figure}\nWrote numbers: {summary_path}")
    print(f"Wall time: {time.perf_counter() - start:.1f} s")
    return {"results": results, "table": table, "figure": figure,
            "initial_weights_max_difference": start_gap,
            "update_difference": update_gap}


if __name__ == "__main__":
    main()
