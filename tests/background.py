"""Child processes that start ahead of the tests that read them.

Some tests read what scripts do in processes of their own: a CPU memory
limit must be set before TensorFlow starts, logical devices and clusters
must not leak into other tests, a run killed with SIGKILL takes its
process with it. Such a run starts once per test run, in the
background, with the first test (a test that reads one carries
the `background(start=...)` mark, see conftest.py), and goes on while the
workers run other tests; the tests that read it find it ended, or wait for
its end. The small-memory runs spend most of their time waiting: each
out-of-memory error costs about 10 s, the time TensorFlow's BFC allocator
waits for memory to be freed before it gives up (a constant of the
allocator, `kMaxMillisToWait`, with no option to change it); in the
background, those waits overlap with each other and with other tests.

`start()` starts a run once per test run: under pytest-xdist, the worker
that asks first starts it (the runs' folder is shared by the workers) and
the other one finds it started. `Run.wait()` waits for its end, from any
worker. Each run is stopped after `timeout` seconds, and its output and
exit status are kept in its folder.
"""

import os
import pathlib
import subprocess
import time
import types

# Keeps this process's children referenced (their status is read from
# their folder, whichever worker reads it).
_STARTED = []

# Runs the command with its output and exit status in the folder given as
# the first argument; the status file appears whole, when the run has ended.
_SHELL = (
    'folder=$1; limit=$2; shift 2; '
    'timeout -k 10 "$limit" "$@" > "$folder/stdout" 2> "$folder/stderr"; '
    'echo $? > "$folder/returncode.part" && '
    'mv "$folder/returncode.part" "$folder/returncode"'
)


def root(tmp_path_factory):
    """This test run's folder for runs, the same for all xdist workers."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # `<run>/popen-gw0` -> `<run>`
    folder = base / "background_runs"
    folder.mkdir(exist_ok=True)
    return folder


class Run:
    """A run started by `start()`, in this worker or another one."""

    def __init__(self, folder, timeout):
        self.folder = pathlib.Path(folder)
        self.timeout = timeout

    def wait(self):
        """Waits for the run's end; returns its `returncode`, `stdout` and
        `stderr` (as `subprocess.run()` does)."""
        status = self.folder / "returncode"
        deadline = time.monotonic() + self.timeout + 60
        while not status.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.folder} did not end")
            time.sleep(0.2)
        code = int(status.read_text())
        # `timeout` answers 124 for a run it stopped.
        assert code != 124, f"{self.folder}: stopped after {self.timeout} s"
        return types.SimpleNamespace(
            returncode=code,
            stdout=(self.folder / "stdout").read_text(),
            stderr=(self.folder / "stderr").read_text(),
        )


def start(tmp_path_factory, name, command, env, timeout=600):
    """Starts `command` in the background, unless a run `name` was started
    already in this test run; returns the `Run`.

    `command`: a list, or a function of the run's folder (where the run
    may write its files) that returns the list.
    """
    folder = root(tmp_path_factory) / name
    try:
        folder.mkdir()
    except FileExistsError:  # Started by the other worker, or earlier.
        return Run(folder, timeout)
    if callable(command):
        command = command(folder)
    _STARTED.append(
        subprocess.Popen(
            ["sh", "-c", _SHELL, "sh", str(folder), str(timeout), *command],
            env=env, stdin=subprocess.DEVNULL,
        )
    )
    return Run(folder, timeout)
