"""Model builders and the side-by-side trainer used by the tests."""

import hashlib
import json
import os
import shutil

import keras
import numpy as np
import tensorflow as tf

import keras_accum


def import_keras_hub():
    """keras_hub, or the calling test (module) skipped with the reason: not
    installed, or a release that does not import with this Keras (keras-hub
    0.32 imports a name that Keras 3.16 no longer re-exports)."""
    import pytest

    try:
        import keras_hub
    except ImportError as error:
        pytest.skip(
            f"keras_hub cannot be imported: {error}", allow_module_level=True
        )
    return keras_hub


def keras_version():
    """This Keras' (major, minor) version."""
    return tuple(int(part) for part in keras.__version__.split(".")[:2])


# Keras before 3.13 divides a masked mean (the "sum_over_batch_size" and
# "mean" reductions with `ignore_class` or a Keras mask) by the number of
# valid elements plus `keras.config.epsilon()` (1e-7), not by the number:
# `apply_mask()` in keras/src/losses/loss.py reads, up to Keras 3.12.4,
#     mask *= total / (valid + backend.epsilon())
# and from Keras 3.13.0
#     mask *= ops.divide_no_nan(total, valid)
# The big batch then divides its sum by `V + eps`, each micro-batch by
# `v_k + eps`, and the window's normaliser is the exact `V = sum(v_k)`: the
# two updates differ by about `eps / v_k` relative, at most `eps` when a
# micro-batch holds one valid element or more. (Measured in float64 on
# Keras 3.8 to 3.12: 1e-9 to 5e-9; with the epsilon set to 1e-300: 2e-15.)
MASKED_MEAN_ADDS_EPSILON = keras_version() < (3, 13)


def masked_mean_rtol(rtol, reduction="sum_over_batch_size"):
    """The tolerance of an update whose loss is a masked mean.

    `rtol`, unless this Keras adds its epsilon to the masked mean's divisor
    (see above): then the epsilon, the most a micro-batch with one valid
    element or more can be off by.
    """
    if MASKED_MEAN_ADDS_EPSILON and reduction in (
        "mean", "sum_over_batch_size"
    ):
        return max(rtol, keras.config.epsilon())
    return rtol


def dense_net(num_classes=3, features=6, regularizer=None):
    """A small MLP: (features,) -> logits of `num_classes`."""
    inputs = keras.Input((features,))
    h = keras.layers.Dense(
        7, activation="tanh", kernel_regularizer=regularizer
    )(inputs)
    outputs = keras.layers.Dense(num_classes)(h)
    return inputs, outputs


def segmentation_net(num_classes=3, size=8):
    """A tiny fully-convolutional net: (size, size, 3) -> per-pixel logits."""
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    outputs = keras.layers.Conv2D(num_classes, 1)(h)
    return inputs, outputs


class SubclassedMLP:
    """`dense_net()`'s layers and `call()`, for a subclassed model class."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(7, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


class Subclassed(SubclassedMLP, keras.Model):
    """`dense_net()` as a subclassed `keras.Model`."""


class AccumulatingSubclassed(
    SubclassedMLP, keras_accum.GradientAccumulationModel
):
    """`dense_net()` as a subclassed `GradientAccumulationModel`."""


class Plain(keras_accum.GradientAccumulationModel):
    """A subclassed `GradientAccumulationModel`: one `Dense(units)`."""

    def __init__(self, units=1, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)


def twins(build, steps, **kwargs):
    """Plain `keras.Model` and `GradientAccumulationModel`, same weights."""
    keras.utils.set_random_seed(0)
    reference = keras.Model(*build())
    ours = keras_accum.GradientAccumulationModel(
        *build(), gradient_accumulation_steps=steps, **kwargs
    )
    ours.set_weights(reference.get_weights())
    return reference, ours


def _in_step(ours, micro_batch, steps):
    """Ours with micro-batches of `micro_batch` inside each step.

    Windows of two steps when `steps` is even (one otherwise): the batch is
    `steps * micro_batch / 2`. Returns that batch size and a function that
    checks that training saw `micro_batch` rows at most (and `rows` in all).
    """
    windows = 2 if steps % 2 == 0 else 1
    ours.gradient_accumulation_steps = windows
    ours.micro_batch_size = micro_batch
    layer = next(x for x in ours.layers if x.trainable_weights)
    largest = tf.Variable(0, trainable=False)
    seen = tf.Variable(0, trainable=False)
    call, train_step = layer.call, ours.train_step
    training = []

    def watched(inputs, *args, **kwargs):
        if training:  # inside `train_step`, not validation or predict
            rows = tf.shape(keras.tree.flatten(inputs)[0])[0]
            largest.assign(tf.maximum(largest, rows))
            seen.assign_add(rows)
        return call(inputs, *args, **kwargs)

    def watched_train_step(data):
        training.append(True)
        try:
            return train_step(data)
        finally:
            training.pop()

    layer.call = watched
    ours.train_step = watched_train_step

    def check(rows):
        assert int(largest.numpy()) == micro_batch
        if rows is not None:
            assert int(seen.numpy()) == rows

    return steps * micro_batch // windows, check


def fit_side_by_side(
    reference,
    ours,
    x,
    y,
    micro_batch,
    steps,
    optimizer,
    loss,
    compile_kwargs,
    sample_weight=None,
    epochs=1,
    loss_weights=None,
    metrics=None,
    in_step=False,
    same_mode=False,
    **fit_kwargs,
):
    """Trains `reference` on batches of `steps * micro_batch` and `ours` on
    micro-batches of `micro_batch`, same samples, same order.

    `in_step`: ours with the micro-batches inside the train step
    (`micro_batch_size`, see `_in_step()`), as the `in_step` fixture says
    (True in tests/test_in_step.py). The reference trains in graph mode
    whatever the mode of ours (in the mode of ours if `same_mode`, for a
    bitwise comparison), once per configuration (`fit_reference`).

    Returns:
        (initial weights, reference History, our History)
    """
    initial = [np.array(w) for w in reference.get_weights()]
    histories = []
    batch, check = micro_batch, None
    if in_step:
        batch, check = _in_step(ours, micro_batch, steps)
    for model, batch in ((reference, steps * micro_batch), (ours, batch)):
        is_reference = model is reference
        model.compile(
            optimizer=optimizer(),
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            **(dict(compile_kwargs, **REFERENCE_MODE)
               if is_reference and not same_mode else compile_kwargs),
        )
        fit_args = dict(
            x=x,
            y=y,
            sample_weight=sample_weight,
            batch_size=batch,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            **fit_kwargs,
        )
        histories.append(
            fit_reference(model, **fit_args) if is_reference
            else model.fit(**fit_args)
        )
    if check is not None:
        check(None if "steps_per_epoch" in fit_kwargs else len(x) * epochs)
    return initial, histories[0], histories[1]


# The reference of `fit_side_by_side` is plain `keras.Model` in graph mode,
# whatever the mode of ours: the big batch's update does not depend on how
# Keras executes it, and one mode lets cases that differ only in the mode
# of ours (and tests/test_in_step.py's reruns) share its training.
REFERENCE_MODE = dict(run_eagerly=False, jit_compile=False)

# Where finished reference trainings are kept for the test run (set by
# conftest.py; shared by the pytest-xdist workers). `None`: not kept.
REFERENCE_RUNS = None


def fit_reference(reference, **fit_args):
    """`reference.fit(**fit_args)` for a compiled plain `keras.Model`, or
    the outcome of the same training earlier in this test run: its final
    weights, optimizer iterations and history, put in place.

    A training is the same when everything that determines it is: the
    architecture, the initial weights, the compile arguments, the precision,
    the data and the fit arguments (`_fingerprint`). One that cannot be
    fingerprinted (a dataset, callbacks) is trained every time.
    """
    key = _fingerprint(reference, fit_args) if REFERENCE_RUNS else None
    if key is None:
        return reference.fit(**fit_args)
    trained = []

    def train(part):
        history = reference.fit(**fit_args)
        trained.append(history)
        weights = reference.get_weights()
        np.savez(
            part / "weights.npz", **{f"w{i}": w for i, w in enumerate(weights)}
        )
        (part / "done").write_text(json.dumps({
            "iterations": int(reference.optimizer.iterations.numpy()),
            "history": {k: [float(v) for v in values]
                        for k, values in history.history.items()},
        }))

    folder = made_once(REFERENCE_RUNS / key, train)
    if trained:
        return trained[0]
    with np.load(folder / "weights.npz") as saved:
        reference.set_weights([saved[f"w{i}"] for i in range(len(saved))])
    outcome = json.loads((folder / "done").read_text())
    reference.optimizer.iterations.assign(outcome["iterations"])
    history = keras.callbacks.History()
    history.history = outcome["history"]
    return history


def made_once(folder, make):
    """`folder` (a `pathlib.Path`), made by `make(part)` unless it exists.

    `make` fills a folder of this process's own, which is then renamed to
    `folder`: a `folder` that exists is complete, whichever pytest-xdist
    worker made it. If another one made it meanwhile, its copy is kept.
    """
    if folder.exists():
        return folder
    part = folder.with_name(f"{folder.name}.{os.getpid()}.part")
    part.mkdir(parents=True, exist_ok=True)
    make(part)
    try:
        part.rename(folder)
    except OSError:  # another worker made it first
        shutil.rmtree(part, ignore_errors=True)
    return folder


def _fingerprint(reference, fit_args):
    """A digest of what determines `reference.fit(**fit_args)`, or `None`
    (also for a model that draws random numbers: they depend on what ran
    before in the process)."""
    if type(reference).__name__ != "Functional" or _draws_random(reference):
        return None
    digest = hashlib.sha256()

    def add(value):
        if isinstance(value, np.ndarray):
            digest.update(f"{value.dtype}{value.shape}".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, (list, tuple)):
            digest.update(f"{type(value).__name__}{len(value)}".encode())
            for item in value:
                add(item)
        elif isinstance(value, dict):
            digest.update(f"dict{len(value)}".encode())
            for name in sorted(value):
                add(name)
                add(value[name])
        elif value is None or isinstance(value, (bool, int, float, str)):
            digest.update(repr((type(value).__name__, value)).encode())
        else:
            raise TypeError(type(value))

    try:
        add(keras.config.floatx())
        add(keras.config.dtype_policy().name)
        add(reference.to_json())
        add([np.asarray(w) for w in reference.get_weights()])
        add(json.dumps(reference.get_compile_config(), sort_keys=True,
                       default=repr))
        add(fit_args)
    except TypeError:
        return None
    return digest.hexdigest()


def _draws_random(layer):
    """Whether `layer` or a layer in it has a seed generator (`Dropout`)."""
    return hasattr(layer, "seed_generator") or any(
        _draws_random(inner) for inner in getattr(layer, "layers", [])
    )


def classification_data(n=40, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(keras.config.floatx())
    y = rng.integers(0, classes, size=(n,))
    return x, y


def segmentation_data(n=16, size=8, classes=3, ignore=255, seed=0):
    """Per-pixel labels with a different share of ignored pixels per sample."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, size, size, 3)).astype(keras.config.floatx())
    y = rng.integers(0, classes, size=(n, size, size))
    for i in range(n):
        share = (i % 5) / 5.0  # 0% .. 80% ignored
        y[i][rng.random((size, size)) < share] = ignore
    return x, y


def buffers(model):
    """The model's accumulation buffers, through the public `state()`."""
    state = model.gradient_accumulator.state()
    return [v for name, v in state.items() if name.startswith("buffer_")]


class Interrupt(keras.callbacks.Callback):
    """Raises `RuntimeError("interrupted")` after train batch `batch`
    (1-based) of epoch `epoch`: the first call of `steps_per_execution`
    batches that reaches it."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == self.at[0] and batch + 1 >= self.at[1]:
            raise RuntimeError("interrupted")
