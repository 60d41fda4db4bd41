"""Two-worker runs of `train.py`, with one backup folder or one per worker.

Usage: python multi_worker.py FOLDER [RUN ...]

Each run is a pair of processes (workers 0 and 1 of a
`MultiWorkerMirroredStrategy` cluster on localhost), forked from this one,
which imported TensorFlow, Keras and keras_accum once and runs no
TensorFlow op (`forking.py`). One after the other (or the RUNs named):

- `uninterrupted`: backups every 2 batches into `FOLDER/reference_backup`;
- `killed`: into `FOLDER/backup`, worker 1 kills itself with SIGKILL after
  batch 3 of epoch 1 (mid-window); worker 0, left waiting for it, is then
  killed too;
- `preempted`: both restarted with `--save-before-preemption`; worker 1
  sends itself SIGTERM as batch 3 of epoch 2 starts (between two
  `save_freq` points): both back up at the check point after the one where
  the signal was seen, batch 4, and exit with
  `BackupAndRestore.PREEMPTION_EXIT_CODE`;
- `resumed`: both restarted, to the end;
- `chief_killed`: into `FOLDER/chief_backup`, worker 0 (the chief) kills
  itself with SIGKILL after batch 3 of epoch 1; worker 1 raises when its
  collective is aborted (TensorFlow's error once the chief's connection
  drops), or is killed while it waits; `chief_resumed`: both restarted;
- `own_killed`, `own_resumed`: as `killed` and `resumed`, each worker with
  a folder of its own, `FOLDER/own_backup-<worker>`;
- `url_killed`, `url_resumed`: the same with one folder given as a
  `file://` URL, `FOLDER/url_backup`;
- `lost_killed`, then `lost_restart1` and `lost_restart2`: a folder per
  worker, `FOLDER/lost_backup-<worker>`, worker 1 killed mid-window, then
  worker 1's folder deleted before each restart: the workers hold no
  backup in common;
- `broken_folder`: a folder per worker, worker 1's replaced by a file as batch 2
  of epoch 1 starts: its backup after that batch cannot be written.

Worker `i` of run `r` writes `OUT_FILE` `FOLDER/<r>-<i>.npz` and logs where
it starts in `FOLDER/<prefix>starts-<i>.jsonl` (`prefix`: the run's name
up to its `_`, for the runs after the first four). Prints one JSON line per
run: its name, each worker's exit code (negative: the signal that ended
it) and stderr's end, the backups in the folders after it (`[epoch,
batches]` of each complete backup, once each), and its duration.
"""

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(__file__)))

import forking  # noqa: E402
import train  # noqa: E402

OPTIONS = ["--save-freq", "2", "--multi-worker"]
# run: (backup folder, `{worker}` for one per worker; options of worker 0,
# options of worker 1)
RUNS = {
    "uninterrupted": ("reference_backup", [], []),
    "killed": ("backup", [], ["--kill", "1:3"]),
    "preempted": (
        "backup", ["--save-before-preemption"],
        ["--save-before-preemption", "--term", "2:3"],
    ),
    "resumed": ("backup", ["--save-before-preemption"],
                ["--save-before-preemption"]),
    "chief_killed": ("chief_backup", ["--kill", "1:3"], []),
    "chief_resumed": ("chief_backup", [], []),
    "own_killed": ("own_backup-{worker}", [], ["--kill", "1:3"]),
    "own_resumed": ("own_backup-{worker}", [], []),
    "url_killed": ("url_backup", ["--file-url"],
                   ["--file-url", "--kill", "1:3"]),
    "url_resumed": ("url_backup", ["--file-url"], ["--file-url"]),
    "lost_killed": ("lost_backup-{worker}", [], ["--kill", "1:3"]),
    "lost_restart1": ("lost_backup-{worker}", [], []),
    "lost_restart2": ("lost_backup-{worker}", [], []),
    "broken_folder": (
        "broken_backup-{worker}", [], ["--break-backup-dir", "1:2"]
    ),
}
TIMEOUT = 240  # seconds, per run


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _worker(index, cluster, argv):
    def run():
        os.environ["TF_CONFIG"] = json.dumps({
            "cluster": cluster, "task": {"type": "worker", "index": index},
        })
        train.main(argv)

    return run


def _wait(pid, deadline):
    """Waits for `pid` until `deadline`, then kills it; its exit code."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return forking.wait(pid)


def backups(folders):
    """`[epoch, batches]` of each complete backup in `folders`, once each
    (both workers write theirs into a folder that they share)."""
    found = set()
    for folder in folders:
        entries = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        for entry in entries:
            manifest = os.path.join(folder, entry, "manifest.json")
            if os.path.exists(manifest):
                with open(manifest) as f:
                    saved = json.load(f)["position"]
                found.add((saved["epoch"], saved["batches"]))
    return sorted(list(b) for b in found)


def main(folder, names=None):
    for name, (backup, *options) in RUNS.items():
        if names and name not in names:
            continue
        start = time.monotonic()
        cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(2)]}
        log = name.split("_")[0] + "_" if "_" in name else ""
        dirs = [os.path.join(folder, backup.format(worker=i)) for i in (0, 1)]
        if name.startswith("lost_restart"):
            # Worker 1's disk lost before the restart.
            shutil.rmtree(dirs[1], ignore_errors=True)
        pids, stderrs = [], []
        for index in (0, 1):
            argv = [os.path.join(folder, f"{name}-{index}.npz"), dirs[index],
                    *OPTIONS,
                    "--log",
                    os.path.join(folder, f"{log}starts-{index}.jsonl"),
                    *options[index]]
            stderrs.append(tempfile.NamedTemporaryFile("r"))
            pids.append(forking.fork(
                _worker(index, cluster, argv), stderrs[-1].name
            ))
        deadline = time.monotonic() + TIMEOUT
        # The worker that kills itself (if any) first: the other one then
        # waits for it in a collective (or has failed there): kill it.
        kills = ["--kill" in worker_options for worker_options in options]
        killed = kills.index(True) if any(kills) else 1
        other = 1 - killed
        codes = [None, None]
        codes[killed] = _wait(pids[killed], deadline)
        if any(kills):
            os.kill(pids[other], signal.SIGKILL)
        codes[other] = _wait(pids[other], deadline)
        print(json.dumps({
            "run": name,
            "returncodes": codes,
            "stderr": [s.read()[-3000:] for s in stderrs],
            "backups": backups(sorted(set(dirs))),
            "seconds": round(time.monotonic() - start, 1),
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
