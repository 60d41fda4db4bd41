"""`GradientAccumulationScheduler`: change N from epoch to epoch."""

import numbers

import keras

from keras_accum.accumulator import MAX_STEPS


class GradientAccumulationScheduler(keras.callbacks.Callback):
    """Sets `gradient_accumulation_steps` at the start of given epochs.

    `{epoch: N}` sets N from that epoch (0-based) on, until the next key.
    Epochs before the first key keep the N the model had when the scheduler
    first started. The window in progress when N changes keeps its own N.

    Args:
        schedule: dict from int epoch >= 0 to int N >= 1.

    Raises:
        ValueError: for an invalid schedule, or at the start of training if
            the model is not a `GradientAccumulationModel`.

    Example:

    ```python
    # Effective batch 8 x 2, then 8 x 4 from epoch 2, 8 x 8 from epoch 4.
    scheduler = keras_accum.callbacks.GradientAccumulationScheduler(
        {0: 2, 2: 4, 4: 8}
    )
    model.fit(x, y, batch_size=8, epochs=6, callbacks=[scheduler])
    ```
    """

    def __init__(self, schedule):
        super().__init__()
        if not isinstance(schedule, dict) or not schedule:
            raise ValueError(
                "`schedule` must be a non-empty dict from epoch to "
                f"`gradient_accumulation_steps`. Received: schedule={schedule!r}"
            )
        for epoch, steps in schedule.items():
            if not _is_int(epoch) or epoch < 0:
                raise ValueError(
                    "The keys of `schedule` must be integer epochs >= 0. "
                    f"Received: schedule={schedule!r}"
                )
            if not _is_int(steps) or not 1 <= steps <= MAX_STEPS:
                raise ValueError(
                    "The values of `schedule` must be integers from 1 to "
                    "2**63 - 1 (`gradient_accumulation_steps`). Received: "
                    f"schedule={schedule!r}"
                )
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
        steps = self._initial_steps
        for start, value in self.schedule.items():
            if start <= epoch:
                steps = value
        return steps

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.steps_for_epoch(epoch)
        if steps is not None and steps != self.model.gradient_accumulation_steps:
            self.model.gradient_accumulation_steps = steps


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
