"""What `fit()` adds to Keras' loop: the window's end at an epoch's end
(docs/design.md, "One window end") and the start line."""

import keras
import tensorflow as tf

from keras_accum import _keras_compat as compat
from keras_accum._auto_micro_batch import out_of_memory_hint


def is_backup(callback):
    """Whether `callback` is `keras_accum.callbacks.BackupAndRestore` (or
    one like it): a backup that needs the train step to record its input
    and runs before the other callbacks. The callback says so itself (the
    core does not import the callbacks)."""
    return getattr(type(callback), "keras_accum_backup", False) is True


class EpochEnd:
    """Ends the pending window at the end of the epoch in progress, unless
    the window carries over into the next epoch."""

    def __init__(self):
        self.last = False  # whether it is the last epoch of `fit()`

    def begin(self, epoch, epochs):
        self.last = epochs is not None and epoch + 1 >= epochs

    def end(self, model):
        if model.flush_at_epoch_end or model.stop_training or self.last:
            model.flush_gradients()


def window_train_function(model, train_function):
    """Keras' train function, ending the window when the input runs out."""

    def window_train_function(iterator):
        try:
            if model.input_position.take(
                model, iterator, model.steps_per_execution
            ):
                # The logs of a train step: metrics and `updates`.
                return model._step_logs(model.get_metrics_result())
            return train_function(iterator)
        except tf.errors.ResourceExhaustedError as error:
            if model.auto_micro_batch is not None:
                raise
            raise out_of_memory_hint(model, error) from error
        except (StopIteration, tf.errors.OutOfRangeError):
            # An epoch of unknown length ended.
            model.input_position.reset()
            model.epoch_end.end(model)
            raise

    return window_train_function


def with_window_callbacks(model, callbacks, x=None, fit_kwargs=None):
    """`callbacks` with the window's end first and last (our
    `BackupAndRestore` right after the first), and a progress bar that
    shows `updates` as an integer."""
    fit_kwargs = fit_kwargs or {}
    batch = fit_kwargs.get("batch_size")  # the global batch, if known
    if isinstance(x, tf.data.Dataset):
        spec = keras.tree.flatten(x.element_spec)
        batch = spec[0].shape[0] if spec and spec[0].shape.rank else None
    elif hasattr(x, "shape") or isinstance(x, (list, tuple, dict)):
        batch = batch or 32
    first, last = [_WindowEnd(batch)], [_LastWindowEnd()]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        for callback in first + last:
            callback.set_model(model)
            callback.set_params(callbacks.params)
        callbacks.callbacks[:0] = first
        callbacks.callbacks.extend(last)
        return callbacks
    # Our `BackupAndRestore` first, the others in their order.
    callbacks = sorted(
        callbacks or [], key=lambda c: not is_backup(c)
    )
    if fit_kwargs.get("verbose", "auto") != 0 and not any(
        isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks
    ):
        callbacks.append(compat.ProgbarLogger())
    return first + callbacks + last


class _WindowEnd(keras.callbacks.Callback):
    """Runs first: the window's end before others see an epoch's end; the
    start line."""

    def __init__(self, batch=None):
        super().__init__()
        self.batch = batch

    def on_train_begin(self, logs=None):
        params = self.params or {}
        model = self.model
        verbose = params.get("verbose", 0)
        if model.auto_micro_batch is not None:
            model.auto_micro_batch.verbose = verbose
        if verbose == 0 or not model.gradient_accumulator.accumulates:
            return
        n = model.gradient_accumulation_steps
        rows = model.micro_batch_size
        replicas = model.distribute_strategy.num_replicas_in_sync
        per_replica = " per replica" if replicas > 1 else ""
        line = f"{n} micro-batches"
        if rows == "auto":
            line = "micro-batches as large as the device holds ('auto')"
        elif rows is not None:
            line = f"micro-batches of at most {rows} samples{per_replica}"
        if rows is not None:
            line += f" inside each step, {n} step{'s' if n > 1 else ''}"
        line += (
            f" of {self.batch} samples per update = an effective batch of "
            f"{n * self.batch}" if self.batch else " per update"
        )
        if replicas > 1:
            line += f", on {replicas} replicas"
        steps = params.get("steps")
        if steps:
            unit = "micro-batches" if rows is None else "steps"
            updates = -(-steps // n) if model.flush_at_epoch_end else steps / n
            line += f"; {updates:g} updates per epoch of {steps} {unit}"
        print(f"Gradient accumulation: {line}.")

    def on_epoch_begin(self, epoch, logs=None):
        self.model.epoch_end.begin(epoch, (self.params or {}).get("epochs"))

    def on_epoch_end(self, epoch, logs=None):
        self.model.epoch_end.end(self.model)
        if logs is not None and "updates" in logs:
            logs["updates"] = int(self.model.optimizer.iterations.numpy())

    def on_train_end(self, logs=None):
        self.model.flush_gradients()


class _LastWindowEnd(keras.callbacks.Callback):
    """Runs last: the window's end after an epoch's last batch, or the batch
    after which a callback stopped `fit()`, and at an epoch's end where a
    callback stopped `fit()`."""

    def on_train_batch_end(self, batch, logs=None):
        steps = (self.params or {}).get("steps")
        if self.model.stop_training or (steps and batch + 1 >= steps):
            self.model.epoch_end.end(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if self.model.stop_training:
            self.model.flush_gradients()
