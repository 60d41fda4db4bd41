"""Generative exactness tests: drawn configurations against the big batch.

Hypothesis draws configurations across the dimensions of the promise (the
mode, the input, the strategy, N, the batch and sample counts, the epochs,
`flush_at_epoch_end`, the loss, the optimizer, `steps_per_execution`; see
`generative.py`) and checks each against the independent reference: plain
`keras.Model`, same initial weights, float64, one update per window on the
window's samples concatenated. The update must agree to a relative 1e-9, and
`optimizer.iterations` must equal the reference's count of windows.

One-device cases train in this process. The `MirroredStrategy` cases (2
logical CPUs) train in one worker process, started with the module's first
such case and fed one case at a time (tests/distributed/generative_worker.py):
TensorFlow starts once, and shrinking a failure costs a case, not a process.

The profiles are in conftest.py: `ci` (the default: derandomized, a fixed
small number of examples) and `long` (`--hypothesis-profile=long`, an hour's
search); see CONTRIBUTING.md.
"""

import json
import os
import select
import subprocess
import sys
import tempfile

import generative
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

WORKER = os.path.join(
    os.path.dirname(__file__), "distributed", "generative_worker.py"
)
# Seconds a case may take in the worker (a few, traced once per case).
CASE_TIMEOUT = 300
# The mirrored test's examples, as a share of the profile's `max_examples`:
# a mirrored case costs about as much as a one-device one, plus the worker's
# start once.
MIRRORED_SHARE = 1.0


class MirroredWorker:
    """The worker process under `MirroredStrategy`, started on first use
    (again after it died)."""

    def __init__(self):
        self.process = None
        self.stderr = None

    def run(self, case):
        """`generative.run_case(case, strategy)` in the worker."""
        if self.process is None or self.process.poll() is not None:
            self._start()
        self.process.stdin.write(json.dumps(case) + "\n")
        self.process.stdin.flush()
        line = self._line("RESULT ")
        return json.loads(line[len("RESULT "):])

    def _start(self):
        self.close()
        self.stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        env.pop("TF_CONFIG", None)
        self.process = subprocess.Popen(
            [sys.executable, WORKER], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1,
            env=env,
        )
        self._line("READY")

    def _line(self, prefix):
        """The worker's next line that starts with `prefix`."""
        stdout = self.process.stdout
        while True:
            ready, _, _ = select.select([stdout], [], [], CASE_TIMEOUT)
            line = stdout.readline() if ready else ""
            if line.startswith(prefix):
                return line
            if not line:  # ended or stuck
                self.process.kill()
                self.process.wait()
                self.stderr.seek(0)
                raise RuntimeError(
                    f"the worker gave no {prefix.strip()} line "
                    f"(exit status {self.process.returncode}):\n"
                    + self.stderr.read()[-3000:]
                )

    def close(self):
        if self.process is not None:
            if self.process.poll() is None:
                self.process.stdin.close()
                try:
                    self.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None


@pytest.fixture(scope="module")
def mirrored_worker():
    worker = MirroredWorker()
    yield worker
    worker.close()


@given(case=generative.cases(strategy=st.just("one_device")))
def test_one_device(case):
    generative.check(case, generative.run_case(case))


@settings(
    max_examples=max(1, int(settings.default.max_examples * MIRRORED_SHARE))
)
@given(case=generative.cases(strategy=st.just("mirrored")))
def test_mirrored(case, mirrored_worker):
    result = mirrored_worker.run(case)
    assert result["replicas"] == 2
    generative.check(case, result)
