"""
Title: Gradient accumulation in your own `train_step`: cross-entropy + Dice
Description: Subclass `GradientAccumulationModel`, write `train_step` yourself
and hand the gradients to `self.gradient_accumulator`.

## Introduction

`GradientAccumulationModel.fit()` accumulates exactly for the losses given to
`compile()`. When the loss needs more than `compile()` offers, write your own
`train_step` and let the model's `GradientAccumulator` do the accumulation:

```python
grads = tape.gradient(scaled_loss, self.trainable_variables)
self.gradient_accumulator.accumulate_and_maybe_apply(
    grads, self.optimizer, self.trainable_variables, normalizer=normaliser
)
```

`weight` is the *normaliser* of this micro-batch's mean loss: the number the
summed per-element losses were divided by. The accumulator multiplies each
micro-batch gradient by its weight, sums them over the window and divides by
the sum of the weights. For a loss of the form `sum(per-element losses) /
count` this reproduces the gradient of the big batch exactly, whatever the
count of each micro-batch: here the cross-entropy is averaged over the valid
(not ignored) pixels, so the weight is the number of valid pixels, not the
number of images. The model still flushes a partial window at the end of each
epoch.

## Dice is not exact, and what that means

The loss here is `cross-entropy + dice_weight * (1 - soft Dice)`, with the
soft Dice coefficient of class `c` computed over the whole (micro-)batch:

    Dice_c = 2 * sum(p_c * y_c) / (sum(p_c) + sum(y_c))

where the sums run over every valid pixel of every image in the batch. This is
a *ratio of sums*. Accumulation can only form a weighted mean of per-micro-
batch gradients, and the gradient of a ratio of window-wide sums is not a mean
of the gradients of per-micro-batch ratios: the denominator of the big batch
mixes all micro-batches, and a micro-batch in which a class is absent or tiny
gets a very different Dice (and gradient) from the one it contributes to in the
big batch. No choice of `weight` fixes that, so:

* the cross-entropy part of the update is exactly the big-batch one;
* the Dice part is the (pixel-weighted) mean of micro-batch Dice gradients,
  i.e. training with "Dice over `B` images" rather than "Dice over `N * B`
  images". It is still a sound loss, with a smaller batch: noisier, and
  more sensitive to micro-batches where a class is rare. Raising the micro-
  batch size brings it closer to the big-batch Dice;
* a per-image Dice (sums over one image, then the mean over images) *is* a
  per-sample mean and accumulates exactly with `weight = number of images`;
  combined with a pixel-averaged cross-entropy, though, the two terms have
  different normalisers and one weight cannot make both exact.

Before training, the script measures the gap on one window: it compares the
accumulated gradient of each term with the big-batch gradient.

## Running it

```
python examples/custom_training_loop.py
python examples/custom_training_loop.py --smoke
```
"""

import os
import sys
import time

import keras
import tensorflow as tf

import keras_accum

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_utils as utils  # noqa: E402  (flags, strategy, figures)
import segmentation  # noqa: E402  (data pipeline and U-Net)

IGNORE_LABEL = segmentation.IGNORE_LABEL


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------


def masked_cross_entropy(y_true, logits):
    """Cross-entropy averaged over valid pixels; returns `(loss, num_valid)`."""
    valid = tf.not_equal(y_true, IGNORE_LABEL)
    labels = tf.where(valid, y_true, 0)  # Any class: masked out below.
    per_pixel = keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True
    )
    valid = tf.cast(valid, per_pixel.dtype)
    num_valid = tf.reduce_sum(valid)
    loss = tf.math.divide_no_nan(tf.reduce_sum(per_pixel * valid), num_valid)
    return loss, num_valid


def soft_dice_loss(y_true, logits, num_classes, smooth=1.0):
    """1 - batch-global soft Dice (mean over classes), valid pixels only."""
    valid = tf.cast(tf.not_equal(y_true, IGNORE_LABEL), tf.float32)[..., None]
    labels = tf.where(tf.not_equal(y_true, IGNORE_LABEL), y_true, 0)
    target = tf.one_hot(labels, num_classes) * valid
    probs = tf.nn.softmax(tf.cast(logits, tf.float32)) * valid
    axes = [0, 1, 2]  # Images and pixels: one Dice per class, for the batch.
    intersection = tf.reduce_sum(probs * target, axis=axes)
    total = tf.reduce_sum(probs, axis=axes) + tf.reduce_sum(target, axis=axes)
    dice = (2.0 * intersection + smooth) / (total + smooth)
    return 1.0 - tf.reduce_mean(dice)


# ---------------------------------------------------------------------------
# The model: a GradientAccumulationModel with its own train_step
# ---------------------------------------------------------------------------


class DiceSegmenter(keras_accum.GradientAccumulationModel):
    """Wraps a segmentation network; trains it on cross-entropy + Dice."""

    def __init__(self, network, num_classes, dice_weight=1.0, **kwargs):
        super().__init__(**kwargs)
        self.network = network
        self.num_classes = num_classes
        self.dice_weight = dice_weight
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.ce_tracker = keras.metrics.Mean(name="cross_entropy")
        self.dice_tracker = keras.metrics.Mean(name="dice_loss")
        self.iou = segmentation.make_iou_metric(num_classes)

    def call(self, inputs, training=False):
        return self.network(inputs, training=training)

    @property
    def metrics(self):
        # Listed here so that Keras resets them at the start of every epoch.
        return [self.loss_tracker, self.ce_tracker, self.dice_tracker, self.iou]

    def compute_losses(self, y, logits):
        ce, num_valid = masked_cross_entropy(y, logits)
        dice = soft_dice_loss(y, logits, self.num_classes)
        return ce + self.dice_weight * dice, ce, dice, num_valid

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            loss, ce, dice, num_valid = self.compute_losses(y, logits)
            # Loss scaling for mixed_float16 (a no-op otherwise).
            scaled_loss = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled_loss, self.trainable_variables)
        # The cross-entropy is a mean over the valid pixels, so that count is
        # its normaliser: with it, the cross-entropy part of the update is the
        # big batch's exactly. (For a per-image mean it would be the number of
        # images, tf.shape(x)[0].) The Dice part is approximate, see above.
        self.gradient_accumulator.accumulate_and_maybe_apply(
            grads, self.optimizer, self.trainable_variables, normalizer=num_valid
        )
        return self._update_metrics(y, logits, loss, ce, dice, num_valid)

    def test_step(self, data):
        x, y = data
        logits = self(x, training=False)
        loss, ce, dice, num_valid = self.compute_losses(y, logits)
        return self._update_metrics(y, logits, loss, ce, dice, num_valid)

    def _update_metrics(self, y, logits, loss, ce, dice, num_valid):
        batch = tf.shape(y)[0]
        self.loss_tracker.update_state(loss, sample_weight=batch)
        self.ce_tracker.update_state(ce, sample_weight=num_valid)
        self.dice_tracker.update_state(dice, sample_weight=batch)
        self.iou.update_state(y, logits)
        return {m.name: m.result() for m in self.metrics}


# ---------------------------------------------------------------------------
# How far is the accumulated gradient from the big batch's?
# ---------------------------------------------------------------------------


def window_gradient_gap(model, x, y, steps):
    """Relative difference, per loss term, accumulated vs big-batch gradient.

    Splits the batch `(x, y)` into `steps` micro-batches, weights their
    gradients by their valid-pixel counts, as `train_step` does, and compares
    the result with the gradient of the whole batch.
    """
    variables = model.trainable_variables

    def term_grads(xb, yb):
        with tf.GradientTape(persistent=True) as tape:
            _, ce, dice, num_valid = model.compute_losses(
                yb, model(xb, training=True)
            )
        grads = [tape.gradient(ce, variables), tape.gradient(dice, variables)]
        del tape
        return grads, num_valid

    big, _ = term_grads(x, y)
    accumulated = [[tf.zeros_like(v) for v in variables] for _ in range(2)]
    weight_sum = 0.0
    for xb, yb in zip(tf.split(x, steps), tf.split(y, steps)):
        grads, weight = term_grads(xb, yb)
        weight_sum += weight
        for term in range(2):
            accumulated[term] = [
                a + weight * g for a, g in zip(accumulated[term], grads[term])
            ]

    def relative_gap(a, b):
        a = tf.concat([tf.reshape(t / weight_sum, [-1]) for t in a], 0)
        b = tf.concat([tf.reshape(t, [-1]) for t in b], 0)
        return float(tf.norm(a - b) / tf.norm(b))

    return {
        "cross_entropy": relative_gap(accumulated[0], big[0]),
        "dice": relative_gap(accumulated[1], big[1]),
    }


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def main(argv=None):
    start = time.perf_counter()
    parser = utils.build_parser(
        description="U-Net trained on cross-entropy + Dice in a custom "
        "train_step, with exact gradient accumulation for the cross-entropy."
    )
    parser.add_argument(
        "--dice-weight",
        type=float,
        default=1.0,
        help="Weight of the Dice loss (default: %(default)s).",
    )
    parser.set_defaults(
        output_dir=os.path.join("outputs", "custom_training_loop")
    )
    args = utils.resolve_settings(parser.parse_args(argv))
    strategy = utils.make_strategy(args.strategy)
    # Before the seed: the weights do not depend on whether it was there.
    segmentation.prepare_dataset(args)
    keras.utils.set_random_seed(args.seed)
    if args.mixed_precision != "none":
        keras.mixed_precision.set_global_policy(args.mixed_precision)

    class_names = utils.DATASETS[args.dataset]["class_names"]
    num_classes = len(class_names)
    steps = args.gradient_accumulation_steps
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    train_ds, val_ds = segmentation.load_datasets(args, global_batch)
    updates_per_epoch = -(-utils.count_batches(train_ds) // steps)

    with strategy.scope():
        inputs, logits = segmentation.unet_layers(
            args.image_size, num_classes, width=args.width, depth=args.depth
        )
        model = DiceSegmenter(
            keras.Model(inputs, logits, name="unet"),
            num_classes,
            dice_weight=args.dice_weight,
            gradient_accumulation_steps=steps,
        )
        model.compile(
            optimizer=segmentation.make_optimizer(args, updates_per_epoch),
            jit_compile="auto"
            if args.jit_compile is None
            else args.jit_compile,
        )

    # One window, before training: accumulated vs big-batch gradient per term.
    gap = None
    x, y = next(iter(train_ds.unbatch().batch(global_batch * steps)))
    if x.shape[0] == global_batch * steps:
        gap = window_gradient_gap(model, x, y, steps)
        print(
            f"Accumulated vs {x.shape[0]}-image gradient, relative difference: "
            f"cross-entropy {gap['cross_entropy']:.1e}, Dice {gap['dice']:.1e}"
        )

    history = model.fit(
        train_ds,
        validation_data=val_ds,
        epochs=args.epochs,
        shuffle=False,
        verbose=args.verbose,
    ).history

    os.makedirs(args.output_dir, exist_ok=True)
    paths = {
        "predictions": utils.save_prediction_grid(
            model,
            val_ds,
            class_names,
            os.path.join(args.output_dir, "predictions.png"),
        ),
        "training_curves": utils.save_training_curves(
            history,
            os.path.join(args.output_dir, "training_curves.png"),
            title=f"Cross-entropy + {args.dice_weight:g} x Dice, batch "
            f"{global_batch} x {steps} accumulation steps",
        ),
    }
    results = {
        "val_mean_iou": float(history["val_mean_iou"][-1]),
        "val_loss": float(history["val_loss"][-1]),
        "gradient_gap": gap,
        "wall_time_s": time.perf_counter() - start,
    }
    for name, path in paths.items():
        print(f"Wrote {name}: {path}")
    print(f"Final validation mean IoU: {results['val_mean_iou']:.4f}")
    print(f"Wall time: {results['wall_time_s']:.1f} s")
    return {**results, "paths": paths, "history": history}


if __name__ == "__main__":
    main()
