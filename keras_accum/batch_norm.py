"""BatchNormalization moving statistics per accumulation window (TensorFlow).

`keras.layers.BatchNormalization` updates its moving mean and variance on
every training call. Under gradient accumulation a training call is one
micro-batch, so the moving averages would advance N times per optimizer
update, each time from the statistics of a small micro-batch. One big batch
holding the same samples advances them once, from the statistics of all its
samples. `WindowBatchNormStatistics` reproduces the big batch: it records the
statistics of each micro-batch, combines them exactly over the window (and,
under `tf.distribute`, over the replicas) and updates the moving statistics
once, when the window's update is applied.

This module is specific to the TensorFlow backend.
"""

import contextlib
import threading

import tensorflow as tf
from keras import layers as keras_layers

from keras_accum.accumulator import assign_per_replica
from keras_accum.accumulator import in_strategy_replica_context
from keras_accum.accumulator import run_if

_BatchNormalization = keras_layers.BatchNormalization
_MISSING = object()


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


def _local_variable(initial_value, name):
    """A variable local to each replica (a plain one without a strategy).

    Read and written in replica context only; `ONLY_FIRST_REPLICA` so that
    an eager read outside a replica context is not a collective.
    """
    return tf.Variable(
        initial_value,
        trainable=False,
        name=name,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


class _Slot:
    """One call of one layer: its place in a `_SlotGroup`'s flat vectors."""

    def __init__(self, layer, index, size):
        self.layer = layer
        self.index = index
        self.size = size


class _SlotGroup(tf.Module):
    """The window's running (count, mean, M2) of several calls, flattened.

    Each channel of each call has one entry in three flat variables; a
    call's count is repeated over its channels, so that all the window's
    arithmetic is elementwise on one vector per group: a few ops per
    micro-batch whatever the number of layers. Groups are created once, when
    new calls are first seen (at `build()`, or while the train step is
    traced), and never change shape. Under `tf.distribute` each replica
    holds its own: the statistics of its share of the window's samples.
    """

    def __init__(self, keys, dtype, name):
        super().__init__(name=name)
        self.dtype = dtype
        self.slots = []
        for layer, index in keys:
            size = layer.moving_mean.shape.num_elements()
            self.slots.append(_Slot(layer, index, size))
        self.sizes = [slot.size for slot in self.slots]
        with tf.init_scope():
            zeros = tf.zeros((sum(self.sizes),), dtype)
            self.count = _local_variable(zeros, name + "_count")
            self.mean = _local_variable(zeros, name + "_mean")
            self.m2 = _local_variable(zeros, name + "_m2")

    def flatten(self, calls):
        """Flat (count, mean, variance) of one forward pass.

        Args:
            calls: dict from slot to its recorded (count, mean, variance);
                a slot without a recorded call contributes a count of 0.

        Returns:
            Three flat tensors, or `None` if no slot of the group was called.
        """
        if not any(slot in calls for slot in self.slots):
            return None
        counts, means, variances = [], [], []
        for slot in self.slots:
            if slot in calls:
                count, mean, variance = calls[slot]
                counts.append(count)
                means.append(_flat(mean, self.dtype))
                variances.append(_flat(variance, self.dtype))
            else:
                zeros = tf.zeros([slot.size], self.dtype)
                counts.append(tf.zeros((), tf.int64))
                means.append(zeros)
                variances.append(zeros)
        # One count per call, repeated over the call's channels.
        slot_of_entry = [
            i for i, size in enumerate(self.sizes) for _ in range(size)
        ]
        return (
            tf.gather(tf.cast(tf.stack(counts), self.dtype), slot_of_entry),
            _concat(means),
            _concat(variances),
        )

    def add(self, count, mean, variance):
        """Adds one micro-batch (Chan et al.'s parallel combination)."""
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

    def read(self):
        return (
            self.count.read_value(),
            self.mean.read_value(),
            self.m2.read_value(),
        )

    def reset(self):
        for variable in (self.count, self.mean, self.m2):
            variable.assign(tf.zeros_like(variable))


def _update_moving_statistics(statistics):
    """`moving = moving * momentum + window * (1 - momentum)` where n > 0.

    One update per recorded call, in call order for a layer called several
    times (as one big batch does); the calls with the same index (distinct
    layers) are updated together, elementwise on concatenated vectors.

    Args:
        statistics: list of (group, count, mean, m2), the window's flat
            statistics of each group: this replica's own, or under
            `tf.distribute` those combined over the replicas (in
            cross-replica context).
    """
    # (has samples, mean, variance), flat per channel, for each group.
    flat = [
        (group, count > 0, mean, tf.math.divide_no_nan(m2, count))
        for group, count, mean, m2 in statistics
    ]
    rounds = {}  # (call index, moving dtype) -> slots
    for group, *_ in flat:
        for slot in group.slots:
            key = (slot.index, tf.as_dtype(slot.layer.moving_mean.dtype))
            rounds.setdefault(key, []).append(slot)
    split = None  # slot -> its parts of `flat`; made only when needed
    for (_, dtype), slots in sorted(
        rounds.items(), key=lambda item: item[0][0]
    ):
        # Usually (each layer called once) a round is one whole group: its
        # flat vectors are used as they are.
        whole = [entry for entry in flat if entry[0].slots == slots]
        if whole:
            _, has, mean, variance = whole[0]
        else:
            if split is None:
                split = {}
                for group, *vectors in flat:
                    parts = [tf.split(v, group.sizes) for v in vectors]
                    for slot, *slot_parts in zip(group.slots, *parts):
                        split[slot] = slot_parts
            has, mean, variance = (
                _concat([split[slot][i] for slot in slots]) for i in range(3)
            )
        sizes = [slot.size for slot in slots]
        momentum = tf.constant(
            [m for slot in slots for m in [slot.layer.momentum] * slot.size],
            dtype,
        )
        rest = tf.constant(
            [
                r
                for slot in slots
                for r in [1.0 - slot.layer.momentum] * slot.size
            ],
            dtype,
        )
        for name, value in (
            ("moving_mean", mean),
            ("moving_variance", variance),
        ):
            variables = [getattr(slot.layer, name) for slot in slots]
            moving = _concat(
                [_flat(tf.convert_to_tensor(v), dtype) for v in variables]
            )
            value = tf.cast(value, dtype)
            updated = tf.where(has, moving * momentum + value * rest, moving)
            parts = tf.split(updated, sizes) if len(sizes) > 1 else [updated]
            for variable, part in zip(variables, parts):
                if part.shape != variable.shape:
                    part = tf.reshape(part, variable.shape)
                variable.assign(part)


def _flat(value, dtype):
    """`value` as a flat vector of `dtype` (no op where it already is)."""
    value = tf.cast(value, dtype)
    if value.shape.rank != 1:
        value = tf.reshape(value, [-1])
    return value


def _concat(parts):
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def _count(layer, inputs, mask):
    """Number of values per channel that `layer._moments` reduced over.

    Always this replica's own count, also for `synchronized=True` layers,
    whose mean and variance are those of the global micro-batch: summed over
    the replicas, the local counts weight each micro-batch by its global
    count, so nothing is counted twice and no reduction is needed here.
    """
    if mask is not None:
        return tf.reduce_sum(tf.cast(mask, tf.int64))
    rank = inputs.shape.rank
    if rank is not None and len(layer._reduction_axes) == rank - 1:
        channels = inputs.shape[layer.axis]
        if channels is not None:
            # Every axis but the channel axis is reduced over.
            return tf.size(inputs, out_type=tf.int64) // channels
    shape = tf.shape(inputs, out_type=tf.int64)
    return tf.reduce_prod(tf.gather(shape, layer._reduction_axes))


class WindowBatchNormStatistics(tf.Module):
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
    float64 moving statistics), in variables that are not model weights but
    are saved with the pending window (`state()`, `restore()`); the moving
    statistics remain ordinary layer weights.

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
    and the assignment Keras then makes to the moving statistics is not
    made (safe for a non-finite micro-batch too; no `momentum=1` trick, as
    `NaN * 0 = NaN`). When the window ends and its update was applied, the
    moving statistics are updated once; a window skipped by the non-finite
    policy leaves them unchanged. A micro-batch whose statistics are not
    finite is not added to the window. A layer called several times per
    forward pass gets one update per call, in call order, as with one big
    batch. With a Keras mask the count is the number of unmasked values;
    Keras divides by that count plus 1e-7, so masked statistics match the
    big batch to about that relative tolerance.

    Under `tf.distribute` (`MirroredStrategy`, `MultiWorkerMirroredStrategy`)
    the statistics are those of the global window: all replicas, all
    micro-batches. Each replica accumulates `(n_r, mean_r, M2_r)` of its own
    samples, with no communication on any micro-step; when a window's update
    has been applied they are combined in two all-reduces for all layers
    together, then the moving statistics (mirrored) are updated once:

        n      = sum_r n_r
        mean   = sum_r n_r * mean_r / n                       (1st all-reduce)
        M2     = sum_r (M2_r + n_r * (mean_r - mean)**2)      (2nd all-reduce)
        variance = M2 / n

    Every term of the second sum is non-negative, so nothing cancels (unlike
    `sum(x**2) - n * mean**2`): exact to rounding in float64 and stable in
    float32 whatever the ratio of mean to standard deviation. A skipped
    window and the micro-steps that end no window make no reduction, nor
    does a model without windowed BatchNormalization layers.
    `synchronized=True` layers record their global micro-batch mean and
    variance with the replica's local count, so the same combination gives
    the global window without counting anything twice.

    Not covered (Keras' per-call updates are kept): `renorm=True` layers
    (their renormalisation statistics are a different update), subclasses
    that override `call()`, calls traced inside a `tf.cond`/`tf.while_loop`
    of the model's own `call()`, and `gradient_accumulation_steps=1`
    (identical to Keras). Frozen layers (`trainable=False`) run in inference
    mode and update nothing, as in Keras.

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
        super().__init__(name="window_batch_norm")
        self.enabled = enabled
        # `_groups` is tracked (`tf.train.Checkpoint`); the bookkeeping is
        # not: (id(layer), call index) -> _Slot, in creation order, ...
        self._groups = []  # _SlotGroup, in creation order
        object.__setattr__(self, "_slots", {})
        # ... `id(layer)` -> _LayerPatch, and values restored before their
        # group existed (see `restore`).
        object.__setattr__(self, "_patches", {})
        object.__setattr__(self, "_pending_state", {})
        # `MirroredStrategy` traces each replica's step in a thread of its
        # own: the patches are shared (counted), the recordings per thread.
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def slots(self):
        """The per-(layer, call) accumulators created so far."""
        return list(self._slots.values())

    def build(self, model):
        """Creates the window's variables for one call of each layer.

        Call before the train function is traced, inside the distribution
        strategy's scope if any (a layer called several times per forward
        pass gets its further variables while tracing).

        Args:
            model: the `GradientAccumulationModel` to be trained.
        """
        if not self.enabled or model.gradient_accumulation_steps == 1:
            return
        self._ensure_slots(
            [
                (layer, 0)
                for layer in window_batch_norm_layers(model)
                if layer.built
            ]
        )

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
        if not self.enabled or model.gradient_accumulation_steps == 1:
            yield
            return
        bn_layers = window_batch_norm_layers(model)
        if not bn_layers:
            yield
            return
        recording = _Recording(model, bn_layers)
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
        self._ensure_slots([key for key, _ in recorded])
        calls = {
            self._slots[(id(layer), index)]: statistics
            for (layer, index), statistics in recorded
        }
        flat = []
        for group in self._groups:
            values = group.flatten(calls)
            if values is not None:
                flat.append((group, values))
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

    def end_step(self, accumulator):
        """Ends the window if the train step just ended one.

        Call after `accumulator.accumulate_and_maybe_apply(...)`: a window
        ended when `accumulator.micro_step == 0`.

        Args:
            accumulator: the `GradientAccumulator`.
        """
        if not self._groups:
            return
        self.end_window(
            accumulator.update_applied.read_value(),
            window_ended=tf.equal(accumulator.micro_step.read_value(), 0),
        )

    def end_window(self, applied, window_ended=True):
        """Updates the moving statistics once if applied, then resets.

        Under several replicas call it in replica context, on every replica
        (as the train step does); `applied` and `window_ended` must be the
        same on all replicas.

        Args:
            applied: bool tensor, whether the window's update was applied;
                if not (a skipped window) the moving statistics are kept.
            window_ended: bool tensor, whether a window ended at all.
        """
        groups = list(self._groups)
        if not groups:
            return
        if in_strategy_replica_context():
            self._end_window_distributed(groups, applied, window_ended)
            return

        def update():
            _update_moving_statistics(
                [(group,) + group.read() for group in groups]
            )
            return tf.constant(True)

        def finish():
            tf.cond(applied, update, lambda: tf.constant(False))
            for group in groups:
                group.reset()
            return tf.constant(True)

        if window_ended is True:
            finish()
        else:
            run_if(window_ended, finish)

    def _end_window_distributed(self, groups, applied, window_ended):
        """The window's end under several replicas.

        The moving statistics are mirrored: they are updated in
        cross-replica context (`merge_call`), inside a `tf.cond` there, as
        the optimizer's update is. The reductions run only in the branch of
        a window whose update was applied, in the same order on every
        worker.
        """
        context = tf.distribute.get_replica_context()
        window_ended = tf.convert_to_tensor(window_ended, tf.bool)
        applied = tf.convert_to_tensor(applied, tf.bool)

        def cross_replica(distribution, window_ended, applied):
            window_ended = distribution.experimental_local_results(
                window_ended
            )[0]
            applied = distribution.experimental_local_results(applied)[0]

            def update():
                _update_from_replicas(distribution, groups)
                return tf.constant(True)

            return tf.cond(
                tf.logical_and(window_ended, applied),
                update,
                lambda: tf.constant(False),
            )

        context.merge_call(cross_replica, args=(window_ended, applied))

        def reset_local():
            for group in groups:
                group.reset()
            return tf.constant(True)

        tf.cond(window_ended, reset_local, lambda: tf.constant(False))

    def state(self):
        """The window's statistics variables, by name (groups created so far).

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
        state = self.state()
        self._pending_state.clear()
        for name, per_replica in values.items():
            variable = state.get(name)
            if variable is None:
                self._pending_state[name] = per_replica
            elif tuple(variable.shape) == tuple(per_replica[0].shape):
                assign_per_replica(variable, per_replica)
            else:
                raise ValueError(
                    f"The saved BatchNormalization window statistics "
                    f"`{name}` have shape {per_replica[0].shape}, but the "
                    f"model's have {tuple(variable.shape)}: the model "
                    "differs from the one that was saved."
                )

    def _ensure_slots(self, keys):
        """Creates one group for the (layer, call index) pairs not yet held.

        Under `MirroredStrategy` the replicas trace in threads of their own;
        the first one creates the group, the others find it.
        """
        with self._lock:
            missing = []
            for layer, index in keys:
                slot = self._slots.get((id(layer), index))
                if slot is None or slot.layer is not layer:
                    missing.append((layer, index))
            by_dtype = {}
            for layer, index in missing:
                dtype = _statistics_dtype(layer.moving_mean)
                by_dtype.setdefault(dtype, []).append((layer, index))
            for dtype, group_keys in by_dtype.items():
                group = _SlotGroup(
                    group_keys, dtype, f"window_batch_norm_{len(self._groups)}"
                )
                self._groups.append(group)
                for slot in group.slots:
                    self._slots[(id(slot.layer), slot.index)] = slot
            if missing and self._pending_state:
                self.restore(dict(self._pending_state))

    # ------------------------------------------------------------------
    # Patches of the layers, while forward passes are recorded
    # ------------------------------------------------------------------
    def _patch(self, layers):
        with self._lock:
            for layer in layers:
                patch = self._patches.get(id(layer))
                if patch is None:
                    patch = _LayerPatch(layer)
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
        """`layer._moments`, recording each call's (count, mean, variance).

        Calls in another thread's or no recording, and calls traced in
        another graph (Keras building a layer with a symbolic scratch call,
        or a call inside a `tf.cond` branch) are not recorded: their Keras
        updates are kept.
        """
        original = layer._moments

        def _moments(inputs, mask):
            recording = getattr(self._local, "recording", None)
            if recording is None or not recording.wants(layer, inputs):
                if recording is not None:
                    recording.suppress[id(layer)] = False
                return original(inputs, mask)
            mean, variance = original(inputs, mask)
            recording.calls[id(layer)].append(
                (
                    _count(layer, inputs, mask),
                    mean,
                    variance,
                )
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
                and _current_graph() is recording.graph
            ):
                return value
            return original(value, *args, **kwargs)

        return assign


class _Recording:
    """What one forward pass (in one thread) has recorded."""

    def __init__(self, model, layers):
        self.model = model
        self.graph = _current_graph()
        self.calls = {id(layer): [] for layer in layers}
        # Whether the layer's latest `_moments` call was recorded (then its
        # following assignments to the moving statistics are not made).
        self.suppress = {}
        self._has_trainable_weights = None

    def wants(self, layer, inputs):
        if not tf.is_tensor(inputs) or _current_graph() is not self.graph:
            return False
        if id(layer) not in self.calls:
            return False
        if self._has_trainable_weights is None:
            # Without trainable weights no window is ever counted: keep
            # Keras' per-call updates.
            self._has_trainable_weights = bool(self.model.trainable_weights)
        return self._has_trainable_weights


class _LayerPatch:
    """`_moments` and the moving statistics' `assign` of one layer, patched."""

    def __init__(self, layer):
        self.layer = layer
        self.users = 0
        self._own_moments = layer.__dict__.get("_moments", _MISSING)
        self._assigns = None  # [(variable, own `assign` attribute)]

    def install_moments(self, moments):
        object.__setattr__(self.layer, "_moments", moments)

    def install_assign(self, make_assign):
        if self._assigns is not None:
            return
        self._assigns = []
        for variable in (self.layer.moving_mean, self.layer.moving_variance):
            own = variable.__dict__.get("assign", _MISSING)
            object.__setattr__(
                variable, "assign", make_assign(self.layer, variable.assign)
            )
            self._assigns.append((variable, own))

    def remove(self):
        _restore(self.layer, "_moments", self._own_moments)
        for variable, own in self._assigns or ():
            _restore(variable, "assign", own)
        self._assigns = None


def _restore(obj, name, own):
    if own is _MISSING:
        object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, own)


def _update_from_replicas(distribution, groups):
    """Combines the replicas' statistics; updates the moving statistics.

    In cross-replica context. Two all-reduces, for all groups at once: the
    counts and `n_r * mean_r`, then `M2_r + n_r * (mean_r - mean)**2`.
    """
    dtype = (
        tf.float64
        if any(group.dtype == tf.float64 for group in groups)
        else tf.float32
    )
    sizes = [sum(group.sizes) for group in groups]
    total = sum(sizes)

    def local_statistics():
        return [
            tuple(tf.cast(value, dtype) for value in group.read())
            for group in groups
        ]

    def first_moments():
        local = local_statistics()
        return tf.concat(
            [count for count, _, _ in local]
            + [count * mean for count, mean, _ in local],
            axis=0,
        )

    def second_moments(means):
        return tf.concat(
            [
                m2 + count * tf.square(mean - global_mean)
                for (count, mean, m2), global_mean in zip(
                    local_statistics(), tf.split(means, sizes)
                )
            ],
            axis=0,
        )

    sum_op = tf.distribute.ReduceOp.SUM
    totals = distribution.reduce(
        sum_op,
        distribution.extended.call_for_each_replica(first_moments),
        axis=None,
    )
    counts = totals[:total]
    means = tf.math.divide_no_nan(totals[total:], counts)
    m2s = distribution.reduce(
        sum_op,
        distribution.extended.call_for_each_replica(
            second_moments, args=(means,)
        ),
        axis=None,
    )
    _update_moving_statistics(
        list(
            zip(
                groups,
                tf.split(counts, sizes),
                tf.split(means, sizes),
                tf.split(m2s, sizes),
            )
        )
    )


def _current_graph():
    """The graph being built, or `None` when executing eagerly."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()
