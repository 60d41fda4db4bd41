"""One train path: Keras' own step for N = 1, files of the earlier window
format, the `updates` count in the progress bar, models built functionally
from several threads."""

import contextlib
import io
import re
import sys
import threading

import h5py
import keras
import numpy as np
import pytest
from conftest import RTOL
from conftest import assert_close_to_reference
from helpers import classification_data
from helpers import dense_net
from helpers import keras_version
from helpers import twins

import keras_accum

N, B = 4, 3


def test_one_step_is_keras_own_step_without_buffers(mode, compile_kwargs):
    x, y = classification_data(n=12)
    reference, ours = twins(dense_net, steps=1)
    for model in (reference, ours):
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      **compile_kwargs)
    ref_history = reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    history = ours.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    for a, b in zip(reference.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert history.history == ref_history.history
    state = ours.gradient_accumulator.state()
    assert not [name for name in state if name.startswith("buffer_")]


def _zero_steps_in_window(path):
    """Writes the window as files did before `steps_in_window` counted the
    train steps of the cross-step mode (it stayed 0 there)."""
    found = []

    def visit(name, item):
        if isinstance(item, h5py.Dataset) and "steps_in_window" in name:
            found.append(name)

    with h5py.File(path, "r+") as f:
        f.visititems(visit)
        for name in found:
            f[name][...] = 0
    return found


def test_window_of_the_earlier_format_completes_after_its_n(float64, tmp_path):
    x, y = classification_data(n=N * B)
    reference, ours = twins(dense_net, steps=N)
    _, fresh = twins(dense_net, steps=N)
    initial = [np.array(w) for w in reference.get_weights()]
    for model in (reference, ours, fresh):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    for k in range(3):  # three micro-batches of the window pending
        ours.train_on_batch(x[k * B : (k + 1) * B], y[k * B : (k + 1) * B])
    assert int(ours.micro_step) == 3
    path = str(tmp_path / "window.weights.h5")
    ours.save_weights(path)
    assert _zero_steps_in_window(path)
    fresh.load_weights(path)
    assert int(fresh.micro_step) == 3
    fresh.train_on_batch(x[3 * B :], y[3 * B :])
    reference.train_on_batch(x, y)
    assert int(fresh.optimizer.iterations) == 1
    assert int(fresh.micro_step) == 0
    assert_close_to_reference(
        "window of the earlier file format", initial,
        reference.get_weights(), fresh.get_weights(), RTOL["float64"],
    )


@pytest.mark.parametrize("verbose", [1, 2])
def test_progress_bar_shows_updates_as_an_integer(verbose):
    x, y = classification_data(n=8 * B)
    model = keras_accum.GradientAccumulationModel(
        *dense_net(), gradient_accumulation_steps=N
    )
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        history = model.fit(x, y, batch_size=B, epochs=2, verbose=verbose)
    text = output.getvalue()
    if keras_version() < (3, 12):
        # Keras 3.11's bar converts every value to a float; the count is
        # still the last step's, not an average over the epoch.
        assert "updates: 2.0000" in text and "updates: 4.0000" in text, text
    else:
        assert re.search(r"updates: 2\b(?!\.)", text), text
        assert re.search(r"updates: 4\b(?!\.)", text), text
        assert "updates: 2.0" not in text
    assert history.history["updates"] == [2, 4]


def _built_functionally_class():
    """A fresh subclass whose `__init__` builds a functional graph (as a
    keras-hub task's does)."""

    class BuiltFunctionally(keras_accum.GradientAccumulationModel):
        def __init__(self, **kwargs):
            inputs = keras.Input((3,))
            outputs = keras.layers.Dense(2)(inputs)
            super().__init__(inputs, outputs, **kwargs)

    return BuiltFunctionally


@pytest.mark.parametrize("attempt", range(5))
def test_models_built_functionally_in_threads_rewrite_no_class(attempt):
    built_functionally = _built_functionally_class()
    bases = (
        built_functionally.__bases__,
        keras_accum.GradientAccumulationModel.__bases__,
    )
    models, errors = [], []
    start = threading.Barrier(8)

    def build():
        try:
            start.wait()
            for _ in range(3):
                models.append(built_functionally(gradient_accumulation_steps=2))
                models.append(keras.Model(*dense_net()))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    # Threads switch often, so that two first builds of a class race.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=build) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert not errors
    assert len(models) == 48
    functional = keras.src.models.functional.Functional
    for model in models:
        assert isinstance(model, functional)
    ours = [m for m in models if isinstance(m, built_functionally)]
    assert len(ours) == 24
    assert len({type(m) for m in ours}) == 1, "one class made per base class"
    assert (
        built_functionally.__bases__,
        keras_accum.GradientAccumulationModel.__bases__,
    ) == bases
    # Plain models built afterwards are Keras' own.
    assert type(keras.Model(*dense_net())) is functional
