"""Smoke tests of the examples in `examples/`.

Every example's `main()` runs end to end with `--smoke` (tiny images, a few
steps) into a temporary output directory. Nothing is downloaded:
`synthetic_shapes` is generated locally and `oxford_iiit_pet` is replaced by
`tfds.testing.mock_data`. The small-memory run (`--memory-limit-mb`) runs
in a child process, with a CPU memory limit set before TensorFlow starts;
it starts in the background with the first test.
"""

import json
import math
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from background import start

EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"
)
sys.path.insert(0, EXAMPLES)

import compare_accumulation  # noqa: E402
import custom_training_loop  # noqa: E402
import segmentation  # noqa: E402
import synthetic_shapes  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    assert os.path.isfile(path), path
    assert os.path.getsize(path) > 1000, path
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A TFDS data dir holding `synthetic_shapes/small`, generated once."""
    path = str(tmp_path_factory.mktemp("tensorflow_datasets"))
    tfds.builder("synthetic_shapes/small", data_dir=path).download_and_prepare()
    return path


# ---------------------------------------------------------------------------
# synthetic_shapes
# ---------------------------------------------------------------------------


def test_render_example_is_deterministic_and_labelled():
    first = synthetic_shapes.render_example(
        np.random.default_rng([0, 0, 7]), 64
    )
    second = synthetic_shapes.render_example(
        np.random.default_rng([0, 0, 7]), 64
    )
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    image, mask, shapes = first
    assert image.shape == (64, 64, 3) and image.dtype == np.uint8
    assert mask.shape == (64, 64, 1) and mask.dtype == np.uint8
    values = set(np.unique(mask).tolist())
    assert values <= {0, 1, 2, 3, synthetic_shapes.IGNORE_LABEL}
    assert synthetic_shapes.IGNORE_LABEL in values  # The border band.
    assert set(shapes) <= {1, 2, 3} and len(shapes) >= 1
    for shape in shapes:
        assert shape in values


def test_ignore_band_separates_regions():
    labels = np.zeros((9, 9), dtype=np.uint8)
    labels[3:6, 3:6] = 2
    band = synthetic_shapes._ignore_band(labels)
    # One pixel on each side of the boundary: a ring two pixels wide.
    assert band[4, 4] == 0 and band[3, 3] and band[2, 2] and not band[1, 1]


def test_synthetic_shapes_loads_through_tfds(data_dir):
    builder = tfds.builder("synthetic_shapes/small", data_dir=data_dir)
    assert builder.info.splits["train"].num_examples == 128
    assert builder.info.splits["test"].num_examples == 64
    train = tfds.load(
        "synthetic_shapes/small", split="train", data_dir=data_dir
    )
    example = next(iter(tfds.as_numpy(train)))
    assert example["image"].shape == (32, 32, 3)
    assert example["segmentation_mask"].shape == (32, 32, 1)


# ---------------------------------------------------------------------------
# segmentation.py
# ---------------------------------------------------------------------------


# `--smoke` trains 2 epochs of 6 micro-batches (24 examples in micro-batches
# of 4), two per update. Killed after batch 5 of epoch 2 with backups every
# 3 batches, the last backup is the one after batch 3 of epoch 2: in the
# middle of a window, with epoch 1's order to replay at the restart.
KILL_AFTER = "2:5"
SAVE_FREQ = "3"


def start_segmentation_runs(tmp_path_factory):
    """Starts, in the background with the first test, `segmentation.py
    --smoke` three times, one after the other, each in a process of its own:
    uninterrupted (without `--backup-dir`, the reference; it generates
    `synthetic_shapes/small` in `data/`), then with `--backup-dir`, killed
    by `KERAS_ACCUM_EXAMPLE_KILL_AFTER`, then the same command again. The
    killed run finds the dataset generated: had the initial weights depended
    on that, it could not end with the reference's figures. Each run writes
    its output to `<name>.out` in the run's folder, and the killed one its
    exit status to `killed.returncode`."""
    script = (
        'py=$1; example=$2; folder=$3; kill=$4; freq=$5\n'
        'run() { name=$1; shift; "$py" "$example" --smoke --verbose 2 '
        '--data-dir "$folder/data" "$@" > "$folder/$name.out" 2>&1; }\n'
        'resumable() { run "$1" --output-dir "$folder/resumed" '
        '--backup-dir "$folder/backup" --save-freq "$freq"; }\n'
        'run uninterrupted --output-dir "$folder/uninterrupted" || exit 1\n'
        '(export KERAS_ACCUM_EXAMPLE_KILL_AFTER="$kill"; resumable killed)\n'
        'echo $? > "$folder/killed.returncode"\n'
        'ls "$folder/backup" > "$folder/backup.listing"\n'
        'resumable restarted\n'
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KERAS_ACCUM_EXAMPLE_KILL_AFTER", None)
    return start(
        tmp_path_factory, "segmentation_killed",
        lambda folder: [
            "sh", "-c", script, "sh", sys.executable,
            os.path.join(EXAMPLES, "segmentation.py"), str(folder),
            KILL_AFTER, SAVE_FREQ,
        ],
        env,
    )


def _segmentation_runs(tmp_path_factory):
    run = start_segmentation_runs(tmp_path_factory)
    proc = run.wait()
    outputs = {
        name: (run.folder / f"{name}.out").read_text()
        for name in ("uninterrupted", "killed", "restarted")
        if (run.folder / f"{name}.out").exists()
    }
    assert proc.returncode == 0, (proc.stderr[-3000:], outputs)
    return run.folder, outputs


@pytest.mark.slow
@pytest.mark.background(start=start_segmentation_runs)
def test_segmentation_smoke(tmp_path_factory):
    folder, _ = _segmentation_runs(tmp_path_factory)
    output = folder / "uninterrupted"
    for name in ("predictions", "training_curves"):
        assert_png(output / f"{name}.png")
    with open(output / "metrics.json") as f:
        result = json.load(f)
    assert (
        math.isfinite(result["val_mean_iou"])
        and 0.0 <= result["val_mean_iou"] <= 1.0
    )
    assert math.isfinite(result["val_loss"])
    # 24 examples in micro-batches of 4, two per update: 3 updates per epoch.
    assert result["optimizer_updates"] == 3 * 2
    assert len(result["history"]["val_mean_iou"]) == 2
    assert result["history"]["val_mean_iou"][-1] == result["val_mean_iou"]


@pytest.mark.slow
@pytest.mark.background(start=start_segmentation_runs)
def test_segmentation_killed_mid_epoch_resumes_exactly(tmp_path_factory):
    folder, outputs = _segmentation_runs(tmp_path_factory)
    # SIGKILL: the shell reports 128 + 9. The backup it left was made
    # after batch 3 of epoch 2 (epoch index 1), mid-window.
    assert (folder / "killed.returncode").read_text().strip() == "137"
    assert "killed after batch 5 of epoch 2" in outputs["killed"]
    assert "Epoch 1/2" in outputs["killed"]
    assert (folder / "backup.listing").read_text().startswith("backup-1-3-")
    # The restart began in epoch 2, from the backup.
    assert "Epoch 1/2" not in outputs["restarted"], outputs["restarted"]
    assert "Epoch 2/2" in outputs["restarted"]
    assert not (folder / "backup").exists()  # Deleted at the end.

    def figures(name):
        with open(folder / name / "metrics.json") as f:
            metrics = json.load(f)
        # This process's time, and the flags (other folders) differ.
        del metrics["wall_time_s"], metrics["args"]
        return metrics

    reference, resumed = figures("uninterrupted"), figures("resumed")
    # The History of both epochs: the one before the restart kept.
    assert len(resumed["history"]["loss"]) == 2
    assert resumed == reference  # Exactly: weights, metrics, history.


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--save-freq", "0"], "--save-freq must be an integer >= 1. "
         "Received: --save-freq 0"),
        (["--backup-dir", "backup", "--memory-limit-mb", "64"],
         "--backup-dir cannot be used with --memory-limit-mb.*Received: "
         "--backup-dir backup --memory-limit-mb 64"),
    ],
)
def test_segmentation_rejects_bad_backup_flags(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        segmentation.main(["--smoke", "--output-dir", str(tmp_path), *flags])


def test_pet_trimap_mapping():
    trimap = tf.constant([[[1], [2]], [[3], [0]]], dtype=tf.uint8)
    labels = segmentation._pet_labels(trimap).numpy()[..., 0]
    np.testing.assert_array_equal(labels, [[1, 0], [255, 255]])


def _fake_pets(
    self, split, decoders=None, read_config=None, shuffle_files=False, **kwargs
):
    """Stands in for `oxford_iiit_pet`: odd-sized images with pet trimaps."""
    seed = 0 if "train" in str(split) else 1
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(12):
        height, width = rng.integers(40, 90, size=2)
        image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        trimap = np.full((height, width, 1), 2, dtype=np.uint8)  # Background.
        top, left = height // 4, width // 4
        trimap[top : 3 * top, left : 3 * left] = 3  # Border...
        trimap[top + 2 : 3 * top - 2, left + 2 : 3 * left - 2] = (
            1  # ...around the pet.
        )
        image[trimap[..., 0] == 1] //= 3
        examples.append((image, trimap))
    dataset = tf.data.Dataset.from_generator(
        lambda: ({"image": i, "segmentation_mask": m} for i, m in examples),
        output_signature={
            "image": tf.TensorSpec((None, None, 3), tf.uint8),
            "segmentation_mask": tf.TensorSpec((None, None, 1), tf.uint8),
        },
    )
    # Like a real TFDS split, the dataset knows its length.
    return dataset.apply(tf.data.experimental.assert_cardinality(len(examples)))


@pytest.mark.slow
def test_segmentation_oxford_pet_smoke(tmp_path):
    with tfds.testing.mock_data(
        policy=tfds.testing.MockPolicy.USE_CODE,
        as_dataset_fn=_fake_pets,
    ):
        result = segmentation.main(
            [
                "--dataset",
                "oxford_iiit_pet",
                "--smoke",
                "--verbose",
                "0",
                "--mixed-precision",
                "mixed_bfloat16",
                "--output-dir",
                str(tmp_path / "out"),
            ]
        )
    assert_png(result["paths"]["predictions"])
    assert_png(result["paths"]["training_curves"])
    assert (
        math.isfinite(result["val_mean_iou"])
        and 0.0 <= result["val_mean_iou"] <= 1.0
    )
    assert math.isfinite(result["val_loss"])


# ---------------------------------------------------------------------------
# custom_training_loop.py
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_custom_training_loop_smoke(data_dir, tmp_path):
    result = custom_training_loop.main(
        [
            "--smoke",
            "--data-dir",
            data_dir,
            "--output-dir",
            str(tmp_path),
            "--verbose",
            "0",
        ]
    )
    assert_png(result["paths"]["predictions"])
    assert_png(result["paths"]["training_curves"])
    assert math.isfinite(result["val_mean_iou"]) and math.isfinite(
        result["val_loss"]
    )
    history = result["history"]
    assert {"loss", "cross_entropy", "dice_loss", "mean_iou"} <= set(history)
    # Weighted by valid pixels, the accumulated cross-entropy gradient is the
    # big batch's; the batch-global Dice's is not.
    gap = result["gradient_gap"]
    assert gap["cross_entropy"] < 1e-4
    assert gap["dice"] > 10 * gap["cross_entropy"]


# ---------------------------------------------------------------------------
# compare_accumulation.py
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_compare_accumulation_smoke(data_dir, tmp_path):
    summary = compare_accumulation.main(
        ["--smoke", "--data-dir", data_dir, "--output-dir", str(tmp_path)]
    )
    assert_png(summary["figure"])
    results = summary["results"]
    small, accumulated, big = (results[r] for r in compare_accumulation.RUNS)
    assert small["updates"] == 2 * accumulated["updates"]
    assert accumulated["updates"] == big["updates"]
    for run in results.values():
        assert run["peak_rss_mb"] > 0
        for key in ("val_loss", "val_mean_iou"):
            assert all(math.isfinite(v) for v in run["history"][key])
    # Same initial weights and data order: accumulation follows the big batch.
    np.testing.assert_allclose(
        accumulated["history"]["val_loss"],
        big["history"]["val_loss"],
        rtol=1e-3,
    )
    assert summary["initial_weights_max_difference"] == 0.0
    assert summary["update_difference"] < 1e-3
    assert "| batch 4 x 2 accumulation |" in summary["table"]


# ---------------------------------------------------------------------------
# segmentation.py --memory-limit-mb
# ---------------------------------------------------------------------------


def _limited_cpu_env(limit_mb):
    """A child's environment with a CPU memory limit (and no GPU: the sizes
    in the tests are measured on a CPU)."""
    import example_utils

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.update(example_utils.cpu_limit_environment(limit_mb))
    return env


# 62 MiB: a plain keras.Model runs out at the batch of 64 (about 90 MiB
# without a limit), and so does "auto" with the whole batch (69 MiB to more
# than 72, from run to run); micro-batches of 32 fit (about 56 MiB).
MEMORY_LIMIT_MB = 62


def start_background_runs(tmp_path_factory):
    """Starts `segmentation.py --memory-limit-mb` in a child, in the
    background, with the first test: its two out-of-memory
    errors each cost about 10 s of the allocator's waiting
    (`background.py`). Its folder is its output dir; it generates
    `synthetic_shapes/small` in `data/` there, as the script does when the
    data is missing."""
    return start(
        tmp_path_factory, "segmentation_memory_limit",
        lambda folder: [
            sys.executable, os.path.join(EXAMPLES, "segmentation.py"),
            "--smoke", "--memory-limit-mb", str(MEMORY_LIMIT_MB),
            "--data-dir", str(folder / "data"), "--output-dir", str(folder),
            "--verbose", "0",
        ],
        _limited_cpu_env(MEMORY_LIMIT_MB),
    )


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
def test_segmentation_memory_limit_smoke(tmp_path_factory):
    run = start_background_runs(tmp_path_factory)
    proc = run.wait()
    tmp_path = run.folder
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Running again" not in proc.stdout  # The limit was in place.
    with open(tmp_path / "metrics.json") as f:
        results = json.load(f)
    memory = results["memory"]
    assert memory["plain_batch"] == 64
    assert memory["plain_out_of_memory"], memory
    assert "OOM when allocating" in memory["plain_error"]
    assert "Plain keras.Model, batch 64: out of memory" in proc.stdout
    # "auto" ran out with the whole batch, was rolled back and trained the
    # batch in smaller micro-batches, within the limit.
    assert memory["recoveries"], memory
    assert memory["micro_batch_size"] < 64
    assert all(size < rows for size, rows in memory["last_epoch"])
    assert memory["peak_mib"] <= MEMORY_LIMIT_MB
    assert results["optimizer_updates"] == 1  # 64 examples, batches of 64.
    assert math.isfinite(results["val_loss"])
    assert_png(tmp_path / "predictions.png")
