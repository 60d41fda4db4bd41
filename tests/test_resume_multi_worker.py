"""`BackupAndRestore` with two workers that share one backup folder.

Two processes train under `MultiWorkerMirroredStrategy` (localhost, CPU,
float64) with `resume/train.py` (7 batches an epoch, windows of 4, backups
every 2 batches), as cluster jobs are written: the same `backup_dir` for
both. The runs (`resume/multi_worker.py`, in the background from the first
test): the uninterrupted run; worker 1 killed with SIGKILL mid-window
(batch 3 of epoch 1), worker 0 then killed too; both restarted, worker 1
sent SIGTERM during batch 3 of epoch 2 (`save_before_preemption=True`):
both back up there and exit with `PREEMPTION_EXIT_CODE`; both restarted
to the end; then, into another folder, worker 0 (the chief, the one that
writes) killed mid-window (worker 1's collective then fails, or it is
killed too), both restarted to the end. The resumed workers end with the
uninterrupted run's weights.
"""

import json
import os
import signal
import sys

import numpy as np
import pytest
from background import start
from conftest import record
from conftest import relative_difference

from keras_accum.callbacks import BackupAndRestore

SCRIPT = os.path.join(os.path.dirname(__file__), "resume", "multi_worker.py")


def start_background_runs(tmp_path_factory):
    """Starts the runs of `resume/multi_worker.py` (with the first test)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    return start(
        tmp_path_factory, "resume_multi_worker",
        lambda folder: [sys.executable, SCRIPT, str(folder)], env,
        timeout=6 * 240,
    )


def _runs(tmp_path_factory):
    """The runs' folder, and each run's JSON line by name."""
    run = start_background_runs(tmp_path_factory)
    done = run.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    return run.folder, {r["run"]: r for r in results}


def _weights(path):
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def _check_codes(result, codes):
    for code, stderr in zip(result["returncodes"], result["stderr"]):
        assert code == codes, (result["run"], stderr)


def _check_resumed(folder, prefix, starts, what):
    """Each worker's starts (`[epoch, updates, pending micro-batches]` of
    each run), its resumed weights against the uninterrupted run's, and the
    backup folder gone at the end."""
    for worker in (0, 1):
        logged = (folder / f"{prefix}starts-{worker}.jsonl").read_text()
        assert [json.loads(line) for line in logged.splitlines()] == starts
        diff = relative_difference(
            _weights(folder / f"uninterrupted-{worker}.npz"),
            _weights(folder / f"{prefix}resumed-{worker}.npz"),
        )
        record(what, diff)
        assert diff <= 1e-12, f"worker {worker} differs: {diff:.3g}"
    assert not (folder / f"{prefix}backup").exists()


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
def test_uninterrupted_run_with_one_backup_folder(tmp_path_factory):
    folder, runs = _runs(tmp_path_factory)
    _check_codes(runs["uninterrupted"], 0)
    first, second = (
        _weights(folder / f"uninterrupted-{i}.npz") for i in (0, 1)
    )
    assert relative_difference(first, second) == 0.0
    assert not (folder / "reference_backup").exists()


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
def test_killed_worker_then_sigterm_resume_exactly(tmp_path_factory):
    folder, runs = _runs(tmp_path_factory)
    # Killed: the backup after batch 2 of epoch 1 is the only one left.
    _check_codes(runs["killed"], -signal.SIGKILL)
    assert runs["killed"]["backups"] == [[1, 2]]
    # SIGTERM to worker 1 only, during batch 3 of epoch 2: both stop after
    # it, back up there (not at batch 2, the last `save_freq` point) and
    # exit with the documented status.
    _check_codes(runs["preempted"], BackupAndRestore.PREEMPTION_EXIT_CODE)
    assert runs["preempted"]["backups"] == [[2, 3]]
    _check_codes(runs["resumed"], 0)
    _check_resumed(
        folder, "", [[0, 0, 0], [0, 0, 0], [1, 2, 2], [2, 4, 3]],
        "resumed two workers after SIGKILL and SIGTERM",
    )


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
def test_killed_chief_resumes_exactly(tmp_path_factory):
    folder, runs = _runs(tmp_path_factory)
    # The chief killed after batch 3 of epoch 1: its backup after batch 2
    # is the only one left, and worker 1 restores it too. Worker 1 either
    # raises, its collective aborted when the chief's connection drops
    # (TensorFlow's error), or is killed while it waits.
    chief, other = runs["chief_killed"]["returncodes"]
    assert chief == -signal.SIGKILL, runs["chief_killed"]["stderr"][0]
    stderr = runs["chief_killed"]["stderr"][1]
    assert other == -signal.SIGKILL or (
        other == 1 and "Collective ops is aborted" in stderr
    ), stderr
    assert runs["chief_killed"]["backups"] == [[1, 2]]
    _check_codes(runs["chief_resumed"], 0)
    _check_resumed(
        folder, "chief_", [[0, 0, 0], [1, 2, 2]],
        "resumed two workers after the chief's SIGKILL",
    )
