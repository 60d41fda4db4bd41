"""The window's state through saving, restoring and inputs of unknown length.

Every save path (`.keras`, `.weights.h5`, `tf.train.Checkpoint` restored
before or after the first step, `ModelCheckpoint`, Keras' own
`BackupAndRestore`) saves in the middle of a window (micro_step 1..N-1) and
at an epoch boundary with a carried window; a fresh model restores it and
trains on the rest of the same samples. The result must equal the
uninterrupted run (float64). Inputs of unknown length must train exactly as
the same samples with known length: plain `keras.Model` on the big batches.
"""

import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import record
from conftest import relative_difference
from helpers import fit_reference
from helpers import made_once

import keras_accum

N = 4  # micro-batches per window
B = 8  # micro-batch
EXACT = 1e-12


def _net(cls=keras_accum.GradientAccumulationModel, batch_norm=False, **kw):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(1)(h)
    return cls(inputs, outputs, **kw)


def _ours(optimizer="sgd", flush_at_epoch_end=True, run_eagerly=True, **kw):
    model = _net(
        gradient_accumulation_steps=N,
        flush_at_epoch_end=flush_at_epoch_end,
        **kw,
    )
    _compile(model, optimizer, run_eagerly=run_eagerly)
    return model


def _compile(model, optimizer, **kwargs):
    optimizer = {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }[optimizer]()
    model.compile(optimizer=optimizer, loss="mse", **kwargs)


def _data(n):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 6)), rng.normal(size=(n, 1))


def _fit(model, x, y, **kwargs):
    kwargs.setdefault("batch_size", B)
    return model.fit(x, y, shuffle=False, verbose=0, **kwargs)


# ----------------------------------------------------------------------
# Save paths x position in the window x optimizer x flush mode
# ----------------------------------------------------------------------
class _At(keras.callbacks.Callback):
    """Calls `action(model, point)` at (epoch, batches done in the epoch)."""

    def __init__(self, points, action):
        super().__init__()
        self.points = set(points)
        self.action = action
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) in self.points:
            self.action(self.model, (self.epoch, batch + 1))

    def on_epoch_end(self, epoch, logs=None):
        if (epoch, "end") in self.points:
            self.action(self.model, (epoch, "end"))


def _saver(path, folder):
    """(callbacks that save at `points`, restore(point) -> model)."""

    def file(point, suffix):
        return os.path.join(folder, f"{point[0]}-{point[1]}{suffix}")

    if path == "keras":
        return (
            lambda points: [
                _At(points, lambda m, p: m.save(file(p, ".keras")))
            ],
            lambda point, make: keras.saving.load_model(
                file(point, ".keras")
            ),
        )
    if path == "weights":

        def restore(point, make):
            model = make()
            model.load_weights(file(point, ".weights.h5"))
            return model

        return (
            lambda points: [
                _At(points, lambda m, p: m.save_weights(file(p, ".weights.h5")))
            ],
            restore,
        )
    if path.startswith("checkpoint"):

        def restore(point, make):
            model = make()
            if path == "checkpoint_after_first_step":
                x, y = _data(B)
                _fit(model, x, y)
            checkpoint = tf.train.Checkpoint(
                model=model, optimizer=model.optimizer
            )
            checkpoint.read(file(point, "")).assert_existing_objects_matched()
            return model

        return (
            lambda points: [
                _At(
                    points,
                    lambda m, p: tf.train.Checkpoint(
                        model=m, optimizer=m.optimizer
                    ).write(file(p, "")),
                )
            ],
            restore,
        )

    # Keras' callbacks write one file over and over: copy it at the points.
    if path == "model_checkpoint":
        latest = os.path.join(folder, "latest.keras")

        def callbacks(points):
            return [
                keras.callbacks.ModelCheckpoint(latest, save_freq=1),
                keras.callbacks.ModelCheckpoint(latest, save_freq="epoch"),
                _At(points, lambda m, p: shutil.copy(latest, file(p, ".keras"))),
            ]

        return callbacks, lambda point, make: keras.saving.load_model(
            file(point, ".keras")
        )

    assert path == "keras_backup_and_restore"
    backups = [os.path.join(folder, "by_batch"), os.path.join(folder, "epoch")]

    def callbacks(points):
        def copy(model, point):
            source = backups[point[1] == "end"]
            shutil.copy(
                os.path.join(source, "latest.weights.h5"),
                file(point, ".weights.h5"),
            )

        return [
            keras.callbacks.BackupAndRestore(
                backups[0], save_freq=1, delete_checkpoint=False
            ),
            keras.callbacks.BackupAndRestore(
                backups[1], save_freq="epoch", delete_checkpoint=False
            ),
            _At(points, copy),
        ]

    def restore(point, make):
        model = make()
        model.load_weights(file(point, ".weights.h5"))
        return model

    return callbacks, restore


SAVE_PATHS = [
    "keras",
    "weights",
    "checkpoint_before_first_step",
    "checkpoint_after_first_step",
    "model_checkpoint",
    "keras_backup_and_restore",
]


def _save_points(flush_at_epoch_end):
    """(epoch, batches done) where the uninterrupted run saves."""
    if flush_at_epoch_end:
        # micro_step 1, 2, 3 of the first window of the last epoch (after
        # the updates of the first one, its partial window included).
        return [(1, 1), (1, 2), (1, 3)]
    # micro_step 3 carried over the boundary; then micro_step 1 and 2.
    return [(0, "end"), (1, 2), (1, 3)]


def _uninterrupted_run(optimizer, flush_at_epoch_end, tmp_path_factory):
    """The uninterrupted run of `optimizer` and flush mode, which saves at
    its points by every path of `SAVE_PATHS` (a folder each): its folder,
    with its final weights and iterations. Trained once per test run, in a
    folder every pytest-xdist worker reads (saving changes nothing: see
    `test_restore_in_graph_and_xla`)."""
    import background

    def train(part):
        callbacks = []
        for path in SAVE_PATHS:
            os.makedirs(part / path)
            savers, _ = _saver(path, str(part / path))
            callbacks += savers(_save_points(flush_at_epoch_end))
        model = _ours(optimizer, flush_at_epoch_end, batch_norm=True)
        x, y = _data(7 * B)
        _fit(model, x, y, epochs=2, callbacks=callbacks)
        np.savez(part / "weights.npz", *model.get_weights())
        (part / "iterations").write_text(str(int(model.optimizer.iterations)))

    name = f"{optimizer}-{flush_at_epoch_end}"
    folder = made_once(
        background.root(tmp_path_factory) / "uninterrupted" / name, train
    )
    with np.load(folder / "weights.npz") as saved:
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    return folder, weights, int((folder / "iterations").read_text())


@pytest.mark.parametrize("flush_at_epoch_end", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("path", SAVE_PATHS)
def test_restore_mid_window_equals_uninterrupted(
    path, optimizer, flush_at_epoch_end, float64, tmp_path_factory
):
    # 7 micro-batches per epoch, 2 epochs: a partial window every epoch
    # (flushed, or carried over the epoch boundary).
    x, y = _data(7 * B)
    epochs = 2
    folder, expected, iterations = _uninterrupted_run(
        optimizer, flush_at_epoch_end, tmp_path_factory
    )
    _, restore = _saver(path, str(folder / path))

    def make():
        return _ours(optimizer, flush_at_epoch_end, batch_norm=True)

    for point in _save_points(flush_at_epoch_end):
        model = restore(point, make)
        epoch, done = point
        if done != "end":
            # The rest of the interrupted epoch, then the later epochs.
            _fit(model, x[done * B :], y[done * B :])
        if epoch + 1 < epochs:
            _fit(model, x, y, epochs=epochs, initial_epoch=epoch + 1)
        diff = relative_difference(expected, model.get_weights())
        record(f"restored mid-window: {path}", diff)
        assert diff <= EXACT, f"{path} at {point}: {diff:.3g}"
        assert int(model.optimizer.iterations) == iterations
        assert int(model.micro_step) == 0


def test_restore_in_graph_and_xla(float64, tmp_path):
    x, y = _data(8 * B)
    for jit_compile in (False, True):
        reference = _net(gradient_accumulation_steps=N, batch_norm=True)
        _compile(reference, "adam", jit_compile=jit_compile)
        _fit(reference, x, y)
        model = _net(gradient_accumulation_steps=N, batch_norm=True)
        _compile(model, "adam", jit_compile=jit_compile)
        file = str(tmp_path / f"{jit_compile}.keras")
        _fit(
            model,
            x,
            y,
            callbacks=[_At([(0, 6)], lambda m, p: m.save(file))],
        )
        # Saving changed nothing in the run that saved.
        assert relative_difference(reference.get_weights(), model.get_weights()) == 0
        loaded = keras.saving.load_model(file)
        assert int(loaded.micro_step) == 2
        _fit(loaded, x[6 * B :], y[6 * B :])
        diff = relative_difference(reference.get_weights(), loaded.get_weights())
        assert diff <= EXACT


def test_file_without_window_state_loads(float64, tmp_path):
    # What keras_accum 0.1 wrote: Keras' numbered variables only.
    plain = _net(keras.Model)
    _compile(plain, "adam")
    x, y = _data(2 * B)
    _fit(plain, x, y)
    plain.save_weights(tmp_path / "plain.weights.h5")
    model = _ours("adam")
    model.load_weights(tmp_path / "plain.weights.h5")
    assert relative_difference(plain.get_weights(), model.get_weights()) == 0
    assert int(model.micro_step) == 0
    assert int(model.optimizer.iterations) == int(plain.optimizer.iterations)


def test_weights_list_is_that_of_keras_model():
    assert len(_ours(batch_norm=True).weights) == len(
        _net(keras.Model, batch_norm=True).weights
    )


# ----------------------------------------------------------------------
# Unknown length
# ----------------------------------------------------------------------
def _batches(x, y):
    for i in range(0, len(x), B):
        yield x[i : i + B], y[i : i + B]


def _unknown_length(kind, x, y):
    if kind == "filter":
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .filter(lambda *_: True)
            .batch(B)
        )
    assert kind == "from_generator"
    spec = (
        tf.TensorSpec((None, 6), tf.float64),
        tf.TensorSpec((None, 1), tf.float64),
    )
    return tf.data.Dataset.from_generator(
        lambda: _batches(x, y), output_signature=spec
    )


def _ours_in(mode, optimizer):
    model = _net(gradient_accumulation_steps=N)
    _compile(
        model, optimizer, run_eagerly=mode == "eager", jit_compile=mode == "jit"
    )
    return model


# Eagerly, Keras' end-of-data call fails before the train step starts.
@pytest.mark.parametrize("mode", ["graph", "jit"])
@pytest.mark.parametrize("kind", ["filter", "from_generator"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("micro_batches", [7, 8])
def test_unknown_length_equals_big_batch(
    micro_batches, kind, optimizer, mode, float64
):
    # An epoch of two windows, the second full (8) or partial (7).
    x, y = _data(micro_batches * B)
    reference = _net(keras.Model)
    _compile(reference, optimizer)
    fit_reference(
        reference, x=x, y=y, batch_size=N * B, epochs=2, shuffle=False,
        verbose=0,
    )

    model = _ours_in(mode, optimizer)
    model.fit(_unknown_length(kind, x, y), epochs=2, verbose=0)
    assert int(model.optimizer.iterations) == 4
    diff = relative_difference(reference.get_weights(), model.get_weights())
    record(f"unknown length: {kind}", diff)
    assert diff <= EXACT, f"{kind}: {diff:.3g}"


@pytest.mark.parametrize("mode", ["graph", "jit"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("micro_batches", [7, 8])
def test_python_generator(micro_batches, optimizer, mode, float64):
    # A generator is read once: one epoch of two windows.
    x, y = _data(micro_batches * B)
    reference = _net(keras.Model)
    _compile(reference, optimizer)
    fit_reference(
        reference, x=x, y=y, batch_size=N * B, shuffle=False, verbose=0
    )

    model = _ours_in(mode, optimizer)
    model.fit(_batches(x, y), verbose=0)
    assert int(model.optimizer.iterations) == 2
    diff = relative_difference(reference.get_weights(), model.get_weights())
    record("unknown length: Python generator", diff)
    assert diff <= EXACT


class _UpdatesPerEpoch(keras.callbacks.Callback):
    """`optimizer.iterations` at each epoch's end (after the window's end)."""

    def __init__(self):
        super().__init__()
        self.iterations = []

    def on_epoch_end(self, epoch, logs=None):
        self.iterations.append(int(self.model.optimizer.iterations))


# Graph mode, where Keras calls the train function once more at each epoch's
# end and that call's input runs out.
@pytest.mark.parametrize(
    "micro_batches, flush_at_epoch_end, updates",
    [(8, True, [2, 4]), (7, True, [2, 4]), (7, False, [1, 4])],
)
def test_updates_per_epoch_on_unknown_length(
    micro_batches, flush_at_epoch_end, updates, float64
):
    # One update per window, none for Keras' extra call at an epoch's end:
    # epochs of 2 windows, the second full (8) or flushed (7); or, with the
    # window carried over, 14 micro-batches in windows of 4 and a flushed 2.
    x, y = _data(micro_batches * B)
    reference = _net(keras.Model)
    _compile(reference, "adam")
    epochs = 2 if flush_at_epoch_end else 1
    if not flush_at_epoch_end:
        x, y = np.concatenate([x, x]), np.concatenate([y, y])
    fit_reference(
        reference, x=x, y=y, batch_size=N * B, epochs=epochs, shuffle=False,
        verbose=0,
    )
    model = _ours("adam", flush_at_epoch_end, run_eagerly=False)
    seen = _UpdatesPerEpoch()
    x, y = x[: micro_batches * B], y[: micro_batches * B]
    model.fit(
        _unknown_length("filter", x, y), epochs=2, verbose=0, callbacks=[seen]
    )
    assert seen.iterations == updates
    diff = relative_difference(reference.get_weights(), model.get_weights())
    record("unknown length: updates per epoch", diff)
    assert diff <= EXACT, f"{flush_at_epoch_end}: {diff:.3g}"


def test_one_step_per_update_counts_as_keras_on_unknown_length(float64):
    """N = 1 is Keras' own train step, bit for bit, with Keras' count.

    On input of unknown length, plain `keras.Model` itself counts one more
    optimizer iteration per epoch than it has batches in graph mode (the
    extra call at the epoch's end, whose input runs out; 3.15.1: 14 for 12
    batches in 2 epochs). N = 1 keeps Keras' step and so its count
    (docs/semantics.md); the count is measured on plain Keras here.
    """
    x, y = _data(6 * B)
    counts, weights = [], []
    for cls, kw in ((keras.Model, {}), (keras_accum.GradientAccumulationModel,
                                        dict(gradient_accumulation_steps=1))):
        model = _net(cls, **kw)
        _compile(model, "adam")
        seen = _UpdatesPerEpoch()
        model.fit(
            _unknown_length("filter", x, y), epochs=2, verbose=0,
            callbacks=[seen],
        )
        counts.append(seen.iterations)
        weights.append(model.get_weights())
    assert counts[1] == counts[0]
    for keras_weight, ours in zip(*weights, strict=True):
        np.testing.assert_array_equal(ours, keras_weight)


def test_empty_fit_changes_nothing(float64):
    x, y = _data(6 * B)
    model = _ours("adam", run_eagerly=False)
    _fit(model, x, y)
    before = model.get_weights()
    iterations = int(model.optimizer.iterations)
    empty = tf.data.Dataset.from_tensor_slices((x, y)).filter(
        lambda *_: False
    )
    model.fit(empty.batch(B), epochs=2, verbose=0)
    assert int(model.optimizer.iterations) == iterations
    assert relative_difference(before, model.get_weights()) == 0


# ----------------------------------------------------------------------
# What callbacks see at the end of an epoch
# ----------------------------------------------------------------------
class _Seen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.at_epoch_end = []

    def on_epoch_end(self, epoch, logs=None):
        self.at_epoch_end.append(
            (
                int(self.model.optimizer.iterations),
                int(getattr(self.model, "micro_step", 0)),
                [np.array(w) for w in self.model.get_weights()],
                logs.get("val_loss"),
            )
        )


def _reference_epoch_ends(x, y, validation, epochs=1):
    """What `_Seen` sees of plain Keras (Adam) on `(x, y)` in batches of
    N * B, validated on `validation` after each epoch."""
    seen = _Seen()
    reference = _net(keras.Model)
    _compile(reference, "adam")
    reference.fit(
        x, y, batch_size=N * B, epochs=epochs, shuffle=False, verbose=0,
        validation_data=validation, callbacks=[seen],
    )
    return seen.at_epoch_end


def _assert_same_epoch_ends(reference, ours):
    """Each epoch end that `ours` saw (`_Seen.at_epoch_end`) is the
    reference's: its update count, no pending window, its weights, and a
    validation of those weights."""
    for (it_ref, _, w_ref, val_ref), (it, micro_step, w, val) in zip(
        reference, ours, strict=True
    ):
        assert (it, micro_step) == (it_ref, 0)
        assert relative_difference(w_ref, w) <= EXACT
        np.testing.assert_allclose(val, val_ref, rtol=1e-12)


class _Batches(keras.utils.PyDataset):
    """`(x, y)` in micro-batches of B, as a `keras.utils.PyDataset`; an
    infinite one (`num_batches` `None`) repeats them."""

    def __init__(self, x, y, infinite=False, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.infinite = x, y, infinite
        self.batches = -(-len(x) // B)

    @property
    def num_batches(self):
        return None if self.infinite else self.batches

    def __getitem__(self, index):
        rows = slice(index % self.batches * B, (index % self.batches + 1) * B)
        return self.x[rows], self.y[rows]


@pytest.mark.parametrize(
    "kind",
    [
        "known", "unknown", "steps_per_epoch", "steps_per_execution",
        "py_dataset", "py_dataset_workers", "py_dataset_infinite",
    ],
)
def test_epoch_end_sees_the_applied_window(kind, float64):
    x, y = _data(7 * B)
    validation = _data(2 * B)
    seen = _Seen()

    model = _net(gradient_accumulation_steps=N)
    _compile(
        model,
        "adam",
        steps_per_execution=3 if kind == "steps_per_execution" else 1,
    )
    if kind == "unknown":
        data = _unknown_length("filter", x, y)
        model.fit(
            data, epochs=2, verbose=0, validation_data=validation,
            callbacks=[seen],
        )
    elif kind == "steps_per_epoch":
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B).repeat()
        model.fit(
            data, epochs=2, steps_per_epoch=7, verbose=0,
            validation_data=validation, callbacks=[seen],
        )
    elif kind.startswith("py_dataset"):
        # Keras' own input class; with threads, batches still come in order.
        infinite = kind.endswith("infinite")
        data = _Batches(
            x, y, infinite, workers=2 if kind.endswith("workers") else 1
        )
        model.fit(
            data, epochs=2, steps_per_epoch=7 if infinite else None,
            shuffle=False, verbose=0, validation_data=_Batches(*validation),
            callbacks=[seen],
        )
    else:
        _fit(model, x, y, epochs=2, validation_data=validation, callbacks=[seen])

    _assert_same_epoch_ends(
        _reference_epoch_ends(x, y, validation, epochs=2), seen.at_epoch_end
    )


class _StopAfter(keras.callbacks.Callback):
    """Stops `fit()` at the end of a batch, as `TerminateOnNaN` does."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 >= self.batches:
            self.model.stop_training = True


def _data_of(kind, x, y):
    """`(x, y)` as `fit()` arguments: arrays, or a dataset of unknown length."""
    if kind == "unknown":
        return dict(x=_unknown_length("filter", x, y))
    return dict(x=x, y=y, batch_size=B)


@pytest.mark.parametrize("flush_at_epoch_end", [True, False])
@pytest.mark.parametrize("kind", ["known", "unknown"])
def test_stop_mid_epoch_validates_the_applied_window(
    kind, flush_at_epoch_end, float64
):
    # A batch callback stops `fit()` after 6 micro-batches (a window, then
    # a partial one of 2): the partial window is applied before validation
    # and the epoch's end, as after an epoch's last batch. The reference:
    # plain Keras on the same 6 micro-batches as batches of N * B, then 2 B.
    x, y = _data(7 * B)
    validation = _data(2 * B)
    seen = _Seen()

    model = _net(
        gradient_accumulation_steps=N, flush_at_epoch_end=flush_at_epoch_end
    )
    _compile(model, "adam")
    model.fit(
        **_data_of(kind, x, y), epochs=2, shuffle=False, verbose=0,
        validation_data=validation, callbacks=[_StopAfter(6), seen],
    )
    assert int(model.optimizer.iterations) == 2
    _assert_same_epoch_ends(
        _reference_epoch_ends(x[: 6 * B], y[: 6 * B], validation),
        seen.at_epoch_end,
    )


@pytest.mark.parametrize("kind", ["known", "unknown"])
def test_carried_window_is_applied_before_the_last_validation(kind, float64):
    # With `flush_at_epoch_end=False` windows carry over into the next
    # epoch; the one pending after the last epoch's last batch is applied
    # before its validation, so that the last `val_loss` is that of the
    # weights the epoch's end sees. Two epochs of 7 micro-batches, N = 4:
    # windows of 4, 4 and 4, then 2: plain Keras on the 14 micro-batches
    # as batches of N * B.
    x, y = _data(7 * B)
    validation = _data(2 * B)
    seen = _Seen()

    model = _net(gradient_accumulation_steps=N, flush_at_epoch_end=False)
    _compile(model, "adam")
    model.fit(
        **_data_of(kind, x, y), epochs=2, shuffle=False, verbose=0,
        validation_data=validation, callbacks=[seen],
    )
    assert int(model.optimizer.iterations) == 4
    reference = _reference_epoch_ends(
        np.concatenate([x, x]), np.concatenate([y, y]), validation
    )
    _assert_same_epoch_ends(reference, seen.at_epoch_end[1:])


def _big_batch_and_ours():
    """Plain Keras on batches of N * B, and ours on micro-batches of B."""
    return ((_net(keras.Model), N * B), (_net(gradient_accumulation_steps=N), B))


def test_swapped_ema_weights_validate_the_applied_window(float64):
    # `SwapEMAWeights` validates with the EMA weights and, with
    # `swap_on_epoch=True`, hands them to the epoch's later callbacks: EMA
    # that moved once per update, the epoch's partial window included.
    x, y = _data(7 * B)
    validation = _data(2 * B)
    runs = []
    for model, batch_size in _big_batch_and_ours():
        model.compile(
            optimizer=keras.optimizers.Adam(0.01, use_ema=True),
            loss="mse",
        )
        seen = _Seen()
        model.fit(
            x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
            validation_data=validation,
            callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True), seen],
        )
        runs.append(seen.at_epoch_end)
    _assert_same_epoch_ends(*runs)


def test_early_stopping_restores_the_applied_window(float64):
    x, y = _data(7 * B)
    validation = _data(2 * B)
    histories = []
    for model, batch_size in _big_batch_and_ours():
        _compile(model, "adam")
        stop = keras.callbacks.EarlyStopping(
            monitor="val_loss", patience=0, restore_best_weights=True,
            min_delta=-1.0,  # every epoch improves: keeps the last one
        )
        histories.append(
            (
                model.fit(
                    x, y, batch_size=batch_size, epochs=2, shuffle=False,
                    verbose=0, validation_data=validation, callbacks=[stop],
                ),
                model.get_weights(),
            )
        )
    assert relative_difference(histories[0][1], histories[1][1]) <= EXACT


# ----------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------
def test_failed_compile_leaves_model_as_it_was():
    model = _ours("sgd", run_eagerly=False)
    optimizer = model.optimizer
    with pytest.raises(ValueError, match="accumulated twice"):
        model.compile(
            optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2),
            loss="mse",
        )
    assert model.optimizer is optimizer
    assert not optimizer.gradient_accumulation_steps

    fresh = _net(gradient_accumulation_steps=N, non_finite_policy="propagate")
    with pytest.raises(ValueError, match="cannot be used with a"):
        fresh.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD()
            ),
            loss="mse",
        )
    assert getattr(fresh, "optimizer", None) is None
    assert not fresh.compiled


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("flush_at_epoch_end", "False", "flush_at_epoch_end='False'"),
        ("gradient_accumulation_steps", 2**63, "must be at most 2\\*\\*63 - 1"),
        ("gradient_accumulation_steps", 0, "must be an integer >= 1"),
        ("non_finite_policy", "never", "non_finite_policy='never'"),
        ("window_batch_norm", 1, "window_batch_norm=1"),
    ],
)
def test_from_config_validates(key, value, message):
    config = _ours().get_config()
    config[key] = value
    with pytest.raises(ValueError, match=message):
        keras_accum.GradientAccumulationModel.from_config(config)


def test_largest_int64_window_is_accepted():
    model = _net(gradient_accumulation_steps=2**63 - 1)
    assert model.gradient_accumulation_steps == 2**63 - 1
