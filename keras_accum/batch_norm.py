"""BatchNormalization moving statistics per accumulation window (TensorFlow).

`keras.layers.BatchNormalization` updates its moving mean and variance on
every training call. Under gradient accumulation a training call is one
micro-batch, so the moving averages would advance N times per optimizer
update, each time from the statistics of a small micro-batch. One big batch
holding the same samples advances them once, from the statistics of all its
samples. `WindowBatchNormStatistics` reproduces the big batch: it records the
statistics of each micro-batch, combines them exactly over the window and
updates the moving statistics once, when the window's update is applied.

This module is specific to the TensorFlow backend.
"""

import contextlib
import warnings

import tensorflow as tf
from keras import layers as keras_layers

_BatchNormalization = keras_layers.BatchNormalization


def window_batch_norm_layers(model):
    """The `BatchNormalization` layers whose moving statistics are windowed.

    These are the layers of `model`, nested sub-models included, that
    are instances of `keras.layers.BatchNormalization` (or of a subclass that
    keeps its `call()`), are trainable (a frozen layer runs in inference mode
    and updates nothing) and do not use batch renormalization (`renorm=True`
    layers keep Keras' per-call updates).

    Args:
        model: a `keras.Model` (or layer).

    Returns:
        A list of layers, each listed once.
    """
    found = []
    seen = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if (
            id(layer) in seen
            or not isinstance(layer, _BatchNormalization)
            or type(layer).call is not _BatchNormalization.call
            or not layer.trainable
            or layer.renorm
        ):
            continue
        seen.add(id(layer))
        found.append(layer)
    return found


def _statistics_dtype(variable):
    # float64 variables keep float64; anything else is combined in float32.
    if tf.as_dtype(variable.dtype) == tf.float64:
        return tf.float64
    return tf.float32


class _Slot:
    """The window's running (count, mean, M2) of one call of one layer."""

    def __init__(self, layer, index):
        self.layer = layer
        self.index = index
        dtype = _statistics_dtype(layer.moving_mean)
        shape = tuple(layer.moving_mean.shape)
        prefix = f"{layer.name}_call{index}_window_"
        with tf.init_scope():
            self.count = tf.Variable(
                tf.zeros((), dtype), trainable=False, name=prefix + "count"
            )
            self.mean = tf.Variable(
                tf.zeros(shape, dtype), trainable=False, name=prefix + "mean"
            )
            self.m2 = tf.Variable(
                tf.zeros(shape, dtype), trainable=False, name=prefix + "m2"
            )

    def add(self, count, mean, variance):
        """Adds one micro-batch (Chan et al.'s parallel combination)."""
        dtype = self.count.dtype
        count = tf.cast(count, dtype)
        mean = tf.reshape(tf.cast(mean, dtype), self.mean.shape)
        variance = tf.reshape(tf.cast(variance, dtype), self.m2.shape)
        count_a = self.count.read_value()
        mean_a = self.mean.read_value()
        total = count_a + count
        delta = mean - mean_a
        self.mean.assign(
            mean_a + delta * tf.math.divide_no_nan(count, total)
        )
        self.m2.assign(
            self.m2.read_value()
            + variance * count
            + tf.square(delta)
            * tf.math.divide_no_nan(count_a * count, total)
        )
        self.count.assign(total)

    def update_moving_statistics(self):
        """`moving = moving * momentum + window * (1 - momentum)` if n > 0."""
        layer = self.layer
        momentum = layer.momentum
        count = self.count.read_value()
        has_samples = count > 0
        window_mean = self.mean.read_value()
        window_variance = tf.math.divide_no_nan(self.m2.read_value(), count)
        for variable, value in (
            (layer.moving_mean, window_mean),
            (layer.moving_variance, window_variance),
        ):
            moving = tf.convert_to_tensor(variable)
            value = tf.cast(value, moving.dtype)
            updated = moving * momentum + value * (1.0 - momentum)
            variable.assign(tf.where(has_samples, updated, moving))

    def reset(self):
        self.count.assign(tf.zeros_like(self.count))
        self.mean.assign(tf.zeros_like(self.mean))
        self.m2.assign(tf.zeros_like(self.m2))


def _count(layer, inputs, mask):
    """Number of values per channel that `layer._moments` reduced over."""
    if mask is not None:
        count = tf.reduce_sum(tf.cast(mask, tf.int64))
    else:
        shape = tf.shape(inputs, out_type=tf.int64)
        count = tf.reduce_prod(tf.gather(shape, layer._reduction_axes))
    if layer.synchronized:
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            count = context.all_reduce(tf.distribute.ReduceOp.SUM, count)
    return count


class WindowBatchNormStatistics:
    """Updates BatchNormalization moving statistics once per window.

    Inside a `GradientAccumulationModel`, every trainable
    `keras.layers.BatchNormalization` (nested sub-models included, with or
    without `synchronized=True`) updates its `moving_mean` and
    `moving_variance` once per accumulation window, from the exact statistics
    of all the window's samples, as one big batch of `N * B` samples would:

        moving = moving * momentum + window_statistic * (1 - momentum)

    with the layer's own `momentum`. The window's count, mean and (biased,
    as Keras uses) variance are combined across micro-batches with Chan et
    al.'s parallel algorithm on `(count, mean, M2)`, never as a mean of
    per-micro-batch variances. They are accumulated in float32 (float64 for
    float64 moving statistics), in variables that are not model weights and
    are not saved; the moving statistics remain ordinary layer weights.

    What stays per micro-batch: the normalisation applied during training.
    In the forward pass each micro-batch is normalised with its own mean and
    variance, exactly as `keras.layers.BatchNormalization` does; statistics
    over samples that are not in memory together cannot be computed before
    the gradients are. With N=4 micro-batches of 8 samples, training is
    "batch normalisation with batches of 8" with inference statistics of
    batches of 32. With very small micro-batches (a few samples per
    micro-batch) prefer `keras.layers.GroupNormalization`, whose statistics
    do not depend on the batch at all.

    Mechanism: during the forward pass of a micro-batch each layer's
    `_moments()` is wrapped to record every call's count, mean and variance,
    and the assignment Keras then makes to the moving statistics is undone:
    their values from before the layer's first call are written back (safe
    for a non-finite micro-batch too; no `momentum=1` trick, as
    `NaN * 0 = NaN`). When the window ends and its update was applied, the
    moving statistics are updated once; a window skipped by the non-finite
    policy leaves them unchanged. A micro-batch whose statistics are not
    finite is not added to the window. A layer called several times per
    forward pass gets one update per call, in call order, as with one big
    batch. With a Keras mask the count is the number of unmasked values;
    Keras divides by that count plus 1e-7, so masked statistics match the
    big batch to about that relative tolerance.

    Not covered (Keras' per-call updates are kept): `renorm=True` layers
    (their renormalisation statistics are a different update), subclasses
    that override `call()`, calls traced inside a `tf.cond`/`tf.while_loop`
    of the model's own `call()`, `gradient_accumulation_steps=1` (identical
    to Keras) and training under a `tf.distribute` strategy with more than
    one replica (not yet supported: a warning is issued once and Keras'
    per-micro-batch updates are kept). Frozen layers (`trainable=False`) run
    in inference mode and update nothing, as in Keras.

    Args:
        enabled: bool, whether to window the moving statistics. If `False`
            every method is a no-op and Keras updates the moving statistics
            on every micro-batch.

    Example:

    ```python
    stats = WindowBatchNormStatistics()
    with tf.GradientTape() as tape:
        with stats.record(model):
            y_pred = model(x, training=True)
        ...
    accumulator.accumulate_and_maybe_apply(...)
    stats.end_step(accumulator)
    ```
    """

    def __init__(self, enabled=True):
        if not isinstance(enabled, bool):
            raise ValueError(
                "`window_batch_norm` must be a bool. Received: "
                f"window_batch_norm={enabled!r}"
            )
        self.enabled = enabled
        self._slots = {}  # (id(layer), call index) -> _Slot, in creation order
        self._warned_distributed = False

    @property
    def slots(self):
        """The per-(layer, call) accumulators created so far."""
        return list(self._slots.values())

    def _active(self, model, bn_layers):
        if not bn_layers:
            return False
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            if not self._warned_distributed:
                self._warned_distributed = True
                warnings.warn(
                    "GradientAccumulationModel: per-window BatchNormalization "
                    "statistics are not yet supported with several replicas; "
                    "the moving statistics are updated on every micro-batch "
                    "(Keras' behaviour).",
                    stacklevel=3,
                )
            return False
        return True

    def build(self, model):
        """Creates the window's variables for one call of each layer.

        Call before the train function is traced (a layer called several
        times per forward pass gets its further variables while tracing).

        Args:
            model: the `GradientAccumulationModel` to be trained.
        """
        if (
            not self.enabled
            or model.gradient_accumulation_steps == 1
            or model.distribute_strategy.num_replicas_in_sync > 1
        ):
            return
        for layer in window_batch_norm_layers(model):
            if layer.built:
                self._slot(layer, 0)

    @contextlib.contextmanager
    def record(self, model):
        """Records the BatchNormalization statistics of one forward pass.

        Wrap the training forward pass of one micro-batch. Each layer's
        moving statistics are read on its first call (layers still unbuilt on
        entry are built by that call), restored to those values on exit, and
        each call's count, mean and variance are added to the window.

        Args:
            model: the `GradientAccumulationModel` being trained.

        Yields:
            None.
        """
        if not self.enabled or model.gradient_accumulation_steps == 1:
            yield
            return
        bn_layers = window_batch_norm_layers(model)
        if not self._active(model, bn_layers):
            yield
            return
        calls = {id(layer): [] for layer in bn_layers}
        snapshots = {}
        graph = _current_graph()
        patched = []
        for layer in bn_layers:
            own = layer.__dict__.get("_moments")
            patched.append((layer, own))
            object.__setattr__(
                layer,
                "_moments",
                _recording_moments(
                    layer, layer._moments, calls[id(layer)], snapshots, graph
                ),
            )
        try:
            yield
        finally:
            for layer, own in patched:
                if own is None:
                    object.__delattr__(layer, "_moments")
                else:
                    object.__setattr__(layer, "_moments", own)
        recorded = [
            (layer, calls[id(layer)]) for layer in bn_layers if calls[id(layer)]
        ]
        if not recorded or not model.trainable_weights:
            # Without trainable weights no window is ever counted: keep
            # Keras' per-call updates.
            return
        for layer, _ in recorded:
            mean, variance = snapshots[id(layer)]
            layer.moving_mean.assign(mean)
            layer.moving_variance.assign(variance)
        finite = tf.reduce_all(
            tf.stack(
                [
                    tf.logical_and(
                        tf.reduce_all(tf.math.is_finite(mean)),
                        tf.reduce_all(tf.math.is_finite(variance)),
                    )
                    for _, layer_calls in recorded
                    for _, mean, variance in layer_calls
                ]
            )
        )
        for layer, layer_calls in recorded:
            for index, (count, mean, variance) in enumerate(layer_calls):
                slot = self._slot(layer, index)
                zero = tf.zeros_like(mean)
                slot.add(
                    tf.where(finite, count, tf.zeros_like(count)),
                    tf.where(finite, mean, zero),
                    tf.where(finite, variance, zero),
                )

    def end_step(self, accumulator):
        """Ends the window if the train step just ended one.

        Call after `accumulator.accumulate_and_maybe_apply(...)`: a window
        ended when `accumulator.micro_step == 0`.

        Args:
            accumulator: the `GradientAccumulator`.
        """
        if not self._slots:
            return
        self.end_window(
            accumulator.update_applied.read_value(),
            window_ended=tf.equal(accumulator.micro_step.read_value(), 0),
        )

    def end_window(self, applied, window_ended=True):
        """Updates the moving statistics once if applied, then resets.

        Args:
            applied: bool tensor, whether the window's update was applied;
                if not (a skipped window) the moving statistics are kept.
            window_ended: bool tensor, whether a window ended at all.
        """
        slots = self.slots
        if not slots:
            return

        def update():
            for slot in slots:
                slot.update_moving_statistics()
            return tf.constant(True)

        def finish():
            tf.cond(applied, update, lambda: tf.constant(False))
            for slot in slots:
                slot.reset()
            return tf.constant(True)

        if window_ended is True:
            finish()
        else:
            tf.cond(window_ended, finish, lambda: tf.constant(False))

    def reset(self):
        """Discards the statistics of the pending window."""
        for slot in self.slots:
            slot.reset()

    def _slot(self, layer, index):
        key = (id(layer), index)
        slot = self._slots.get(key)
        if slot is None or slot.layer is not layer:
            slot = _Slot(layer, index)
            self._slots[key] = slot
        return slot


def _current_graph():
    """The graph being built, or `None` when executing eagerly."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()


def _recording_moments(layer, original, calls, snapshots, graph):
    """`layer._moments`, recording each call's (count, mean, variance).

    On the layer's first call the moving statistics are read, before the
    layer assigns them. Calls traced in another graph (Keras building a
    layer with a symbolic scratch call, or a call inside a `tf.cond` branch)
    are not recorded: their Keras updates are kept.
    """

    def _moments(inputs, mask):
        if not tf.is_tensor(inputs) or _current_graph() is not graph:
            return original(inputs, mask)
        if id(layer) not in snapshots:
            snapshots[id(layer)] = (
                tf.identity(tf.convert_to_tensor(layer.moving_mean)),
                tf.identity(tf.convert_to_tensor(layer.moving_variance)),
            )
        mean, variance = original(inputs, mask)
        calls.append(
            (
                _count(layer, inputs, mask),
                tf.stop_gradient(mean),
                tf.stop_gradient(variance),
            )
        )
        return mean, variance

    return _moments
