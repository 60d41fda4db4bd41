"""Shared fixtures: execution modes, float64 policy and the big-batch reference.

Every equivalence test trains two models from the same initial weights on the
same samples in the same order: plain `keras.Model` on batches of `N * B`
(the independent reference) and `GradientAccumulationModel` on micro-batches
of `B` with `gradient_accumulation_steps=N`. The largest relative difference
seen per case is printed in a table at the end of the run. A reference
training is run once per test run and configuration, and shared by the
cases that differ only in how ours trains (`helpers.fit_reference`).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import collections  # noqa: E402
import gc  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck  # noqa: E402
from hypothesis import settings  # noqa: E402

MODES = {
    "eager": dict(run_eagerly=True),
    "graph": dict(run_eagerly=False, jit_compile=False),
    "jit": dict(run_eagerly=False, jit_compile=True),
}

# float64 claims exactness; float32 is held to float tolerance.
RTOL = {"float64": 1e-9, "float32": 1e-5}

_MEASURED = collections.defaultdict(float)


@pytest.fixture(params=list(MODES))
def mode(request):
    """The execution mode: `eager`, `graph` or `jit`."""
    return request.param


@pytest.fixture
def compile_kwargs(mode):
    return dict(MODES[mode])


@pytest.fixture
def in_step():
    """Whether `helpers.fit_side_by_side` trains ours with the micro-batches
    inside the train step (`micro_batch_size`) rather than one per step:
    tests/test_in_step.py overrides it to run tests of other files again
    in that mode."""
    return False


def _set_precision(dtype):
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)


@pytest.fixture(scope="session", autouse=True)
def _freeze_imported_objects():
    """Keeps the objects that exist before the first test (those of the
    modules imported: TensorFlow, Keras, keras-hub, ...; some 400,000) out
    of the garbage collector's scans: `keras.backend.clear_session()`
    collects garbage after every test (`_restore_precision`), and scanning
    them all costs some 0.2 to 0.7 s per test. They live as long as the
    modules anyway."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


# Hypothesis' profiles (tests/test_generative.py). Each example sets its
# own precision and clears its Keras session, so the autouse fixtures above,
# which run once per test, not per example, are no harm to it.
_HYPOTHESIS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    print_blob=True,
)
# The default: the same examples every run, within the suite's budget.
settings.register_profile(
    "ci", max_examples=10, derandomize=True, database=None, **_HYPOTHESIS
)
# `--hypothesis-profile=long`: about an hour's random search on two cores,
# failures kept in `.hypothesis/` and tried first next time.
settings.register_profile("long", max_examples=150, **_HYPOTHESIS)


def pytest_configure(config):
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("ci")
    config.addinivalue_line(
        "markers",
        "generative: a Hypothesis search (tests/test_generative*.py), run "
        "by `python -m pytest -m generative`, CI's second job.",
    )
    config.addinivalue_line(
        "markers",
        "slow: runs whole example scripts or multi-process clusters (a "
        "minute or more of CPU each), run by `python -m pytest -m slow`, "
        "CI's second job.",
    )
    config.addinivalue_line(
        "markers",
        "background(start=...): the test reads child processes that "
        "`start(tmp_path_factory)` starts in the background "
        "(tests/background.py), with the first test.",
    )


# The modules whose every test runs in the main job in every mode (the
# `mode` fixture): the exactness against plain Keras, eagerly, in graph
# mode and under XLA. Elsewhere the main job runs the graph mode, and the
# eager and XLA variants run in the second job (marked `slow` here): a
# feature's logic is the same in the three modes, which test_equivalence.py
# holds to the big batch each, and XLA's compilation on a CPU is what makes
# them slow (a third of the main job's time, measured with --durations=0).
ALL_MODES_IN_MAIN_JOB = {"test_equivalence.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Marks `slow` the eager and XLA variants outside
    `ALL_MODES_IN_MAIN_JOB` (before `-m` selects); then the tests that read
    background runs go last: by then the runs started with the first test
    have ended, and the workers trained other tests meanwhile instead of
    waiting for them."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (
            callspec is not None
            and callspec.params.get("mode") in ("eager", "jit")
            and item.path.name not in ALL_MODES_IN_MAIN_JOB
        ):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: bool(item.get_closest_marker("background")))


@pytest.fixture(scope="session", autouse=True)
def _background_runs(request, tmp_path_factory):
    """Starts, with the first test, the child processes that the
    selected tests read (`background.py`, the `background` mark)."""
    starts = {}
    for item in request.session.items:
        for mark in item.iter_markers("background"):
            starts.setdefault(mark.kwargs["start"], None)
    for start in starts:
        start(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _shared_reference_runs(tmp_path_factory):
    """Has `helpers.fit_reference` keep each reference training for the
    test run, in a folder that every pytest-xdist worker reads."""
    import background
    import helpers

    helpers.REFERENCE_RUNS = background.root(tmp_path_factory) / "references"
    yield
    helpers.REFERENCE_RUNS = None


@pytest.fixture(autouse=True)
def _restore_precision():
    floatx = keras.config.floatx()
    policy = keras.config.dtype_policy()
    gradients = set(_gradient_registry())
    yield
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)
    _forget_custom_gradients(gradients)
    keras.backend.clear_session()


def _gradient_registry():
    """TensorFlow's registry of gradient functions, by op type name."""
    from tensorflow.python.framework import ops

    return ops._gradient_registry._registry


def _forget_custom_gradients(before):
    """Drops the gradient functions that the test's graphs registered.

    Every `tf.custom_gradient` traced in a graph registers a gradient
    function under a new name, and TensorFlow never removes it: each
    traced optimizer update (Keras' gradient all-reduce) registers one
    that holds its whole graph. Left there, the graphs of every test
    would stay alive, and `clear_session()`'s garbage collection would
    scan them all after each later test (0.3 to 0.8 s per test late in a
    run). No graph of an ended test is differentiated again.
    """
    registry = _gradient_registry()
    for name in set(registry) - before:
        if name.startswith("CustomGradient-"):
            del registry[name]


@pytest.fixture
def float64():
    _set_precision("float64")
    return "float64"


@pytest.fixture(params=["float64", "float32"])
def precision(request):
    _set_precision(request.param)
    return request.param


def relative_difference(reference, candidate):
    """max over tensors of max|a - b| / max|a| (the update's relative error)."""
    worst = 0.0
    for a, b in zip(reference, candidate, strict=True):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        scale = max(np.max(np.abs(a)), 1e-30)
        worst = max(worst, float(np.max(np.abs(a - b)) / scale))
    return worst


def update_difference(initial, reference, candidate):
    """Relative difference of the total updates `w_end - w_start`."""
    worst = 0.0
    for w0, a, b in zip(initial, reference, candidate, strict=True):
        da = np.asarray(a, np.float64) - np.asarray(w0, np.float64)
        db = np.asarray(b, np.float64) - np.asarray(w0, np.float64)
        scale = max(np.max(np.abs(da)), 1e-30)
        worst = max(worst, float(np.max(np.abs(da - db)) / scale))
    return worst


def record(case, value):
    """Keeps the largest relative difference measured for `case`."""
    _MEASURED[case] = max(_MEASURED[case], value)
    _UNREPORTED.append((case, value))


# Under pytest-xdist the measurements travel to the controller with each
# test's report.
_UNREPORTED = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call" and _UNREPORTED:
        outcome.get_result().user_properties.append(
            ("relative_differences", list(_UNREPORTED))
        )
        _UNREPORTED.clear()


def pytest_runtest_logreport(report):
    for name, values in report.user_properties:
        if name == "relative_differences":
            for case, value in values:
                _MEASURED[case] = max(_MEASURED[case], value)


def assert_close_to_reference(case, initial, reference, candidate, rtol):
    """Asserts the updates agree to `rtol`, relative to the update's size."""
    assert len(reference) == len(candidate)
    diff = update_difference(initial, reference, candidate)
    record(case, diff)
    assert diff <= rtol, f"{case}: relative update difference {diff:.3g}"
    return diff


def pytest_terminal_summary(terminalreporter):
    if not _MEASURED:
        return
    terminalreporter.write_sep("-", "largest relative update difference")
    terminalreporter.write_line(f"| {'case':<58} | {'max rel. diff':>13} |")
    terminalreporter.write_line(f"|{'-' * 60}|{'-' * 15}|")
    for case in sorted(_MEASURED):
        terminalreporter.write_line(
            f"| {case:<58} | {_MEASURED[case]:>13.3g} |"
        )
