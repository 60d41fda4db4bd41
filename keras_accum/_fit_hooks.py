"""What `fit()` adds to Keras' loop: the window's end after an epoch's last
batch (before validation) and before callbacks see an epoch's end, and the
start line."""

import keras
import tensorflow as tf

from keras_accum import _keras_compat as compat
from keras_accum._auto_micro_batch import out_of_memory_hint
from keras_accum.callbacks import BackupAndRestore


class BatchSkip:
    """Batches that the next train calls consume without training."""

    def __init__(self):
        self.remaining = 0

    def set(self, count):
        """The next `count` batches are skipped (0: none)."""
        self.remaining = int(count)

    def take(self, iterator, steps_per_execution):
        """Consumes one train call's batches if any are to be skipped."""
        if not self.remaining:
            return False
        count = min(steps_per_execution, self.remaining)
        for _ in range(count):
            getattr(iterator, "get_next", lambda: next(iterator))()
        self.remaining -= count
        return True


class EpochEnd:
    """Whether the end of the epoch in progress ends the pending window."""

    def __init__(self):
        self.last = False  # whether it is the last epoch of `fit()`

    def begin(self, epoch, epochs):
        self.last = epochs is not None and epoch + 1 >= epochs

    def ends_window(self, model):
        """`False` only where the window carries over into the next epoch."""
        return model.flush_at_epoch_end or model.stop_training or self.last


def window_train_function(model, train_function):
    """Keras' train function, ending the window when the input runs out."""

    def window_train_function(iterator):
        try:
            if model.batch_skip.take(iterator, model.steps_per_execution):
                return model.get_metrics_result()
            return train_function(iterator)
        except tf.errors.ResourceExhaustedError as error:
            if model.auto_micro_batch is not None:
                raise
            raise out_of_memory_hint(model, error) from error
        except (StopIteration, tf.errors.OutOfRangeError):
            # An epoch of unknown length ended: the window ends before
            # validation and the epoch's callbacks.
            model.batch_skip.set(0)
            if model.epoch_end.ends_window(model):
                model.flush_gradients()
            raise

    return window_train_function


def _batch_size(x, batch_size):
    """The (global) batch size `fit()` will see, if known upfront."""
    if isinstance(x, tf.data.Dataset):
        spec = keras.tree.flatten(x.element_spec)
        return spec[0].shape[0] if spec and spec[0].shape.rank else None
    if hasattr(x, "shape") or isinstance(x, (list, tuple, dict)):
        return batch_size or 32
    return batch_size


def _describe_window(model, batch, steps):
    """The line `fit()` prints at its start: what one update is made of."""
    n = model.gradient_accumulation_steps
    rows = model.micro_batch_size
    replicas = model.distribute_strategy.num_replicas_in_sync
    unit = "micro-batches" if rows is None else "steps"
    if rows is None:
        line = f"Gradient accumulation: {n} micro-batches"
    elif rows == "auto":
        line = (
            "Gradient accumulation: micro-batches as large as the device "
            f"holds ('auto') inside each step, {n} step{'s' if n > 1 else ''}"
        )
    else:
        line = (
            f"Gradient accumulation: micro-batches of at most {rows} samples"
            f"{' per replica' if replicas > 1 else ''} inside each step, "
            f"{n} step{'s' if n > 1 else ''}"
        )
    if batch:
        line += (
            f" of {batch} samples per update = an effective batch of "
            f"{n * batch}"
        )
    else:
        line += " per update"
    if replicas > 1:
        line += f", on {replicas} replicas"
    if steps:
        updates = -(-steps // n) if model.flush_at_epoch_end else steps / n
        line += f"; {updates:g} updates per epoch of {steps} {unit}"
    return line + "."


def with_window_callbacks(model, callbacks, x=None, fit_kwargs=None):
    """`callbacks` with the window's end first and last (our
    `BackupAndRestore` right after the first), and a progress bar that
    shows `updates` as an integer."""
    batch = _batch_size(x, (fit_kwargs or {}).get("batch_size"))
    first, last = [_WindowEnd(batch)], [_LastWindowEnd()]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        for callback in first + last:
            callback.set_model(model)
            callback.set_params(callbacks.params)
        callbacks.callbacks[:0] = first
        callbacks.callbacks.extend(last)
        return callbacks
    callbacks = list(callbacks or [])
    backups = [c for c in callbacks if isinstance(c, BackupAndRestore)]
    rest = [c for c in callbacks if c not in backups]
    if (fit_kwargs or {}).get("verbose", "auto") != 0 and not any(
        isinstance(c, keras.callbacks.ProgbarLogger) for c in rest
    ):
        rest.append(compat.ProgbarLogger())
    return first + backups + rest + last


class _WindowEnd(keras.callbacks.Callback):
    """Runs first: the window's end before others see an epoch's end (the
    last epoch's always: before EMA is finalized); the start line."""

    def __init__(self, batch=None):
        super().__init__()
        self.batch = batch

    def on_train_begin(self, logs=None):
        params = self.params or {}
        auto = self.model.auto_micro_batch
        verbose = params.get("verbose", 0)
        if auto is not None:
            auto.verbose = verbose
        if verbose != 0 and self.model.gradient_accumulator.accumulates:
            print(_describe_window(self.model, self.batch, params.get("steps")))

    def on_epoch_begin(self, epoch, logs=None):
        self.model.epoch_end.begin(epoch, (self.params or {}).get("epochs"))

    def on_epoch_end(self, epoch, logs=None):
        if self.model.epoch_end.ends_window(self.model):
            self.model.flush_gradients()
        if logs is not None and "updates" in logs:
            logs["updates"] = int(self.model.optimizer.iterations.numpy())

    def on_train_end(self, logs=None):
        self.model.flush_gradients()


class _LastWindowEnd(keras.callbacks.Callback):
    """Runs last: the window's end after an epoch's last batch, or the batch
    after which a callback stopped `fit()` (before validation), and a
    carried one's when a callback stopped `fit()` at an epoch's end."""

    def on_train_batch_end(self, batch, logs=None):
        steps = self.params.get("steps") if self.params else None
        model = self.model
        last = model.stop_training or (steps and batch + 1 >= steps)
        if last and model.epoch_end.ends_window(model):
            model.flush_gradients()

    def on_epoch_end(self, epoch, logs=None):
        if self.model.stop_training:
            self.model.flush_gradients()
