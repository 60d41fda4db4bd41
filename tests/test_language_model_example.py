"""Smoke test of `examples/language_model.py`.

Its `main()` runs end to end with `--smoke` (tiny corpus and model) into a
temporary output directory, and its first-window check shows the point of
the example: with a padding-masked loss, keras_accum's update equals the big
batch's in float64, and the optimizer's built-in accumulation does not.
With `--memory-limit-mb` (in a child process with a CPU memory limit), a
bucketed run recovers from running out of memory in the middle of an epoch.
"""

import json
import math
import os
import sys

import pytest
from background import start

EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"
)
sys.path.insert(0, EXAMPLES)

import example_utils  # noqa: E402
import language_model  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MEMORY_LIMIT_MB = 26


def start_background_runs(tmp_path_factory):
    """Starts `language_model.py --memory-limit-mb` in a child (a CPU limit,
    set before TensorFlow starts), in the background, with the first test:
    its out-of-memory errors each cost about 10 s of the allocator's waiting
    (`background.py`). Its folder is its output dir."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.update(example_utils.cpu_limit_environment(MEMORY_LIMIT_MB))
    return start(
        tmp_path_factory, "language_model_memory_limit",
        lambda folder: [
            sys.executable, os.path.join(EXAMPLES, "language_model.py"),
            "--smoke", "--memory-limit-mb", str(MEMORY_LIMIT_MB),
            "--output-dir", str(folder),
        ],
        env,
    )


@pytest.mark.slow
def test_language_model_smoke(tmp_path):
    result = language_model.main(["--smoke", "--output-dir", str(tmp_path)])

    figure = tmp_path / "language_model.png"
    assert result["figure"] == str(figure)
    assert figure.stat().st_size > 1000
    assert figure.read_bytes()[:8] == PNG_MAGIC
    with open(tmp_path / "language_model.json") as f:
        numbers = json.load(f)

    # Micro-batches with different numbers of real tokens: the case the
    # built-in option gets wrong.
    tokens = numbers["first_window_real_tokens_per_micro_batch"]
    assert len(set(tokens)) > 1
    for optimizer in ("sgd", "adam"):
        differences = numbers["first_window_update_difference"][optimizer]
        assert differences["big_batch"] == 0.0
        assert differences["keras_accum"] < 1e-9, (optimizer, differences)
        assert differences["builtin"] > 1e-3, (optimizer, differences)

    assert numbers["initial_weights_max_difference"] == 0.0
    runs = numbers["runs"]
    assert set(runs) == {"big_batch", "keras_accum", "builtin"}
    starts = {run["val_loss_per_update"][0] for run in runs.values()}
    assert len(starts) == 1  # Same weights, same validation loss.
    for run in runs.values():
        # 32 sequences, windows of 2 x 4: 4 updates in the one epoch.
        assert run["updates"] == 4
        assert all(math.isfinite(v) for v in run["val_loss_per_update"])
    # float32 training follows the big batch to rounding.
    assert runs["keras_accum"]["val_loss_per_update"] == pytest.approx(
        runs["big_batch"]["val_loss_per_update"], rel=1e-4
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gradient-accumulation-steps", "1"], "at least 2"),
        (["--batch-size", "0"], "positive integer"),
        (["--min-length", "10", "--max-length", "5"], "--max-length"),
        (["--num-sequences", "4"], "one window"),
        (["--save-freq", "0"], "--save-freq must be an integer >= 1"),
        # "auto" would choose its micro-batches again after a restart.
        (["--backup-dir", "backup", "--memory-limit-mb", "48"],
         "--backup-dir cannot be used with --memory-limit-mb"),
    ],
)
def test_language_model_rejects_bad_flags(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        language_model.main(["--smoke", "--output-dir", str(tmp_path), *flags])


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
def test_language_model_memory_limit_recovers_mid_epoch(tmp_path_factory):
    # In 26 MiB (a CPU limit, set before TensorFlow starts: a child process)
    # a batch of 256 sequences of 16 tokens fits whole, and the micro-batch
    # "auto" guesses for the longer buckets from it runs out of memory:
    # attention's memory grows with the square of the length.
    run = start_background_runs(tmp_path_factory)
    proc = run.wait()
    tmp_path = run.folder
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "language_model_memory.json") as f:
        numbers = json.load(f)
    batches = numbers["first_epoch_batches"]
    assert batches[0] == [256, 16]  # The first batch: short sequences.
    assert {length for _, length in batches} == {16, 32, 64}
    recoveries = numbers["recoveries"]
    assert recoveries, proc.stdout
    # Recovered after the first batch, in the middle of the epoch.
    assert all(r["batch"] > 0 and r["epoch"] == 0 for r in recoveries)
    assert "Out of memory with micro-batches" in recoveries[0]["message"]
    # Training went on to the end: one update per batch.
    assert numbers["updates"] == len(batches)
    assert all(math.isfinite(v) for v in numbers["loss_per_epoch"])
    assert all(math.isfinite(v) for v in numbers["val_loss_per_epoch"])
    assert numbers["peak_mib"] <= 26
