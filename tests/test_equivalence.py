"""The applied update equals one big batch of the same samples (issue: core).

Reference: plain `keras.Model` on batches of N*B; ours: micro-batches of B.
float64 is held to a relative update difference of 1e-9, float32 to 1e-5;
a masked mean on Keras < 3.13 to Keras' epsilon (`helpers.masked_mean_rtol`).
"""

import keras
import numpy as np
import pytest
from conftest import RTOL
from conftest import assert_close_to_reference
from conftest import record
from conftest import update_difference
from helpers import AccumulatingSubclassed
from helpers import classification_data
from helpers import dense_net
from helpers import fit_side_by_side
from helpers import masked_mean_rtol
from helpers import segmentation_data
from helpers import segmentation_net
from helpers import twins

import keras_accum

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
}


def scce():
    """Created per test: a loss object takes `floatx()` as its dtype."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_default_reduction(
    optimizer, precision, mode, compile_kwargs, in_step
):
    x, y = classification_data(n=48)
    reference, ours = twins(dense_net, steps=4)
    initial, ref_hist, our_hist = fit_side_by_side(
        reference, ours, x, y, 4, 4, OPTIMIZERS[optimizer], scce(),
        compile_kwargs, epochs=2,
        in_step=in_step,
    )
    assert_close_to_reference(
        f"a. default reduction, {optimizer}, {precision}",
        initial, reference.get_weights(), ours.get_weights(), RTOL[precision],
    )
    # The logged loss is the true per-sample loss, as with keras.Model
    # (weights are equal within a window, so the epoch means agree).
    np.testing.assert_allclose(
        our_hist.history["loss"], ref_hist.history["loss"],
        rtol=100 * RTOL[precision],
    )
    assert int(ours.optimizer.iterations) == int(
        reference.optimizer.iterations
    ) == 6


@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "mean_with_sample_weight"]
)
def test_sample_weight(reduction, float64, mode, compile_kwargs, in_step):
    x, y = classification_data(n=32)
    sample_weight = np.linspace(0.1, 3.0, len(x)) ** 2
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction
    )
    reference, ours = twins(dense_net, steps=4)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 4, 4, OPTIMIZERS["adam"], loss,
        compile_kwargs, sample_weight=sample_weight,
        in_step=in_step,
    )
    assert_close_to_reference(
        f"b. sample_weight, reduction={reduction}",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "mean_with_sample_weight"]
)
def test_class_weight_and_validation_split(
    reduction, float64, mode, compile_kwargs
):
    # Keras turns `class_weight` into per-sample weights (a window's mean
    # with sample weights divides by their sum) and holds out the arrays'
    # last fifth for validation: 32 samples train, 8 validate.
    x, y = classification_data(n=40)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction
    )
    reference, ours = twins(dense_net, steps=4)
    initial, ref_hist, our_hist = fit_side_by_side(
        reference, ours, x, y, 4, 4, OPTIMIZERS["adam"], loss,
        compile_kwargs, epochs=2, class_weight={0: 0.2, 1: 1.0, 2: 3.5},
        validation_split=0.2,
    )
    assert int(ours.optimizer.iterations) == 4
    assert_close_to_reference(
        f"b. class_weight and validation_split, reduction={reduction}",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )
    # Each epoch's validation sees the epoch's applied windows.
    np.testing.assert_allclose(
        our_hist.history["val_loss"], ref_hist.history["val_loss"],
        rtol=1e-9,
    )


def test_sum_reduction(float64, mode, compile_kwargs, in_step):
    # A sum over samples has no normaliser: the window divides by 1, and the
    # sum of the micro-batches' gradients is the big batch's.
    x, y = classification_data(n=32)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum"
    )
    reference, ours = twins(dense_net, steps=4)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 4, 4, OPTIMIZERS["sgd_momentum"], loss,
        compile_kwargs,
        in_step=in_step,
    )
    assert_close_to_reference(
        "b. reduction='sum'",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def test_short_last_micro_batch_and_window(
    precision, mode, compile_kwargs, in_step
):
    # 37 samples, B=5, N=3: micro-batches 5,5,5 | 5,5,5 | 5,2 per epoch; the
    # big batch of 15 gives 15 | 15 | 7.
    x, y = classification_data(n=37)
    reference, ours = twins(dense_net, steps=3)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 5, 3, OPTIMIZERS["adam"], scce(),
        compile_kwargs, epochs=2,
        in_step=in_step,
    )
    assert int(ours.optimizer.iterations) == 6
    assert int(ours.micro_step) == 0
    assert_close_to_reference(
        f"c. short last micro-batch and window, {precision}",
        initial, reference.get_weights(), ours.get_weights(), RTOL[precision],
    )


def test_partial_windows_of_many_epochs(float64, mode, compile_kwargs):
    """Six epochs that each end with a partial window: the first four are
    applied eagerly, the later ones by a traced function (docs/design.md)."""
    # 35 samples, B=5, N=3: windows 15 | 15 | 5 per epoch.
    x, y = classification_data(n=35)
    reference, ours = twins(dense_net, steps=3)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 5, 3, OPTIMIZERS["adam"], scce(),
        compile_kwargs, epochs=6,
    )
    assert int(ours.optimizer.iterations) == 18
    assert int(ours.micro_step) == 0
    assert_close_to_reference(
        "c. partial windows of six epochs",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def test_carry_over_across_epochs(float64, mode, compile_kwargs):
    """`flush_at_epoch_end=False`: windows span epochs; fit() ends flushed."""
    x, y = classification_data(n=35)
    reference, ours = twins(dense_net, steps=3, flush_at_epoch_end=False)
    initial = [np.array(w) for w in reference.get_weights()]
    ours.compile(optimizer=OPTIMIZERS["adam"](), loss=scce(), **compile_kwargs)
    ours.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    # Reference: the same micro-batch sequence, regrouped into windows of 3
    # micro-batches across the epoch boundary, one big batch each.
    micro = [(x[i : i + 5], y[i : i + 5]) for i in range(0, 35, 5)] * 2
    reference.compile(optimizer=OPTIMIZERS["adam"](), loss=scce())
    for start in range(0, len(micro), 3):
        window = micro[start : start + 3]
        reference.train_on_batch(
            np.concatenate([m[0] for m in window]),
            np.concatenate([m[1] for m in window]),
        )
    assert int(ours.optimizer.iterations) == 5  # 14 micro-batches: 3*4 + 2
    assert_close_to_reference(
        "c. carry-over across epochs",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "mean_with_sample_weight"]
)
def test_ignore_class(reduction, float64, mode, compile_kwargs, in_step):
    x, y = segmentation_data(n=16)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=255, reduction=reduction
    )
    reference, ours = twins(segmentation_net, steps=4)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 2, 4, OPTIMIZERS["sgd_momentum"], loss,
        compile_kwargs, epochs=2,
        in_step=in_step,
    )
    assert_close_to_reference(
        f"d. ignore_class, reduction={reduction}",
        initial, reference.get_weights(), ours.get_weights(),
        masked_mean_rtol(RTOL["float64"], reduction),
    )


@pytest.mark.parametrize("case", ["ignore_class", "mean_with_sample_weight"])
def test_builtin_option_differs_from_big_batch(case, float64):
    """The cases matter: a mean of per-micro-batch means is measurably off.

    Same data as the tests above, with the built-in
    `optimizer(gradient_accumulation_steps=4)` in place of ours.
    """
    if case == "ignore_class":
        x, y = segmentation_data(n=16)
        build, micro, sample_weight = segmentation_net, 2, None
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=255
        )
    else:
        x, y = classification_data(n=32)
        build, micro = dense_net, 4
        sample_weight = np.linspace(0.1, 3.0, len(x)) ** 2
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        )
    keras.utils.set_random_seed(0)
    reference = keras.Model(*build())
    builtin = keras.Model(*build())
    initial = reference.get_weights()
    builtin.set_weights(initial)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    builtin.compile(
        optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=4),
        loss=loss,
    )
    for model, batch in ((reference, 4 * micro), (builtin, micro)):
        model.fit(x, y, sample_weight=sample_weight, batch_size=batch,
                  shuffle=False, verbose=0)
    diff = update_difference(
        initial, reference.get_weights(), builtin.get_weights()
    )
    record(f"(built-in optimizer option, {case})", diff)
    assert diff > 1e-2


def test_keras_mask_on_predictions(
    float64, mode, compile_kwargs, in_step
):
    """A Keras mask on `y_pred` (padded time steps) is normalised per window."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 6, 3))
    for i in range(len(x)):
        x[i, 6 - (i % 4) - 1 :] = 0.0  # 1..4 padded steps per sequence
    y = rng.normal(size=(12, 6, 2))

    def build():
        inputs = keras.Input((6, 3))
        h = keras.layers.Masking(0.0)(inputs)
        outputs = keras.layers.Dense(2)(h)
        return inputs, outputs

    reference, ours = twins(build, steps=3)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 2, 3, OPTIMIZERS["adam"], "mse",
        compile_kwargs,
        in_step=in_step,
    )
    assert_close_to_reference(
        "d. Keras mask on y_pred",
        initial, reference.get_weights(), ours.get_weights(),
        masked_mean_rtol(RTOL["float64"]),
    )


def test_multi_output_loss_weights_and_regularisers(
    float64, mode, compile_kwargs, in_step
):
    x, y = classification_data(n=24)
    y_reg = np.sin(x[:, :2])

    class WeightPenalty(keras.layers.Layer):
        """Adds a loss that depends on weights only, via `add_loss`."""

        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1],))

        def call(self, inputs):
            self.add_loss(0.1 * keras.ops.sum(self.w**2))
            return inputs * self.w

    def build():
        inputs = keras.Input((6,))
        h = WeightPenalty()(inputs)
        h = keras.layers.Dense(
            5, activation="tanh",
            kernel_regularizer=keras.regularizers.L2(0.05),
        )(h)
        return inputs, [
            keras.layers.Dense(3, name="cls")(h),
            keras.layers.Dense(2, name="reg")(h),
        ]

    reference, ours = twins(build, steps=3)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, [y, y_reg], 2, 3, OPTIMIZERS["adam"],
        [scce(), "mse"], compile_kwargs, loss_weights=[1.0, 0.3], epochs=2,
        in_step=in_step,
    )
    assert_close_to_reference(
        "e. multi-output, loss_weights, regularisers",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def test_one_step_trains_exactly_like_keras_model(
    mode, compile_kwargs, in_step
):
    x, y = classification_data(n=24)
    reference, ours = twins(dense_net, steps=1)
    fit_side_by_side(
        reference, ours, x, y, 8, 1, OPTIMIZERS["adam"], scce(),
        compile_kwargs, epochs=2,
        in_step=in_step, same_mode=True,
    )
    for a, b in zip(reference.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_steps_per_execution_validation_evaluate_predict(
    float64, mode, compile_kwargs, in_step
):
    x, y = classification_data(n=40)
    x_val, y_val = classification_data(n=12, seed=1)
    reference, ours = twins(dense_net, steps=4)
    initial, ref_hist, our_hist = fit_side_by_side(
        reference, ours, x, y, 2, 4,
        OPTIMIZERS["adam"], scce(),
        dict(compile_kwargs, steps_per_execution=3),
        epochs=2, validation_data=(x_val, y_val),
        metrics=["sparse_categorical_accuracy"],
        in_step=in_step,
    )
    assert_close_to_reference(
        "steps_per_execution=3 with validation",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )
    np.testing.assert_allclose(
        our_hist.history["val_loss"], ref_hist.history["val_loss"], rtol=1e-9
    )
    np.testing.assert_allclose(
        ours.evaluate(x_val, y_val, verbose=0),
        reference.evaluate(x_val, y_val, verbose=0),
        rtol=1e-9,
    )
    np.testing.assert_allclose(
        ours.predict(x_val, verbose=0),
        reference.predict(x_val, verbose=0),
        rtol=1e-9,
    )


def test_callbacks_see_every_micro_batch(mode, compile_kwargs):
    x, y = classification_data(n=40)
    _, ours = twins(dense_net, steps=4)
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(
                (int(self.model.micro_step), bool(self.model.update_applied))
            )

    ours.compile(optimizer="sgd", loss=scce(), **compile_kwargs)
    ours.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[Spy()])
    assert len(seen) == 10
    assert [s[1] for s in seen] == [False, False, False, True] * 2 + [
        False, False,
    ]
    # The last window (2 micro-batches) is applied at the end of the epoch.
    assert int(ours.optimizer.iterations) == 3


def test_tf_data_input(float64, mode, compile_kwargs):
    import tensorflow as tf

    x, y = classification_data(n=30)
    reference, ours = twins(dense_net, steps=3)
    initial = [np.array(w) for w in reference.get_weights()]
    for model, batch in ((reference, 9), (ours, 3)):
        model.compile(optimizer=OPTIMIZERS["adam"](), loss=scce(),
                      **compile_kwargs)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        model.fit(data, epochs=2, verbose=0)
    assert_close_to_reference(
        "tf.data input (unknown-length epochs)",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def test_functional_subclassed_and_wrapped(float64):
    x, y = classification_data(n=16)
    keras.utils.set_random_seed(0)
    reference = keras.Model(*dense_net())
    subclassed = AccumulatingSubclassed(gradient_accumulation_steps=2)
    subclassed(x[:1])
    subclassed.set_weights(reference.get_weights())
    sequential = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(7, activation="tanh"),
         keras.layers.Dense(3)]
    )
    sequential.set_weights(reference.get_weights())
    wrapped = keras_accum.GradientAccumulationModel.from_model(
        sequential, gradient_accumulation_steps=2
    )
    initial = [np.array(w) for w in reference.get_weights()]
    reference.compile(optimizer=OPTIMIZERS["adam"](), loss=scce())
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for model in (subclassed, wrapped):
        model.compile(optimizer=OPTIMIZERS["adam"](), loss=scce())
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        assert_close_to_reference(
            f"subclassed / from_model ({type(model).__name__})",
            initial, reference.get_weights(), model.get_weights(),
            RTOL["float64"],
        )
    # The wrapper shares the layers (and weights) of the wrapped model.
    for a, b in zip(sequential.get_weights(), wrapped.get_weights()):
        np.testing.assert_array_equal(a, b)
