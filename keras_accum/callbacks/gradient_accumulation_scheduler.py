"""`GradientAccumulationScheduler`: change N from epoch to epoch."""

import numbers

import keras

from keras_accum.accumulator import MAX_STEPS


class GradientAccumulationScheduler(keras.callbacks.Callback):
    """Sets `gradient_accumulation_steps` at the start of given epochs.

    `{epoch: N}` sets N from that 0-based epoch on, until the next key;
    epochs before the first key keep the N the model had when the scheduler
    first started. The window in progress when N changes keeps its N.

    Args:
        schedule: dict from int epoch >= 0 to int N >= 1.

    Raises:
        ValueError: for an invalid schedule, or at the start of training if
            the model is not a `GradientAccumulationModel`.

    Example:

    ```python
    # Updates of 8 x 2 rows, then of 8 x 4 rows from epoch 2.
    scheduler = keras_accum.callbacks.GradientAccumulationScheduler({2: 4})
    model.fit(x, y, batch_size=8, epochs=4, callbacks=[scheduler])
    ```
    """

    def __init__(self, schedule):
        super().__init__()
        if not isinstance(schedule, dict) or not schedule:
            raise ValueError(
                "`schedule` must be a non-empty dict from epoch to "
                "`gradient_accumulation_steps`. Received: "
                f"schedule={schedule!r}"
            )
        for epoch, steps in schedule.items():
            if not _is_int(epoch) or epoch < 0:
                what = "keys of `schedule` must be integer epochs >= 0"
            elif not _is_int(steps) or not 1 <= steps <= MAX_STEPS:
                what = (
                    "values of `schedule` must be integers from 1 to "
                    "2**63 - 1 (`gradient_accumulation_steps`)"
                )
            else:
                continue
            raise ValueError(f"The {what}. Received: schedule={schedule!r}")
        self.schedule = {int(k): int(v) for k, v in sorted(schedule.items())}
        self._initial_steps = None

    def on_train_begin(self, logs=None):
        if not hasattr(self.model, "gradient_accumulator"):
            raise ValueError(
                "`GradientAccumulationScheduler` needs a "
                "`GradientAccumulationModel`. Received: model of type "
                f"{type(self.model).__name__}"
            )
        if self._initial_steps is None:
            self._initial_steps = self.model.gradient_accumulation_steps

    def steps_for_epoch(self, epoch):
        """int: the N that `schedule` gives for 0-based `epoch`."""
        starts = [start for start in self.schedule if start <= epoch]
        return self.schedule[starts[-1]] if starts else self._initial_steps

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.steps_for_epoch(epoch)
        if steps not in (None, self.model.gradient_accumulation_steps):
            self.model.gradient_accumulation_steps = steps


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
