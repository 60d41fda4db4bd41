"""Micro-batches inside the train step (`micro_batch_size`, issue #16).

The exactness tests of the cross-step mode run again here with the
micro-batches inside the step (the `in_step` fixture, overridden here), in
float64: ours trains on batches of `N * B` (or of `N * B / 2`, two steps per
window) split into micro-batches of `B`, against plain `keras.Model` on
batches of `N * B`, and checks that its first layer saw `B` rows at most in
training. (The optimizer-feature counting and `IndexedSlices`-with-Adam
cases add no path of their own.) Below them, what is specific to the mode.
"""

import contextlib

import helpers
import keras
import numpy as np
import pytest
import tensorflow as tf
import test_equivalence
from conftest import RTOL
from conftest import assert_close_to_reference
from conftest import record
from conftest import relative_difference
from helpers import classification_data
from helpers import dense_net
from helpers import import_keras_hub
from helpers import masked_mean_rtol
from helpers import twins
from test_batch_norm import _fit as bn_fit
from test_batch_norm import _moving
from test_batch_norm import _regression_data
from test_batch_norm import bn_on_input
from test_distribute import mirrored_results
from test_distribute import start_background_runs
from test_equivalence import scce
from test_equivalence import test_ignore_class  # noqa: F401
from test_equivalence import test_keras_mask_on_predictions  # noqa: F401
from test_equivalence import test_multi_output_loss_weights_and_regularisers  # noqa: F401
from test_equivalence import test_one_step_trains_exactly_like_keras_model  # noqa: F401
from test_equivalence import test_sample_weight  # noqa: F401
from test_equivalence import test_short_last_micro_batch_and_window  # noqa: F401
from test_equivalence import test_steps_per_execution_validation_evaluate_predict  # noqa: F401
from test_equivalence import test_sum_reduction  # noqa: F401
from test_gradients import test_indexed_slices_from_embedding  # noqa: F401
from test_gradients import test_none_gradients_for_unused_variables  # noqa: F401
from test_mixed_precision import MIXED_UPDATE_RTOL
from test_mixed_precision import _data as mp_data
from test_mixed_precision import _loss as mp_loss
from test_mixed_precision import _sgd as mp_sgd
from test_mixed_precision import conv_net

import keras_accum


@pytest.fixture
def in_step():
    """The tests imported above run with the micro-batches inside the train
    step (`helpers.fit_side_by_side`)."""
    return True


@pytest.fixture
def precision(float64):
    """float64 only: float32 adds no path of its own here."""
    return float64


def test_default_reduction(precision, mode, compile_kwargs, in_step):
    """With AdamW (the optimizer adds no path of its own here)."""
    test_equivalence.test_default_reduction(
        "adamw", precision, mode, compile_kwargs, in_step
    )


@pytest.mark.background(start=start_background_runs)
@pytest.mark.parametrize("case", ["masked", "batchnorm"])
def test_mirrored_strategy(case, tmp_path_factory):
    """Two replicas, each splitting its half of every batch of 12 into
    micro-batches of 2 (the last batch: 6, so 2 + 1 per replica). The
    case `CASE:in_step` of tests/test_distribute.py's process under
    `MirroredStrategy` (`MIRRORED_RUN`, in the background)."""
    result = mirrored_results(tmp_path_factory)[f"{case}:in_step"]
    rtol = masked_mean_rtol(1e-9) if case == "masked" else 1e-9
    assert result["relative_update_difference"] <= rtol, result
    assert result["iterations"] == result["reference_iterations"] == 6
    if case == "batchnorm":
        assert result["moving_statistics"] == 6
        assert result["moving_statistics_difference"] <= 1e-9, result
        # A `synchronized=True` layer would all-reduce inside the loop.
        assert result["synchronized_refused"] is True
    # Every step is a window, with the reductions of one update and none
    # per micro-batch.
    per_update = 2 + (2 if case == "batchnorm" else 0)
    assert [d for _, d in result["reductions_per_step"]] == [per_update] * 6
    assert all(applied for applied, _ in result["reductions_per_step"])


def test_batch_norm_moving_statistics(float64, mode, compile_kwargs):
    """Moved once per update from all micro-batches of the step (76
    samples in batches of 32, micro-batches of 8: the last batch 8 + 4)."""
    x, y = _regression_data(76)
    keras.utils.set_random_seed(0)
    reference = keras.Model(*bn_on_input())
    ours = keras_accum.GradientAccumulationModel(
        *bn_on_input(), micro_batch_size=8
    )
    ours.set_weights(reference.get_weights())
    bn_fit(reference, x, y, 32, compile_kwargs, epochs=2)
    bn_fit(ours, x, y, 32, compile_kwargs, epochs=2)
    assert int(ours.optimizer.iterations) == 6
    diff = relative_difference(_moving(reference), _moving(ours))
    record(f"in-step: BN moving statistics, {mode}", diff)
    assert diff <= 1e-9


def _mixed_precision_models(**kwargs):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    reference = keras.Model(*conv_net())
    ours = keras_accum.GradientAccumulationModel(
        *conv_net(), micro_batch_size=4, **kwargs
    )
    ours.set_weights(reference.get_weights())
    return reference, ours


@pytest.mark.parametrize("bad", [0, 2])
def test_overflow_skips_the_step(bad, mode, compile_kwargs):
    """Micro-batch `bad` of the first batch of 12 overflows in float16."""
    x, y = mp_data(24)
    x[bad * 4 : (bad + 1) * 4] *= 1e6
    reference, ours = _mixed_precision_models()
    ours.compile(optimizer=mp_sgd(), loss=mp_loss(), **compile_kwargs)
    initial = [np.array(w) for w in ours.get_weights()]
    ours.fit(x[:12], y[:12], batch_size=12, shuffle=False, verbose=0)
    for a, b in zip(initial, ours.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(ours.optimizer.iterations) == 0
    assert float(ours.optimizer.dynamic_scale) == 2.0**14  # halved once
    assert int(ours.skipped_windows) == 1
    # The next batch trains: it equals the big batch of its samples.
    ours.fit(x[12:], y[12:], batch_size=12, shuffle=False, verbose=0)
    reference.compile(optimizer=mp_sgd(), loss=mp_loss())
    reference.fit(x[12:], y[12:], batch_size=12, shuffle=False, verbose=0)
    assert_close_to_reference(
        "in-step: overflow, the step after a skipped one", initial,
        reference.get_weights(), ours.get_weights(), MIXED_UPDATE_RTOL,
    )


def test_drop_micro_batch_policy(mode, compile_kwargs):
    """Micro-batch 1 of the second batch overflows: only it is dropped."""
    x, y = mp_data(24)
    x[16:20] *= 1e6
    reference, ours = _mixed_precision_models(
        non_finite_policy="drop_micro_batch"
    )
    initial = [np.array(w) for w in ours.get_weights()]
    ours.compile(optimizer=mp_sgd(), loss=mp_loss(), **compile_kwargs)
    ours.fit(x, y, batch_size=12, shuffle=False, verbose=0)
    reference.compile(optimizer=mp_sgd(), loss=mp_loss())
    reference.train_on_batch(x[:12], y[:12])
    keep = np.r_[12:16, 20:24]
    reference.train_on_batch(x[keep], y[keep])
    assert int(ours.optimizer.iterations) == 2
    assert int(ours.gradient_accumulator.dropped_micro_batches) == 1
    # Halved at the overflow: the micro-batch after it used the new scale.
    assert float(ours.optimizer.dynamic_scale) == 2.0**14
    assert_close_to_reference(
        "in-step: drop_micro_batch", initial,
        reference.get_weights(), ours.get_weights(), MIXED_UPDATE_RTOL,
    )


@pytest.mark.parametrize("path", ["keras", "weights_h5", "checkpoint"])
def test_pending_window_saved_and_loaded(path, float64, tmp_path):
    """Two steps per window, saved by a callback after the first step (3
    micro-batches pending); loaded, the second step completes the window as
    the big batch of both."""
    x, y = classification_data(n=24)
    reference, ours = twins(dense_net, steps=2, micro_batch_size=5)
    _, fresh = twins(dense_net, steps=2, micro_batch_size=5)
    initial = [np.array(w) for w in reference.get_weights()]
    for model in (reference, ours, fresh):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=scce())
    target = str(tmp_path / "pending")
    pending = []

    def save(batch, logs):
        if batch == 0:
            pending.append(int(ours.micro_step))
            if path == "keras":
                ours.save(target + ".keras")
            elif path == "weights_h5":
                ours.save_weights(target + ".weights.h5")
            else:
                tf.train.Checkpoint(
                    model=ours, optimizer=ours.optimizer
                ).write(target)

    ours.fit(
        x[:12], y[:12], batch_size=12, verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=save)],
    )
    assert pending == [3]
    if path == "keras":
        loaded = keras.saving.load_model(target + ".keras")
        assert loaded.micro_batch_size == 5
        assert loaded.gradient_accumulation_steps == 2
    elif path == "weights_h5":
        loaded = fresh
        loaded.load_weights(target + ".weights.h5")
    else:
        loaded = fresh
        tf.train.Checkpoint(model=loaded, optimizer=loaded.optimizer).read(
            target
        ).expect_partial()
    if path != "checkpoint":  # a checkpoint restores at the first step
        assert int(loaded.micro_step) == 3
    loaded.fit(x[12:], y[12:], batch_size=12, verbose=0)
    reference.fit(x, y, batch_size=24, verbose=0)
    assert int(loaded.optimizer.iterations) == 1
    assert_close_to_reference(
        f"in-step: pending window through {path}", initial,
        reference.get_weights(), loaded.get_weights(), RTOL["float64"],
    )


@pytest.mark.parametrize("source", ["filter", "generator"])
def test_input_of_unknown_length(source, float64, mode, compile_kwargs):
    """Batches of 12, 12 and 6 from a filtered dataset or a generator (no
    length known): micro-batches of 5, one update per batch, as plain
    Keras on the same batches."""
    x, y = classification_data(n=30)
    reference, ours = twins(dense_net, steps=1, micro_batch_size=5)
    initial = [np.array(w) for w in reference.get_weights()]
    for model in (reference, ours):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01), loss=scce(),
            **compile_kwargs,
        )
    reference.fit(x, y, batch_size=12, shuffle=False, verbose=0)
    if source == "filter":
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(12).filter(
            lambda *_: True
        )
    else:
        data = ((x[i : i + 12], y[i : i + 12]) for i in range(0, 30, 12))
    ours.fit(data, verbose=0)
    assert int(ours.optimizer.iterations) == 3
    assert_close_to_reference(
        f"in-step: input of unknown length ({source})", initial,
        reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def _largest_rows_seen(model):
    """A variable that keeps the most rows the model's first trainable
    layer was called with, in any step."""
    layer = next(x for x in model.layers if x.trainable_weights)
    largest = tf.Variable(0, trainable=False)
    call = layer.call

    def watched(inputs, *args, **kwargs):
        largest.assign(tf.maximum(largest, tf.shape(inputs)[0]))
        return call(inputs, *args, **kwargs)

    layer.call = watched
    return largest


@pytest.mark.parametrize("source", ["arrays", "filter"])
def test_evaluate_and_predict_in_micro_batches(
    source, float64, mode, compile_kwargs
):
    """Evaluation and prediction split their batches as training does (a
    batch that the device holds only in micro-batches is validated too):
    batches of 12, 12 and 6 in micro-batches of 5, a masked mean with
    sample weights (its micro-batches weighted by their weight of valid
    pixels). Loss, metric and predictions equal plain Keras' on the whole
    batches; the first layer saw 5 rows at most, in every step."""
    x, y = helpers.segmentation_data(n=30)
    weights = np.random.default_rng(3).uniform(0.2, 2.0, size=(30, 8, 8))
    reference, ours = twins(
        helpers.segmentation_net, steps=1, micro_batch_size=5
    )
    largest = _largest_rows_seen(ours)
    for model in (reference, ours):
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, ignore_class=255
            ),
            metrics=["sparse_categorical_accuracy"],
            **compile_kwargs,
        )
    if source == "arrays":
        data = dict(x=x, y=y, sample_weight=weights, batch_size=12)
        inputs = dict(x=x, batch_size=12)
    else:
        data = dict(x=tf.data.Dataset.from_tensor_slices(
            (x, y, weights)
        ).batch(12).filter(lambda *_: True))
        inputs = dict(x=tf.data.Dataset.from_tensor_slices(x).batch(12))
    expected = reference.evaluate(**data, verbose=0, return_dict=True)
    got = ours.evaluate(**data, verbose=0, return_dict=True)
    assert set(got) == set(expected)
    rtol = masked_mean_rtol(RTOL["float64"])
    for key, value in expected.items():
        record(f"in-step: evaluate ({source}), {key}",
               abs(got[key] - value) / abs(value))
        np.testing.assert_allclose(got[key], value, rtol=rtol)
    predicted = ours.predict(**inputs, verbose=0)
    assert predicted.shape == (30, 8, 8, 3)
    np.testing.assert_allclose(
        predicted, reference.predict(**inputs, verbose=0), rtol=1e-12
    )
    assert int(largest.numpy()) == 5


def test_restored_model_evaluates_and_predicts_in_micro_batches(
    float64, tmp_path
):
    """Trained, saved to `.keras`, loaded, and evaluated and asked to
    predict before any `fit()`: in micro-batches of 5 (its saved size),
    as plain Keras with the same weights on the whole batches."""
    x, y = classification_data(n=30)
    reference, ours = twins(dense_net, steps=2, micro_batch_size=5)
    for model in (reference, ours):
        model.compile(optimizer="adam", loss=scce(), metrics=["accuracy"])
    ours.fit(x[:10], y[:10], batch_size=10, verbose=0)
    ours.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.micro_batch_size == 5
    largest = _largest_rows_seen(loaded)
    reference.set_weights(loaded.get_weights())
    expected = reference.evaluate(x, y, batch_size=12, verbose=0)
    np.testing.assert_allclose(
        loaded.evaluate(x, y, batch_size=12, verbose=0), expected, rtol=1e-12
    )
    np.testing.assert_allclose(
        loaded.predict(x, batch_size=12, verbose=0),
        reference.predict(x, batch_size=12, verbose=0),
        rtol=1e-12,
    )
    assert int(largest.numpy()) == 5


@pytest.mark.parametrize("source", ["arrays", "filter"])
# Its masked and weighted terms: the warning that the update is
# approximate is expected (test_keras_hub's RetinaNet asserts it).
@pytest.mark.filterwarnings("ignore:GradientAccumulationModel. the model's loss")
def test_per_output_losses_are_the_whole_batch_s(
    source, float64, mode, compile_kwargs
):
    """The losses that Keras logs for a model with two outputs (`loss`,
    `cls_loss`, `reg_loss`), batches of 10, 10 and 4 in micro-batches of
    4, as plain Keras logs them for the whole batches: in training and
    validation, and in `evaluate()` with a masked mean (`ignore_class`)
    and a weighted one, whose micro-batches are combined by their
    normalisers. (Trained on unmasked, unweighted terms: with several
    data-dependent normalisers the update itself is approximate, as
    docs/semantics.md says.) The reference runs eagerly, where Keras
    weights each batch's `<output>_loss` by its rows; in graph mode it
    weights a batch of no static size by 1, and on input of unknown length
    counts one call more than there were batches (measured on Keras 3.15:
    a count of 4 for 3 batches)."""
    x, y = classification_data(n=24)
    y_reg = np.sin(x[:, :2])
    masked = y.copy()
    masked[::3] = -1  # ignored
    weights = np.random.default_rng(4).uniform(0.2, 2.0, size=24)

    def build():
        inputs = keras.Input((6,))
        h = keras.layers.Dense(
            5, activation="tanh",
            kernel_regularizer=keras.regularizers.L2(0.05),
        )(inputs)
        return inputs, {
            "cls": keras.layers.Dense(3, name="cls")(h),
            "reg": keras.layers.Dense(2, name="reg")(h),
        }

    def batches(labels, sample_weight=None):
        targets = {"cls": labels, "reg": y_reg}
        if source == "arrays":
            return dict(x=x, y=targets, sample_weight=sample_weight,
                        batch_size=10)
        parts = (x, targets) + (() if sample_weight is None else (sample_weight,))
        return dict(x=tf.data.Dataset.from_tensor_slices(parts).batch(
            10
        ).filter(lambda *_: True))

    reference, ours = twins(build, steps=1, micro_batch_size=4)
    results = []
    for model in (reference, ours):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss={
                "cls": keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, ignore_class=-1
                ),
                "reg": "mse",
            },
            loss_weights={"cls": 1.0, "reg": 0.3},
            **(compile_kwargs if model is ours else dict(run_eagerly=True)),
        )
        history = model.fit(
            **batches(y), epochs=2, shuffle=False, verbose=0,
            validation_data=(x[:14], {"cls": y[:14], "reg": y_reg[:14]}),
            validation_batch_size=10,
        ).history
        with pytest.warns(UserWarning) if model is ours else (
            contextlib.nullcontext()
        ):  # the update's weighting of such terms, warned at the trace
            history["evaluate"] = model.evaluate(
                **batches(masked, weights), verbose=0
            )
        results.append(history)
    expected, got = results
    assert {"cls_loss", "reg_loss", "val_cls_loss", "val_loss"} <= set(got)
    rtol = masked_mean_rtol(RTOL["float64"])
    for key, values in expected.items():
        record(f"in-step: logged {key} ({source})", relative_difference(
            [np.asarray(values)], [np.asarray(got[key])]
        ))
        np.testing.assert_allclose(got[key], values, rtol=rtol, err_msg=key)


def test_one_traced_loop_whatever_the_batch(float64):
    """The micro-batches run in a loop: the forward pass is traced once
    for the full micro-batches (and once for a short last one), however
    many the batch holds; nothing is unrolled."""
    x, y = classification_data(n=64)
    _, ours = twins(dense_net, steps=1, micro_batch_size=4)
    ours.compile(optimizer="sgd", loss=scce())
    traces = []
    call = ours.call

    def counted(*args, **kwargs):
        traces.append(1)
        return call(*args, **kwargs)

    ours.call = counted
    for batch in (8, 64):  # 2 and 16 micro-batches
        traces.clear()
        ours.fit(x, y, batch_size=batch, verbose=0)
        # Symbolic build aside: the loop body, and the short-batch branch.
        assert len(traces) <= 3, (batch, len(traces))


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_invalid_micro_batch_size(value):
    with pytest.raises(
        ValueError,
        match="`micro_batch_size` must be an integer >= 1, 'auto' or None. "
        "Received: micro_batch_size=",
    ):
        keras_accum.GradientAccumulationModel(
            *dense_net(), micro_batch_size=value
        )


def test_start_line_and_logs(capsys):
    x, y = classification_data(n=40)
    _, ours = twins(dense_net, steps=2, micro_batch_size=4)
    ours.compile(optimizer="sgd", loss=scce(), metrics=["accuracy"])
    history = ours.fit(x, y, batch_size=10, epochs=1, verbose=2)
    assert (
        "Gradient accumulation: micro-batches of at most 4 samples inside "
        "each step, 2 steps of 10 samples per update = an effective batch "
        "of 20; 2 updates per epoch of 4 steps." in capsys.readouterr().out
    )
    assert history.history["updates"] == [2]
    # The config round trip keeps it.
    config = ours.get_config()
    assert config["micro_batch_size"] == 4


def test_keras_hub_task(float64):
    """A keras-hub causal LM on its preprocessor's tokens and padding mask:
    batches of 8 texts split in micro-batches of 2 (16, 5, 10 and 3 real
    tokens), the loss a mean over real tokens; against keras-hub's own task
    on the batch. (Raw strings: tests/test_keras_hub.py.)"""
    keras_hub = import_keras_hub()
    from test_keras_hub import _assert_window_equals_big_batch
    from test_keras_hub import _gpt2
    from test_keras_hub import _preprocessor
    from test_keras_hub import _tokens

    def compile_kwargs():
        return dict(
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            ),
        )

    x, y, sample_weight = _tokens()
    reference = _gpt2(with_preprocessor=False)
    ours = keras_accum.GradientAccumulationModel.from_model(
        _gpt2(with_preprocessor=False),
        gradient_accumulation_steps=1,
        micro_batch_size=2,
    )
    initial = [np.array(w) for w in reference.get_weights()]
    for model in (reference, ours):
        model.compile(**compile_kwargs())
        model.fit(x, y, sample_weight=sample_weight, batch_size=8,
                  shuffle=False, verbose=0)
    assert int(ours.optimizer.iterations) == 1
    assert isinstance(ours, keras_hub.models.GPT2CausalLM)
    _assert_window_equals_big_batch(
        "in-step: keras-hub GPT2CausalLM, mean over real tokens",
        initial, reference, ours,
    )
    ours.preprocessor = _preprocessor()  # for `generate()`
    assert isinstance(ours.generate("air", max_length=6), str)


def _xla_compiled_calls(model, batch):
    """Calls in the traced train step that XLA compiles on their own."""
    spec = keras.tree.map_structure(
        lambda t: tf.TensorSpec((None,) + t.shape[1:], t.dtype), batch
    )
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    definition = graph.as_graph_def()
    nodes = list(definition.node) + [
        node
        for function in definition.library.function
        for node in function.node_def
    ]
    return sum(
        node.attr["_XlaMustCompile"].b
        for node in nodes
        if "_XlaMustCompile" in node.attr
    )


def test_jit_on_cpu_compiles_each_micro_batch(float64):
    """With `jit_compile=True` and no accelerator, a model with convolutions
    runs its micro-batch loop outside XLA and each micro-batch inside it
    (XLA's CPU backend compiles convolution gradients inside a loop ~8x
    slower, benchmarks/README.md); a dense model keeps the whole step in
    XLA. Exact either way, against plain Keras on the big batch."""
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("the split is for machines without an accelerator")
    seg_x, seg_y = helpers.segmentation_data(n=24)

    def filtered(x, y):
        # Unknown length and batch size: the short last micro-batch (12 =
        # 5 + 5 + 2) runs after the loop in a `tf.cond`, outside XLA.
        return tf.data.Dataset.from_tensor_slices((x, y)).filter(
            lambda *_: True
        ).batch(12)

    def static(x, y):
        # A static batch size: the short last micro-batch is compiled too.
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(
            12, drop_remainder=True
        )

    cases = (  # (net, x, y, micro-batch rows, dataset, split)
        (helpers.segmentation_net, seg_x, seg_y, 4, None, True),
        (helpers.segmentation_net, seg_x, seg_y, 5, filtered, True),
        (helpers.segmentation_net, seg_x, seg_y, 5, static, True),
        (dense_net, *classification_data(n=24), 4, None, False),
    )
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=255
    )
    for build, x, y, rows, dataset, split in cases:
        reference, ours = twins(build, steps=1, micro_batch_size=rows)
        initial = [np.array(w) for w in reference.get_weights()]
        for model in (reference, ours):
            model.compile(
                optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                loss=loss,
                jit_compile=True,
            )
            if dataset is None:
                model.fit(x, y, batch_size=12, shuffle=False, verbose=0)
            else:
                model.fit(dataset(x, y), verbose=0)
        assert ours.jit_compile is True
        # Conv net: the full micro-batches' body, called in the step's loop.
        calls = _xla_compiled_calls(ours, (x[:12], y[:12]))
        assert calls == (1 if split else 0), build.__name__
        assert_close_to_reference(
            f"in-step, XLA on CPU, {build.__name__}, B={rows}, "
            f"{dataset.__name__ if dataset else 'arrays'}",
            initial, reference.get_weights(), ours.get_weights(),
            masked_mean_rtol(RTOL["float64"]),
        )
