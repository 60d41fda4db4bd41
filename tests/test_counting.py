"""Schedules, EMA, weight decay and clipping count updates, not micro-batches.

Each optimizer feature is checked against plain `keras.Model` on the big
batch (float64, relative update difference <= 1e-9), with settings chosen so
that the feature changes the result (clipping thresholds that bind, a
schedule that moves within the run, a short EMA overwrite period).
"""

import keras
import numpy as np
import pytest
from conftest import RTOL
from conftest import assert_close_to_reference
from helpers import classification_data
from helpers import dense_net
from helpers import fit_side_by_side
from helpers import twins

OPTIMIZERS = {
    "piecewise_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.PiecewiseConstantDecay([2, 4], [0.5, 0.1, 0.01])
    ),
    "exponential_schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.5)
    ),
    "ema": lambda: keras.optimizers.Adam(
        0.05, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
    "sgd_weight_decay": lambda: keras.optimizers.SGD(0.1, weight_decay=0.2),
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=1e-2),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=1e-2),
    "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=1e-3),
}


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizer_features_count_updates(
    optimizer, float64, mode, compile_kwargs
):
    x, y = classification_data(n=36)
    reference, ours = twins(dense_net, steps=3)
    initial, _, _ = fit_side_by_side(
        reference, ours, x, y, 3, 3, OPTIMIZERS[optimizer], _loss(),
        compile_kwargs, epochs=2,
    )
    # 36 samples / 9 per window = 4 updates per epoch.
    assert int(ours.optimizer.iterations) == 8
    assert_close_to_reference(
        f"counting: {optimizer}",
        initial, reference.get_weights(), ours.get_weights(), RTOL["float64"],
    )


def test_schedule_sees_update_count(float64):
    """The learning rate after training is the schedule at the update count."""
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    x, y = classification_data(n=32)
    _, ours = twins(dense_net, steps=4)
    ours.compile(optimizer=keras.optimizers.SGD(schedule), loss=_loss())
    ours.fit(x, y, batch_size=2, shuffle=False, verbose=0)  # 16 micro, 4 updates
    assert int(ours.optimizer.iterations) == 4
    np.testing.assert_allclose(
        float(ours.optimizer.learning_rate), 0.1 * 0.5**4, rtol=1e-6
    )
