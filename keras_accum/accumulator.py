"""`GradientAccumulator`: the accumulation primitive (TensorFlow backend)."""

import functools
import numbers

import tensorflow as tf
from keras import optimizers

from keras_accum._tf_utils import accumulation_dtype
from keras_accum._tf_utils import assign_per_replica
from keras_accum._tf_utils import assign_state
from keras_accum._tf_utils import in_replica_context
from keras_accum._tf_utils import in_xla_context
from keras_accum._tf_utils import per_replica_values
from keras_accum._tf_utils import run_if
from keras_accum._tf_utils import state_variable

NON_FINITE_POLICIES = ("auto", "skip_window", "drop_micro_batch", "propagate")
# The micro-step counter is an int64.
MAX_STEPS = 2**63 - 1


def validate_steps(value, name="gradient_accumulation_steps"):
    """Returns `value` as an int, or raises a `ValueError` in Keras' style."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < 1
    ):
        raise ValueError(
            f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
        )
    if value > MAX_STEPS:
        raise ValueError(
            f"`{name}` must be at most 2**63 - 1 (the micro-step counter "
            f"is an int64). Received: {name}={value!r}"
        )
    return int(value)


def validate_policy(value):
    if not isinstance(value, str) or value not in NON_FINITE_POLICIES:
        raise ValueError(
            "`non_finite_policy` must be one of "
            f"{', '.join(repr(p) for p in NON_FINITE_POLICIES)}. "
            f"Received: non_finite_policy={value!r}"
        )
    return value


def resolve_policy(policy, loss_scaled):
    """The non-finite policy in force, `"auto"` resolved; checked."""
    if policy == "auto":
        return "skip_window" if loss_scaled else "propagate"
    if loss_scaled and policy == "propagate":
        raise ValueError(
            "`non_finite_policy='propagate'` cannot be used with a "
            "`LossScaleOptimizer`: an overflow must not reach the "
            "weights. Use 'skip_window' or 'drop_micro_batch'."
        )
    return policy


def is_loss_scale_optimizer(optimizer):
    return isinstance(optimizer, optimizers.LossScaleOptimizer)


class GradientAccumulator(tf.Module):
    """Accumulates micro-batch gradients and applies their exact window mean.

    Each micro-batch's gradients are added with its `normalizer` (the `D` its
    mean loss was divided by); after `gradient_accumulation_steps` of them
    the optimizer is applied once to `sum_k(D_k * g_k) / sum_k(D_k)`, what
    one batch of all the window's samples would give. Buffers are float32
    (float64 for float64 variables); state is per replica under
    `tf.distribute`. With a `LossScaleOptimizer`, micro-batches are unscaled
    one by one and the inner optimizer takes one step per window. Listeners
    (`add_window_end_listener`) hear of every window's end. Several
    micro-batches per train step: `add()` each, then `end_step()`; the
    window is then N train steps. See docs/design.md.

    `non_finite_policy`: `"skip_window"` skips a window with any non-finite
    micro-batch (a loss scale is halved); `"drop_micro_batch"` drops that
    micro-batch and normalises by what remains; `"propagate"` checks
    nothing; `"auto"` (default) is `"skip_window"` with loss scaling, else
    `"propagate"`.

    Args:
        gradient_accumulation_steps: int >= 1, micro-batches per update.
            `1` allocates no buffers.
        non_finite_policy: str, one of the policies above.
        name: str, the module's name.

    Raises:
        ValueError: for an invalid argument.

    Example:

    ```python
    import keras
    import tensorflow as tf
    import keras_accum

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    accumulator = keras_accum.GradientAccumulator(gradient_accumulation_steps=2)
    x, y = tf.ones((4, 3)), tf.zeros((4, 1))
    for x_k, y_k in [(x[:2], y[:2]), (x[2:], y[2:])]:
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y_k, model(x_k))
            loss = tf.reduce_mean(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        accumulator.accumulate_and_maybe_apply(
            grads, optimizer, model.trainable_variables, normalizer=2
        )
    assert int(optimizer.iterations) == 1
    ```
    """

    def __init__(
        self,
        gradient_accumulation_steps,
        non_finite_policy="auto",
        name="gradient_accumulator",
    ):
        super().__init__(name=name)
        steps = validate_steps(gradient_accumulation_steps)
        self._steps = steps
        # Whether windows go through buffers (N > 1 now or ever before):
        # decided in Python, when tracing.
        self._accumulates = steps > 1
        self.non_finite_policy = validate_policy(non_finite_policy)
        self._variable_ids = None
        self._buffers = []
        self._normalizer_sum = None
        self._normalizer_dtype = tf.float32
        # Which variables get gradients: known when tracing, and saved, so
        # that a restored window can be applied before any trace.
        self._has_gradient = None
        # Not tracked: saved values waiting for their variables (`restore`)
        # and the window-end listeners.
        object.__setattr__(self, "_pending_state", {})
        object.__setattr__(self, "_listeners", [])
        self._gradient_is_none = None
        # Whether windows count train steps (`add()` traced, or a saved
        # count restored): only then does a window's end reset the count.
        self._counts_steps = False
        with tf.init_scope():
            self.micro_step = state_variable(0, "micro_step", dtype=tf.int64)
            # N of the current window, and of the windows after it.
            self.window_steps = state_variable(
                steps, "window_steps", dtype=tf.int64
            )
            self.next_window_steps = state_variable(
                steps, "next_window_steps", dtype=tf.int64
            )
            # Train steps of the window, when they `add()` several
            # micro-batches each (`end_step()`).
            self.steps_in_window = state_variable(
                0, "steps_in_window", dtype=tf.int64
            )
            # Micro-batches of the window whose gradients were added.
            self.added_micro_batches = state_variable(
                0, "added_micro_batches", dtype=tf.int64
            )
            self.update_applied = state_variable(False, "update_applied")
            self.skipped_windows = state_variable(
                0, "skipped_windows", dtype=tf.int64
            )
            self.dropped_micro_batches = state_variable(
                0, "dropped_micro_batches", dtype=tf.int64
            )

    @property
    def built(self):
        return self._variable_ids is not None

    @property
    def accumulates(self):
        """bool: whether windows go through the buffers.

        `True` once N > 1 was set, or when set to `True` (for several
        micro-batches per train step with N = 1, see `add()`); it is not
        set back to `False`.
        """
        return self._accumulates

    @accumulates.setter
    def accumulates(self, value):
        if value and not self._accumulates:
            self._accumulates = True
            # The next `build()` creates the buffers.
            self._variable_ids = None

    @property
    def gradient_accumulation_steps(self):
        """int: micro-batches per update, of the windows to come.

        Settable between steps: the window in progress keeps its N, the
        next one takes the new value. Values > 1 live in a variable (no
        new trace); the first change from 1 to more creates the buffers, and
        the train step must be traced again.
        """
        return self._steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value):
        value = validate_steps(value)
        self._steps = value
        if value > 1:
            self.accumulates = True
        with tf.init_scope():
            replicas = _replicas(self.micro_step)
            assign_per_replica(self.next_window_steps, [value] * replicas)
            if not int(self.micro_step.numpy()):
                assign_per_replica(self.window_steps, [value] * replicas)

    def add_window_end_listener(self, listener):
        """Has `listener` hear of every window's end.

        Args:
            listener: has `window_end(strategy, applied)`, called in
                cross-replica context (`applied`: whether the update was
                applied), and `reset()`, called on every replica after it.
        """
        self._listeners.append(listener)

    def build(self, variables):
        """Creates one buffer per variable; a no-op for the same variables.

        Args:
            variables: list of the (trainable) variables to accumulate for.

        Raises:
            ValueError: if gradients are pending for other variables.
        """
        variables = list(variables)
        ids = [id(v) for v in variables]
        if ids == self._variable_ids:
            return
        with tf.init_scope():
            if self.built and tf.executing_eagerly():
                pending = int(self.micro_step.numpy())
                if pending:
                    raise ValueError(
                        "The trainable variables changed while a window of "
                        f"{pending} micro-batches is pending. Call `flush()` "
                        "first so that no gradients are lost."
                    )
            dtypes = [accumulation_dtype(v.dtype) for v in variables]
            dtype = tf.float64 if tf.float64 in dtypes else tf.float32
            if self._normalizer_sum is None or dtype != self._normalizer_dtype:
                self._normalizer_dtype = dtype
                self._normalizer_sum = state_variable(
                    tf.zeros((), dtype),
                    "normalizer_sum",
                    tf.VariableAggregation.SUM,
                )
            if self._buffers:
                # Other variables. (The first build appends to the tracked
                # list: `tf.train.Checkpoint` restores into it later.)
                self._buffers = []
            if self._accumulates:
                self._buffers.extend(map(_buffer, variables, dtypes))
            if self._has_gradient is None or (
                self._has_gradient.shape[0] != len(variables)
            ):
                self._has_gradient = state_variable(
                    tf.ones([len(variables)], tf.bool), "has_gradient"
                )
        self._variable_ids = ids
        self._gradient_is_none = None
        # Keras' float8 scales and amax histories: their "gradient" is
        # their next value. Neither unscaled nor normalised; the window
        # keeps the largest (as Keras' own accumulation does).
        self._overwrite = [
            bool(getattr(v, "overwrite_with_gradient", False))
            for v in variables
        ]
        if self._pending_state:
            self.restore(self._pending_state)

    def state(self):
        """The window's state variables by name (those created so far).

        Returns:
            dict from name to `tf.Variable`: the counters, `normalizer_sum`
            and `buffer_<i>`, one per variable.
        """
        state = {
            "micro_step": self.micro_step,
            "window_steps": self.window_steps,
            "next_window_steps": self.next_window_steps,
            "added_micro_batches": self.added_micro_batches,
            "steps_in_window": self.steps_in_window,
            "skipped_windows": self.skipped_windows,
            "dropped_micro_batches": self.dropped_micro_batches,
        }
        if self._normalizer_sum is not None:
            state["normalizer_sum"] = self._normalizer_sum
        if self._has_gradient is not None:
            state["has_gradient"] = self._has_gradient
        for i, buffer in enumerate(self._buffers):
            state[f"buffer_{i}"] = buffer
        return state

    def restore(self, values):
        """Assigns saved state; what does not exist yet waits for `build()`.

        Args:
            values: dict from a `state()` name to a list of values, one per
                replica.

        Raises:
            ValueError: if a saved buffer does not fit its variable.
        """
        if any(v != 0 for v in values.get("steps_in_window", [])):
            self._counts_steps = True
        object.__setattr__(
            self, "_pending_state", assign_state(self.state(), values)
        )

    def accumulate_and_maybe_apply(
        self,
        gradients,
        optimizer,
        variables,
        normalizer=1.0,
        *,
        gradient_scale=1.0,
    ):
        """Adds one micro-batch; applies the window once it is complete.

        Args:
            gradients: list of gradients (tensors, `IndexedSlices` or `None`),
                one per variable, of the micro-batch's (possibly
                loss-scaled) mean loss.
            optimizer: the `keras.optimizers.Optimizer` (a
                `LossScaleOptimizer` is detected and handled).
            variables: list of the variables the gradients belong to.
            normalizer: scalar, the `D` the micro-batch's mean loss was
                divided by (e.g. its number of samples), or `None` if the
                loss is a sum.
            gradient_scale: scalar, a factor the loss was divided by beyond
                its normaliser (Keras divides each replica's loss by the
                number of replicas); the gradients are multiplied back by it.

        Returns:
            A boolean tensor: whether an optimizer update was applied.
        """
        variables = list(variables)
        if self._accumulates:
            _accumulate(
                self, gradients, optimizer, variables, normalizer,
                gradient_scale,
            )
            return self._end_window(
                optimizer,
                variables,
                self._resolve_policy(optimizer),
                self.micro_step >= self.window_steps,
            )
        gradients, policy = _checked(self, gradients, optimizer, variables)
        with tf.control_dependencies(_tensors(gradients)):
            gradients = _unscaled(gradients, optimizer, self._overwrite)
            return _apply_directly(
                self, gradients, optimizer, variables, policy
            )

    def add(
        self,
        gradients,
        optimizer,
        variables,
        normalizer=1.0,
        *,
        gradient_scale=1.0,
    ):
        """Adds one micro-batch to the window without ending it.

        For several micro-batches per train step: `add()` each, then
        `end_step()` once; the window then ends after N train steps (N = 1:
        every step). Needs `accumulates` to be `True`.

        Args:
            gradients, optimizer, variables, normalizer, gradient_scale: as
                for `accumulate_and_maybe_apply`.

        Raises:
            ValueError: if `accumulates` is `False`.
        """
        if not self._accumulates:
            raise ValueError(
                "`add()` needs the window's buffers: set "
                "`accumulates = True` (or `gradient_accumulation_steps` > 1) "
                "before the train step is traced."
            )
        self._counts_steps = True
        _accumulate(
            self, gradients, optimizer, variables, normalizer, gradient_scale
        )

    def end_step(self, optimizer, variables):
        """Ends a train step of `add()`s; applies the window after N steps.

        Args and return value as for `flush()`.
        """
        self.steps_in_window.assign_add(1)
        ready = self.steps_in_window >= self.window_steps
        return self._end_window(
            optimizer, list(variables), self._resolve_policy(optimizer), ready
        )

    def flush(self, optimizer, variables):
        """Applies a partially filled window, if any; a no-op otherwise.

        Args:
            optimizer: the optimizer, as for `accumulate_and_maybe_apply`.
            variables: the variables, as for `accumulate_and_maybe_apply`.

        Returns:
            A boolean tensor: whether an update was applied.
        """
        if not self.built or not self._accumulates:
            return tf.constant(False)
        policy = self._resolve_policy(optimizer)
        return self._end_window(
            optimizer, list(variables), policy, self.micro_step > 0
        )

    def reset(self):
        """Discards the pending window (the stale buffers are overwritten by
        its next first micro-batch)."""
        if self._normalizer_sum is not None:
            self._normalizer_sum.assign(tf.zeros_like(self._normalizer_sum))
        self.micro_step.assign(0)
        if self._counts_steps:
            self.steps_in_window.assign(0)
        self.added_micro_batches.assign(0)
        self.window_steps.assign(self.next_window_steps)
        for listener in self._listeners:
            listener.reset()

    def _record_gradients(self, gradients):
        """Notes (and saves) which variables the traced step gives gradients."""
        self._gradient_is_none = [g is None for g in gradients]
        with tf.init_scope():
            mask = [not none for none in self._gradient_is_none]
            assign_per_replica(
                self._has_gradient, [mask] * _replicas(self._has_gradient)
            )

    def _gradients_are_none(self):
        """Which gradients are `None`: as traced, or as saved with a window
        restored before any trace."""
        if self._gradient_is_none is None:
            with tf.init_scope():
                mask = per_replica_values(self._has_gradient)[0]
            self._gradient_is_none = [not bool(m) for m in mask]
        return self._gradient_is_none

    def _resolve_policy(self, optimizer):
        return resolve_policy(
            self.non_finite_policy, is_loss_scale_optimizer(optimizer)
        )

    def _end_window(self, optimizer, variables, policy, ready):
        """The one place where a window ends (docs/design.md, "One window end")."""

        def end(strategy, ready):
            ready = strategy.experimental_local_results(ready)[0]
            return run_if(
                ready,
                functools.partial(
                    _finish_window, self, strategy, optimizer, variables, policy
                ),
            )

        context = tf.distribute.get_replica_context()
        applied = context.merge_call(end, args=(ready,))
        self.update_applied.assign(applied)
        return applied


def _finish_window(accumulator, strategy, optimizer, variables, policy):
    """Applies or skips the window, in cross-replica context; resets it."""
    lso = is_loss_scale_optimizer(optimizer)
    target = optimizer.inner_optimizer if lso else optimizer
    several = strategy.num_replicas_in_sync > 1
    if several:
        # Micro-batches seen, added, and the normaliser: summed over the
        # replicas in one reduction.
        counts = strategy.extended.call_for_each_replica(
            _window_counts, args=(accumulator,)
        )
        steps, added, normalizer = tf.unstack(
            strategy.reduce(tf.distribute.ReduceOp.SUM, counts, axis=None)
        )
        normalizer = tf.cast(normalizer, accumulator._normalizer_dtype)
    else:
        steps = accumulator.micro_step
        added = accumulator.added_micro_batches
        normalizer = accumulator._normalizer_sum

    def apply():
        strategy.extended.call_for_each_replica(
            lambda: target.apply(
                _window_gradients(accumulator, normalizer, several), variables
            )
        )
        if lso:
            _grow_loss_scale(optimizer)
        return tf.constant(True)

    def skip():
        strategy.extended.call_for_each_replica(
            accumulator.skipped_windows.assign_add, args=(1,)
        )
        if lso and policy == "skip_window":
            _shrink_loss_scale(optimizer)
        return tf.constant(False)

    if lso and policy == "drop_micro_batch" and several:
        # Halve the shared scale once for a window that dropped.
        run_if(added < steps, functools.partial(_shrink_loss_scale, optimizer))
    if policy == "propagate":
        applied = apply()
    else:
        ok = tf.equal(added, steps) if policy == "skip_window" else added > 0
        applied = tf.cond(ok, apply, skip)
    for listener in accumulator._listeners:
        listener.window_end(strategy, applied)
    strategy.extended.call_for_each_replica(accumulator.reset)
    return applied


def _checked(accumulator, gradients, optimizer, variables):
    """The gradients as a list, and the policy; builds what is missing."""
    gradients, variables = list(gradients), list(variables)
    if len(gradients) != len(variables):
        raise ValueError(
            "`gradients` and `variables` must have the same length. "
            f"Received: {len(gradients)} gradients and "
            f"{len(variables)} variables."
        )
    accumulator.build(variables)
    if not optimizer.built:
        # Loss scaling state is read before the first update.
        optimizer.build(variables)
    accumulator._record_gradients(gradients)
    return gradients, accumulator._resolve_policy(optimizer)


def _accumulate(
    accumulator, gradients, optimizer, variables, normalizer, gradient_scale
):
    """Adds one micro-batch to the window (`add()`)."""
    gradients, policy = _checked(accumulator, gradients, optimizer, variables)
    # Nothing below runs before the gradients exist: a step whose input ran
    # out (Keras' end-of-data call) changes no state.
    with tf.control_dependencies(_tensors(gradients)):
        _add_micro_batch(
            accumulator,
            _unscaled(gradients, optimizer, accumulator._overwrite),
            normalizer, gradient_scale, optimizer, policy,
        )


def _add_micro_batch(
    accumulator, gradients, normalizer, gradient_scale, optimizer, policy
):
    dtype = accumulator._normalizer_dtype
    factor = tf.cast(gradient_scale, dtype)
    if normalizer is None:
        normalizer = tf.zeros((), dtype)
    else:
        normalizer = tf.cast(normalizer, dtype)
        factor = normalizer * factor

    def add():
        first = tf.equal(accumulator.added_micro_batches, 0)
        _add_to_buffers(
            accumulator._buffers, gradients, factor, first,
            accumulator._overwrite,
        )
        accumulator._normalizer_sum.assign_add(normalizer)
        accumulator.added_micro_batches.assign_add(1)
        return tf.constant(True)

    finite = _all_finite(gradients, policy)
    if finite is None:
        add()
    else:

        def drop():
            if policy == "drop_micro_batch":
                accumulator.dropped_micro_batches.assign_add(1)
                if is_loss_scale_optimizer(optimizer) and not (
                    in_replica_context()
                ):
                    # Several replicas halve it once at the window's end.
                    _shrink_loss_scale(optimizer)
            return tf.constant(False)

        tf.cond(finite, add, drop)
    accumulator.micro_step.assign_add(1)


def _window_counts(accumulator):
    counts = (
        accumulator.micro_step,
        accumulator.added_micro_batches,
        accumulator._normalizer_sum,
    )
    return tf.stack([tf.cast(c, tf.float64) for c in counts])


def _replicas(variable):
    if isinstance(variable, tf.distribute.DistributedValues):
        return len(variable.values)
    return 1


def _window_gradients(accumulator, normalizer, several):
    """The buffers over the window's normaliser; zeros from a replica that
    added nothing (its buffers are stale)."""
    buffers = accumulator._buffers
    if several:
        added = accumulator.added_micro_batches > 0
        buffers = [tf.where(added, b, tf.zeros_like(b)) for b in buffers]
    divisor = tf.where(normalizer > 0, normalizer, tf.ones_like(normalizer))
    return [
        None if is_none else b if overwrite else b / tf.cast(divisor, b.dtype)
        for b, is_none, overwrite in zip(
            buffers, accumulator._gradients_are_none(), accumulator._overwrite
        )
    ]


def _buffer(variable, dtype):
    """A per-replica buffer for `variable`'s gradients."""
    name = getattr(variable, "path", None) or variable.name
    return state_variable(
        tf.zeros(variable.shape, dtype),
        "buffer_" + name.replace("/", "_").replace(":", "_"),
        tf.VariableAggregation.SUM,
    )


def _unscaled(gradients, optimizer, overwrite):
    """The gradients divided by the loss scale, if `optimizer` scales."""
    if not is_loss_scale_optimizer(optimizer):
        return gradients
    unscale = 1.0 / tf.cast(optimizer.dynamic_scale, tf.float32)
    return [
        g if g is None or keep else _scale(g, unscale)
        for g, keep in zip(gradients, overwrite)
    ]


def _apply_directly(accumulator, gradients, optimizer, variables, policy):
    """`gradient_accumulation_steps=1`: the step's gradients, no buffer."""
    lso = is_loss_scale_optimizer(optimizer)
    target = optimizer.inner_optimizer if lso else optimizer

    def apply():
        target.apply(gradients, variables)
        if lso:
            _grow_loss_scale(optimizer)
        return tf.constant(True)

    finite = _all_finite(gradients, policy)
    if finite is None:
        applied = apply()
    else:

        def skip():
            accumulator.skipped_windows.assign_add(1)
            if lso:
                _shrink_loss_scale(optimizer)
            return tf.constant(False)

        applied = tf.cond(finite, apply, skip)
    accumulator.update_applied.assign(applied)
    return applied


def _add_to_buffers(buffers, gradients, factor, first, overwrite):
    """`buffer += factor * g`, or `= factor * g` if `first` (docs/design.md)."""
    pairs = []
    for b, g, keep_max in zip(buffers, gradients, overwrite):
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
    if not in_xla_context():
        tf.cond(
            first,
            functools.partial(_write_scaled, pairs, factors),
            functools.partial(_add_scaled, pairs, factors),
        )
        return
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


def _all_finite(gradients, policy):
    if policy == "propagate":
        return None
    checks = [tf.reduce_all(tf.math.is_finite(g)) for g in _tensors(gradients)]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def _tensors(gradients):
    """The dense tensors of `gradients` (`IndexedSlices` values)."""
    return [
        g.values if isinstance(g, tf.IndexedSlices) else g
        for g in gradients
        if g is not None
    ]


def _write_scaled(pairs, factors):
    """`buffer = factor * g` for each (buffer, g): a window's first addition."""
    for buffer, g in pairs:
        c = factors[buffer.dtype]
        if isinstance(g, tf.IndexedSlices):
            buffer.assign(tf.zeros_like(buffer))
            _scatter_add_scaled(buffer, g, c)
        else:
            buffer.assign(tf.cast(g, buffer.dtype) * c)
    return tf.constant(True)


def _add_scaled(pairs, factors):
    """`buffer += factor * g` in place, in one pass (`buffer -= -factor * g`)."""
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
    """`buffer[g.indices] += factor * g.values` (`g` a `tf.IndexedSlices`)."""
    buffer.scatter_add(
        tf.IndexedSlices(
            tf.cast(g.values, buffer.dtype) * factor, g.indices, g.dense_shape
        )
    )


def _zero(variables):
    for variable in variables:
        variable.assign(tf.zeros_like(variable))
    return tf.constant(True)


def _scale(g, factor):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape
        )
    return g * tf.cast(factor, g.dtype)


def _shrink_loss_scale(optimizer):
    optimizer.step_counter.assign(0)
    optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
    return tf.constant(True)


def _grow_loss_scale(optimizer):
    def upscale():
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)
        return tf.constant(True)

    def increment():
        optimizer.step_counter.assign_add(1)
        return tf.constant(False)

    tf.cond(
        tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1),
        upscale,
        increment,
    )
