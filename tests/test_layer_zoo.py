"""`remat=True` on every layer class that `keras.layers` exports.

The classes are enumerated when the tests run (`dir(keras.layers)`, each
class once: aliases such as `Convolution2D` are `Conv2D`), so that a new
Keras release brings its new layers in. Each is built from its
`__init__`'s required parameters, filled in by parameter name (`REQUIRED`;
`OPTIONAL` turns on random transformations that are off by default, and
`EXTRA` holds the few classes that need more), into a block (`Block`: a
`Dense` projection, the layer, `tanh`), in the model
`Input -> Block -> Flatten -> Dense(2)`, on the first input and call
pattern on which a symbolic build works (`FLOAT_INPUTS`, `IDS`). A layer
with neither weights nor a seed generator has nothing to replay and is
skipped; the classes not run are in `EXCLUDED`, with the reason, and
`test_every_exported_layer_is_run_skipped_or_excluded` fails for a new
class that is none of the three.

Each case trains the model twice from the same initial weights on the same
samples with the same seeds, without and with recomputation, and compares
every weight and the optimizer's variables: in float64 they must agree to
1e-12, or the recomputation must be refused, at the first step, with
`UnreplayableLayerError`. The block's `call()` is counted while tracing:
with `remat` it runs once more per trace of the forward pass of training
(the recomputation in the backward pass), so that a plan that recomputes
nothing cannot pass. Modes: graph (`gradient_accumulation_steps=2`), in the
step (`micro_batch_size=2` in batches of 4: graph mode's windows, compared
with graph mode's run without `remat`) and XLA (compared with XLA without
`remat`: its random numbers may differ from graph mode's). A case that
plain `keras.Model` cannot train either in that mode is skipped, saying
why. The main job runs four stateful layers in graph mode (`MAIN_JOB`);
the rest is `slow`.
"""

import inspect

import keras
import numpy as np
import pytest

import keras_accum
from keras_accum import remat as remat_lib

GAM = keras_accum.GradientAccumulationModel
EXACT = 1e-12

# Classes not run, by class name, with the reason.
_CELLS = "a cell runs inside `RNN`: covered by LSTM, GRU and SimpleRNN"
_LOOKUP = (
    "string or lookup preprocessing: its state (a vocabulary, bins) is "
    "not changed in training and takes no gradient"
)
_FLOAT32_ONLY = (
    "Keras cannot train it in float64: a float32 constant meets the "
    "float64 image in its training path"
)
EXCLUDED = {
    "InputLayer": "the model's input, not a layer called on a tensor",
    "Lambda": "runs a user's Python function: what it replays is the user's",
    "TFSMLayer": "loads a TensorFlow SavedModel from a file",
    "JaxLayer": "wraps a JAX function: the JAX backend only",
    "FlaxLayer": "wraps a Flax module: the JAX backend only",
    "TorchModuleWrapper": "wraps a torch module: the torch backend only",
    "Layer": "the base class (each block here is one)",
    "Wrapper": "the abstract base of Bidirectional and TimeDistributed",
    "RNN": "runs a cell: covered by LSTM, GRU and SimpleRNN, which are RNNs",
    "StackedRNNCells": _CELLS,
    "LSTMCell": _CELLS,
    "GRUCell": _CELLS,
    "SimpleRNNCell": _CELLS,
    "Pipeline": "a sequence of other exported preprocessing layers",
    "StringLookup": _LOOKUP,
    "TextVectorization": _LOOKUP,
    "IntegerLookup": _LOOKUP,
    "Hashing": _LOOKUP,
    "HashedCrossing": _LOOKUP,
    "Discretization": _LOOKUP,
    "CategoryEncoding": _LOOKUP,
    # Keras' own errors in float64 (Keras 3.15: "Input 'y' of 'Mul' Op has
    # type float32 that does not match type float64"), in training.
    "AugMix": _FLOAT32_ONLY,
    "RandAugment": _FLOAT32_ONLY,
    "RandomRotation": _FLOAT32_ONLY,
    "STFTSpectrogram": (
        "builds its Fourier kernels with scipy, which the tests do not "
        "install"
    ),
}

# The values of required `__init__` parameters, by parameter name (a
# callable is called for each layer built: a fresh inner layer each time).
REQUIRED = {
    "units": 4,
    "filters": 4,
    "kernel_size": 3,
    "num_heads": 2,
    "key_dim": 4,
    "head_dim": 4,
    "num_query_heads": 2,
    "num_key_value_heads": 1,
    "rate": 0.3,
    "stddev": 0.3,
    "input_dim": 10,
    "output_dim": 4,
    "factor": 0.2,
    "height_factor": 0.2,
    "width_factor": 0.2,
    "height": 4,
    "width": 4,
    "output_size": 2,
    "pool_size": 2,
    "activation": "tanh",
    "axes": -1,
    "equation": "ab,bc->ac",
    "output_shape": 4,
    "dims": (2, 1),
    "target_shape": (-1,),
    "n": 2,
    "scale": 0.5,
    "max_number": 2,
    "layer": lambda: keras.layers.Dense(4),
}

# Optional parameters, by name, whose defaults leave a layer's random
# transformation off (`RandomShear`, `RandomColorJitter`, `Solarization`;
# the jitter's hue and saturation would pass no gradient to the
# projection), and the images' range (their default: 0 to 255).
OPTIONAL = {
    "x_factor": 0.2,
    "y_factor": 0.2,
    "brightness_factor": 0.2,
    "contrast_factor": 0.2,
    "addition_factor": 0.2,
    "threshold_factor": 0.2,
    "value_range": (0, 1),
}

# The few classes that need more than their required parameters to be
# meaningful here, by class name.
EXTRA = {
    # `layer` must be a recurrent layer.
    "Bidirectional": dict(layer=lambda: keras.layers.LSTM(4)),
    # The default, 32 groups, needs 32 channels or more.
    "GroupNormalization": dict(groups=2),
    # `factor` is a number of bits here, in [1, 8].
    "RandomPosterization": dict(factor=4),
}

# Variants that matter, beyond each class with its defaults: id ->
# (class name, keyword arguments).
VARIANTS = {
    # (`renorm` is an argument from Keras 3.14.)
    **({"BatchNormalization-renorm": ("BatchNormalization", dict(renorm=True))}
       if "renorm" in inspect.signature(
           keras.layers.BatchNormalization.__init__).parameters else {}),
    "LSTM-dropout": ("LSTM", dict(dropout=0.2, recurrent_dropout=0.2)),
    "MultiHeadAttention-dropout": ("MultiHeadAttention", dict(dropout=0.2)),
}

# The inputs tried, in order, until a symbolic build works: (dtype, shape
# of one sample). A layer with an `input_dim` (an embedding) takes integer
# ids, and tries them first; an image preprocessing layer (one would take
# a sequence for an unbatched image) tries the images first.
SEQUENCES = ("float64", (6, 4))
IMAGES = ("float64", (8, 8, 3))
FLOAT_INPUTS = [
    SEQUENCES,
    ("float64", (6,)),
    IMAGES,
    ("float64", (4, 4, 4, 2)),
    ("float64", (3, 4, 4, 4, 2)),
]
IDS = ("int32", (6,))


def exported_classes():
    """Every `keras.layers.Layer` subclass `keras.layers` exports, once
    each (aliases are the same class), by class name."""
    found = {}
    for name in dir(keras.layers):
        cls = getattr(keras.layers, name)
        if isinstance(cls, type) and issubclass(cls, keras.layers.Layer):
            found.setdefault(cls, cls.__name__)
    return {name: cls for cls, name in found.items()}


def _required(cls):
    return [
        p.name for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def construct(name, kwargs=None):
    """A new layer of the exported class `name`."""
    cls = exported_classes()[name]
    values = {p: REQUIRED[p] for p in _required(cls) if p in REQUIRED}
    parameters = inspect.signature(cls.__init__).parameters
    values.update({p: v for p, v in OPTIONAL.items() if p in parameters})
    values.update(EXTRA.get(name, {}))
    values.update(kwargs or {})
    values = {k: v() if callable(v) else v for k, v in values.items()}
    return cls(**values)


def _inputs(name):
    cls = exported_classes()[name]
    if "input_dim" in _required(cls):
        return [IDS, *FLOAT_INPUTS]
    if ".image_preprocessing." in cls.__module__:
        return [IMAGES, *FLOAT_INPUTS]
    return FLOAT_INPUTS


class Calls:
    """How many times the block's and the head's `call()` ran in training
    (not counted: the symbolic runs that find the output's structure)."""

    def __init__(self):
        self.block = self.head = 0


def _counted(training):
    """1 for a call in training that is not symbolic, else 0."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return int(bool(training) and not in_symbolic_scope())


class Block(keras.layers.Layer):
    """A `Dense` projection (of float inputs) and the layer under test,
    called as `pattern` says, then `tanh`; `training` passed through where
    the layer's `call()` takes it. Its `call()` is counted in `calls` (a
    `Calls`)."""

    def __init__(self, layer, pattern, input_dtype, width, calls, **kwargs):
        super().__init__(**kwargs)
        self.layer, self.pattern, self.calls = layer, pattern, calls
        self.input_dtype = input_dtype
        self.project = None
        if input_dtype.startswith("float"):
            self.project = keras.layers.Dense(width)  # the input's width
        self.takes_training = "training" in inspect.signature(
            layer.call
        ).parameters

    def build(self, input_shape):
        # Built here, not by Keras tracing `call()` (which would turn an
        # error into a warning); the layer on a symbolic tensor, outside
        # any graph (`Normalization` keeps tensors made when it builds).
        shape, dtype = tuple(input_shape), self.input_dtype
        if self.project is not None:
            self.project.build(shape)
            dtype = self.project.compute_dtype
        self._apply(keras.KerasTensor(shape, dtype=dtype))

    def call(self, x, training=None):
        self.calls.block += _counted(training)
        h = x if self.project is None else self.project(x)
        # A nonlinearity after the layer: the gradient then depends on its
        # output (not so for `GaussianNoise`'s, `x + noise`, alone), so
        # that a recomputation that drew new noise would show.
        return keras.ops.tanh(self._apply(h, training))

    def _apply(self, h, training=None):
        kwargs = dict(training=training) if self.takes_training else {}
        if self.pattern == "h, h":  # query, value
            return self.layer(h, h, **kwargs)
        if self.pattern == "[h, h]":
            return self.layer([h, h], **kwargs)
        return self.layer(h, **kwargs)


class Head(keras.layers.Flatten):
    """`Flatten`, its `call()` counted: once per trace of a forward pass of
    training."""

    def __init__(self, calls, **kwargs):
        super().__init__(**kwargs)
        self.calls = calls

    def call(self, x, training=None):
        self.calls.head += _counted(training)
        return super().call(x)


def _model(name, kwargs, dtype, shape, pattern, calls):
    layer = construct(name, kwargs)
    inputs = keras.Input(shape, dtype=dtype)
    block = Block(layer, pattern, dtype, shape[-1], calls, name="zoo_block")
    # Built in training: the shapes of training (`RandomCrop` crops only
    # in training).
    x = Head(calls)(block(inputs, training=True))
    return keras.Model(inputs, keras.layers.Dense(2)(x)), block


def _patterns(name):
    """How the layer is called on the projection `h`, in the order tried."""
    cls = exported_classes()[name]
    if "value" in inspect.signature(cls.call).parameters:
        return ["h, h"]  # attention: query, value
    return ["h", "[h, h]"]


def find_build(name, kwargs=None):
    """`(dtype, shape, pattern)` of the first input and call pattern on
    which the model builds symbolically, and whether the layer has state
    (weights, or a seed generator's). A layer that builds on none but
    builds on its own without state is stateless (`None, None, None,
    False`: TensorFlow has no float64 `MaxPool3D`). Raises the first
    error otherwise."""
    errors = []
    for dtype, shape in _inputs(name):
        for pattern in _patterns(name):
            try:
                _, block = _model(name, kwargs, dtype, shape, pattern,
                                  Calls())
            except Exception as error:  # the next candidate
                errors.append(error)
                continue
            return dtype, shape, pattern, bool(block.layer.variables)
    for _, shape in _inputs(name):
        layer = construct(name, kwargs)
        try:
            layer.build((None, *shape))
        except Exception:  # the next candidate
            continue
        if not layer.variables:
            return None, None, None, False
    raise errors[0]


# The cases: each class that is not excluded, with its defaults, and the
# variants. id -> (class name, keyword arguments).
CASES = {
    name: (name, {}) for name in sorted(exported_classes())
    if name not in EXCLUDED
}
CASES.update(VARIANTS)

# Mode -> (accumulation options, compile options, batch size, the mode of
# the run without `remat` that the run with it is compared with). In the
# step, micro-batches of 2 in batches of 4 are graph mode's windows.
MODES = {
    "graph": (dict(gradient_accumulation_steps=2), dict(jit_compile=False),
              2, "graph"),
    "in_step": (dict(gradient_accumulation_steps=1, micro_batch_size=2),
                dict(jit_compile=False), 4, "graph"),
    "jit": (dict(gradient_accumulation_steps=2), dict(jit_compile=True),
            2, "jit"),
}

# The runs without `remat`, by (case, mode), as `_train` returns them (in
# the step shares graph mode's).
_PLAIN = {}


def _data(dtype, shape):
    rng = np.random.RandomState(0)
    if dtype.startswith("int"):
        x = rng.randint(1, 10, size=(8, *shape)).astype(dtype)
    else:
        x = rng.rand(8, *shape)
    return x, rng.rand(8, 2)


def _train(case, mode, remat, accumulate=True):
    """The case's model (the same initial weights in each run), and a
    function that trains it for one epoch of 8 samples; returns the
    weights before training, and the calls of the block and the head
    (counted from the first trace of training on). `accumulate=False`:
    plain `keras.Model`."""
    name, kwargs = CASES[case]
    dtype, shape, pattern, _ = find_build(name, kwargs)
    options, compile_kwargs, batch_size, _ = MODES[mode]
    calls = Calls()
    keras.utils.set_random_seed(0)
    model, _ = _model(name, kwargs, dtype, shape, pattern, calls)
    calls.block = calls.head = 0  # the symbolic build's
    initial = _values(model.weights)
    if accumulate:
        model = GAM.from_model(model, remat=remat, **options)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  **compile_kwargs)

    def fit():
        keras.utils.set_random_seed(7)  # the same dropout and noise seeds
        model.fit(*_data(dtype, shape), batch_size=batch_size, epochs=1,
                  shuffle=False, verbose=0)
        return _values(model.weights) + _values(model.optimizer.variables)

    return model, fit, initial, calls


def _values(variables):
    return [(v.path, np.array(v, dtype=np.float64)) for v in variables]


def _plain(case, mode):
    """The run without `remat` that `mode`'s run with it is compared with:
    its weights and optimizer variables after training, and the calls.
    Skips the test where plain `keras.Model` cannot train the model in
    this mode either (XLA has no `StatelessRandomGammaV3`, which `MixUp`
    and `CutMix` draw from; `RandomElasticTransform`'s shapes are not
    static): nothing to compare."""
    key = (case, MODES[mode][3])
    if key not in _PLAIN:
        _, fit, _, calls = _train(case, key[1], False)
        try:
            _PLAIN[key] = fit(), calls
        except Exception as error:
            _, keras_fit, _, _ = _train(case, key[1], False, accumulate=False)
            try:
                keras_fit()
            except Exception:
                pytest.skip("plain keras.Model cannot train it in this mode "
                            f"either: {_summary(error)}")
            raise
    return _PLAIN[key]


def _summary(error):
    """`error`'s type and its line that says the most (XLA's reason)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if "XLA" in line] or lines or [""]
    return f"{type(error).__name__}: {said[0][:300]}"


def _difference(a, b):
    """The largest absolute difference between two states (of the same
    variables, in order), and where."""
    assert len(a) == len(b)
    return max(
        (float(np.max(np.abs(x - y), initial=0.0)), path)
        for (path, x), (_, y) in zip(a, b)
    )


# The cases that run in the main job, in graph mode: layers with state
# that training writes or draws from (statistics, seeds, a written kernel).
# The others run in the second job: the graph cases take about 110 s of CPU
# together (65 cases, measured with --durations=0), these some 9 s.
MAIN_JOB = {
    "BatchNormalization-renorm",
    "SpectralNormalization",
    "Dropout",
    "LSTM-dropout",
}


def _marks(case, mode):
    if mode == "graph" and case in MAIN_JOB:
        return []
    return [pytest.mark.slow]


@pytest.mark.parametrize("case, mode", [
    pytest.param(case, mode, marks=_marks(case, mode), id=f"{case}-{mode}")
    for case in CASES for mode in MODES
])
def test_layer_trains_as_without_remat(float64, case, mode, record_property):
    name, kwargs = CASES[case]
    stateful = find_build(name, kwargs)[3]
    if not stateful:
        pytest.skip(f"{name}: no weights and no seed generator (stateless)")
    plain, plain_calls = _plain(case, mode)
    # Without `remat`, each trace calls the block as often as the head.
    assert plain_calls.block == plain_calls.head >= 1
    model, fit, initial, calls = _train(case, mode, True)
    try:
        ours = fit()
    except remat_lib.UnreplayableLayerError as error:
        record_property("result", f"refused: {error}")
        assert "zoo_block" in str(error)
        # At the first step: nothing trained.
        assert _difference(initial, _values(model.weights))[0] == 0
        return
    assert model.remat is True and model.remat_active
    # Keras compiles without XLA a model with a layer that cannot
    # (`RandomCrop`, `RandomZoom`, ...): the "jit" case then runs in graph
    # mode.
    record_property("jit_compile", model.jit_compile)
    # Each trace of a forward pass of training is recomputed once.
    assert calls.head >= 1
    assert calls.block - calls.head == calls.head
    difference, where = _difference(plain, ours)
    record_property("result", "exact")
    record_property("max_difference", difference)
    assert difference <= EXACT, f"{where}: {difference:.3g}"
    moved, _ = _difference(initial, ours[:len(initial)])
    record_property("moved", moved)
    assert moved > 1e-3  # it trained


@pytest.mark.slow  # builds every class: some 10 s of CPU
def test_every_exported_layer_is_run_skipped_or_excluded(float64):
    # A class that Keras exports is run (it builds here and has state), or
    # skipped (it builds and has none), or excluded with a reason: a class
    # that a new release adds and that builds on none of the inputs fails
    # here, to be taught (`REQUIRED`, `EXTRA`) or excluded.
    unbuilt = {}
    for name in sorted(exported_classes()):
        if name in EXCLUDED:
            continue
        try:
            find_build(name)
        except Exception as error:
            unbuilt[name] = f"{type(error).__name__}: {error}"[:500]
    assert not unbuilt, (
        "Layer classes that build on none of the inputs here; teach "
        "`REQUIRED`/`EXTRA` to build them, or add them to `EXCLUDED` with "
        f"the reason: {unbuilt}"
    )
