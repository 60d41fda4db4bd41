"""Generative exactness tests: drawn configurations against the big batch.

Hypothesis draws configurations across the dimensions of the promise (the
mode, the input, the strategy, N, the batch and sample counts, the epochs,
`flush_at_epoch_end`, the loss, the optimizer, `steps_per_execution`; see
`generative.py`) and checks each against the independent reference: plain
`keras.Model`, same initial weights, float64, one update per window on the
window's samples concatenated. The update must agree to a relative 1e-9, and
`optimizer.iterations` must equal the reference's count of windows.

An example is a list of 10 different cases (Hypothesis draws the cases of
one example more diversely than as many examples of one case each). A
failure names the failing case; shrinking simplifies every case of the
list, which can take some minutes.

One-device cases train in this process. The `MirroredStrategy` cases (2
logical CPUs) train in one worker process, started with the module's first
such case and fed one case at a time (tests/distributed/generative_worker.py):
TensorFlow starts once, and shrinking a failure costs cases, not processes.

Found by this test so far: `reduction="sum"` on 2 replicas (pinned below),
and input of unknown length on 2 replicas over 2 epochs across steps (one
update too many per epoch after whole windows; being fixed elsewhere, not
pinned).

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
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

pytestmark = pytest.mark.generative

WORKER = os.path.join(
    os.path.dirname(__file__), "distributed", "generative_worker.py"
)
# Seconds a case may take in the worker (a few, traced once per case).
CASE_TIMEOUT = 300
# Cases per example: the profile's `max_examples` counts cases.
CASES = 10
# The mirrored test runs three times the profile's cases: its space is
# smaller, but a cell of it (an input of unknown length on 2 replicas over
# 2 epochs, across steps, whole windows) is 4 dimensions deep.
MIRRORED_SHARE = 3


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


def _examples(share=1):
    """The examples of a test, `CASES` cases each: `share` times the
    profile's `max_examples` cases."""
    return max(1, share * settings.default.max_examples // CASES)


def _lists(strategy):
    """`CASES` different cases drawn together: more diverse than as many
    examples of one case each, which Hypothesis draws as variations of
    each other."""
    return st.lists(
        generative.cases(strategy=st.just(strategy)),
        min_size=CASES, max_size=CASES,
        unique_by=lambda case: tuple(case.values()),
    )


@settings(max_examples=_examples())
@given(cases=_lists("one_device"))
def test_one_device(cases):
    for case in cases:
        generative.check(case, generative.run_case(case))


# Found by this test: `reduction="sum"` on 2 replicas applied twice the big
# batch's update (both modes; update ratio 2.0, relative difference 1.0).
SUM_ON_REPLICAS = dict(
    strategy="mirrored", mode="across", input="arrays", steps=2, batch=1,
    micro_batch_size=None, samples=1, epochs=1, flush_at_epoch_end=False,
    loss="sum", optimizer="sgd", steps_per_execution=1, seed=0,
)


@settings(max_examples=_examples(MIRRORED_SHARE))
@given(cases=_lists("mirrored"))
@example(cases=[SUM_ON_REPLICAS])
def test_mirrored(cases, mirrored_worker):
    for case in cases:
        result = mirrored_worker.run(case)
        assert result["replicas"] == 2
        generative.check(case, result)
