"""BatchNormalization moving statistics that move once per window, from all
its samples (docs/design.md, "BatchNormalization statistics per window")."""

import collections
import contextlib
import threading

import tensorflow as tf
from keras import layers as keras_layers

from keras_accum import _keras_compat as compat
from keras_accum._tf_utils import accumulation_dtype
from keras_accum._tf_utils import assign_state
from keras_accum._tf_utils import current_graph
from keras_accum._tf_utils import state_variable

_BatchNormalization = keras_layers.BatchNormalization


def window_batch_norm_layers(model):
    """The trainable `BatchNormalization` layers of `model` (nested too), each
    once, that keep Keras' `call()` and have no `renorm`."""
    found = []
    seen = set()
    for layer in compat.layers_of(model):
        if (
            id(layer) in seen
            or not isinstance(layer, _BatchNormalization)
            or type(layer).call is not _BatchNormalization.call
            or not layer.trainable
            or getattr(layer, "renorm", False)  # an attribute from Keras 3.14
        ):
            continue
        seen.add(id(layer))
        found.append(layer)
    return found


# One call of one layer: its place in a `_CallGroup`'s flat vectors.
_Call = collections.namedtuple("_Call", ["layer", "index", "size"])


class _CallGroup(tf.Module):
    """The window's running (count, mean, M2) of the calls with one index
    and moving-statistics dtype, flattened into three per-replica vectors
    (one entry per channel of each call)."""

    def __init__(self, keys, moving_dtype, name):
        super().__init__(name=name)
        self.index = keys[0][1]
        self.moving_dtype = moving_dtype
        self.dtype = accumulation_dtype(moving_dtype)
        self.calls = [
            _Call(layer, index, layer.moving_mean.shape.num_elements())
            for layer, index in keys
        ]
        self.sizes = [call.size for call in self.calls]
        with tf.init_scope():
            zeros = tf.zeros((sum(self.sizes),), self.dtype)
            self.count = state_variable(zeros, name + "_count")
            self.mean = state_variable(zeros, name + "_mean")
            self.m2 = state_variable(zeros, name + "_m2")

    def flatten(self, recorded):
        """Flat (count, mean, variance) of `recorded` (`_Call` -> its three),
        or `None`; a call not in it counts 0."""
        if not any(call in recorded for call in self.calls):
            return None
        counts, means, variances = [], [], []
        for call in self.calls:
            if call in recorded:
                count, mean, variance = recorded[call]
                counts.append(count)
                means.append(_flat(mean, self.dtype))
                variances.append(_flat(variance, self.dtype))
            else:
                zeros = tf.zeros([call.size], self.dtype)
                counts.append(tf.zeros((), tf.int64))
                means.append(zeros)
                variances.append(zeros)
        call_of_entry = _per_channel(range(len(self.sizes)), self.sizes)
        return (
            tf.gather(tf.cast(tf.stack(counts), self.dtype), call_of_entry),
            _concat(means),
            _concat(variances),
        )

    def add(self, count, mean, variance):
        """Adds one micro-batch's statistics to the window's."""
        combined = combine_moments(self.read(), (count, mean, variance * count))
        for variable, value in zip((self.count, self.mean, self.m2), combined):
            variable.assign(value)

    def read(self):
        return tuple(v.read_value() for v in (self.count, self.mean, self.m2))

    def reset(self):
        for variable in (self.count, self.mean, self.m2):
            variable.assign(tf.zeros_like(variable))

    def update_moving(self, has, mean, variance):
        """Moves the layers' statistics towards the window's, where `has`."""
        dtype = self.moving_dtype
        layers = [call.layer for call in self.calls]
        momenta = [layer.momentum for layer in layers]
        momentum = tf.constant(_per_channel(momenta, self.sizes), dtype)
        rest = [1.0 - m for m in momenta]
        rest = tf.constant(_per_channel(rest, self.sizes), dtype)
        for name, value in (
            ("moving_mean", mean),
            ("moving_variance", variance),
        ):
            variables = [getattr(layer, name) for layer in layers]
            moving = _concat(
                [_flat(tf.convert_to_tensor(v), dtype) for v in variables]
            )
            value = tf.cast(value, dtype)
            updated = tf.where(has, moving * momentum + value * rest, moving)
            parts = tf.split(updated, self.sizes) if len(layers) > 1 else [
                updated
            ]
            for variable, part in zip(variables, parts):
                if part.shape != variable.shape:
                    part = tf.reshape(part, variable.shape)
                variable.assign(part)


def combine_moments(a, b):
    """Chan et al.'s parallel combination: the (count, mean, M2) of the union
    of two parts given as (count, mean, M2), M2 the sum of squared deviations.
    """
    count_a, mean_a, m2_a = a
    count_b, mean_b, m2_b = b
    count = count_a + count_b
    delta = mean_b - mean_a
    mean = mean_a + delta * tf.math.divide_no_nan(count_b, count)
    m2 = m2_a + m2_b + tf.square(delta) * tf.math.divide_no_nan(
        count_a * count_b, count
    )
    return count, mean, m2


def _update_moving_statistics(statistics):
    """`moving = moving * momentum + window * (1 - momentum)` where n > 0,
    for (group, count, mean, m2) per group, in the order of the calls."""
    for group, count, mean, m2 in sorted(
        statistics, key=lambda entry: entry[0].index
    ):
        group.update_moving(count > 0, mean, tf.math.divide_no_nan(m2, count))


def _per_channel(values, sizes):
    """Each call's value, repeated over its channels."""
    return [v for v, size in zip(values, sizes) for _ in range(size)]


def _flat(value, dtype):
    """`value` as a flat vector of `dtype` (no op where it already is)."""
    value = tf.cast(value, dtype)
    if value.shape.rank != 1:
        value = tf.reshape(value, [-1])
    return value


def _concat(parts):
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def _count(layer, inputs, mask):
    """Values per channel the moments reduced over, on this replica."""
    if mask is not None:
        return tf.reduce_sum(tf.cast(mask, tf.int64))
    rank = inputs.shape.rank
    axes = compat.reduction_axes(layer)
    if rank is not None and len(axes) == rank - 1:
        channels = inputs.shape[layer.axis]
        if channels is not None:
            # Every axis but the channel axis is reduced over.
            return tf.size(inputs, out_type=tf.int64) // channels
    shape = tf.shape(inputs, out_type=tf.int64)
    return tf.reduce_prod(tf.gather(shape, axes))


class WindowBatchNormStatistics(tf.Module):
    """Updates BatchNormalization moving statistics once per window.

    Every trainable `keras.layers.BatchNormalization` of the model (nested
    and `synchronized=True` ones too) moves its moving mean and variance once
    per applied window, from the exact statistics of all the window's
    samples and replicas; a skipped window leaves them unchanged. See
    docs/semantics.md.

    Args:
        enabled: bool, whether to window the moving statistics. If `False`
            nothing is recorded and Keras updates them every micro-batch.

    Raises:
        ValueError: if `enabled` is not a bool.

    Example:

    ```python
    statistics = WindowBatchNormStatistics()
    accumulator.add_window_end_listener(statistics)
    with tf.GradientTape() as tape:
        with statistics.record(model):
            y_pred = model(x, training=True)
        ...
    accumulator.accumulate_and_maybe_apply(...)
    ```
    """

    def __init__(self, enabled=True):
        if not isinstance(enabled, bool):
            raise ValueError(
                "`window_batch_norm` must be a bool. Received: "
                f"window_batch_norm={enabled!r}"
            )
        super().__init__(name="window_batch_norm")
        self.enabled = enabled
        self._groups = []  # tracked (`tf.train.Checkpoint`); the rest is not
        object.__setattr__(self, "_calls_by_key", {})  # (id, index) -> _Call
        object.__setattr__(self, "_patches", {})  # id -> compat.MomentsPatch
        object.__setattr__(self, "_pending_state", {})
        # `MirroredStrategy` traces each replica's step in a thread of its
        # own: the patches are shared (counted), the recordings per thread.
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def calls(self):
        """The per-(layer, call) accumulators created so far."""
        return list(self._calls_by_key.values())

    def build(self, model):
        """Creates the window's variables for one call of each layer.

        Call before the train function is traced, inside the distribution
        strategy's scope if any (a layer called several times per forward
        pass gets its further variables while tracing).

        Args:
            model: the `GradientAccumulationModel` to be trained.
        """
        if not self.enabled or not model.gradient_accumulator.accumulates:
            return
        layers = window_batch_norm_layers(model)
        self._ensure_calls([(layer, 0) for layer in layers if layer.built])

    @contextlib.contextmanager
    def record(self, model):
        """Records the BatchNormalization statistics of one forward pass.

        Wrap the training forward pass of one micro-batch. Each call's count,
        mean and variance are added to the window, and Keras' update of the
        moving statistics is not made (layers still unbuilt on entry are
        built by their first call).

        Args:
            model: the `GradientAccumulationModel` being trained.

        Yields:
            None.
        """
        if not self.enabled or not model.gradient_accumulator.accumulates:
            yield
            return
        bn_layers = window_batch_norm_layers(model)
        if not bn_layers:
            yield
            return
        recording = _ForwardRecording(model, bn_layers)
        previous = getattr(self._local, "recording", None)
        self._local.recording = recording
        self._patch(bn_layers)
        try:
            yield
        finally:
            self._local.recording = previous
            self._unpatch(bn_layers)
        recorded = [
            ((layer, index), statistics)
            for layer in bn_layers
            for index, statistics in enumerate(recording.calls[id(layer)])
        ]
        if not recorded:
            return
        self._ensure_calls([key for key, _ in recorded])
        calls = {
            self._calls_by_key[(id(layer), index)]: statistics
            for (layer, index), statistics in recorded
        }
        flat = [(group, group.flatten(calls)) for group in self._groups]
        flat = [(group, values) for group, values in flat if values is not None]
        # A micro-batch whose statistics are not all finite adds nothing.
        finite = tf.reduce_all(
            tf.stack(
                [
                    tf.reduce_all(tf.math.is_finite(values[i]))
                    for _, values in flat
                    for i in (1, 2)
                ]
            )
        )
        for group, values in flat:
            group.add(
                *[tf.where(finite, v, tf.zeros_like(v)) for v in values]
            )

    def window_end(self, strategy, applied):
        """Updates the moving statistics once if the window was applied.

        Called by the accumulator in cross-replica context when a window
        ends (see `GradientAccumulator.add_window_end_listener`).

        Args:
            strategy: the `tf.distribute.Strategy` (the default one without
                a strategy).
            applied: bool tensor, whether the window's update was applied.
        """
        groups = list(self._groups)
        if not groups:
            return

        def update():
            if strategy.num_replicas_in_sync > 1:
                _update_from_replicas(strategy, groups)
            else:
                _update_moving_statistics(
                    [(group,) + group.read() for group in groups]
                )
            return tf.constant(True)

        tf.cond(applied, update, lambda: tf.constant(False))

    def reset(self):
        """Discards this replica's statistics of the window."""
        for group in self._groups:
            group.reset()

    def state(self):
        """The window's statistics variables by name (groups created so far).

        Returns:
            dict from name (`group_<g>_count`, `_mean`, `_m2`) to variable.
        """
        return {
            f"group_{g}_{field}": getattr(group, field)
            for g, group in enumerate(self._groups)
            for field in ("count", "mean", "m2")
        }

    def restore(self, values):
        """Assigns saved statistics; a group not created yet gets them later.

        Args:
            values: dict from a `state()` name to a list of values, one per
                replica.
        """
        object.__setattr__(
            self, "_pending_state", assign_state(self.state(), values)
        )

    def _ensure_calls(self, keys):
        """Creates groups for the (layer, call index) pairs not yet held."""
        with self._lock:
            missing = []
            for layer, index in keys:
                call = self._calls_by_key.get((id(layer), index))
                if call is None or call.layer is not layer:
                    missing.append((layer, index))
            by_kind = {}  # (call index, moving dtype) -> keys
            for layer, index in missing:
                kind = (index, tf.as_dtype(layer.moving_mean.dtype))
                by_kind.setdefault(kind, []).append((layer, index))
            for (_, dtype), group_keys in by_kind.items():
                group = _CallGroup(
                    group_keys, dtype, f"window_batch_norm_{len(self._groups)}"
                )
                self._groups.append(group)
                for call in group.calls:
                    self._calls_by_key[(id(call.layer), call.index)] = call
            if missing and self._pending_state:
                self.restore(self._pending_state)

    def _patch(self, layers):
        with self._lock:
            for layer in layers:
                patch = self._patches.get(id(layer))
                if patch is None:
                    patch = compat.MomentsPatch(layer)
                    patch.install_moments(self._recording_moments(layer))
                    self._patches[id(layer)] = patch
                patch.users += 1

    def _unpatch(self, layers):
        with self._lock:
            for layer in layers:
                patch = self._patches[id(layer)]
                patch.users -= 1
                if patch.users == 0:
                    patch.remove()
                    del self._patches[id(layer)]

    def _recording_moments(self, layer):
        """The layer's moments, recording those of this thread's recording."""
        original = compat.moments(layer)

        def _moments(inputs, mask):
            recording = getattr(self._local, "recording", None)
            if recording is None or not recording.wants(layer, inputs):
                if recording is not None:
                    recording.suppress[id(layer)] = False
                return original(inputs, mask)
            mean, variance = original(inputs, mask)
            recording.calls[id(layer)].append(
                (_count(layer, inputs, mask), mean, variance)
            )
            # The layer now assigns its moving statistics: not this time.
            with self._lock:
                self._patches[id(layer)].install_assign(
                    self._suppressed_assign
                )
            recording.suppress[id(layer)] = True
            return mean, variance

        return _moments

    def _suppressed_assign(self, layer, original):
        """`variable.assign`, a no-op right after a recorded call."""

        def assign(value, *args, **kwargs):
            recording = getattr(self._local, "recording", None)
            if (
                recording is not None
                and recording.suppress.get(id(layer))
                and current_graph() is recording.graph
            ):
                return value
            return original(value, *args, **kwargs)

        return assign


class _ForwardRecording:
    """What one forward pass (in one thread) has recorded."""

    def __init__(self, model, layers):
        self.model = model
        self.graph = current_graph()
        self.calls = {id(layer): [] for layer in layers}
        self.suppress = {}  # id(layer) -> whether its last call was recorded
        self._has_trainable_weights = None

    def wants(self, layer, inputs):
        if not tf.is_tensor(inputs) or current_graph() is not self.graph:
            return False
        if id(layer) not in self.calls:
            return False
        if self._has_trainable_weights is None:
            # Without trainable weights no window is ever counted: keep
            # Keras' per-call updates.
            self._has_trainable_weights = bool(self.model.trainable_weights)
        return self._has_trainable_weights


def _update_from_replicas(distribution, groups):
    """Combines the replicas' statistics (two all-reduces); updates."""
    float64 = any(group.dtype == tf.float64 for group in groups)
    dtype = tf.float64 if float64 else tf.float32
    sizes = [sum(group.sizes) for group in groups]

    def local():
        """This replica's (count, mean, M2), concatenated over the groups."""
        values = [
            [tf.cast(value, dtype) for value in group.read()]
            for group in groups
        ]
        return [_concat([v[i] for v in values]) for i in range(3)]

    def total(f):
        """`f` of each replica's statistics, summed in one all-reduce."""
        summed = distribution.reduce(
            tf.distribute.ReduceOp.SUM,
            distribution.extended.call_for_each_replica(
                lambda: tf.concat(f(*local()), axis=0)
            ),
            axis=None,
        )
        return tf.split(summed, summed.shape[0] // sum(sizes))

    # `combine_moments` of all replicas at once, as sums: two all-reduces.
    counts, weighted = total(lambda n, mean, m2: [n, n * mean])
    means = tf.math.divide_no_nan(weighted, counts)
    (m2s,) = total(
        lambda n, mean, m2: [m2 + n * tf.square(mean - means)]
    )
    split = [tf.split(value, sizes) for value in (counts, means, m2s)]
    _update_moving_statistics(list(zip(groups, *split)))
