"""Runs `train.py` again and again, each run a process of its own.

Usage: python restarts.py RUNS_JSON
       python restarts.py --serve

RUNS_JSON: `{group: [argv, ...]}`, argument lists of `train.py` by group
(their `OUT_FILE`'s folder is made if missing). This process imports
TensorFlow, Keras and keras_accum once, runs no TensorFlow op, and forks a
child for each run, one after the other: every run starts as a fresh
process with these modules imported (without paying for the imports
again), trains, and ends or kills itself with SIGKILL as `train.py` does.
Prints one JSON line per run: its group, its exit code (negative: the
signal that ended it), whether its output file exists after it, and its
stderr. With `--serve`, it reads one RUNS_JSON per line of its stdin, runs
it, and prints `{"done": true}` after its runs' lines, until stdin ends.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(__file__)))

import forking  # noqa: E402
import train  # noqa: E402


def run(argv):
    """`train.main(argv)` in a forked child; returns its exit code and
    stderr."""
    with tempfile.NamedTemporaryFile("r") as stderr:
        code = forking.wait(
            forking.fork(lambda: train.main(argv), stderr.name)
        )
        return code, stderr.read()


def main(groups):
    for group, runs in groups.items():
        for argv in runs:
            os.makedirs(os.path.dirname(argv[0]), exist_ok=True)
            code, stderr = run(argv)
            print(json.dumps({
                "group": group,
                "returncode": code,
                "out_exists": os.path.exists(argv[0]),
                "stderr": stderr[-3000:],
            }), flush=True)


def serve():
    for line in sys.stdin:
        main(json.loads(line))
        print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        main(json.loads(sys.argv[1]))
