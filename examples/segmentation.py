"""
Title: Image segmentation with exact gradient accumulation
Description: Train a small U-Net with `keras_accum.GradientAccumulationModel`,
`model.fit()` and a masked (ignore-class) loss.

## Introduction

Segmentation models are memory hungry: every pixel of every image keeps its
activations alive until the backward pass. When the batch you want does not
fit in memory, gradient accumulation splits it into `N` micro-batches of `B`
images, adds up their gradients and applies a single optimizer update.
`keras_accum.GradientAccumulationModel` does this inside `model.fit()`, and
does it *exactly*: the update equals the one computed from a single batch of
`N * B` images, including for losses that ignore some pixels, where every
micro-batch has a different number of valid pixels.

This example trains a U-Net on one of two datasets:

* `synthetic_shapes` (the default): circles, squares and triangles on textured
  backgrounds, generated offline by `synthetic_shapes.py` in this folder. It
  needs no download and trains in a minute or two on a laptop CPU.
* `oxford_iiit_pet`: the Oxford-IIIT pet dataset from TFDS (downloaded by TFDS
  the first time, about 800 MB). Its trimaps are turned into two classes (pet,
  background); the border region of the trimap becomes the ignore class.

Both datasets mark ambiguous pixels along object boundaries with the label
`255`. The loss is `SparseCategoricalCrossentropy(ignore_class=255)`, which
averages over the *valid* pixels only, and the mean IoU metric is told to
skip the same pixels.

## Why GroupNormalization and not BatchNormalization

BatchNormalization normalises each layer's activations with the statistics of
the *current* batch. With gradient accumulation the current batch is a
micro-batch of a few images: its statistics are noisy, and they are not those
of the big batch the accumulated update stands for, so the forward pass, and
with it the gradients, differ from the big batch's. (`keras_accum` does update
BatchNormalization's moving averages once per window, from the whole window,
but it cannot change what the forward pass normalises with.)
GroupNormalization computes its statistics per image, over groups of
channels, so it computes the same thing for any batch size and accumulation
stays exact. The model has no dropout either: its random masks would differ
between micro-batches and big batch, and the two runs would only agree on
average, not update for update.

## Training in small memory

`micro_batch_size="auto"` takes the opposite view of the same tool: choose
the batch each update should train on, and let the model find how many
images of it fit in the device at once. Every train step splits its batch
into micro-batches as large as the memory holds and accumulates them, so the
update is the one of the whole batch. The first batch is tried whole; a step
that runs out of memory (`ResourceExhaustedError`) is rolled back, its
micro-batch halved and the same batch trained again. After training,
`model.micro_batch_size` reads the size that was chosen.

`--memory-limit-mb 1024` shows it on a device of 1 GiB. On a GPU the script
makes a logical device of that size; on a CPU it runs itself again with
TensorFlow's CPU allocator limited to it (`TF_CPU_ALLOCATOR_USE_BFC=true`,
`TF_CPU_BFC_MEM_LIMIT_IN_MB=1024`, and `TF_ENABLE_ONEDNN_OPTS=0`, since
oneDNN's kernels crash at the limit instead of raising). It trains on the
full 64x64 images, on batches of 256 (one update each). Without a limit a
plain `keras.Model` peaks at about 1.5 GiB on such a batch, so the script
first lets one try and prints its out-of-memory error; then it trains with
`micro_batch_size="auto"`, which runs out of memory with the whole batch,
is rolled back and trains it in micro-batches of at most 128, and prints
the micro-batches of the last epoch and the peak memory against the limit.
The validation batches are smaller (32): evaluation does not split them.

## Recomputing activations

When not even one image fits, "auto" gives up ("Not even one row of the
batch fits"). `--remat` passes `remat=True`: the forward pass of training
keeps only the tensors at the boundaries of about sqrt(n) segments of the
U-Net's graph (6 segments of 3 to 19 layers at the default depth), and the
backward pass runs each segment again from them before taking its
gradients. The update is the same; a train step costs about one forward
pass more. `--remat auto` passes `remat="auto"` with
`micro_batch_size="auto"` (also without `--memory-limit-mb`): it trains
without recomputation and turns it on only once a micro-batch of one image
runs out of memory. The run prints whether recomputation was on.

What recomputation saves is the activations kept for the backward pass,
not what one layer needs at a time, and on a CPU one layer needs a lot:
the backward pass of a 3x3 convolution unfolds its input, one image at a
time, into a matrix of 9 x channels values per pixel, in one piece (432
MiB at 512x512 for the 48 input channels of the full-resolution decoder's
first convolution). With the default depth, one image of 512x512 trains
in about the same limit with or without recomputation (it does fit
micro-batches of 2 where a plain step fits one). With `--depth 5` (7.9
million weights instead of 0.5 million, and two more levels of
activations) a plain step runs out of memory even for one image in 960 to
1120 MiB, and the recomputed one trains:

```
python examples/segmentation.py --image-size 512 --depth 5 --batch-size 2 \
    --max-samples 4 --epochs 1 --memory-limit-mb 1024 --verbose 2  # OOM
python examples/segmentation.py --image-size 512 --depth 5 --batch-size 2 \
    --max-samples 4 --epochs 1 --memory-limit-mb 1024 --verbose 2 --remat
```

Each takes about a minute on two CPU cores; `--remat auto` about a
minute and a half (one more out-of-memory error: one image without
recomputation; once it is on, "auto" keeps micro-batches of one image).

## Resuming a killed run

With `--backup-dir DIR`, `keras_accum.callbacks.BackupAndRestore` backs
training up to `DIR` every `--save-freq` micro-batches (default 50) and at
the end of every epoch. Killed, the same command run again resumes from the
last backup, mid-epoch and mid-window, and ends with the numbers of a run
that was never interrupted. The pipeline reshuffles every epoch with a
fixed seed: the restart replays the orders of the epochs before the backup,
so the backup needs no shuffle buffer. `fit()`'s `History` only holds the
epochs trained after the restart, so a small callback keeps every epoch's
logs in `DIR` too, for `metrics.json` and the curves. `DIR` is deleted when
training ends. (Not with `--memory-limit-mb` or `--remat auto`: "auto"
would choose its micro-batches again after a restart.)

## Running it

```
python examples/segmentation.py                         # synthetic_shapes, CPU
python examples/segmentation.py --batch-size 4 --gradient-accumulation-steps 8
python examples/segmentation.py --image-size 64 --epochs 10   # full size
python examples/segmentation.py --dataset oxford_iiit_pet --image-size 128 \
    --epochs 10 --mixed-precision mixed_float16          # on a GPU
python examples/segmentation.py --smoke                 # tiny, a few steps
python examples/segmentation.py --memory-limit-mb 1024  # batches of 256 in 1 GiB
python examples/segmentation.py --remat                 # recompute activations
python examples/segmentation.py --backup-dir backups/segmentation  # resumable
```

The default run trains for 6 epochs on micro-batches of 16 images with 2
accumulation steps (effective batch 32), on the 64x64 images downscaled to
32x32. On a two-core CPU it takes about a minute and a half, generating the
dataset included, and reaches a validation mean IoU of about 0.79 (other
machines may differ by about 0.01: multi-threaded CPU kernels sum in a
different order).

The run writes, to `--output-dir`:

* `predictions.png`: input, true mask and predicted mask for a few validation
  images;
* `training_curves.png`: loss and mean IoU per epoch, train and validation;
* `metrics.json`: the final numbers and the settings used, `remat_active`
  (whether the backward pass recomputed activations) and, with
  `--memory-limit-mb`, the plain model's error, the micro-batch chosen and
  the peak memory.

With `--memory-limit-mb 1024` the run takes two to three minutes on a
two-core CPU: 2 epochs of 4 updates on batches of 256 images, to a
validation mean IoU of about 0.4 (the point is the memory: 8 updates are
few). Every out-of-memory error costs about 10 seconds there: TensorFlow's
allocator waits that long for memory to be freed before it gives up.
"""

import argparse
import contextlib
import gc
import json
import os
import sys
import time

import keras
import tensorflow as tf
import tensorflow_datasets as tfds
from keras import layers

import keras_accum

# Importing the module registers the `synthetic_shapes` builder with TFDS.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_utils as utils  # noqa: E402
import synthetic_shapes  # noqa: E402

IGNORE_LABEL = synthetic_shapes.IGNORE_LABEL  # 255, skipped by loss and metric.
AUTOTUNE = tf.data.AUTOTUNE

# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


def tfds_name(dataset, smoke=False):
    """The TFDS name to load; smoke runs use the small synthetic config."""
    if dataset == "synthetic_shapes" and smoke:
        return "synthetic_shapes/small"
    return dataset


def _pet_labels(trimap):
    """Oxford pet trimap (1 pet, 2 background, 3 border) to training labels."""
    trimap = tf.cast(trimap, tf.int32)
    labels = tf.fill(
        tf.shape(trimap), IGNORE_LABEL
    )  # Border and anything else.
    labels = tf.where(trimap == 1, 1, labels)
    labels = tf.where(trimap == 2, 0, labels)
    return labels


def make_preprocess(dataset, image_size):
    """Returns a function: TFDS example -> `(uint8 image, int32 mask)`."""

    def preprocess(example):
        image = example["image"]
        mask = example["segmentation_mask"]
        if dataset == "oxford_iiit_pet":
            mask = _pet_labels(mask)
        image = tf.image.resize(image, (image_size, image_size), antialias=True)
        image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
        # Nearest neighbour keeps the label values (and the ignore value).
        mask = tf.image.resize(mask, (image_size, image_size), method="nearest")
        return image, tf.cast(mask[..., 0], tf.int32)

    return preprocess


def _normalise(image, mask):
    return tf.cast(image, tf.float32) / 255.0, mask


def prepare_dataset(args):
    """Generates (`synthetic_shapes`) or downloads the dataset if it is not
    there yet.

    `main()` calls it before it seeds the random generators: preparing the
    dataset may draw random numbers, and the initial weights must not
    depend on whether the dataset was there already (a run resumed from a
    backup must find the weights of the run it resumes).
    """
    tfds.builder(
        tfds_name(args.dataset, args.smoke), data_dir=args.data_dir
    ).download_and_prepare()


def load_datasets(args, global_batch_size, val_batch_size=None):
    """Loads train/validation splits as batched, prefetched `tf.data` pipelines.

    Preprocessed examples are cached in memory, then shuffled with a fixed seed
    *before* batching, so runs with different batch sizes see the examples in
    the same order: a batch of `N * B` is exactly the concatenation of the next
    `N` micro-batches of `B`. Validation batches hold `val_batch_size`
    examples (default: `global_batch_size`).
    """
    train, val = tfds.load(
        tfds_name(args.dataset, args.smoke),
        split=["train", "test"],
        data_dir=args.data_dir,
        shuffle_files=False,
    )
    preprocess = make_preprocess(args.dataset, args.image_size)

    def pipeline(ds, training):
        if args.max_samples:
            ds = ds.take(args.max_samples)
        ds = ds.map(preprocess, num_parallel_calls=AUTOTUNE).cache()
        if training:
            ds = ds.shuffle(2048, seed=args.seed, reshuffle_each_iteration=True)
        ds = ds.map(_normalise, num_parallel_calls=AUTOTUNE)
        ds = ds.batch(
            global_batch_size if training else
            (val_batch_size or global_batch_size))
        options = tf.data.Options()
        # Examples are split across workers by index, not by file.
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        options.deterministic = True
        return ds.with_options(options).prefetch(AUTOTUNE)

    return pipeline(train, True), pipeline(val, False)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def conv_block(x, filters, name):
    """Conv-ReLU-Conv-GroupNorm-ReLU.

    One normalisation per block rather than one per convolution: on a CPU the
    element-wise normalisation costs about as much as a small convolution, and
    one per block is enough to keep training stable.
    """
    x = layers.Conv2D(filters, 3, padding="same", name=f"{name}_conv0")(x)
    x = layers.Activation("relu", name=f"{name}_relu0")(x)
    x = layers.Conv2D(
        filters, 3, padding="same", use_bias=False, name=f"{name}_conv1"
    )(x)
    # Per-image statistics: independent of the (micro-)batch size.
    x = layers.GroupNormalization(
        groups=min(8, filters // 2), name=f"{name}_gn"
    )(x)
    return layers.Activation("relu", name=f"{name}_relu1")(x)


def unet_layers(image_size, num_classes, width=16, depth=3):
    """A small U-Net. Returns `(inputs, logits)` for a functional model."""
    inputs = keras.Input((image_size, image_size, 3), name="image")
    x = inputs
    skips = []
    for level in range(depth):
        x = conv_block(x, width * 2**level, name=f"down{level}")
        skips.append(x)
        x = layers.MaxPooling2D(name=f"pool{level}")(x)
    x = conv_block(x, width * 2**depth, name="bottleneck")
    for level in reversed(range(depth)):
        x = layers.UpSampling2D(interpolation="bilinear", name=f"up{level}")(x)
        x = layers.Concatenate(name=f"skip{level}")([x, skips[level]])
        x = conv_block(x, width * 2**level, name=f"dec{level}")
    # Logits stay float32 under mixed precision, for a stable softmax.
    logits = layers.Conv2D(num_classes, 1, dtype="float32", name="logits")(x)
    return inputs, logits


def build_model(args, num_classes):
    """The U-Net as a `GradientAccumulationModel`; with `--memory-limit-mb`
    (or `--remat auto`), each train step splits its batch into micro-batches
    that fit. `--remat` recomputes activations in the backward pass."""
    inputs, logits = unet_layers(
        args.image_size, num_classes, width=args.width, depth=args.depth
    )
    remat = getattr(args, "remat", False)
    return keras_accum.GradientAccumulationModel(
        inputs,
        logits,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        micro_batch_size=(
            "auto" if getattr(args, "memory_limit_mb", None)
            or remat == "auto" else None
        ),
        # The functional U-Net is a graph of plain layers: `True` cuts it
        # into about sqrt(n) segments, each recomputed in the backward pass.
        remat=remat,
        name="unet",
    )


def make_optimizer(args, updates_per_epoch):
    """Adam with a cosine decay over all optimizer *updates*.

    With accumulation, `optimizer.iterations` counts applied updates, one per
    `gradient_accumulation_steps` micro-batches, so the schedule is sized in
    updates.
    """
    schedule = keras.optimizers.schedules.CosineDecay(
        args.learning_rate,
        decay_steps=max(1, args.epochs * updates_per_epoch),
        alpha=0.05,
    )
    return keras.optimizers.Adam(schedule)


def compile_model(model, args, num_classes, optimizer):
    model.compile(
        optimizer=optimizer,
        # `ignore_class`: pixels labelled 255 add nothing to the loss, and the
        # mean is taken over the remaining (valid) pixels only.
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=IGNORE_LABEL
        ),
        metrics=[make_iou_metric(num_classes)],
        jit_compile="auto" if args.jit_compile is None else args.jit_compile,
    )


def make_iou_metric(num_classes):
    # `sparse_y_pred=False`: predictions are logits (argmax taken inside);
    # `ignore_class`: ignore pixels are left out of the confusion matrix.
    return keras.metrics.MeanIoU(
        num_classes=num_classes,
        ignore_class=IGNORE_LABEL,
        sparse_y_pred=False,
        name="mean_iou",
    )


# ---------------------------------------------------------------------------
# Training in small memory (--memory-limit-mb)
# ---------------------------------------------------------------------------

# `--memory-limit-mb`: batches of 256 full-size (64x64) images, one update
# each. Measured without a limit (TF's CPU tensor memory, a 2-core CPU): a
# plain `keras.Model` peaks at 1,526 MiB on that batch; "auto" with
# micro-batches of 128 at 909 MiB, of 64 at 541 MiB. Under a limit the CPU
# kernels make do with less scratch memory (a plain batch of 192, 1,265 MiB
# without a limit, once trained in 1,024 MiB), so the batch is well above
# what fits: in 1024 MiB plain runs out of memory and "auto" trains it.
MEMORY = {
    "image_size": 64,
    "batch_size": 256,
    "gradient_accumulation_steps": 1,
    "epochs": 2,
}
# `--memory-limit-mb` with `--smoke`: the smoke sizes on batches of 64. With
# a limit of 72 MiB (the tests') plain runs out and micro-batches of 32 fit.
# (Below about 50 MiB nothing fits: on a CPU the backward pass of a
# convolution takes a 20 MiB scratch buffer whatever the batch.)
MEMORY_SMOKE = {"batch_size": 64, "gradient_accumulation_steps": 1,
                "epochs": 1, "max_samples": 64}
# Validation batches under a limit: evaluation does not split its batches.
MEMORY_VAL_BATCH = 32
MIB = 2**20


def try_plain_model(args, num_classes, train_ds, batch, strategy):
    """Trains one batch of `batch` images with a plain `keras.Model`.

    Returns:
        dict: `plain_batch`, `plain_out_of_memory` and the one-line error
        (or, if the batch fitted, the peak memory of the step).
    """
    with strategy.scope():
        inputs, logits = unet_layers(
            args.image_size, num_classes, width=args.width, depth=args.depth
        )
        plain = keras.Model(inputs, logits, name="plain_unet")
        compile_model(
            plain, args, num_classes, keras.optimizers.Adam(args.learning_rate)
        )
    result = {"plain_batch": batch, "plain_out_of_memory": False}
    device = utils.memory_device()
    try:
        tf.config.experimental.reset_memory_stats(device)
        plain.fit(train_ds.unbatch().batch(batch).take(1), shuffle=False, verbose=0)
        peak = tf.config.experimental.get_memory_info(device)["peak"]
        result["plain_peak_mib"] = peak / MIB
    except tf.errors.ResourceExhaustedError as error:
        result.update(plain_out_of_memory=True,
                      plain_error=utils.out_of_memory_line(error))
    del plain
    gc.collect()
    return result


def describe_plain(memory):
    """One line: how the plain model's batch went under the limit."""
    limit = f"{memory['limit_mib']:,} MiB"
    if memory["plain_out_of_memory"]:
        return (f"Plain keras.Model, batch {memory['plain_batch']}: out of "
                f"memory in {limit} ({memory['plain_error']}).")
    return (f"Plain keras.Model, batch {memory['plain_batch']}: fits in "
            f"{limit} (peak {memory['plain_peak_mib']:,.0f} MiB); a smaller "
            "--memory-limit-mb makes it run out.")


def describe_auto(memory, log):
    """One line: the micro-batches "auto" trained the last epoch's batches
    in, and the peak."""
    full = sorted({size for size, rows in memory["last_epoch"]
                   if rows == memory["batch"]}, reverse=True)
    short = [(size, rows) for size, rows in memory["last_epoch"]
             if rows != memory["batch"]]
    line = (f"micro_batch_size='auto' trained the batches of {memory['batch']}"
            f" in micro-batches of {' or '.join(map(str, full)) or '-'}")
    for size, rows in short:
        line += f" (the short last batch of {rows}: {size})"
    if memory["peak_mib"]:
        line += (f", peak {memory['peak_mib']:,.0f} MiB of the "
                 f"{memory['limit_mib']:,} MiB limit")
    text = log.describe_recoveries()
    return f"{line}; {text[0].lower()}{text[1:]}."


def result_of_child(args, code):
    """What `main()` returns, read from the files of a run in a child."""
    if code:
        raise SystemExit(code)
    paths = {
        name: os.path.join(args.output_dir, file) for name, file in [
            ("predictions", "predictions.png"),
            ("training_curves", "training_curves.png"),
            ("metrics", "metrics.json")]
    }
    with open(paths["metrics"]) as f:
        results = json.load(f)
    return {**results, "paths": paths, "history": results["history"]}


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def remat_flag(value):
    """`--remat`'s value: only "auto" (`--remat` alone means `True`)."""
    if value.lower() == "auto":
        return "auto"
    raise argparse.ArgumentTypeError(
        f"expected no value or 'auto'. Received: --remat {value}")


def describe_remat(remat, active):
    """One line: whether the backward pass recomputed activations."""
    if not remat:
        return "Recomputation (remat): off."
    state = "on" if active else "off"
    if remat == "auto":
        why = ("one sample per micro-batch did not fit" if active else
               "one sample per micro-batch fitted, so it was not needed")
        return f"Recomputation (remat='auto'): {state} ({why})."
    return f"Recomputation (remat=True): {state}."


def build_parser():
    parser = utils.build_parser(utils.docstring_title(__doc__))
    parser.add_argument(
        "--remat",
        nargs="?",
        const=True,
        default=False,
        type=remat_flag,
        metavar="auto",
        help="Recompute activations in the backward pass instead of keeping "
        "them (remat=True: the U-Net's graph is cut into about sqrt(n) "
        "segments, each run again in the backward pass). '--remat auto': "
        "micro_batch_size='auto' (also without --memory-limit-mb), and "
        "recomputation turns on only if one sample per micro-batch does not "
        "fit. The update is the same; a step costs about one more forward "
        "pass.",
    )
    parser.add_argument(
        "--memory-limit-mb",
        type=int,
        help="Train in a device of this many MiB (a logical GPU, or a CPU "
        "limit): a plain keras.Model tries the batch first, then "
        "micro_batch_size='auto' trains it. Changes the defaults to "
        f"--image-size {MEMORY['image_size']} --batch-size "
        f"{MEMORY['batch_size']} --gradient-accumulation-steps "
        f"{MEMORY['gradient_accumulation_steps']} --epochs "
        f"{MEMORY['epochs']}; --verbose 0 becomes 2 (the choices are "
        "printed).",
    )
    return utils.add_backup_flags(parser)


def main(argv=None):
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    utils.check_backup_flags(args)
    if args.remat == "auto" and args.backup_dir:
        # As with --memory-limit-mb: "auto" chooses again after a restart.
        raise ValueError(
            "--backup-dir cannot be used with --remat auto (it trains with "
            "micro_batch_size='auto'): a restarted run would choose its "
            "micro-batches again and could not end with the uninterrupted "
            f"run's figures. Received: --backup-dir {args.backup_dir} "
            "--remat auto")
    if args.memory_limit_mb:
        # On a CPU the limit must be set before TensorFlow starts: then the
        # run happens in a child process.
        code = utils.limit_device_memory(args.memory_limit_mb, __file__, argv)
        if code is not None:
            return result_of_child(args, code)
        args = utils.resolve_settings(
            args, {**utils.DEFAULTS, **MEMORY}, {**utils.SMOKE, **MEMORY_SMOKE}
        )
    else:
        args = utils.resolve_settings(args)
    strategy = utils.make_strategy(args.strategy)  # Before any other TF op.
    # TFDS generates `synthetic_shapes` on first use (a few seconds), before
    # the seed is set: the weights are the same whether it was there or not.
    prepare_dataset(args)
    keras.utils.set_random_seed(args.seed)
    if args.mixed_precision != "none":
        keras.mixed_precision.set_global_policy(args.mixed_precision)

    class_names = utils.DATASETS[args.dataset]["class_names"]
    num_classes = len(class_names)
    replicas = strategy.num_replicas_in_sync
    global_batch = args.batch_size * replicas
    effective_batch = global_batch * args.gradient_accumulation_steps

    train_ds, val_ds = load_datasets(
        args, global_batch,
        min(global_batch, MEMORY_VAL_BATCH) if args.memory_limit_mb else None,
    )
    steps_per_epoch = utils.count_batches(train_ds)
    updates_per_epoch = -(-steps_per_epoch // args.gradient_accumulation_steps)
    unit = "batches" if args.memory_limit_mb else "micro-batches"
    print(
        f"{args.dataset}: {steps_per_epoch} {unit} of {global_batch} "
        f"per epoch, {args.gradient_accumulation_steps} per update -> "
        f"effective batch {effective_batch}, "
        f"{updates_per_epoch} updates per epoch, {replicas} replica(s)."
    )

    memory = None
    if args.memory_limit_mb:
        # First what the limit means for plain Keras at the effective batch.
        memory = {"limit_mib": args.memory_limit_mb, **try_plain_model(
            args, num_classes, train_ds, effective_batch, strategy)}
        print(describe_plain(memory), flush=True)
        keras.utils.set_random_seed(args.seed)  # The same initial weights.

    # Model, optimizer, loss and metric are created under the strategy scope.
    with strategy.scope():
        model = build_model(args, num_classes)
        optimizer = make_optimizer(args, updates_per_epoch)
        compile_model(model, args, num_classes, optimizer)

    # With `--backup-dir`: backups, and the logs of the epochs trained
    # before a restart.
    callbacks = utils.backup_callbacks(args.backup_dir, args.save_freq)
    # With a limit: what "auto" prints, and the peak of the train steps.
    log = utils.AutoMicroBatchLog() if memory else None
    with log or contextlib.nullcontext():
        history = model.fit(
            train_ds,
            validation_data=val_ds,
            epochs=args.epochs,
            # The tf.data pipeline shuffles, with a fixed seed; a restart
            # replays the orders of the epochs before its backup.
            shuffle=False,
            callbacks=callbacks + ([log] if log else []),
            verbose=(args.verbose or 2) if memory else args.verbose,
        ).history
    history = utils.whole_history(history, callbacks)

    results = {
        "val_mean_iou": float(history["val_mean_iou"][-1]),
        "val_loss": float(history["val_loss"][-1]),
        "train_loss": float(history["loss"][-1]),
        "optimizer_updates": int(model.optimizer.iterations.numpy()),
        "remat": args.remat,
        # With "auto": whether it turned recomputation on.
        "remat_active": bool(model.remat_active),
        "wall_time_s": time.perf_counter() - start,
    }
    title = (f"U-Net on {args.dataset}, batch {global_batch} x "
             f"{args.gradient_accumulation_steps} accumulation steps")
    if model.remat_active:
        title += ", recomputed activations"
    if memory:
        # The micro-batch of each step of the last epoch, next to its rows.
        rows = [int(n) for n in train_ds.map(
            lambda x, y: tf.shape(x)[0]).as_numpy_iterator()]
        memory.update(
            batch=global_batch,
            micro_batch_size=model.micro_batch_size,
            last_epoch=list(zip(log.micro_batch_sizes[-len(rows):], rows)),
            peak_mib=log.peak / MIB if log.peak else None,
            recoveries=log.recoveries,
            choices=log.choices,
        )
        results["memory"] = memory
        title += f", 'auto' micro-batches in {args.memory_limit_mb:,} MiB"
        print(describe_auto(memory, log))
    paths = utils.write_outputs(
        model, history, val_ds, class_names, args.output_dir, title,
        results, args,
        # Under a limit, one image per forward pass: the batch of the grid
        # is not split into micro-batches.
        predict_batch_size=1 if args.memory_limit_mb else None,
    )
    print(describe_remat(args.remat, results["remat_active"]))
    print(f"Final loss: train {results['train_loss']:.4f}, validation "
          f"{results['val_loss']:.4f}")
    print(f"Final validation mean IoU: {results['val_mean_iou']:.4f}")
    print(f"Wall time: {results['wall_time_s']:.1f} s")
    return {**results, "paths": paths, "history": history}


if __name__ == "__main__":
    main()
