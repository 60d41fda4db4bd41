"""Drawn configurations of the exactness promise, and how one is checked.

The promise "the applied update equals plain Keras on one big batch of the
same samples" is a product of dimensions: the mode (micro-batches across
train steps, inside one step with a fixed `micro_batch_size`, or `"auto"`),
the input (arrays, `tf.data` of known length, `tf.data` with `.filter()`,
i.e. of unknown length, a Python generator), the strategy (one device, or
`MirroredStrategy` on 2 logical CPUs), N, the batch and sample counts
(whole windows or not), the epochs, `flush_at_epoch_end`, the loss (mean,
sum, `sample_weight` with either reduction, `ignore_class`, a Keras mask),
the optimizer, `steps_per_execution`, the layers recomputed (`remat`) and
how ours is written (functional, `Sequential` with or without an `Input`,
subclassed, built before `fit()` or not). `cases()` draws a point of that
space as a JSON-able dict; `run_case()` trains ours on it and the
reference, and returns what `check()` asserts.

The reference is independent of the code under test: plain `keras.Model`,
same initial weights, float64, one update per window on the window's
samples concatenated (the big batch), on one device. What a window holds
(README, docs/semantics.md): the input's batches of an epoch, in order,
N at a time (N train steps, whatever the mode: across steps each step is
one micro-batch, inside the step each step's batch is split into
micro-batches of `micro_batch_size` rows); a short last window of an epoch
is applied at the epoch's end, or with `flush_at_epoch_end=False` carries
over into the next epoch and is applied when `fit()` ends at the latest.
`steps_per_execution` and the strategy change how the steps run, not the
windows.

Used by tests/test_generative.py in the test process (one device) and by
tests/distributed/generative_worker.py (`MirroredStrategy`).
"""

import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from hypothesis import assume  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import keras_accum  # noqa: E402

MODES = ("across", "in_step", "auto")
INPUTS = ("arrays", "dataset", "filtered", "generator")
LOSSES = (
    "mean", "sum", "sample_weight", "mean_with_sample_weight",
    "ignore_class", "masking",
)
OPTIMIZERS = ("sgd", "adam")
# How ours is written: functional, `Sequential` with or without an `Input`,
# a `keras.Model` subclass built before `fit()` or by it (all converted by
# `from_model()`); the reference is always functional.
STYLES = (
    "functional", "sequential", "sequential_no_input", "subclassed",
    "subclassed_built",
)
STRATEGIES = ("one_device", "mirrored")

# float64 claims exactness (docs/semantics.md: <= 1e-9 relative).
RTOL = 1e-9
IGNORE = 255  # the ignored class of the "ignore_class" loss
TIMESTEPS, FEATURES, CLASSES = 3, 2, 3


def excluded(case):
    """Why `case` is left out (a combination that plain Keras itself gets
    wrong, so no reference exists), or `None`."""
    mirrored = case["strategy"] == "mirrored"
    if mirrored and case["steps_per_execution"] > 1:
        # Plain Keras under `MirroredStrategy` with steps_per_execution > 1
        # fails too.
        return "steps_per_execution > 1 under MirroredStrategy"
    if mirrored and case["input"] == "generator":
        # Plain Keras does not distribute a Python generator's batches.
        return "a Python generator under MirroredStrategy"
    if (
        case["input"] == "generator" and case["epochs"] > 1
        and len(batches(case)) % case["steps_per_execution"]
    ):
        # With `steps_per_epoch` (the endless generator of two epochs) not
        # a multiple of `steps_per_execution`, plain Keras runs whole
        # executions: it trains on more batches per epoch than
        # `steps_per_epoch` (measured on Keras 3.15: 4 updates for
        # `steps_per_epoch=1`, 2 epochs, `steps_per_execution=2`).
        return "steps_per_epoch not a multiple of steps_per_execution"
    unknown_length = case["input"] == "filtered" or (
        case["input"] == "generator" and case["epochs"] == 1
    )
    if (
        not mirrored and case["mode"] == "across" and case["steps"] == 1
        and unknown_length
    ):
        # N = 1 across steps on one device is Keras' own train step (across
        # replicas it takes the window's normalisation): on input of unknown
        # length Keras counts the epoch's extra train call in
        # `optimizer.iterations`, which across epochs also changes Adam's
        # update (docs/semantics.md, "Inputs of unknown length").
        return "N=1 across steps on input of unknown length"
    return None


@st.composite
def cases(draw, strategy=st.sampled_from(STRATEGIES)):
    """A configuration: a JSON-able dict that `run_case()` takes."""
    strategy = draw(strategy)
    mirrored = strategy == "mirrored"
    mode = draw(st.sampled_from(MODES))
    steps = draw(st.integers(1, 4))
    if mode == "across":
        batch, micro_batch_size = draw(st.integers(1, 4)), None
    elif mode == "in_step":
        micro_batch_size = draw(st.integers(1, 3))
        batch = draw(st.integers(1, 8))
    else:
        micro_batch_size, batch = "auto", draw(st.integers(1, 8))
    case = dict(
        strategy=strategy,
        mode=mode,
        # Not what `excluded()` leaves out under MirroredStrategy.
        input=draw(st.sampled_from(
            [i for i in INPUTS if not (mirrored and i == "generator")]
        )),
        steps=steps,
        batch=batch,
        micro_batch_size=micro_batch_size,
        # Whole windows (1 to 3), or from less than one window to a few.
        samples=draw(st.one_of(
            st.integers(1, 3).map(lambda k: k * steps * batch),
            st.integers(1, 3 * steps * batch + batch),
        )),
        epochs=draw(st.integers(1, 2)),
        flush_at_epoch_end=draw(st.booleans()),
        loss=draw(st.sampled_from(LOSSES)),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        steps_per_execution=draw(st.integers(1, 1 if mirrored else 3)),
        seed=draw(st.integers(0, 3)),
        # Recomputation of one or both layers in the backward pass (the
        # names of `remat=`, comma-separated; a case is hashable).
        remat=draw(st.sampled_from(["", "hidden", "hidden,logits"])),
        style=draw(st.sampled_from(STYLES)),
    )
    assume(excluded(case) is None)
    return case


def describe(case):
    """One line naming the case."""
    return ", ".join(f"{k}={v}" for k, v in case.items())


@contextlib.contextmanager
def float64():
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def make_data(case):
    """`x` (samples, TIMESTEPS, FEATURES), `y` (samples, TIMESTEPS) class
    labels and `sample_weight` (samples, TIMESTEPS) or `None`."""
    rng = np.random.default_rng(case["seed"])
    n = case["samples"]
    x = rng.normal(size=(n, TIMESTEPS, FEATURES))
    y = rng.integers(0, CLASSES, size=(n, TIMESTEPS))
    weights = None
    if case["loss"] == "ignore_class":
        # 0 to all labels of a sample ignored, differing per sample.
        y[rng.random((n, TIMESTEPS)) < rng.random((n, 1))] = IGNORE
    elif case["loss"] == "masking":
        # 0 to all time steps of a sample masked (all-zero features).
        x[rng.random((n, TIMESTEPS)) < rng.random((n, 1)) * 0.9] = 0.0
    elif "sample_weight" in case["loss"]:
        # Per label (Keras does not broadcast one per sample against the
        # time steps), some of them 0.
        weights = rng.uniform(0.0, 3.0, size=(n, TIMESTEPS))
        weights[rng.random((n, TIMESTEPS)) < 0.2] = 0.0
    return x, y, weights


def build(case, cls, **kwargs):
    """Per time step: Dense(4, tanh), Dense(CLASSES) logits; after
    Masking for the "masking" loss. (Keras' mask and a sample weight per
    sample do not broadcast against each other.)"""
    inputs = keras.Input((TIMESTEPS, FEATURES))
    h = inputs
    if case["loss"] == "masking":
        h = keras.layers.Masking(0.0)(h)
    h = keras.layers.Dense(4, activation="tanh", name="hidden")(h)
    outputs = keras.layers.Dense(CLASSES, name="logits")(h)
    return cls(inputs, outputs, **kwargs)


class PerTimeStep(keras.Model):
    """`build()`'s layers as a `keras.Model` subclass."""

    def __init__(self, masking, initial, **kwargs):
        super().__init__(**kwargs)
        self.masking = keras.layers.Masking(0.0) if masking else None
        self.hidden, self.logits = _dense_layers(initial)

    def call(self, x):
        if self.masking is not None:
            x = self.masking(x)
        return self.logits(self.hidden(x))


def _dense_layers(initial):
    """`build()`'s two Dense layers, made with the weights `initial`."""

    def made_with(index):
        return dict(
            kernel_initializer=keras.initializers.Constant(initial[index]),
            bias_initializer=keras.initializers.Constant(initial[index + 1]),
        )

    return (
        keras.layers.Dense(4, activation="tanh", name="hidden",
                           **made_with(0)),
        keras.layers.Dense(CLASSES, name="logits", **made_with(2)),
    )


def build_styled(case, initial, **kwargs):
    """Ours, written as `case["style"]`, with the weights `initial` (a
    model built by `fit()` is made with them)."""
    style = case.get("style", "functional")
    if style == "functional":
        ours = build(case, keras_accum.GradientAccumulationModel, **kwargs)
        ours.set_weights(initial)
        return ours
    masking = case["loss"] == "masking"
    if style.startswith("subclassed"):
        model = PerTimeStep(masking, initial)
        if style == "subclassed_built":
            model(np.zeros((1, TIMESTEPS, FEATURES)))
    else:
        layers = [keras.layers.Masking(0.0)] if masking else []
        layers += list(_dense_layers(initial))
        if style == "sequential":
            layers.insert(0, keras.Input((TIMESTEPS, FEATURES)))
        model = keras.Sequential(layers)
    return keras_accum.GradientAccumulationModel.from_model(model, **kwargs)


def loss(case):
    """A new loss object (it takes `floatx()` as its dtype)."""
    kind = case["loss"]
    reduction = {
        "sum": "sum", "mean_with_sample_weight": "mean_with_sample_weight",
    }.get(kind, "sum_over_batch_size")
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction,
        ignore_class=IGNORE if kind == "ignore_class" else None,
    )


def optimizer(case):
    if case["optimizer"] == "sgd":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.Adam(0.01)


def batches(case):
    """The slices of one epoch's input batches, in order."""
    n, b = case["samples"], case["batch"]
    return [slice(i, min(i + b, n)) for i in range(0, n, b)]


def windows(case):
    """The reference's windows: lists of sample indices, in order."""
    rows = np.arange(case["samples"])
    epoch = [rows[s] for s in batches(case)]
    n = case["steps"]
    if case["flush_at_epoch_end"]:
        return [
            np.concatenate(epoch[i : i + n])
            for _ in range(case["epochs"])
            for i in range(0, len(epoch), n)
        ]
    steps = epoch * case["epochs"]
    return [
        np.concatenate(steps[i : i + n]) for i in range(0, len(steps), n)
    ]


def _input(case, x, y, w):
    """`fit()`'s data arguments for `case["input"]`."""
    arrays = (x, y) if w is None else (x, y, w)
    kind = case["input"]
    if kind == "arrays":
        return dict(
            x=x, y=y, sample_weight=w, batch_size=case["batch"]
        )
    if kind in ("dataset", "filtered"):
        data = tf.data.Dataset.from_tensor_slices(arrays)
        if kind == "filtered":  # unknown length
            data = data.filter(lambda *_: True)
        return dict(x=data.batch(case["batch"]))
    parts = [tuple(a[s] for a in arrays) for s in batches(case)]
    if case["epochs"] == 1:
        # Of unknown length. (Keras reads a Python generator once: a second
        # epoch would see only the batches it peeked at.)
        return dict(x=(part for part in parts))

    def forever():
        while True:
            yield from parts

    return dict(x=forever(), steps_per_epoch=len(parts))


def train_ours(case, x, y, w, initial, strategy=None):
    """Trains `GradientAccumulationModel` on `case`; returns its final
    weights and `optimizer.iterations`."""
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        ours = build_styled(
            case, initial,
            gradient_accumulation_steps=case["steps"],
            micro_batch_size=case["micro_batch_size"],
            flush_at_epoch_end=case["flush_at_epoch_end"],
            remat=case["remat"].split(",") if case.get("remat") else False,
        )
        ours.compile(
            optimizer=optimizer(case), loss=loss(case),
            steps_per_execution=case["steps_per_execution"],
        )
    ours.fit(
        **_input(case, x, y, w), epochs=case["epochs"], shuffle=False,
        verbose=0,
    )
    return ours.get_weights(), int(ours.optimizer.iterations.numpy())


def train_reference(case, x, y, w, initial):
    """Plain `keras.Model` on one device, one update per window on the
    window's samples (one `fit()` over a dataset of the big batches)."""
    reference = build(case, keras.Model)
    reference.set_weights(initial)
    # Eagerly: the big batch's update does not depend on how Keras runs
    # it, and a few eager steps cost less than a trace.
    reference.compile(
        optimizer=optimizer(case), loss=loss(case), run_eagerly=True
    )
    data = None
    for index in windows(case):
        part = (x[index], y[index]) + (() if w is None else (w[index],))
        piece = tf.data.Dataset.from_tensors(part)
        data = piece if data is None else data.concatenate(piece)
    reference.fit(data, epochs=1, shuffle=False, verbose=0)
    return reference.get_weights(), int(reference.optimizer.iterations.numpy())


def update_difference(initial, reference, candidate):
    """max over weights of max|change - reference's| / max|reference's|;
    a weight the reference leaves unchanged contributes its absolute
    change."""
    worst = 0.0
    for w0, a, b in zip(initial, reference, candidate, strict=True):
        da = np.asarray(a, np.float64) - np.asarray(w0, np.float64)
        db = np.asarray(b, np.float64) - np.asarray(w0, np.float64)
        scale = float(np.max(np.abs(da)))
        change = float(np.max(np.abs(da - db)))
        worst = max(worst, change / scale if scale > 0 else change)
    return worst


def update_ratio(initial, reference, candidate):
    """|our total update| / |the reference's| (norms over all weights): 1
    when the updates agree, 2 for one applied twice."""
    norms = []
    for final in (reference, candidate):
        norms.append(np.sqrt(sum(
            float(np.sum((np.asarray(b, np.float64) - w0) ** 2))
            for w0, b in zip(initial, final, strict=True)
        )))
    return norms[1] / norms[0] if norms[0] > 0 else float(norms[1] > 0)


def run_case(case, strategy=None):
    """Trains ours (under `strategy`, if given) and the reference on `case`
    in float64; returns the update difference and both update counts."""
    with float64():
        try:
            keras.utils.set_random_seed(0)
            x, y, w = make_data(case)
            initial = build(case, keras.Model).get_weights()
            error = None
            try:
                ours, iterations = train_ours(case, x, y, w, initial, strategy)
            except Exception as e:  # reported with the case by `check()`
                error = f"{type(e).__name__}: {e}"[:2000]
                ours, iterations = initial, -1
            reference, expected = train_reference(case, x, y, w, initial)
            return dict(
                difference=update_difference(initial, reference, ours),
                update_ratio=update_ratio(initial, reference, ours),
                iterations=iterations,
                reference_iterations=expected,
                error=error,
            )
        finally:
            keras.backend.clear_session()


def check(case, result):
    """Asserts that ours trained `case` as the reference did."""
    where = describe(case)
    assert result["error"] is None, f"{where}: {result['error']}"
    assert result["iterations"] == result["reference_iterations"], (
        f"{where}: {result['iterations']} updates, the reference "
        f"{result['reference_iterations']} (update difference "
        f"{result['difference']:.3g}, update ratio "
        f"{result['update_ratio']:.3g})"
    )
    assert result["difference"] <= RTOL, (
        f"{where}: relative update difference {result['difference']:.3g}, "
        f"update ratio {result['update_ratio']:.3g}"
    )
