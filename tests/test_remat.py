"""`remat=`: recomputation changes the memory, never the update.

Each case trains the same model (same initial weights, same samples, same
seeds) twice, without and with recomputation, and compares every weight
(BatchNormalization's moving statistics included) and the optimizer's
variables: in float64 they must agree to 1e-12. The model without `remat`
is itself held to the big batch by tests/test_equivalence.py. The blocks
have `Dropout` and `BatchNormalization`, so that a recomputation that drew
new masks or moved the statistics again would show (the mutation tests at
the end check that it would).
"""

import functools
import inspect
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_accum
from keras_accum import remat as remat_lib

GAM = keras_accum.GradientAccumulationModel
EXACT = 1e-12


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class ResidualBlock(keras.layers.Layer):
    """Conv, BatchNormalization, ReLU, Dropout, and the residual add; with
    `activity` an activity-regularised Dense inside (an `add_loss`)."""

    def __init__(self, channels=4, activity=False, **kwargs):
        super().__init__(**kwargs)
        self.channels, self.activity = channels, activity
        self.conv = keras.layers.Conv2D(channels, 3, padding="same",
                                        use_bias=False)
        self.norm = keras.layers.BatchNormalization()
        self.dropout = keras.layers.Dropout(0.3)
        self.mix = keras.layers.Dense(
            channels,
            activity_regularizer=keras.regularizers.L2(0.1) if activity
            else None,
        )

    def build(self, input_shape):
        self.conv.build(input_shape)
        inner = tuple(input_shape[:-1]) + (self.channels,)
        self.norm.build(inner)
        self.mix.build(inner)

    def call(self, x, training=None):
        h = keras.activations.relu(self.norm(self.conv(x), training=training))
        h = self.dropout(h, training=training)
        return x + self.mix(h)

    def get_config(self):
        return dict(super().get_config(), channels=self.channels,
                    activity=self.activity)


def residual_net(blocks=3, activity=False, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 4))
    x = inputs
    for _ in range(blocks):
        x = ResidualBlock(4, activity=activity)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(x))


def plain_graph(seed=0):
    """A functional graph of plain layers with a skip (a small U-Net)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    a = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    a = keras.layers.BatchNormalization()(a)
    b = keras.layers.MaxPooling2D()(a)
    b = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(b)
    b = keras.layers.Dropout(0.2)(b)
    b = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(b)
    c = keras.layers.UpSampling2D()(b)
    c = keras.layers.Concatenate()([c, a])
    c = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(c)
    c = keras.layers.BatchNormalization()(c)
    return keras.Model(inputs, keras.layers.Conv2D(2, 1)(c))


def _data(shape, outputs, n=24, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.rand(n, *shape)
    y = rng.rand(n, *outputs)
    return x, y


def _train(make, remat, data, fit=None, compile_kwargs=None, **options):
    model = GAM.from_model(make(), remat=remat, **options)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        **(compile_kwargs or {}),
    )
    keras.utils.set_random_seed(7)  # the same dropout seeds in both runs
    _drop_global_seed_generator()
    history = model.fit(*data, **dict(dict(batch_size=4, epochs=2,
                                           shuffle=False, verbose=0),
                                      **(fit or {})))
    return model, history


def _drop_global_seed_generator():
    """As `set_random_seed()` does from Keras 3.15 (3.11 keeps it): Keras'
    global seed generator is made again from the seed when next used."""
    from keras.src.backend.common import global_state

    from keras_accum import _keras_compat as compat

    global_state.set_global_attribute(compat._GLOBAL_SEED_GENERATOR, None)


def _assert_same_training(a, b, tolerance=EXACT):
    assert len(a.weights) == len(b.weights)
    for wa, wb in zip(a.weights, b.weights):
        np.testing.assert_allclose(
            np.asarray(wa, np.float64), np.asarray(wb, np.float64),
            rtol=0, atol=tolerance, err_msg=wa.path,
        )
    for va, vb in zip(a.optimizer.variables, b.optimizer.variables):
        np.testing.assert_allclose(
            np.asarray(va, np.float64), np.asarray(vb, np.float64),
            rtol=0, atol=tolerance, err_msg=va.path,
        )


def _moved(a, b):
    return max(
        float(np.max(np.abs(np.asarray(wa) - np.asarray(wb))))
        for wa, wb in zip(a.weights, b.weights)
    )


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


STEP_OPTIONS = {
    "graph": (dict(gradient_accumulation_steps=3), {}, {}),
    "eager": (dict(gradient_accumulation_steps=3), dict(run_eagerly=True), {}),
    "jit": (dict(gradient_accumulation_steps=3), dict(jit_compile=True), {}),
    "in_step": (
        dict(gradient_accumulation_steps=2, micro_batch_size=2), {},
        dict(batch_size=6),
    ),
    "in_step_jit": (
        dict(gradient_accumulation_steps=2, micro_batch_size=2),
        dict(jit_compile=True), dict(batch_size=6),
    ),
    "n1": (dict(gradient_accumulation_steps=1), {}, {}),
}


# As elsewhere outside test_equivalence.py (tests/conftest.py,
# `ALL_MODES_IN_MAIN_JOB`), the eager and XLA cases run in the second job.
_SECOND_JOB = {"eager", "jit", "in_step_jit"}


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.slow) if case in _SECOND_JOB
    else case
    for case in STEP_OPTIONS
])
def test_residual_blocks_train_as_without_remat(float64, case):
    options, compile_kwargs, fit = STEP_OPTIONS[case]
    data = _data((6, 6, 4), (2,))
    runs = [
        _train(residual_net, remat, data, fit, compile_kwargs, **options)
        for remat in (False, True)
    ]
    (plain, plain_history), (ours, history) = runs
    assert ours.remat is True and ours.remat_active
    _assert_same_training(plain, ours)
    np.testing.assert_allclose(
        plain_history.history["loss"], history.history["loss"], rtol=1e-12
    )
    assert _moved(residual_net(), ours) > 1e-3  # it trained


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_mixed_float16_within_float_tolerance(jit):
    keras.config.set_dtype_policy("mixed_float16")
    data = tuple(a.astype("float32") for a in _data((6, 6, 4), (2,)))
    compile_kwargs = dict(jit_compile=jit)
    plain, _ = _train(residual_net, False, data, None, compile_kwargs,
                      gradient_accumulation_steps=3)
    ours, _ = _train(residual_net, True, data, None, compile_kwargs,
                     gradient_accumulation_steps=3)
    assert isinstance(ours.optimizer, keras.optimizers.LossScaleOptimizer)
    tolerance = 1e-5
    if jit and _tensorflow_version() < (2, 21):
        # XLA of TensorFlow 2.16 fuses the recomputed float16 forward pass
        # otherwise than the first: 2.6e-3 apart after these steps (float64
        # stays exact under XLA there too: the "jit" case of
        # test_residual_blocks_train_as_without_remat).
        tolerance = 1e-2
    _assert_same_training(plain, ours, tolerance=tolerance)


def _tensorflow_version():
    import tensorflow as tf

    return tuple(int(part) for part in tf.__version__.split(".")[:2])


def test_functional_graph_is_cut_into_segments(float64):
    model = plain_graph()
    plan = remat_lib.plan(model, True)
    assert not plan.blocks and len(plan.graphs) == 1
    segments = plan.graphs[0][1]
    assert len(segments) > 1
    assert sum(len(s.nodes) for s in segments) == len(model.layers) - 1
    data = _data((8, 8, 3), (8, 8, 2))
    plain, _ = _train(plain_graph, False, data, gradient_accumulation_steps=2)
    ours, _ = _train(plain_graph, True, data, gradient_accumulation_steps=2)
    _assert_same_training(plain, ours)


def test_activity_regulariser_inside_a_block(float64):
    # The loss a block adds in its `call()` reaches the gradient also when
    # the block is recomputed.
    make = lambda: residual_net(activity=True)  # noqa: E731
    data = _data((6, 6, 4), (2,))
    plain, _ = _train(make, False, data, gradient_accumulation_steps=2)
    ours, _ = _train(make, True, data, gradient_accumulation_steps=2)
    _assert_same_training(plain, ours)


class MaskedBlock(keras.layers.Layer):
    """A residual Dense and Dropout, plus their mean over the time steps
    the mask keeps (so that the mask changes every output)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.dense = keras.layers.Dense(8, activation="tanh")
        self.dropout = keras.layers.Dropout(0.3)

    def call(self, x, training=None, mask=None):
        h = self.dropout(self.dense(x), training=training)
        kept = keras.ops.ones_like(h[..., :1])
        if mask is not None:
            kept = keras.ops.expand_dims(keras.ops.cast(mask, h.dtype), -1)
        mean = keras.ops.sum(h * kept, axis=1, keepdims=True) / (
            keras.ops.sum(kept, axis=1, keepdims=True)
        )
        return x + h + mean


class EmbeddingBlock(keras.layers.Layer):
    """Token ids in: the recomputed function's input is an integer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(20, 8)
        self.dense = keras.layers.Dense(8)

    def call(self, ids):
        return self.dense(self.embedding(ids))


class RecurrentBlock(keras.layers.Layer):
    """An LSTM (a loop in the recomputed function) and Dropout."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lstm = keras.layers.LSTM(8, return_sequences=True)
        self.dropout = keras.layers.Dropout(0.2)

    def call(self, x, training=None):
        return self.dropout(self.lstm(x, training=training),
                            training=training)


def _sequence_net(kind):
    keras.utils.set_random_seed(0)
    if kind == "recurrent":
        inputs = keras.Input((5, 3))
        x = RecurrentBlock()(RecurrentBlock()(inputs))
    else:
        inputs = keras.Input((7,), dtype="int32")
        if kind == "masked":
            x = keras.layers.Embedding(20, 8, mask_zero=True)(inputs)
            x = MaskedBlock()(MaskedBlock()(x))
        else:
            x = EmbeddingBlock()(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


@pytest.mark.parametrize("kind", ["masked", "integer_input", "recurrent"])
def test_sequence_blocks(float64, kind):
    # A Keras mask into the blocks (padding at the end of each row), token
    # ids as a block's input, an LSTM inside a block: the blocks are
    # recomputed, and the update is the one without `remat`.
    make = functools.partial(_sequence_net, kind)
    assert remat_lib.plan(make(), True).blocks
    rng = np.random.RandomState(0)
    if kind == "recurrent":
        x = rng.rand(24, 5, 3)
    else:
        x = rng.randint(1, 20, size=(24, 7))
        x[::2, 4:] = 0  # padding: masked in "masked"
    data = (x, rng.rand(24, 2))
    fit = dict(sample_weight=np.linspace(0.5, 1.5, 24), validation_split=0.25)
    plain, plain_history = _train(make, False, data, fit,
                                  gradient_accumulation_steps=3)
    ours, history = _train(make, True, data, fit,
                           gradient_accumulation_steps=3)
    _assert_same_training(plain, ours)
    for key, values in plain_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-12)


# How a model is written. Each style holds three `CountedBlock`s, then
# the pooling and the head, and gets the same initial weights from the seed;
# "unbuilt" styles are first built by `fit()` itself.
STYLES = [
    "functional", "sequential", "sequential_no_input", "subclassed",
    "subclassed_built", "our_subclass", "blocks_made_in_build",
    "nested_unbuilt",
]
# Each `CountedBlock.call()` in training: (style's block, whether recomputed).
CALLS = []


class CountedBlock(ResidualBlock):
    def call(self, x, training=None):
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope

        if training and not in_symbolic_scope():  # not a symbolic run
            CALLS.append(self.name)
        return super().call(x, training=training)


class StyleNet(keras.Model):
    """Blocks as attributes, built in the first call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [CountedBlock(4) for _ in range(3)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x, training=None):
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.pool(x))


class OurStyleNet(GAM):
    """The README's way: our class subclassed, with its own `call()`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [CountedBlock(4) for _ in range(3)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x, training=None):
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.pool(x))


class LazyStyleNet(StyleNet):
    """Blocks made in `build()`, not in `__init__()`."""

    def __init__(self, **kwargs):
        keras.Model.__init__(self, **kwargs)

    def build(self, input_shape):
        self.blocks = [CountedBlock(4) for _ in range(3)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(2, name="head")
        for block in self.blocks:
            block.build(input_shape)
        self.head.build((None, 4))


def styled_net(style, **options):
    """The model of `style`, accumulating with `options`."""
    keras.utils.set_random_seed(0)
    if style == "our_subclass":
        return OurStyleNet(**options)
    tail = [keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2, name="head")]
    blocks = [CountedBlock(4) for _ in range(3)]
    if style == "functional":
        inputs = keras.Input((6, 6, 4))
        x = inputs
        for layer in blocks + tail:
            x = layer(x)
        model = keras.Model(inputs, x)
    elif style == "sequential":
        model = keras.Sequential([keras.Input((6, 6, 4))] + blocks + tail)
    elif style == "sequential_no_input":
        model = keras.Sequential(blocks + tail)
    elif style == "nested_unbuilt":
        model = keras.Sequential([StyleNet(name="backbone")])
    elif style == "blocks_made_in_build":
        model = LazyStyleNet()
    else:
        model = StyleNet()
        if style == "subclassed_built":
            model(np.zeros((1, 6, 6, 4)))
    return GAM.from_model(model, **options)


def _train_style(style, remat, options, compile_kwargs, fit):
    """The trained model, the blocks' calls in training, and the traces of
    its train step."""
    model = styled_net(style, remat=remat, **options)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  **compile_kwargs)
    traces = []
    train_step = model.train_step

    def traced_step(data):
        traces.append(1)
        return train_step(data)

    model.train_step = traced_step
    keras.utils.set_random_seed(7)
    CALLS.clear()
    model.fit(*_data((6, 6, 4), (2,)), **dict(
        dict(batch_size=4, epochs=2, shuffle=False, verbose=0), **fit
    ))
    return model, len(CALLS), len(traces)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.slow) if case != "graph" else case
    for case in ("graph", "jit", "in_step")
])
def test_every_way_of_writing_a_model(float64, style, case):
    # Built before `fit()` or by it, the blocks are found and recomputed:
    # with `remat` each of the three blocks runs twice in training per trace
    # of the train step (the forward pass, and again in the backward pass;
    # without `remat`, once, and a model built in its first step may trace
    # it more than once), and trains as without it.
    options, compile_kwargs, fit = STEP_OPTIONS[case]
    plain, plain_calls, plain_traces = _train_style(
        style, False, options, compile_kwargs, fit
    )
    ours, calls, traces = _train_style(style, True, options,
                                       compile_kwargs, fit)
    assert plain_calls >= 3 * plain_traces > 0
    assert calls == 2 * 3 * traces > 0, (calls, traces)
    _assert_same_training(plain, ours)
    initial = styled_net(style, gradient_accumulation_steps=1)
    initial(np.zeros((1, 6, 6, 4)))
    assert _moved(initial, ours) > 1e-3  # it trained


class CountingBlock(keras.layers.Layer):
    """Assigns a variable in `call()` and reads it back: a count of its
    calls in training that scales its output."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.calls = self.add_weight(shape=(), initializer="zeros",
                                     trainable=False, name="calls")

    def call(self, x, training=None):
        if training:
            self.calls.assign_add(1.0)
        return self.dense(x) * (1.0 + 0.1 * self.calls)


class GlobalNoiseBlock(keras.layers.Layer):
    """Noise from Keras' global seed generator (`seed=None`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x, training=None):
        h = self.dense(x)
        if training:
            h = h + keras.random.normal(keras.ops.shape(h), stddev=0.3)
        return h


class RawWriteBlock(CountingBlock):
    """Writes its variable around `keras.Variable.assign`: refused."""

    def call(self, x, training=None):
        self.calls.value.assign_add(1.0)
        return self.dense(x) * (1.0 + 0.1 * self.calls)


class StatefulRandomBlock(CountingBlock):
    """Draws with TensorFlow's stateful random op: refused."""

    def call(self, x, training=None):
        return self.dense(x) * tf_random_uniform(x)


def tf_random_uniform(x):
    import tensorflow as tf

    return tf.random.uniform([], dtype=x.dtype)


# Blocks whose forward pass writes state that it also reads: each as the
# model's two blocks, replayed exactly.
WRITERS = {
    # Writes its kernel (trainable) and `vector_u` in the forward pass.
    "spectral_normalization": lambda: keras.layers.SpectralNormalization(
        keras.layers.Dense(4)
    ),
    # Reads the renorm statistics it then moves.
    "batch_renormalization": lambda: keras.Sequential(
        [keras.layers.Dense(4), keras.layers.BatchNormalization(renorm=True)]
    ),
    "assigns_in_call": CountingBlock,
    "global_seed_generator": GlobalNoiseBlock,
}
REFUSED = {
    "raw_variable_write": (RawWriteBlock, "AssignAddVariableOp"),
    "stateful_random_op": (StatefulRandomBlock, "RandomUniform"),
}


def _writers_net(make, stateful_lstm=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), batch_size=2 if stateful_lstm else None)
    x = make()(make()(inputs))
    if stateful_lstm:
        # A stateful RNN in a block: its states carry over between batches.
        x = keras.layers.Reshape((5, 1))(x)
        x = keras.Sequential([keras.layers.LSTM(3, stateful=True),
                              keras.layers.Dense(3)])(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


WRITER_OPTIONS = {
    "graph": (dict(gradient_accumulation_steps=3), {}, dict(batch_size=2)),
    "jit": (dict(gradient_accumulation_steps=3), dict(jit_compile=True),
            dict(batch_size=2)),
    "in_step": (dict(gradient_accumulation_steps=1, micro_batch_size=2), {},
                dict(batch_size=6)),
}


# `renorm` is a BatchNormalization argument from Keras 3.14.
_HAS_RENORM = "renorm" in inspect.signature(
    keras.layers.BatchNormalization.__init__
).parameters


@pytest.mark.parametrize("writer", list(WRITERS) + ["stateful_lstm"])
@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.slow) if case != "graph" else case
    for case in WRITER_OPTIONS
])
def test_layers_that_write_state_are_replayed(float64, writer, case):
    # The recomputation reads every variable as the forward pass read it:
    # before the forward pass's writes (and their own reads after them).
    if writer == "batch_renormalization" and not _HAS_RENORM:
        pytest.skip("no `renorm` in this Keras")
    if writer == "stateful_lstm":
        if case == "in_step":
            pytest.skip("a stateful RNN's batch is fixed; in-step batches "
                        "are larger than their micro-batches")
        make = functools.partial(
            _writers_net, functools.partial(keras.layers.Dense, 5), True
        )
    else:
        make = functools.partial(_writers_net, WRITERS[writer])
    options, compile_kwargs, fit = WRITER_OPTIONS[case]
    data = _data((5,), (2,), n=24)
    plain, plain_history = _train(make, False, data, fit, compile_kwargs,
                                  **options)
    ours, history = _train(make, True, data, fit, compile_kwargs, **options)
    assert remat_lib.plan(ours, True).blocks
    _assert_same_training(plain, ours)
    np.testing.assert_allclose(history.history["loss"],
                               plain_history.history["loss"], rtol=1e-12)
    assert _moved(make(), ours) > 1e-3


@pytest.mark.parametrize("refused", list(REFUSED))
@pytest.mark.parametrize("run_eagerly", [
    False, pytest.param(True, marks=pytest.mark.slow)
])
def test_a_layer_that_cannot_be_replayed_is_refused(float64, refused,
                                                    run_eagerly):
    # A write that is not `keras.Variable.assign`, or a stateful random op,
    # would run again with other results: refused at the first step, naming
    # the layer, the operation and the way out; without `remat` it trains.
    block, operation = REFUSED[refused]
    make = functools.partial(_writers_net, block)
    data = _data((5,), (2,), n=8)
    compile_kwargs = dict(run_eagerly=run_eagerly)
    _train(make, False, data, dict(batch_size=2), compile_kwargs,
           gradient_accumulation_steps=2)
    with pytest.raises(remat_lib.UnreplayableLayerError) as error:
        _train(make, True, data, dict(batch_size=2), compile_kwargs,
               gradient_accumulation_steps=2)
    message = str(error.value)
    assert operation in message and "remat=" in message, message
    assert block.__name__ in message, message


def test_named_layers_and_classes(float64):
    model = residual_net()
    names = [layer.name for layer in model.layers[1:3]]
    assert remat_lib.plan(model, tuple(names)).blocks == model.layers[1:3]
    by_class = remat_lib.plan(model, (ResidualBlock,)).blocks
    assert by_class == model.layers[1:4]
    # A layer inside a chosen one is recomputed with it.
    inner = model.layers[1].conv
    assert remat_lib.plan(model, (names[0], inner.name)).blocks == [
        model.layers[1]
    ]
    data = _data((6, 6, 4), (2,))
    plain, _ = _train(residual_net, False, data, gradient_accumulation_steps=2)
    ours, _ = _train(residual_net, [ResidualBlock], data,
                     gradient_accumulation_steps=2)
    assert ours.remat == (ResidualBlock,)
    _assert_same_training(plain, ours)


def test_blocks_of_a_nested_model_are_found():
    keras.utils.set_random_seed(0)
    inner_inputs = keras.Input((6, 6, 4))
    x = ResidualBlock()(ResidualBlock()(inner_inputs))
    backbone = keras.Model(inner_inputs, x, name="backbone")
    inputs = keras.Input((6, 6, 4))
    model = keras.Model(inputs, keras.layers.Dense(2)(backbone(inputs)))
    assert remat_lib.plan(model, True).blocks == backbone.layers[1:]
    # A nested graph of plain layers is cut into segments, as a model's.
    inputs = keras.Input((8, 8, 3))
    nested = plain_graph()
    model = keras.Model(inputs, keras.layers.Dense(2)(nested(inputs)))
    plan = remat_lib.plan(model, True)
    assert not plan.blocks and [g for g, _ in plan.graphs] == [nested]


def test_recomputation_runs_in_the_backward_pass(float64):
    # Each block's `call()` traces once for the forward pass and once for
    # the recomputation (and once for neither without `remat`).
    calls = []

    class Counted(ResidualBlock):
        def call(self, x, training=None):
            calls.append(self.name)
            return super().call(x, training=training)

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6, 6, 4))
        x = Counted()(Counted()(inputs))
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(2)(x))

    data = _data((6, 6, 4), (2,), n=4)
    counts = {}
    for remat in (False, True):
        calls.clear()
        _train(make, remat, data, dict(epochs=1),
               gradient_accumulation_steps=1)
        counts[remat] = len(calls)
    # Two blocks: the symbolic build calls both without `remat` too.
    assert counts[True] - counts[False] == 2


def test_saved_mid_window_and_resumed_with_remat(float64, tmp_path):
    # Saved with a window pending, loaded twice: resumed with `remat` and
    # without, the two go on alike, and the file keeps `remat`.
    path = str(tmp_path / "remat.keras")

    class SaveAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                assert int(self.model.micro_step) == 1
                self.model.save(path)

    data = _data((6, 6, 4), (2,))
    _train(residual_net, [ResidualBlock, "head"], data,
           dict(epochs=1, callbacks=[SaveAt()]), gradient_accumulation_steps=5)
    loaded = []
    for remat in (True, False):
        keras.utils.set_random_seed(3)  # Dropout's seeds are drawn anew
        model = keras.saving.load_model(path)
        assert model.remat == (ResidualBlock, "head")
        assert int(model.micro_step) == 1
        model.remat = model.remat if remat else False
        model.fit(*data, batch_size=4, epochs=1, shuffle=False, verbose=0)
        loaded.append(model)
    ours, plain = loaded
    assert ours.remat_active and not plain.remat_active
    _assert_same_training(plain, ours)


@pytest.mark.slow
def test_interrupted_and_resumed_with_backup_and_restore(float64, tmp_path):
    # Interrupted three times mid-epoch and resumed from its backups each
    # time, a run with `remat` ends as the uninterrupted one without it.
    from helpers import Interrupt

    data = _data((6, 6, 4), (2,), n=28)  # 7 batches of 4 an epoch

    def run(remat, callbacks):
        model = GAM.from_model(residual_net(), gradient_accumulation_steps=3,
                               remat=remat)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        keras.utils.set_random_seed(7)
        model.fit(*data, batch_size=4, epochs=3, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return model

    reference = run(False, [])
    backup = str(tmp_path / "backup")
    for epoch, batch in ((0, 4), (1, 5), (2, 2)):
        with pytest.raises(RuntimeError, match="interrupted"):
            run(True, [keras_accum.callbacks.BackupAndRestore(
                backup, save_freq=2), Interrupt(epoch, batch)])
    resumed = run(True, [keras_accum.callbacks.BackupAndRestore(
        backup, save_freq=2)])
    assert resumed.history.epoch == [2]  # resumed, not trained again
    _assert_same_training(reference, resumed)
    assert reference.history.history["loss"][-1] == pytest.approx(
        resumed.history.history["loss"][-1], rel=1e-12
    )


def test_keras_hub_gpt2_task(float64):
    from helpers import import_keras_hub

    keras_hub = import_keras_hub()

    def make():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=12, dropout=0.2,
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone,
                                             preprocessor=None)

    task = make()
    plan = remat_lib.plan(task, True)
    assert [type(b).__name__ for b in plan.blocks] == ["TransformerDecoder"] * 2
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 50, (8, 12))
    mask = np.arange(12)[None] < rng.randint(4, 13, (8, 1))
    x = {"token_ids": tokens, "padding_mask": mask}
    runs = []
    for remat in (False, True):
        model = GAM.from_model(make(), gradient_accumulation_steps=2,
                               remat=remat)
        model.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        keras.utils.set_random_seed(7)
        model.fit(x, tokens, sample_weight=mask, batch_size=2, epochs=1,
                  shuffle=False, verbose=0)
        runs.append(model)
    _assert_same_training(*runs)


@pytest.mark.parametrize(
    "value", [1, "yes", [], ["dense", 3], [keras.Model.fit], "Auto"]
)
def test_invalid_values_raise(value):
    with pytest.raises(ValueError, match="remat"):
        GAM.from_model(residual_net(), gradient_accumulation_steps=2,
                       remat=value)


def test_unknown_layer_name_raises():
    with pytest.raises(ValueError, match=r"not in the model.*'nope'"):
        GAM.from_model(residual_net(), gradient_accumulation_steps=2,
                       remat=["nope"])


def test_auto_needs_auto_micro_batches():
    with pytest.raises(ValueError, match="micro_batch_size='auto'"):
        GAM.from_model(residual_net(), gradient_accumulation_steps=2,
                       remat="auto")
    model = GAM.from_model(residual_net(), gradient_accumulation_steps=2,
                           micro_batch_size="auto", remat="auto")
    assert model.remat == "auto" and not model.remat_active


def test_nothing_to_recompute_warns_once():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = GAM(inputs, keras.layers.Dense(1)(inputs), remat=True)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3)), np.ones((8, 1))
    with pytest.warns(UserWarning, match="nothing to recompute") as record:
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert sum("nothing to recompute" in str(w.message) for w in record) == 1


@pytest.mark.parametrize("mutation", ["reads", "writes"])
def test_mutations_are_caught(float64, monkeypatch, mutation):
    # A recomputation that reads the variables as they are after the
    # forward pass (new Dropout masks), or that writes them (BatchNormalization
    # moving twice): the comparison above fails, it can tell.
    replay = remat_lib._Replay
    if mutation == "reads":
        monkeypatch.setattr(remat_lib, "_Replay",
                            lambda read, tape: replay([], tape))
    else:
        class WritesThrough(replay):
            def add_update(self, update):
                super().add_update(update)
                update[0]._direct_assign(update[1])

        monkeypatch.setattr(remat_lib, "_Replay", WritesThrough)
    data = _data((6, 6, 4), (2,))
    plain, _ = _train(residual_net, False, data, gradient_accumulation_steps=3)
    ours, _ = _train(residual_net, True, data, gradient_accumulation_steps=3)
    with pytest.raises(AssertionError):
        _assert_same_training(plain, ours)


CHILD = os.path.join(os.path.dirname(__file__), "remat_child.py")


def _child(*args, env=None, timeout=300):
    run = subprocess.run(
        [sys.executable, CHILD, *args], capture_output=True, text=True,
        timeout=timeout, env=dict(os.environ, **(env or {})),
    )
    return run


@pytest.mark.slow
def test_mirrored_strategy_two_replicas():
    # Residual blocks, a block that writes state in its forward pass, and
    # a subclassed model built by `fit()` (`remat_child.MIRRORED_MODELS`).
    run = _child("mirrored")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.splitlines()
             if " difference " in line]
    assert [line[0] for line in lines] == [
        "residual", "spectral_normalization", "subclassed_unbuilt"
    ], run.stdout
    for name, _, moved, _, difference in lines:
        assert float(moved) > 1e-3 and float(difference) <= EXACT, run.stdout


# A CPU memory limit (MiB) in which `remat_child.deep_net()` trains one
# sample per micro-batch only with recomputation (peaks measured without a
# limit: plain Keras 29 MiB, ours 27, with `remat=True` 17).
LIMIT_MB = 22


@pytest.mark.slow
def test_what_one_sample_does_not_fit_trains_with_remat(tmp_path):
    # Under the limit plain Keras and ours without `remat` run out of
    # memory at one sample per step; `remat=True` and `remat="auto"` train,
    # to the weights of the same training without a limit (float64): N=2
    # of one sample, and (for "auto", which ends at micro-batches of one
    # row inside the step) `micro_batch_size=1`.
    limited = dict(
        TF_CPU_ALLOCATOR_USE_BFC="true",
        TF_CPU_BFC_MEM_LIMIT_IN_MB=str(LIMIT_MB),
        TF_ENABLE_ONEDNN_OPTS="0",
    )
    runs = {
        variant: (limited, variant)
        for variant in ("plain", "ours", "remat", "auto")
    }
    unlimited = dict(TF_ENABLE_ONEDNN_OPTS="0")
    runs["reference"] = (unlimited, "ours")
    runs["reference_in_step"] = (unlimited, "in_step")
    children = {
        name: subprocess.Popen(
            [sys.executable, CHILD, "limit", variant,
             str(tmp_path / f"{name}.npy")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, **env),
        )
        for name, (env, variant) in runs.items()
    }
    outputs = {}
    for name, child in children.items():
        stdout, stderr = child.communicate(timeout=1200)
        outputs[name] = (child.returncode, stdout, stderr[-3000:])
    for name in ("plain", "ours"):
        returncode, stdout, stderr = outputs[name]
        # Out of memory, raised (or, in some of TensorFlow's CPU kernels,
        # the process ended).
        assert "out of memory" in stdout or returncode != 0, outputs[name]
        assert not (tmp_path / f"{name}.npy").exists()
    for name, reference in (("remat", "reference"),
                            ("auto", "reference_in_step")):
        returncode, stdout, stderr = outputs[name]
        assert returncode == 0 and "remat active: True" in stdout, outputs[name]
        np.testing.assert_allclose(
            np.load(tmp_path / f"{name}.npy"),
            np.load(tmp_path / f"{reference}.npy"),
            rtol=0, atol=EXACT,
        )
    assert "'remat'" in outputs["auto"][1]  # the logs say so
