"""N that changes during training, and the updates that `fit()` reports.

The reference is plain `keras.Model` (float64) taking one `train_on_batch`
per window on the big batch of the window's samples, in the same order.
"""

import keras
import numpy as np
import pytest
from conftest import RTOL
from conftest import assert_close_to_reference
from helpers import masked_mean_rtol
from helpers import segmentation_data
from helpers import segmentation_net
from helpers import twins

import keras_accum
from keras_accum.callbacks import GradientAccumulationScheduler

MICRO_BATCH = 2
# The loss is a mean over the pixels not ignored.
RTOL_MASKED = masked_mean_rtol(RTOL["float64"])


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=255
    )


def _reference_windows(reference, x, y, windows, compile_kwargs):
    """Plain Keras, one update per window; `windows`: micro-batches each."""
    reference.compile(
        optimizer=keras.optimizers.Adam(0.02), loss=_loss(), **compile_kwargs
    )
    start = 0
    for count in windows:
        stop = start + count * MICRO_BATCH
        reference.train_on_batch(x[start:stop], y[start:stop])
        start = stop
    assert start == len(x)


class TraceCounter(keras_accum.GradientAccumulationModel):
    """Counts the traces of its train step (Python runs once per trace)."""

    traces = 0

    def train_step(self, data):
        TraceCounter.traces += 1
        return super().train_step(data)


def test_steps_change_at_epoch_boundaries(mode, compile_kwargs, float64):
    # 12 micro-batches of 2 per epoch: N = 2, 3, then 4.
    x, y = segmentation_data(n=24)
    reference, ours = twins(segmentation_net, 2)
    initial = [np.array(w) for w in reference.get_weights()]
    ours.compile(
        optimizer=keras.optimizers.Adam(0.02), loss=_loss(), **compile_kwargs
    )
    history = ours.fit(
        x, y, batch_size=MICRO_BATCH, epochs=3, shuffle=False, verbose=0,
        callbacks=[GradientAccumulationScheduler({1: 3, 2: 4})],
    )
    _reference_windows(
        reference,
        np.concatenate([x] * 3),
        np.concatenate([y] * 3),
        [2] * 6 + [3] * 4 + [4] * 3,
        compile_kwargs,
    )
    assert history.history["updates"] == [6, 10, 13]
    assert ours.gradient_accumulation_steps == 4
    assert_close_to_reference(
        f"N changed at epoch boundaries ({mode})",
        initial, reference.get_weights(), ours.get_weights(), RTOL_MASKED,
    )


def test_change_mid_window_never_splits_it(mode, compile_kwargs, float64):
    # 6 micro-batches per epoch, windows carried over: N = 4 leaves 2
    # pending at the end of epoch 0; set to 2 then, that window still
    # takes 4 micro-batches, and the next ones take 2.
    x, y = segmentation_data(n=12)
    reference, ours = twins(segmentation_net, 4, flush_at_epoch_end=False)
    initial = [np.array(w) for w in reference.get_weights()]
    ours.compile(
        optimizer=keras.optimizers.Adam(0.02), loss=_loss(), **compile_kwargs
    )
    ours.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
    # `fit()` ended, so its last window was applied: 4 + 2.
    assert int(ours.optimizer.iterations) == 2
    ours.fit(
        x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0,
        callbacks=[GradientAccumulationScheduler({1: 2})],
    )
    _reference_windows(
        reference,
        np.concatenate([x] * 3),
        np.concatenate([y] * 3),
        [4, 2] + [4, 4] + [2, 2],
        compile_kwargs,
    )
    assert_close_to_reference(
        f"N changed inside a carried-over window ({mode})",
        initial, reference.get_weights(), ours.get_weights(), RTOL_MASKED,
    )


@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_values_above_one_share_one_trace(mode, compile_kwargs):
    x, y = segmentation_data(n=16)
    TraceCounter.traces = 0
    model = TraceCounter(
        *segmentation_net(), gradient_accumulation_steps=2
    )
    model.compile(optimizer="sgd", loss=_loss(), **compile_kwargs)
    for steps in (2, 4, 8, 2):
        model.gradient_accumulation_steps = steps
        model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert TraceCounter.traces == 1
    assert int(model.optimizer.iterations) == 4 + 2 + 1 + 4


def test_from_one_to_more_traces_once_more(compile_kwargs, float64):
    # N = 1 has no buffers; the first N > 1 creates them (one new trace).
    x, y = segmentation_data(n=16)
    TraceCounter.traces = 0
    keras.utils.set_random_seed(0)
    reference = keras.Model(*segmentation_net())
    model = TraceCounter(*segmentation_net())
    model.set_weights(reference.get_weights())
    initial = [np.array(w) for w in reference.get_weights()]
    model.compile(
        optimizer=keras.optimizers.Adam(0.02), loss=_loss(), **compile_kwargs
    )
    scheduler = GradientAccumulationScheduler({1: 4, 2: 2, 3: 1})
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=4, shuffle=False,
              verbose=0, callbacks=[scheduler])
    _reference_windows(
        reference, np.concatenate([x] * 4), np.concatenate([y] * 4),
        [1] * 8 + [4] * 2 + [2] * 4 + [1] * 8, compile_kwargs,
    )
    if not compile_kwargs["run_eagerly"]:
        assert TraceCounter.traces == 2
    assert_close_to_reference(
        "N changed from 1 to 4, 2 and back to 1",
        initial, reference.get_weights(), model.get_weights(), RTOL_MASKED,
    )


def test_steps_saved_with_the_window(tmp_path, float64):
    # Saved while a window of N = 4 is pending and N = 2 is set for the
    # next ones: the loaded model finishes the window with 4.
    x, y = segmentation_data(n=12)
    reference, ours = twins(segmentation_net, 4, flush_at_epoch_end=False)
    initial = [np.array(w) for w in reference.get_weights()]
    ours.compile(optimizer=keras.optimizers.Adam(0.02), loss=_loss())
    for start in (0, 2):  # no callbacks: the window stays pending
        ours.train_on_batch(x[start : start + 2], y[start : start + 2])
    assert int(ours.micro_step) == 2
    ours.gradient_accumulation_steps = 2
    path = str(tmp_path / "model.keras")
    ours.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.gradient_accumulation_steps == 2
    loaded.fit(x[4:], y[4:], batch_size=MICRO_BATCH, verbose=0, shuffle=False)
    _reference_windows(reference, x, y, [4, 2], {})
    assert_close_to_reference(
        "N changed, saved and loaded mid-window",
        initial, reference.get_weights(), loaded.get_weights(), RTOL_MASKED,
    )


def test_updates_logged_only_when_accumulating():
    x, y = segmentation_data(n=16)
    keras.utils.set_random_seed(0)
    histories = {}
    for name, model in (
        ("plain", keras.Model(*segmentation_net())),
        ("n1", keras_accum.GradientAccumulationModel(*segmentation_net())),
        (
            "n4",
            keras_accum.GradientAccumulationModel(
                *segmentation_net(), gradient_accumulation_steps=4
            ),
        ),
    ):
        model.compile(optimizer="sgd", loss=_loss(), metrics=["accuracy"])
        histories[name] = model.fit(
            x, y, batch_size=3, epochs=2, verbose=0,
            validation_data=(x[:4], y[:4]),
        ).history
    # N = 1 logs exactly what `keras.Model` logs.
    assert sorted(histories["n1"]) == sorted(histories["plain"])
    assert "updates" not in histories["n1"]
    # 6 micro-batches per epoch (the last one short): 2 updates per epoch,
    # the partial second window included.
    assert histories["n4"]["updates"] == [2, 4]
    assert sorted(histories["n4"]) == sorted([*histories["plain"], "updates"])


def test_start_line(capsys):
    x, y = segmentation_data(n=16)
    model = keras_accum.GradientAccumulationModel(
        *segmentation_net(), gradient_accumulation_steps=4
    )
    model.compile(optimizer="sgd", loss=_loss())
    model.fit(x, y, batch_size=2, verbose=2)
    out = capsys.readouterr().out
    assert (
        "Gradient accumulation: 4 micro-batches of 2 samples per update = an "
        "effective batch of 8; 2 updates per epoch of 8 micro-batches."
    ) in out
    model.fit(x, y, batch_size=2, verbose=0)
    assert "Gradient accumulation" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "schedule",
    [{}, [2, 4], {-1: 2}, {0: 0}, {0: 2.5}, {"1": 2}, {0: True}],
    ids=["empty", "list", "negative_epoch", "zero", "float", "str", "bool"],
)
def test_scheduler_rejects_bad_schedules(schedule):
    with pytest.raises(ValueError, match="schedule"):
        GradientAccumulationScheduler(schedule)


def test_scheduler_needs_our_model():
    x, y = segmentation_data(n=4)
    model = keras.Model(*segmentation_net())
    model.compile(optimizer="sgd", loss=_loss())
    with pytest.raises(ValueError, match="GradientAccumulationModel"):
        model.fit(x, y, verbose=0,
                  callbacks=[GradientAccumulationScheduler({0: 2})])


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True, None])
def test_setter_rejects_bad_values(value):
    model = keras_accum.GradientAccumulationModel(
        *segmentation_net(), gradient_accumulation_steps=4
    )
    with pytest.raises(ValueError, match="`gradient_accumulation_steps` must"):
        model.gradient_accumulation_steps = value
    assert model.gradient_accumulation_steps == 4


def test_schedule_beyond_the_counter_is_refused_at_construction():
    from keras_accum.callbacks import GradientAccumulationScheduler

    with pytest.raises(
        ValueError,
        match=r"from 1 to 2\*\*63 - 1 .*Received: "
        r"schedule=\{0: 2, 1: 18446744073709551616\}",
    ):
        GradientAccumulationScheduler({0: 2, 1: 2**64})
