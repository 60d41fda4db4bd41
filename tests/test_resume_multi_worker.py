"""`BackupAndRestore` with two workers: one folder, or one per worker.

Two processes train under `MultiWorkerMirroredStrategy` (localhost, CPU,
float64) with `resume/train.py` (7 batches an epoch, windows of 4, backups
every 2 batches); every worker writes its own backups. The runs
(`resume/multi_worker.py`, in the background from the first test): the
uninterrupted run; with one folder for both, worker 1 killed with SIGKILL
mid-window (batch 3 of epoch 1), worker 0 then killed too; both restarted,
worker 1 sent SIGTERM during batch 3 of epoch 2
(`save_before_preemption=True`): both back up at the next batch (the
workers agree through TensorFlow's coordination service, not a collective
per batch) and exit with `PREEMPTION_EXIT_CODE`; both restarted to the
end. Then the chief killed mid-window; worker 1 killed mid-window with a
folder per worker, and with one `file://` folder; each time both
restarted. The resumed workers start where the last backup was made and
end with the uninterrupted run's weights, optimizer variables and logs.
With a folder per worker and worker 1's folder lost before the restart,
the workers hold no backup in common: both raise the same error, which
names each worker's backups and the fix, twice in a row (no collective
failure, no wedge).
"""

import json
import os
import re
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
        timeout=14 * 240,
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


def _check_resumed(folder, run, starts, what, backup_dirs=("backup",)):
    """Each worker's starts (`[epoch, updates, pending micro-batches]` of
    each run), its resumed weights, optimizer variables and last epoch's
    logs against the uninterrupted run's, and the backup folders gone at
    the end."""
    prefix = run.split("_")[0] + "_" if "_" in run else ""
    for worker in (0, 1):
        logged = (folder / f"{prefix}starts-{worker}.jsonl").read_text()
        assert [json.loads(line) for line in logged.splitlines()] == starts
        reference = folder / f"uninterrupted-{worker}.npz"
        resumed = folder / f"{run}-{worker}.npz"
        diff = relative_difference(_weights(reference), _weights(resumed))
        record(what, diff)
        assert diff <= 1e-12, f"worker {worker} differs: {diff:.3g}"
        diff = relative_difference(*(
            _weights(p.with_suffix(".optimizer.npz"))
            for p in (reference, resumed)
        ))
        assert diff <= 1e-12, f"worker {worker}'s optimizer: {diff:.3g}"
        logs = [json.loads(p.with_suffix(".json").read_text())
                for p in (reference, resumed)]
        assert logs[1] == logs[0]
    for name in backup_dirs:
        assert not (folder / name).exists()


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
    # SIGTERM to worker 1 only, during batch 3 of epoch 2: both stop at
    # the check point after the one where it saw the signal, batch 4 (its
    # window's end), back up there and exit with the documented status.
    _check_codes(runs["preempted"], BackupAndRestore.PREEMPTION_EXIT_CODE)
    assert runs["preempted"]["backups"] == [[2, 4]]
    _check_codes(runs["resumed"], 0)
    _check_resumed(
        folder, "resumed", [[0, 0, 0], [0, 0, 0], [1, 2, 2], [2, 5, 0]],
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
        folder, "chief_resumed", [[0, 0, 0], [1, 2, 2]],
        "resumed two workers after the chief's SIGKILL",
        ["chief_backup"],
    )


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
@pytest.mark.parametrize("layout", ["own", "url"])
def test_killed_worker_resumes_exactly_in_any_layout(
    tmp_path_factory, layout
):
    # `own`: a folder per worker (local disks); `url`: one folder given as
    # a `file://` URL. Worker 1 killed after batch 3 of epoch 1: both hold
    # the backup after batch 2, and resume there.
    folder, runs = _runs(tmp_path_factory)
    _check_codes(runs[f"{layout}_killed"], -signal.SIGKILL)
    assert runs[f"{layout}_killed"]["backups"] == [[1, 2]]
    _check_codes(runs[f"{layout}_resumed"], 0)
    dirs = (["own_backup-0", "own_backup-1"] if layout == "own"
            else ["url_backup"])
    _check_resumed(
        folder, f"{layout}_resumed", [[0, 0, 0], [1, 2, 2]],
        f"resumed two workers ({layout} folders)", dirs,
    )


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
def test_lost_folder_is_the_same_clear_error_on_both_workers(
    tmp_path_factory
):
    # A folder per worker; worker 1's deleted before each restart: worker
    # 0 holds the backup after batch 2 of epoch 1, worker 1 none. Both
    # raise the same error, naming each worker's backups and the fix, and
    # again at the next restart.
    folder, runs = _runs(tmp_path_factory)
    assert runs["lost_killed"]["backups"] == [[1, 2]]
    for run in ("lost_restart1", "lost_restart2"):
        codes, stderr = runs[run]["returncodes"], runs[run]["stderr"]
        assert codes == [1, 1], stderr
        errors = [
            re.findall(r"^ValueError: (.*)$", text, re.M)[-1]
            for text in stderr
        ]
        assert errors[0] == errors[1], errors
        message = (
            r"The workers hold no backup in common, so they cannot resume "
            r"at the same position: worker 0 holds backups in "
            r"'[^']*lost_backup-0' \(after batch 2 of epoch 1\); worker 1 "
            r"holds none in '[^']*lost_backup-1'\. Every worker needs the "
            r"same backup: copy the newest backup folder of worker 0's "
            r"'[^']*lost_backup-0' into the `backup_dir` of each worker "
            r"that lacks it, or, to start training over, delete the "
            r"backups of all workers\."
        )
        assert re.fullmatch(message, errors[0]), errors[0]
    # Nothing was deleted: worker 0's backup is still there.
    assert (folder / "lost_backup-0").exists()


@pytest.mark.slow
@pytest.mark.background(start=start_background_runs)
def test_a_worker_that_cannot_back_up_is_named_on_every_worker(
    tmp_path_factory
):
    # Worker 1's folder is replaced by a file mid-run: its backup after
    # batch 2 of epoch 1 fails, with an error that names the backup. Worker
    # 0, whose collective then fails, says which worker stopped and why
    # (through the coordination service), not only the collective; both
    # exit promptly.
    _, runs = _runs(tmp_path_factory)
    run = runs["broken_folder"]
    assert run["returncodes"] == [1, 1], run["stderr"]
    assert run["seconds"] < 60, run["seconds"]
    errors = [re.findall(r"^(\w+(?:\.\w+)*: .*)$", text, re.M)[-1]
              for text in run["stderr"]]
    backup = (r"Could not write the backup '[^']*broken_backup-1/"
              r"backup-1-2-w1-\d+' in `backup_dir` \(")
    assert re.match(r"\S*BackupWriteError: " + backup, errors[1]), errors[1]
    assert re.match(
        r"\S*WorkerFailedError: Worker 1 stopped, and so worker 0, while it "
        r"tried to write its backup after batch 2 of epoch 1\. Worker 1 "
        r"could not write its backup after batch 2 of epoch 1: "
        r"BackupWriteError: " + backup, errors[0],
    ), errors[0]
