"""Two-worker runs of `train.py` that share one backup folder.

Usage: python multi_worker.py FOLDER

Each run is a pair of processes (workers 0 and 1 of a
`MultiWorkerMirroredStrategy` cluster on localhost), forked from this one,
which imported TensorFlow, Keras and keras_accum once and runs no
TensorFlow op (`forking.py`). One after the other:

- `uninterrupted`: backups every 2 batches into `FOLDER/reference_backup`;
- `killed`: into `FOLDER/backup`, worker 1 kills itself with SIGKILL after
  batch 3 of epoch 1 (mid-window); worker 0, left waiting for it, is then
  killed too;
- `preempted`: both restarted with `--save-before-preemption`; worker 1
  sends itself SIGTERM as batch 3 of epoch 2 starts (between two
  `save_freq` points): both back up there and
  exit with `BackupAndRestore.PREEMPTION_EXIT_CODE`;
- `resumed`: both restarted, to the end;
- `chief_killed`: into `FOLDER/chief_backup`, worker 0 (the chief, which
  writes the backups) kills itself with SIGKILL after batch 3 of epoch 1;
  worker 1 raises when its collective is aborted (TensorFlow's error once
  the chief's connection drops), or is killed while it waits;
- `chief_resumed`: both restarted, to the end.

Worker `i` of run `r` writes `OUT_FILE` `FOLDER/<r>-<i>.npz` and logs where
it starts in `FOLDER/starts-<i>.jsonl` (the chief's runs: in
`FOLDER/chief_starts-<i>.jsonl`). Prints one JSON line per run: its
name, each worker's exit code (negative: the signal that ended it) and
stderr's end, the backups in the folder after it (`[epoch, batches]` of
each `position.json`), and its duration.
"""

import json
import os
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
# run: (backup folder, options of worker 0, options of worker 1)
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


def backups(folder):
    """`[epoch, batches]` of each complete backup in `folder`."""
    found = []
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        position = os.path.join(folder, entry, "position.json")
        if os.path.exists(position):
            with open(position) as f:
                saved = json.load(f)
            found.append([saved["epoch"], saved["batches"]])
    return found


def main(folder):
    for name, (backup, *options) in RUNS.items():
        start = time.monotonic()
        cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(2)]}
        log = "chief_" if name.startswith("chief") else ""
        pids, stderrs = [], []
        for index in (0, 1):
            argv = [os.path.join(folder, f"{name}-{index}.npz"),
                    os.path.join(folder, backup), *OPTIONS,
                    "--log", os.path.join(folder, f"{log}starts-{index}.jsonl"),
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
            "backups": backups(os.path.join(folder, backup)),
            "seconds": round(time.monotonic() - start, 1),
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
