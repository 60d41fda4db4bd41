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

## Running it

```
python examples/segmentation.py                         # synthetic_shapes, CPU
python examples/segmentation.py --batch-size 4 --gradient-accumulation-steps 8
python examples/segmentation.py --image-size 64 --epochs 10   # full size
python examples/segmentation.py --dataset oxford_iiit_pet --image-size 128 \
    --epochs 10 --mixed-precision mixed_float16          # on a GPU
python examples/segmentation.py --smoke                 # tiny, a few steps
```

The default run trains for 6 epochs on micro-batches of 16 images with 2
accumulation steps (effective batch 32), on the 64x64 images downscaled to
32x32. On a two-core CPU it takes about a minute and a half, generating the
dataset included, and reaches a validation mean IoU of about 0.78 (other
machines may differ by about 0.01: multi-threaded CPU kernels sum in a
different order).

The run writes, to `--output-dir`:

* `predictions.png`: input, true mask and predicted mask for a few validation
  images;
* `training_curves.png`: loss and mean IoU per epoch, train and validation;
* `metrics.json`: the final numbers and the settings used.
"""

import os
import sys
import time

import keras
import numpy as np
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


def load_datasets(args, global_batch_size):
    """Loads train/validation splits as batched, prefetched `tf.data` pipelines.

    Preprocessed examples are cached in memory, then shuffled with a fixed seed
    *before* batching, so runs with different batch sizes see the examples in
    the same order: a batch of `N * B` is exactly the concatenation of the next
    `N` micro-batches of `B`.
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
        ds = ds.batch(global_batch_size)
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
    """The U-Net as a `GradientAccumulationModel`."""
    inputs, logits = unet_layers(
        args.image_size, num_classes, width=args.width, depth=args.depth
    )
    return keras_accum.GradientAccumulationModel(
        inputs,
        logits,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
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
# Training
# ---------------------------------------------------------------------------


def main(argv=None):
    start = time.perf_counter()
    parser = utils.build_parser(utils.docstring_title(__doc__))
    args = utils.resolve_settings(parser.parse_args(argv))
    strategy = utils.make_strategy(args.strategy)  # Before any other TF op.
    keras.utils.set_random_seed(args.seed)
    if args.mixed_precision != "none":
        keras.mixed_precision.set_global_policy(args.mixed_precision)

    class_names = utils.DATASETS[args.dataset]["class_names"]
    num_classes = len(class_names)
    replicas = strategy.num_replicas_in_sync
    global_batch = args.batch_size * replicas

    # Data: TFDS generates `synthetic_shapes` on first use (a few seconds).
    train_ds, val_ds = load_datasets(args, global_batch)
    steps_per_epoch = utils.count_batches(train_ds)
    updates_per_epoch = -(-steps_per_epoch // args.gradient_accumulation_steps)
    print(
        f"{args.dataset}: {steps_per_epoch} micro-batches of {global_batch} "
        f"per epoch, {args.gradient_accumulation_steps} per update -> "
        f"effective batch {global_batch * args.gradient_accumulation_steps}, "
        f"{updates_per_epoch} updates per epoch, {replicas} replica(s)."
    )

    # Model, optimizer, loss and metric are created under the strategy scope.
    with strategy.scope():
        model = build_model(args, num_classes)
        optimizer = make_optimizer(args, updates_per_epoch)
        compile_model(model, args, num_classes, optimizer)

    history = model.fit(
        train_ds,
        validation_data=val_ds,
        epochs=args.epochs,
        shuffle=False,  # The tf.data pipeline shuffles (with a fixed seed).
        verbose=args.verbose,
    ).history

    results = {
        "val_mean_iou": float(history["val_mean_iou"][-1]),
        "val_loss": float(history["val_loss"][-1]),
        "train_loss": float(history["loss"][-1]),
        "optimizer_updates": int(model.optimizer.iterations.numpy()),
        "wall_time_s": time.perf_counter() - start,
    }
    paths = utils.write_outputs(
        model, history, val_ds, class_names, args.output_dir,
        f"U-Net on {args.dataset}, batch {global_batch} x "
        f"{args.gradient_accumulation_steps} accumulation steps",
        results, args,
    )
    print(f"Final validation mean IoU: {results['val_mean_iou']:.4f}")
    print(f"Wall time: {results['wall_time_s']:.1f} s")
    return {**results, "paths": paths, "history": history}


if __name__ == "__main__":
    main()
