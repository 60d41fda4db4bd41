"""`WindowState`: the counters and buffers of one accumulation window."""

import functools

import tensorflow as tf

from keras_accum._tf_utils import accumulation_dtype
from keras_accum._tf_utils import assign_per_replica
from keras_accum._tf_utils import assign_state
from keras_accum._tf_utils import components
from keras_accum._tf_utils import per_replica_values
from keras_accum._tf_utils import run_if
from keras_accum._tf_utils import state_variable
from keras_accum._tf_utils import xla_on_cpu

# Saved names of the counters (`state()`), in this order.
COUNTERS = (
    "micro_step",
    "window_steps",
    "next_window_steps",
    "added_micro_batches",
    "steps_in_window",
    "skipped_windows",
    "dropped_micro_batches",
)


class WindowState(tf.Module):
    """What one window has accumulated, per replica, as optax's
    `MultiStepsState`: the counters, the normaliser sum and one float32
    (float64 for float64 variables) buffer per variable.

    Counters: `micro_step` (micro-batches seen), `added_micro_batches`
    (those added: finite), `steps_in_window` (train steps ended),
    `window_steps` (N of this window), `next_window_steps` (N of the next),
    `skipped_windows`, `dropped_micro_batches`, `update_applied`.
    """

    def __init__(self, steps, name="window_state"):
        super().__init__(name=name)
        with tf.init_scope():
            for counter in COUNTERS:
                initial = steps if counter.endswith("window_steps") else 0
                setattr(
                    self, counter,
                    state_variable(initial, counter, dtype=tf.int64),
                )
            self.update_applied = state_variable(False, "update_applied")
        self.buffers = []
        self.normalizer_sum = None
        self.normalizer_dtype = tf.float32
        # Which variables get gradients, saved (docs/design.md, "Exact resume").
        self.has_gradient = None
        self.overwrite = []
        self._variable_ids = None
        self._gradient_is_none = None
        # Saved values waiting for their variables (not tracked).
        object.__setattr__(self, "_pending_state", {})

    @property
    def built(self):
        return self._variable_ids is not None

    def unbuild(self):
        """Has the next `build()` create the buffers anew."""
        self._variable_ids = None

    def build(self, variables, with_buffers):
        """Creates the window's variables; a no-op for the same variables."""
        ids = [id(v) for v in variables]
        if ids == self._variable_ids:
            return
        with tf.init_scope():
            pending = self.built and tf.executing_eagerly() and (
                int(self.micro_step.numpy())
            )
            if pending:
                raise ValueError(
                    "The trainable variables changed while a window of "
                    f"{pending} micro-batches is pending. Call `flush()` "
                    "first so that no gradients are lost."
                )
            dtypes = [accumulation_dtype(v.dtype) for v in variables]
            dtype = tf.float64 if tf.float64 in dtypes else tf.float32
            if self.normalizer_sum is None or dtype != self.normalizer_dtype:
                self.normalizer_dtype = dtype
                self.normalizer_sum = state_variable(
                    tf.zeros((), dtype),
                    "normalizer_sum",
                    tf.VariableAggregation.SUM,
                )
            if self.buffers:
                # Other variables. (The first build appends to the tracked
                # list: `tf.train.Checkpoint` restores into it later.)
                self.buffers = []
            if with_buffers:
                self.buffers.extend(map(_buffer, variables, dtypes))
            if self.has_gradient is None or (
                self.has_gradient.shape[0] != len(variables)
            ):
                self.has_gradient = state_variable(
                    tf.ones([len(variables)], tf.bool), "has_gradient"
                )
        self._variable_ids = ids
        self._gradient_is_none = None
        # Keras' float8 scales and amax histories (docs/design.md).
        self.overwrite = [
            bool(getattr(v, "overwrite_with_gradient", False))
            for v in variables
        ]
        if self._pending_state:
            self.restore(self._pending_state)

    def ready(self):
        """bool tensor: whether the window has all its train steps."""
        return self.steps_in_window >= self.window_steps

    def pending(self):
        """bool tensor: whether any micro-batch waits in the window."""
        return self.micro_step > 0

    def count_step(self):
        """Counts a train step that ended, after its micro-batches.

        The count is computed from `micro_step`, which this step's `add()`s
        update once its gradients exist: a data dependency, which graph
        optimisations keep (Grappler's constant folding dropped a control
        dependency on the loss under `MirroredStrategy`). So Keras' extra
        call at the end of an epoch of unknown length, whose input runs
        out, counts no step (docs/design.md, "Input of unknown length").
        """
        seen = self.micro_step.read_value()
        # 1, once `seen` is read (it is never negative).
        one = tf.cast(tf.greater_equal(seen, 0), tf.int64)
        self.steps_in_window.assign_add(one)

    def set_steps(self, steps):
        """N of the next windows; of this one too if it is empty."""
        with tf.init_scope():
            replicas = len(components(self.micro_step))
            assign_per_replica(self.next_window_steps, [steps] * replicas)
            if not int(self.micro_step.numpy()):
                assign_per_replica(self.window_steps, [steps] * replicas)

    def record_gradients(self, gradients):
        """Notes (and saves) which variables the traced step gives gradients."""
        self._gradient_is_none = [g is None for g in gradients]
        with tf.init_scope():
            mask = [not none for none in self._gradient_is_none]
            assign_per_replica(
                self.has_gradient, [mask] * len(components(self.has_gradient))
            )

    def add(self, gradients, normalizer, gradient_scale):
        """Adds one finite micro-batch: `buffer += D * scale * g`."""
        dtype = self.normalizer_dtype
        # (A scale of 1, as without replicas, costs no op.)
        unscaled = isinstance(gradient_scale, (int, float)) and (
            gradient_scale == 1
        )
        scale = 1.0 if unscaled else tf.cast(gradient_scale, dtype)
        if normalizer is None:  # a sum: counted with weight 0
            factor, normalizer = scale, tf.zeros((), dtype)
        else:
            normalizer = tf.cast(normalizer, dtype)
            factor = normalizer if unscaled else normalizer * scale
        self._add_to_buffers(gradients, factor)
        self.normalizer_sum.assign_add(normalizer)
        self.added_micro_batches.assign_add(1)

    def _add_to_buffers(self, gradients, factor):
        """`buffer += factor * g`, or `= factor * g` for the window's first
        (docs/design.md, "Accumulating cheaply")."""
        first = tf.equal(self.added_micro_batches, 0)
        pairs = []
        for b, g, keep_max in zip(self.buffers, gradients, self.overwrite):
            if g is None:
                continue
            if keep_max:
                g = tf.cast(g, b.dtype)
                b.assign(tf.where(first, g, tf.maximum(b, g)))
            else:
                pairs.append((b, g))
        # The factor cast once per buffer dtype, in a fixed order.
        factors = {
            dtype: tf.cast(factor, dtype)
            for dtype in dict.fromkeys(buffer.dtype for buffer, _ in pairs)
        }
        if not xla_on_cpu():
            tf.cond(
                first,
                functools.partial(_write_scaled, pairs, factors),
                functools.partial(_add_scaled, pairs, factors),
            )
            return
        # Under XLA on a CPU a conditional copies every buffer: selects.
        sparse = [b for b, g in pairs if isinstance(g, tf.IndexedSlices)]
        if sparse:
            run_if(first, functools.partial(_zero, sparse))
        for buffer, g in pairs:
            c = factors[buffer.dtype]
            if isinstance(g, tf.IndexedSlices):
                _scatter_add_scaled(buffer, g, c)
            else:
                term = tf.cast(g, buffer.dtype) * c
                buffer.assign(tf.where(first, term, buffer + term))

    def totals(self, strategy):
        """(micro-batches seen, added, normaliser sum) over the replicas."""
        counts = (
            self.micro_step, self.added_micro_batches, self.normalizer_sum
        )
        if strategy.num_replicas_in_sync == 1:
            return counts

        def local():
            return tf.stack([tf.cast(c, tf.float64) for c in counts])

        steps, added, normalizer = tf.unstack(
            strategy.reduce(
                tf.distribute.ReduceOp.SUM,
                strategy.extended.call_for_each_replica(local),
                axis=None,
            )
        )
        return steps, added, tf.cast(normalizer, self.normalizer_dtype)

    def gradients(self, normalizer, several):
        """The buffers over the window's normaliser (zeros if none added)."""
        buffers = self.buffers
        if several:
            added = self.added_micro_batches > 0
            buffers = [tf.where(added, b, tf.zeros_like(b)) for b in buffers]
        if self._gradient_is_none is None:
            with tf.init_scope():
                mask = per_replica_values(self.has_gradient)[0]
            self._gradient_is_none = [not bool(m) for m in mask]
        divisor = tf.where(normalizer > 0, normalizer, tf.ones_like(normalizer))
        return [
            None if none else b if keep else b / tf.cast(divisor, b.dtype)
            for b, none, keep in zip(
                buffers, self._gradient_is_none, self.overwrite
            )
        ]

    def reset(self):
        """Empties the window; the next one takes `next_window_steps`."""
        if self.normalizer_sum is not None:
            self.normalizer_sum.assign(tf.zeros((), self.normalizer_dtype))
        zero = tf.zeros((), tf.int64)
        for counter in ("micro_step", "steps_in_window", "added_micro_batches"):
            getattr(self, counter).assign(zero)
        self.window_steps.assign(self.next_window_steps)

    def state(self):
        """The state variables by name (those created so far)."""
        state = {counter: getattr(self, counter) for counter in COUNTERS}
        if self.normalizer_sum is not None:
            state["normalizer_sum"] = self.normalizer_sum
        if self.has_gradient is not None:
            state["has_gradient"] = self.has_gradient
        for i, buffer in enumerate(self.buffers):
            state[f"buffer_{i}"] = buffer
        return state

    def restore(self, values):
        """Assigns saved per-replica values (the rest waits for `build()`)."""
        steps = values.get("steps_in_window")
        seen = values.get("micro_step")
        # Saved when only train steps of several micro-batches counted
        # `steps_in_window`: each of its micro-batches was one train step.
        if seen is not None and (steps is None or not any(steps)):
            values = dict(values, steps_in_window=seen)
        object.__setattr__(
            self, "_pending_state", assign_state(self.state(), values)
        )


def _buffer(variable, dtype):
    name = getattr(variable, "path", None) or variable.name
    return state_variable(
        tf.zeros(variable.shape, dtype),
        "buffer_" + name.replace("/", "_").replace(":", "_"),
        tf.VariableAggregation.SUM,
    )


def _write_scaled(pairs, factors):
    for buffer, g in pairs:
        c = factors[buffer.dtype]
        if isinstance(g, tf.IndexedSlices):
            buffer.assign(tf.zeros_like(buffer))
            _scatter_add_scaled(buffer, g, c)
        else:
            buffer.assign(tf.cast(g, buffer.dtype) * c)
    return tf.constant(True)


def _add_scaled(pairs, factors):
    """`buffer += factor * g` in one pass: `buffer -= -factor * g`."""
    alphas = {dtype: -c for dtype, c in factors.items()}
    for buffer, g in pairs:
        if isinstance(g, tf.IndexedSlices):
            _scatter_add_scaled(buffer, g, factors[buffer.dtype])
        else:
            tf.raw_ops.ResourceApplyGradientDescent(
                var=buffer.handle,
                alpha=alphas[buffer.dtype],
                delta=tf.cast(g, buffer.dtype),
            )
    return tf.constant(True)


def _scatter_add_scaled(buffer, g, factor):
    buffer.scatter_add(
        tf.IndexedSlices(
            tf.cast(g.values, buffer.dtype) * factor, g.indices, g.dense_shape
        )
    )


def _zero(variables):
    for variable in variables:
        variable.assign(tf.zeros_like(variable))
    return tf.constant(True)
