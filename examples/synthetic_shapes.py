"""
Title: A synthetic, offline segmentation dataset for TFDS
Description: A `tfds` builder that draws circles, squares and triangles on
textured backgrounds, with an Oxford-pets style "ignore" border in the masks.

This module defines the `synthetic_shapes` dataset. It is a real
TensorFlow Datasets builder, so it is used through the ordinary TFDS code
path:

```python
import synthetic_shapes  # registers the builder with TFDS
import tensorflow_datasets as tfds

train, test = tfds.load("synthetic_shapes", split=["train", "test"],
                        data_dir="~/tensorflow_datasets")
```

Nothing is downloaded. Every example is rendered with NumPy from a random
generator seeded by `(config seed, split, example index)`, so the dataset is
the same on every run and does not depend on the order in which examples are
written. `tfds.load` generates it on first use (a few seconds) into its data
directory; processes that share a data directory (several workers on one
machine) should generate it first, by running this file.

## Features

* `image`: `uint8` RGB image, `image_size x image_size x 3`.
* `segmentation_mask`: `uint8`, `image_size x image_size x 1`, with
  * `0`: background,
  * `1`: circle, `2`: square, `3`: triangle,
  * `255`: **ignore**. A band about two pixels wide along every boundary
    between two regions. It plays the role of the "border" class of the
    Oxford-IIIT pet trimaps: the pixels where the label is ambiguous are left
    out of both the loss (`ignore_class=255`) and the metric.
* `shapes`: the classes of the shapes drawn in the image, in drawing order.

Circles, squares and triangles of the same size have the same area, so size
says nothing about the class. Colour says something, but not everything: each
class draws its hue from a range centred on its own (red, green, blue) that
overlaps its neighbours' ranges, and the backgrounds are washed-out textures
(smooth blobs, stripes, checkerboards) with pixel noise. A model learns the
colour cue within an epoch and needs the geometry for the rest. (Without the
colour cue the dataset is much harder: a small U-Net needs far more than the
few CPU minutes the examples are tuned for.)

## Configs

* `default` (the one `tfds.load("synthetic_shapes")` uses): 64x64 pixels,
  1000 train and 200 test examples. Generating it takes a few seconds.
* `small`: 32x32 pixels, 128 train and 64 test examples, for smoke tests.

Run this file directly to generate the dataset and print a few statistics:

```
python examples/synthetic_shapes.py                  # ~/tensorflow_datasets
python examples/synthetic_shapes.py --data-dir data --config small
```
"""

import argparse
import colorsys
import dataclasses

import numpy as np
import tensorflow_datasets as tfds

# Label values used in the masks.
BACKGROUND = 0
CIRCLE = 1
SQUARE = 2
TRIANGLE = 3
IGNORE_LABEL = 255
NUM_CLASSES = 4  # background + three shapes; IGNORE_LABEL is not a class.
SHAPE_NAMES = ["circle", "square", "triangle"]
CLASS_NAMES = ["background"] + SHAPE_NAMES

# Hue (0..1) around which each shape class picks its colour, and the random
# offset added to it. With a jitter above 1/6 the hue ranges of two classes
# overlap, so colour alone does not always give the class away.
SHAPE_HUES = [0.0, 1 / 3, 2 / 3]
HUE_JITTER = 0.2

_SPLIT_IDS = {"train": 0, "test": 1}


# ---------------------------------------------------------------------------
# Rendering (pure NumPy, no TensorFlow needed)
# ---------------------------------------------------------------------------


def _bilinear_upsample(grid, size):
    """Upsamples a small `(h, w, c)` grid to `(size, size, c)` bilinearly."""
    h, w = grid.shape[:2]
    ys = np.linspace(0.0, h - 1.0, size)
    xs = np.linspace(0.0, w - 1.0, size)
    y0 = np.clip(np.floor(ys).astype(int), 0, h - 2)
    x0 = np.clip(np.floor(xs).astype(int), 0, w - 2)
    fy = (ys - y0)[:, None, None]
    fx = (xs - x0)[None, :, None]
    top = grid[y0][:, x0] * (1 - fx) + grid[y0][:, x0 + 1] * fx
    bottom = grid[y0 + 1][:, x0] * (1 - fx) + grid[y0 + 1][:, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy


def _background(rng, size):
    """A random texture: smooth colour noise, stripes or a checkerboard."""
    kind = rng.integers(3)
    if kind == 0:  # Smooth colour blobs.
        cells = int(rng.integers(3, 7))
        image = _bilinear_upsample(rng.uniform(0, 1, (cells, cells, 3)), size)
    else:
        yy, xx = np.mgrid[0:size, 0:size] / size
        colour_a = rng.uniform(0, 1, 3)
        colour_b = rng.uniform(0, 1, 3)
        angle = rng.uniform(0, np.pi)
        freq = rng.uniform(2, 6)
        u = xx * np.cos(angle) + yy * np.sin(angle)
        if kind == 1:  # Soft stripes.
            blend = 0.5 + 0.5 * np.sin(2 * np.pi * freq * u)
        else:  # Checkerboard.
            v = -xx * np.sin(angle) + yy * np.cos(angle)
            blend = ((np.floor(freq * u) + np.floor(freq * v)) % 2).astype(
                float
            )
        blend = blend[..., None]
        image = colour_a * (1 - blend) + colour_b * blend
    # Wash the colours out (the shapes are saturated) and lower the contrast.
    grey = image.mean(axis=-1, keepdims=True)
    image = grey + rng.uniform(0.1, 0.35) * (image - grey)
    return rng.uniform(0.25, 0.75) + rng.uniform(0.3, 0.6) * (
        image - image.mean()
    )


def _shape_mask(shape, cx, cy, radius, angle, yy, xx):
    """Boolean mask of one shape; all shapes have the area of a `radius` disc.

    Returns the mask and the radius of the circle that encloses the shape.
    """
    dx, dy = xx - cx, yy - cy
    if shape == CIRCLE:
        return dx**2 + dy**2 <= radius**2, radius
    if shape == SQUARE:
        half_side = radius * np.sqrt(np.pi) / 2
        u = dx * np.cos(angle) + dy * np.sin(angle)
        v = -dx * np.sin(angle) + dy * np.cos(angle)
        return np.maximum(
            np.abs(u), np.abs(v)
        ) <= half_side, half_side * np.sqrt(2)
    # Equilateral triangle: the intersection of three half-planes.
    circumradius = radius * np.sqrt(4 * np.pi / (3 * np.sqrt(3)))
    inside = np.ones_like(dx, dtype=bool)
    for k in range(3):
        normal_angle = angle + np.pi / 3 + k * 2 * np.pi / 3
        distance = dx * np.cos(normal_angle) + dy * np.sin(normal_angle)
        inside &= distance <= circumradius / 2
    return inside, circumradius


def _ignore_band(labels, width=1):
    """Pixels within `width` (Chebyshev distance) of a different label."""
    padded = np.pad(labels, width, mode="edge")
    size_y, size_x = labels.shape
    band = np.zeros(labels.shape, dtype=bool)
    for oy in range(2 * width + 1):
        for ox in range(2 * width + 1):
            band |= padded[oy : oy + size_y, ox : ox + size_x] != labels
    return band


def render_example(rng, size, max_shapes=3):
    """Draws one image and its mask. Returns `(image, mask, shapes)`.

    `image` is `uint8 (size, size, 3)`, `mask` is `uint8 (size, size, 1)` with
    values in `{0, 1, 2, 3, IGNORE_LABEL}` and `shapes` lists the drawn classes.
    """
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    image = _background(rng, size)
    labels = np.zeros((size, size), dtype=np.uint8)
    placed = []  # (cx, cy, enclosing radius) of the shapes drawn so far.
    shapes = []
    for _ in range(int(rng.integers(1, max_shapes + 1))):
        shape = int(rng.integers(1, 4))
        radius = rng.uniform(0.14, 0.24) * size
        angle = rng.uniform(0, 2 * np.pi)
        # Rejection sampling: shapes do not overlap, so none is hidden.
        for _attempt in range(20):
            cx, cy = rng.uniform(0.1 * size, 0.9 * size, 2)
            mask, reach = _shape_mask(shape, cx, cy, radius, angle, yy, xx)
            if all(
                np.hypot(cx - px, cy - py) > reach + pr + 1
                for px, py, pr in placed
            ):
                break
        else:
            continue
        # A saturated colour whose hue leans towards the class (see the module
        # docstring): a hint that is right most of the time, not always.
        hue = (
            SHAPE_HUES[shape - 1] + rng.uniform(-HUE_JITTER, HUE_JITTER)
        ) % 1.0
        colour = np.array(
            colorsys.hsv_to_rgb(
                hue, rng.uniform(0.6, 1.0), rng.uniform(0.55, 1.0)
            )
        )
        gradient = rng.uniform(-0.15, 0.15, 3) * ((xx - cx) / size)[..., None]
        image = np.where(mask[..., None], colour + gradient, image)
        labels[mask] = shape
        placed.append((cx, cy, reach))
        shapes.append(shape)
    image = image + rng.normal(0, rng.uniform(0.02, 0.08), image.shape)
    labels[_ignore_band(labels)] = IGNORE_LABEL
    image = np.clip(image * 255 + 0.5, 0, 255).astype(np.uint8)
    return image, labels[..., None], shapes


# ---------------------------------------------------------------------------
# The TFDS builder
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class SyntheticShapesConfig(tfds.core.BuilderConfig):
    """Image size and split sizes of a `synthetic_shapes` variant."""

    image_size: int = 64
    num_train: int = 1000
    num_test: int = 200
    seed: int = 0


class SyntheticShapes(tfds.core.GeneratorBasedBuilder):
    """Circles, squares and triangles on textured backgrounds, with masks."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [
        SyntheticShapesConfig(
            name="default",
            description="64x64 images, 1000 train / 200 test examples.",
        ),
        SyntheticShapesConfig(
            name="small",
            description="32x32 images, 128 train / 64 test (smoke tests).",
            image_size=32,
            num_train=128,
            num_test=64,
        ),
    ]

    def _info(self):
        size = self.builder_config.image_size
        # `tfds.core.DatasetInfo` directly: `dataset_info_from_configs` expects
        # the builder to live in its own package folder with metadata files.
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Synthetic semantic segmentation: up to three shapes (circle, "
                "square, triangle) on textured backgrounds. Mask values: "
                "0 background, 1 circle, 2 square, 3 triangle, 255 ignore "
                "(a ~2 pixel band along region boundaries)."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(size, size, 3)),
                    "segmentation_mask": tfds.features.Image(
                        shape=(size, size, 1)
                    ),
                    "shapes": tfds.features.Sequence(
                        tfds.features.ClassLabel(names=SHAPE_NAMES)
                    ),
                }
            ),
            supervised_keys=("image", "segmentation_mask"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        config = self.builder_config
        return {
            "train": self._generate_examples("train", config.num_train),
            "test": self._generate_examples("test", config.num_test),
        }

    def _generate_examples(self, split, num_examples):
        config = self.builder_config
        for index in range(num_examples):
            # One generator per example: deterministic whatever the order.
            rng = np.random.default_rng([config.seed, _SPLIT_IDS[split], index])
            image, mask, shapes = render_example(rng, config.image_size)
            yield (
                index,
                {
                    "image": image,
                    "segmentation_mask": mask,
                    # ClassLabel indices start at 0 for "circle".
                    "shapes": [s - 1 for s in shapes],
                },
            )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Generate the synthetic_shapes TFDS dataset (offline) "
        "and print its class balance."
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="TFDS data directory (default: TFDS's, ~/tensorflow_datasets).",
    )
    parser.add_argument(
        "--config",
        default="default",
        choices=[c.name for c in SyntheticShapes.BUILDER_CONFIGS],
        help="Builder config to generate (default: %(default)s).",
    )
    args = parser.parse_args(argv)

    name = f"synthetic_shapes/{args.config}"
    builder = tfds.builder(name, data_dir=args.data_dir)
    builder.download_and_prepare()
    print(f"Prepared {name} in {builder.data_dir}")
    for split, info in builder.info.splits.items():
        print(f"  {split}: {info.num_examples} examples")
    counts = np.zeros(256, dtype=np.int64)
    for example in tfds.as_numpy(builder.as_dataset(split="train")):
        counts += np.bincount(
            example["segmentation_mask"].ravel(), minlength=256
        )
    total = counts.sum()
    for value, label in list(enumerate(CLASS_NAMES)) + [
        (IGNORE_LABEL, "ignore")
    ]:
        print(
            f"  {value:3d} {label:<10s} "
            f"{100 * counts[value] / total:5.1f}% of pixels"
        )


if __name__ == "__main__":
    main()
