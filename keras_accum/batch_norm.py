"""BatchNormalization moving statistics that move once per window, from all
its samples (docs/design.md, "BatchNormalization statistics per window")."""

import collections
import contextlib
import functools
import threading

import tensorflow as tf
from keras.layers import BatchNormalization

from keras_accum import _keras_compat as compat
from keras_accum._tf_utils import accumulation_dtype
from keras_accum._tf_utils import assign_state
from keras_accum._tf_utils import current_graph
from keras_accum._tf_utils import state_variable

_FIELDS = ("count", "mean", "m2")
# One call of one layer: its place in a `_CallGroup`'s flat vectors.
_Call = collections.namedtuple("_Call", ["layer", "index", "size"])


def window_batch_norm_layers(model):
    """The trainable `BatchNormalization` layers of `model` (nested too), each
    once, that keep Keras' `call()` and have no `renorm`."""
    return [
        layer
        for layer in compat.layers_of(model)
        if isinstance(layer, BatchNormalization)
        and type(layer).call is BatchNormalization.call
        and layer.trainable
        and not getattr(layer, "renorm", False)  # an attribute from Keras 3.14
    ]


def combine_moments(a, b):
    """Chan et al.'s parallel combination: the (count, mean, M2) of the union
    of two parts' (count, mean, M2), M2 the sum of squared deviations."""
    (count_a, mean_a, m2_a), (count_b, mean_b, m2_b) = a, b
    count = count_a + count_b
    delta = mean_b - mean_a
    mean = mean_a + delta * tf.math.divide_no_nan(count_b, count)
    weight = tf.math.divide_no_nan(count_a * count_b, count)
    return count, mean, m2_a + m2_b + tf.square(delta) * weight


class _CallGroup(tf.Module):
    """The window's (count, mean, M2) of the calls of one index and moving
    dtype, as flat per-replica vectors (one entry per channel of each call)."""

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
            for field in _FIELDS:
                setattr(self, field, state_variable(zeros, f"{name}_{field}"))

    def flatten(self, recorded):
        """Flat (count, mean, variance) of `recorded`, by (layer, index)."""
        counts, means, variances = [], [], []
        for layer, index, size in self.calls:
            if (layer, index) in recorded:
                count, mean, variance = recorded[layer, index]
            else:
                count = tf.zeros((), tf.int64)
                mean = variance = tf.zeros([size], self.dtype)
            counts.append(count)
            means.append(_flat(mean, self.dtype))
            variances.append(_flat(variance, self.dtype))
        call_of_entry = _per_channel(range(len(self.sizes)), self.sizes)
        counts = tf.gather(tf.cast(tf.stack(counts), self.dtype), call_of_entry)
        return counts, _concat(means), _concat(variances)

    def add(self, count, mean, variance):
        combined = combine_moments(self.read(), (count, mean, variance * count))
        for field, value in zip(_FIELDS, combined):
            getattr(self, field).assign(value)

    def read(self):
        return tuple(getattr(self, field).read_value() for field in _FIELDS)

    def reset(self):
        for field in _FIELDS:
            getattr(self, field).assign(tf.zeros_like(getattr(self, field)))

    def update_moving(self, count, mean, m2):
        """`moving * momentum + window * (1 - momentum)` where counted."""
        has = count > 0
        values = (mean, tf.math.divide_no_nan(m2, count))
        dtype = self.moving_dtype
        momenta = [call.layer.momentum for call in self.calls]
        momentum = tf.constant(_per_channel(momenta, self.sizes), dtype)
        rest = [1.0 - m for m in momenta]
        rest = tf.constant(_per_channel(rest, self.sizes), dtype)
        for name, value in zip(("moving_mean", "moving_variance"), values):
            variables = [getattr(call.layer, name) for call in self.calls]
            moving = _concat([_flat(v, dtype) for v in variables])
            value = tf.cast(value, dtype)
            updated = tf.where(has, moving * momentum + value * rest, moving)
            parts = [updated]
            if len(variables) > 1:
                parts = tf.split(updated, self.sizes)
            for variable, part in zip(variables, parts):
                if part.shape != variable.shape:
                    part = tf.reshape(part, variable.shape)
                variable.assign(part)


def _per_channel(values, sizes):
    """Each call's value, repeated over its channels."""
    return [v for v, size in zip(values, sizes) for _ in range(size)]


def _flat(value, dtype):
    """`value` as a flat vector of `dtype` (no op where it already is)."""
    value = tf.cast(value, dtype)
    return value if value.shape.rank == 1 else tf.reshape(value, [-1])


def _concat(parts):
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def _count(layer, inputs, mask):
    """Values per channel the moments reduced over, on this replica."""
    if mask is not None:
        return tf.reduce_sum(tf.cast(mask, tf.int64))
    axes = compat.reduction_axes(layer)
    rank = inputs.shape.rank
    if rank is not None and len(axes) == rank - 1:
        channels = inputs.shape[layer.axis]
        if channels is not None:
            return tf.size(inputs, out_type=tf.int64) // channels
    return tf.reduce_prod(tf.gather(tf.shape(inputs, out_type=tf.int64), axes))


def _replica_totals(distribution, groups):
    """Each group's (count, mean, M2) over all replicas: `combine_moments`
    as sums, in two all-reduces."""
    float64 = any(group.dtype == tf.float64 for group in groups)
    dtype = tf.float64 if float64 else tf.float32
    sizes = [sum(group.sizes) for group in groups]

    def total(f):
        """`f` of each replica's statistics, summed in one all-reduce."""

        def local():
            values = [[tf.cast(v, dtype) for v in g.read()] for g in groups]
            values = [_concat([v[i] for v in values]) for i in range(3)]
            return tf.concat(f(*values), axis=0)

        local = distribution.extended.call_for_each_replica(local)
        summed = distribution.reduce("SUM", local, axis=None)
        return tf.split(summed, summed.shape[0] // sum(sizes))

    counts, weighted = total(lambda n, mean, m2: [n, n * mean])
    means = tf.math.divide_no_nan(weighted, counts)
    (m2s,) = total(lambda n, mean, m2: [m2 + n * tf.square(mean - means)])
    return zip(*[tf.split(value, sizes) for value in (counts, means, m2s)])


class WindowBatchNormStatistics(tf.Module):
    """Updates BatchNormalization moving statistics once per window.

    Every trainable `keras.layers.BatchNormalization` of the model (nested
    and `synchronized=True` ones too) moves its moving statistics once per
    applied window, from the exact statistics of all the window's samples
    and replicas; a skipped window leaves them unchanged.

    Args:
        enabled: bool, whether to window the moving statistics. If `False`
            nothing is recorded and Keras updates them every micro-batch.

    Raises:
        ValueError: if `enabled` is not a bool.

    Example:

    ```python
    statistics = WindowBatchNormStatistics()
    accumulator.add_window_end_listener(statistics)
    with statistics.record(model):
        y_pred = model(x, training=True)
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
        object.__setattr__(self, "_patches", {})  # layer -> MomentsPatch
        object.__setattr__(self, "_pending_state", {})
        self._local = threading.local()  # `.recording`, one per thread
        self._lock = threading.Lock()

    @property
    def calls(self):
        """The per-(layer, call) accumulators created so far."""
        return [call for group in self._groups for call in group.calls]

    def build(self, model):
        """Creates the window's variables for one call of each layer.

        Args:
            model: the `GradientAccumulationModel` to be trained.
        """
        layers = self._layers(model)
        self._ensure_calls([(layer, 0) for layer in layers if layer.built])

    @contextlib.contextmanager
    def record(self, model):
        """Records the BatchNormalization statistics of one forward pass.

        Args:
            model: the `GradientAccumulationModel` being trained.

        Yields:
            None.
        """
        layers = self._layers(model)
        if not layers:
            yield
            return
        recording = _ForwardRecording(model, layers)
        previous = getattr(self._local, "recording", None)
        self._local.recording = recording
        self._patch(layers, 1)
        try:
            yield
        finally:
            self._local.recording = previous
            self._patch(layers, -1)
        recorded = {
            (layer, index): statistics
            for layer in layers
            for index, statistics in enumerate(recording.calls[layer])
        }
        if not recorded:
            return
        for layer in layers:
            # Keras' update, suppressed: else it moves them once more.
            if recording.calls[layer] and layer not in recording.assigned:
                raise compat.moving_statistics_not_assigned(layer)
        self._ensure_calls(recorded)
        groups = [
            group
            for group in self._groups
            if any((c.layer, c.index) in recorded for c in group.calls)
        ]
        flat = [group.flatten(recorded) for group in groups]
        # A micro-batch whose statistics are not all finite adds nothing.
        finite = [tf.math.is_finite(v) for values in flat for v in values[1:]]
        finite = tf.reduce_all(tf.stack([tf.reduce_all(f) for f in finite]))
        for group, values in zip(groups, flat):
            group.add(*[tf.where(finite, v, tf.zeros_like(v)) for v in values])

    def window_end(self, strategy, applied):
        """Updates the moving statistics once if the window was applied.

        Args:
            strategy: the `tf.distribute.Strategy` (the default one without
                a strategy).
            applied: bool tensor, whether the window's update was applied.
        """
        groups = sorted(self._groups, key=lambda group: group.index)
        if not groups:
            return

        def update():
            if strategy.num_replicas_in_sync > 1:
                totals = _replica_totals(strategy, groups)
            else:
                totals = [group.read() for group in groups]
            for group, values in zip(groups, totals):
                group.update_moving(*values)
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
            for field in _FIELDS
        }

    def restore(self, values):
        """Assigns saved statistics; a group not created yet gets them later.

        Args:
            values: dict from a `state()` name to a list of values, one per
                replica.
        """
        pending = assign_state(self.state(), values)
        object.__setattr__(self, "_pending_state", pending)

    def _layers(self, model):
        if self.enabled and model.gradient_accumulator.accumulates:
            return window_batch_norm_layers(model)
        return []

    def _ensure_calls(self, keys):
        """Groups the (layer, call index) pairs not held yet by kind."""
        with self._lock:
            held = {(call.layer, call.index) for call in self.calls}
            missing = {}
            for layer, index in keys:
                if (layer, index) not in held:
                    kind = (index, tf.as_dtype(layer.moving_mean.dtype))
                    missing.setdefault(kind, []).append((layer, index))
            for (_, dtype), group_keys in missing.items():
                name = f"window_batch_norm_{len(self._groups)}"
                self._groups.append(_CallGroup(group_keys, dtype, name))
            if missing and self._pending_state:
                self.restore(self._pending_state)

    def _patch(self, layers, users):
        """Adds `users` to the counts of the layers' shared patches."""
        with self._lock:
            for layer in layers:
                patch = self._patches.get(layer)
                if patch is None:
                    patch = compat.MomentsPatch(layer)
                    moments = compat.moments(layer)
                    patch.install_moments(
                        functools.partial(self._moments, layer, moments)
                    )
                    self._patches[layer] = patch
                patch.users += users
                if patch.users == 0:
                    patch.remove()
                    del self._patches[layer]

    def _moments(self, layer, moments, inputs, mask):
        """`moments(inputs, mask)`, recorded (and Keras' update then not)."""
        recording = getattr(self._local, "recording", None)
        wanted = recording is not None and recording.wants(layer, inputs)
        if recording is not None:
            recording.suppress[layer] = wanted
        mean, variance = moments(inputs, mask)
        if wanted:
            count = _count(layer, inputs, mask)
            recording.calls[layer].append((count, mean, variance))
            with self._lock:
                patch = self._patches[layer]
                patch.install_assign(self._suppressed_assign)
        return mean, variance

    def _suppressed_assign(self, layer, assign):
        """`assign`, a no-op right after a recorded call."""

        def suppressed(value, *args, **kwargs):
            recording = getattr(self._local, "recording", None)
            if recording is not None and recording.suppresses(layer):
                recording.assigned.add(layer)
                return value
            return assign(value, *args, **kwargs)

        return suppressed


class _ForwardRecording:
    """What one forward pass (in one thread) has recorded."""

    def __init__(self, model, layers):
        self.model = model
        self.graph = current_graph()
        self.calls = {layer: [] for layer in layers}
        self.suppress = {}  # layer -> whether its last call was recorded
        self.assigned = set()  # layers whose update was suppressed

    @functools.cached_property
    def _has_trainable_weights(self):
        return bool(self.model.trainable_weights)

    def wants(self, layer, inputs):
        return (
            tf.is_tensor(inputs)
            and current_graph() is self.graph
            and layer in self.calls
            and self._has_trainable_weights
        )

    def suppresses(self, layer):
        return self.suppress.get(layer) and current_graph() is self.graph
