"""`GradientAccumulator`: the accumulation primitive (TensorFlow backend)."""

import functools
import numbers

import numpy as np
import tensorflow as tf
from keras import optimizers

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


def is_loss_scale_optimizer(optimizer):
    return isinstance(optimizer, optimizers.LossScaleOptimizer)


def _buffer_dtype(variable):
    # Never accumulate in less than float32; keep float64 variables exact.
    return tf.float64 if tf.as_dtype(variable.dtype) == tf.float64 else (
        tf.float32
    )


def _state_variable(initial_value, dtype, name, aggregation):
    """A non-trainable variable that is local to each replica."""
    return tf.Variable(
        initial_value,
        dtype=dtype,
        name=name,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregation,
    )


def in_strategy_replica_context():
    """Whether this runs in a replica context of a `tf.distribute` strategy.

    Also with one replica (a `MirroredStrategy` on a single device): the
    optimizer's update calls `merge_call` there too, so the window's end must
    be decided in cross-replica context.
    """
    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
    )


class GradientAccumulator(tf.Module):
    """Accumulates micro-batch gradients and applies their exact window mean.

    Each micro-batch contributes its gradients with a `weight`: the
    normaliser its mean loss was divided by (the number of samples, of valid
    pixels, or the sum of sample weights). After `gradient_accumulation_steps`
    micro-batches the optimizer is applied once to

        sum_k(weight_k * gradients_k) / sum_k(weight_k),

    which is the gradient of the mean loss over all samples of the window,
    i.e. what one big batch would give. Gradients are accumulated in float32
    buffers (float64 for float64 variables), one per variable, created once.

    State (all `tf.Variable`s, local to each replica under `tf.distribute`):
    `micro_step` (micro-batches in the current window), `weight_sum`,
    `accumulated` (micro-batches whose gradients were added),
    `update_applied` (whether the last step applied an update),
    `skipped_windows` and `dropped_micro_batches` (the non-finite policy's
    counts), and the buffers: the window's weighted gradient sums, stale
    while `accumulated` is 0 (the window's first added micro-batch
    overwrites them). With `gradient_accumulation_steps=1` no buffers are
    allocated and gradients pass straight to the optimizer. `state()` lists
    them by name and `restore()` assigns saved values (before `build()` too);
    `tf.train.Checkpoint` tracks them as attributes. A micro-batch changes
    the state only once its gradients exist, so a train call whose input ran
    out changes nothing.

    Loss scaling: with a `keras.optimizers.LossScaleOptimizer`, each
    micro-batch's gradients are unscaled by the scale in force when its loss
    was scaled before they are added, and the update goes to the inner
    optimizer, so `iterations`, schedules, EMA, weight decay and clipping see
    one step per window. The loss scale grows after `dynamic_growth_steps`
    *updates*.

    Non-finite policy (`non_finite_policy`):
    - `"skip_window"`: a window with any non-finite micro-batch is skipped
      whole: weights, optimizer slots and `iterations` are unchanged, the
      buffers are reset and a loss scale is halved once.
    - `"drop_micro_batch"`: only the non-finite micro-batch is dropped; the
      window is normalised by what remains (a loss scale is halved at once).
      A window with nothing left is skipped.
    - `"propagate"`: no check, like `keras.Model` without loss scaling.
    - `"auto"` (default): `"skip_window"` with a `LossScaleOptimizer`,
      otherwise `"propagate"`.

    Args:
        gradient_accumulation_steps: int >= 1, micro-batches per update.
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
            grads, optimizer, model.trainable_variables, weight=2
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
        self.gradient_accumulation_steps = validate_steps(
            gradient_accumulation_steps
        )
        self.non_finite_policy = validate_policy(non_finite_policy)
        self._variable_ids = None
        self._buffers = []
        self._grad_is_none = None
        self._weight_dtype = tf.float32
        # Values restored before their variables existed (see `restore`).
        object.__setattr__(self, "_pending_state", {})
        with tf.init_scope():
            first = tf.VariableAggregation.ONLY_FIRST_REPLICA
            self.micro_step = _state_variable(0, tf.int64, "micro_step", first)
            self.accumulated = _state_variable(
                0, tf.int64, "accumulated", first
            )
            self.update_applied = _state_variable(
                False, tf.bool, "update_applied", first
            )
            self.skipped_windows = _state_variable(
                0, tf.int64, "skipped_windows", first
            )
            self.dropped_micro_batches = _state_variable(
                0, tf.int64, "dropped_micro_batches", first
            )
            self._weight_sum = None

    # ------------------------------------------------------------------
    # Building
    # ------------------------------------------------------------------
    @property
    def built(self):
        return self._variable_ids is not None

    @property
    def weight_sum(self):
        """The sum of the weights accumulated in the current window."""
        return self._weight_sum

    def build(self, variables):
        """Creates one buffer per variable; a no-op for the same variables.

        Values restored before the buffers existed (see `restore`) are
        assigned as the buffers are created.

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
                if int(self.micro_step.numpy()) > 0:
                    raise ValueError(
                        "The trainable variables changed while a window of "
                        f"{int(self.micro_step.numpy())} micro-batches is "
                        "pending. Call `flush()` first so that no gradients "
                        "are lost."
                    )
            dtypes = [_buffer_dtype(v) for v in variables]
            weight_dtype = (
                tf.float64 if tf.float64 in dtypes else tf.float32
            )
            if self._weight_sum is None or weight_dtype != self._weight_dtype:
                self._weight_dtype = weight_dtype
                self._weight_sum = _state_variable(
                    tf.zeros((), weight_dtype),
                    weight_dtype,
                    "weight_sum",
                    tf.VariableAggregation.SUM,
                )
            if self._buffers:
                # Other variables: a new list (appending to the tracked one
                # keeps `tf.train.Checkpoint`'s deferred restoration).
                self._buffers = []
            if self.gradient_accumulation_steps > 1:
                for v, dtype in zip(variables, dtypes):
                    self._buffers.append(
                        _state_variable(
                            tf.zeros(v.shape, dtype),
                            dtype,
                            "accumulated_" + _short_name(v),
                            tf.VariableAggregation.SUM,
                        )
                    )
        self._variable_ids = ids
        self._grad_is_none = None
        if self._pending_state:
            self.restore(self._pending_state)

    def state(self):
        """The window's state variables, by name (those created so far).

        Returns:
            dict from name to `tf.Variable`: `micro_step`, `accumulated`,
            `weight_sum`, `skipped_windows`, `dropped_micro_batches` and
            `buffer_<i>`, one per variable.
        """
        state = {
            "micro_step": self.micro_step,
            "accumulated": self.accumulated,
            "skipped_windows": self.skipped_windows,
            "dropped_micro_batches": self.dropped_micro_batches,
        }
        if self._weight_sum is not None:
            state["weight_sum"] = self._weight_sum
        for i, buffer in enumerate(self._buffers):
            state[f"buffer_{i}"] = buffer
        return state

    def restore(self, values):
        """Assigns saved state; what does not exist yet is kept for `build`.

        Args:
            values: dict from a `state()` name to a list of values, one per
                replica (one without a strategy).

        Raises:
            ValueError: if a saved buffer does not fit its variable.
        """
        state = self.state()
        pending = {}
        for name, per_replica in values.items():
            variable = state.get(name)
            if variable is None:
                pending[name] = per_replica
                continue
            if tuple(variable.shape) != tuple(np.shape(per_replica[0])):
                raise ValueError(
                    f"The saved accumulation state `{name}` has shape "
                    f"{np.shape(per_replica[0])}, but the model's is "
                    f"{tuple(variable.shape)}: the model differs from the "
                    "one that was saved."
                )
            assign_per_replica(variable, per_replica)
        object.__setattr__(self, "_pending_state", pending)

    # ------------------------------------------------------------------
    # Public step API
    # ------------------------------------------------------------------
    def accumulate_and_maybe_apply(
        self,
        gradients,
        optimizer,
        variables,
        weight=1.0,
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
            weight: scalar, the normaliser of the micro-batch's mean loss
                (e.g. its number of samples), or `None` if the loss is a sum.
            gradient_scale: scalar, a factor the loss was divided by beyond
                its normaliser (Keras divides each replica's loss by the
                number of replicas under `tf.distribute`); the gradients are
                multiplied back by it.

        Returns:
            A boolean tensor: whether an optimizer update was applied.
        """
        variables = list(variables)
        gradients = list(gradients)
        if len(gradients) != len(variables):
            raise ValueError(
                "`gradients` and `variables` must have the same length. "
                f"Received: {len(gradients)} gradients and "
                f"{len(variables)} variables."
            )
        self.build(variables)
        if not optimizer.built:
            # Loss scaling state is read before the first update.
            optimizer.build(variables)
        self._grad_is_none = [g is None for g in gradients]
        # Nothing below runs before the gradients exist: a step whose input
        # ran out (Keras' end-of-data call) changes no state.
        with tf.control_dependencies(_tensors(gradients)):
            return self._add_micro_batch(
                gradients, optimizer, variables, weight, gradient_scale
            )

    def _add_micro_batch(
        self, gradients, optimizer, variables, weight, gradient_scale
    ):
        policy = self._resolve_policy(optimizer)
        scale = self._loss_scale(optimizer)
        if scale is not None:
            gradients = [
                None if g is None else _scale(g, 1.0 / scale) for g in gradients
            ]
        if self.gradient_accumulation_steps == 1:
            finite = self._all_finite(gradients, policy)
            applied = self._finish_window(
                optimizer, variables, lambda: gradients, finite, policy
            )
            self.update_applied.assign(applied)
        else:
            self._accumulate(
                gradients, weight, gradient_scale, optimizer, policy
            )
            applied = self._maybe_finish(optimizer, variables, policy)
        return applied

    def flush(self, optimizer, variables):
        """Applies a partially filled window, if any; a no-op otherwise.

        Args:
            optimizer: the optimizer, as for `accumulate_and_maybe_apply`.
            variables: the variables, as for `accumulate_and_maybe_apply`.

        Returns:
            A boolean tensor: whether an update was applied.
        """
        if not self.built or self.gradient_accumulation_steps == 1:
            return tf.constant(False)
        policy = self._resolve_policy(optimizer)
        return self._maybe_finish(
            optimizer, list(variables), policy, partial=True
        )

    def reset(self):
        """Discards the pending window (weight sum, counters, buffers).

        The buffers are not written here: while `accumulated` is 0 their
        content is stale, and the next window's first accumulated
        micro-batch overwrites them instead of adding to them. That saves
        a pass over every buffer per window and keeps the buffers out of
        the window-end branch (see `run_if`).
        """
        if self._weight_sum is not None:
            self._weight_sum.assign(tf.zeros_like(self._weight_sum))
        self.micro_step.assign(0)
        self.accumulated.assign(0)

    # ------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------
    def _resolve_policy(self, optimizer):
        return self.resolve_policy(is_loss_scale_optimizer(optimizer))

    def resolve_policy(self, loss_scaled):
        """The non-finite policy in force; `"auto"` resolved.

        Args:
            loss_scaled: bool, whether the optimizer scales the loss.

        Returns:
            str, `"skip_window"`, `"drop_micro_batch"` or `"propagate"`.

        Raises:
            ValueError: for `"propagate"` with loss scaling.
        """
        if self.non_finite_policy == "auto":
            return "skip_window" if loss_scaled else "propagate"
        if loss_scaled and self.non_finite_policy == "propagate":
            raise ValueError(
                "`non_finite_policy='propagate'` cannot be used with a "
                "`LossScaleOptimizer`: an overflow must not reach the "
                "weights. Use 'skip_window' or 'drop_micro_batch'."
            )
        return self.non_finite_policy

    @staticmethod
    def _loss_scale(optimizer):
        if is_loss_scale_optimizer(optimizer):
            return tf.cast(optimizer.dynamic_scale, tf.float32)
        return None

    @staticmethod
    def _all_finite(gradients, policy):
        if policy == "propagate":
            return None
        checks = [
            tf.reduce_all(
                tf.math.is_finite(
                    g.values if isinstance(g, tf.IndexedSlices) else g
                )
            )
            for g in gradients
            if g is not None
        ]
        return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)

    def _accumulate(self, gradients, weight, gradient_scale, optimizer, policy):
        gradient_scale = tf.cast(gradient_scale, self._weight_dtype)
        if weight is None:
            coefficient = gradient_scale
            weight_increment = tf.zeros((), self._weight_dtype)
        else:
            weight = tf.cast(weight, self._weight_dtype)
            coefficient = weight * gradient_scale
            weight_increment = weight

        def add():
            # The window's first added micro-batch replaces the stale
            # buffers (see `reset`) instead of adding to them. Under XLA a
            # select that fuses with the addition does it; otherwise a
            # `tf.cond` writes `c * g` (first) or adds it in place (later).
            # Dense buffers are never zero-filled: Grappler can fold such a
            # tensor, the size of each buffer, into a constant of the graph.
            first = tf.equal(self.accumulated.read_value(), 0)
            pairs = [
                (buffer, g)
                for buffer, g in zip(self._buffers, gradients)
                if g is not None
            ]
            # Buffer dtype -> the coefficient in it, cast once per dtype.
            factors = {
                dtype: tf.cast(coefficient, dtype)
                for dtype in dict.fromkeys(buffer.dtype for buffer, _ in pairs)
            }
            if _in_xla_context():
                sparse = [
                    buffer
                    for buffer, g in pairs
                    if isinstance(g, tf.IndexedSlices)
                ]
                if sparse:
                    run_if(first, functools.partial(_zero, sparse))
                for buffer, g in pairs:
                    c = factors[buffer.dtype]
                    if isinstance(g, tf.IndexedSlices):
                        _scatter_add_scaled(buffer, g, c)
                    else:
                        contribution = tf.cast(g, buffer.dtype) * c
                        buffer.assign(
                            tf.where(
                                first, contribution, buffer + contribution
                            )
                        )
            else:
                tf.cond(
                    first,
                    functools.partial(_write_scaled, pairs, factors),
                    functools.partial(_add_scaled, pairs, factors),
                )
            self._weight_sum.assign_add(weight_increment)
            self.accumulated.assign_add(1)
            return tf.constant(True)

        finite = self._all_finite(gradients, policy)
        if finite is None:
            add()
        else:

            def drop():
                self.dropped_micro_batches.assign_add(
                    1 if policy == "drop_micro_batch" else 0
                )
                if (
                    policy == "drop_micro_batch"
                    and is_loss_scale_optimizer(optimizer)
                    and not in_strategy_replica_context()
                ):
                    _shrink_loss_scale(optimizer)
                return tf.constant(False)

            tf.cond(finite, add, drop)
        self.micro_step.assign_add(1)

    def _divisor(self, weight_sum):
        """The window's normaliser; 1 for a window of sums (or of nothing)."""
        return tf.where(weight_sum > 0, weight_sum, tf.ones_like(weight_sum))

    def _window_grads(self, weight_sum=None):
        """The buffers divided by the window's normaliser.

        Args:
            weight_sum: the normaliser of a window over several replicas;
                then a replica that added nothing this window (all its
                micro-batches were dropped) contributes zeros, not its
                stale buffers. By default this replica's own weight sum (a
                window that is applied has added something).
        """
        if weight_sum is None:
            grads = self._buffers
            weight_sum = self._weight_sum
        else:
            added = self.accumulated > 0
            grads = [tf.where(added, b, tf.zeros_like(b)) for b in self._buffers]
        divisor = self._divisor(weight_sum)
        return [
            None if is_none else g / tf.cast(divisor, g.dtype)
            for g, is_none in zip(grads, self._grad_is_none)
        ]

    def _window_ok(self, policy):
        """Whether the window may be applied; `None`: always (no branch)."""
        if policy == "propagate":
            return None
        if policy == "skip_window":
            return tf.equal(self.accumulated, self.micro_step)
        return self.accumulated > 0

    def _maybe_finish(self, optimizer, variables, policy, partial=False):
        if partial:
            ready = self.micro_step > 0
        else:
            ready = self.micro_step >= self.gradient_accumulation_steps
        if in_strategy_replica_context():
            return self._maybe_finish_distributed(
                optimizer, variables, policy, ready
            )

        def finish():
            applied = self._finish_window(
                optimizer,
                variables,
                self._window_grads,
                self._window_ok(policy),
                policy,
            )
            self.reset()
            return applied

        applied = run_if(ready, finish)
        self.update_applied.assign(applied)
        return applied

    def _finish_window(self, optimizer, variables, grads_fn, ok, policy):
        """Applies `grads_fn()` if `ok`, else skips; handles loss scaling."""
        lso = is_loss_scale_optimizer(optimizer)
        target = optimizer.inner_optimizer if lso else optimizer

        def apply():
            target.apply(grads_fn(), variables)
            if lso:
                _grow_loss_scale(optimizer)
            return tf.constant(True)

        def skip():
            self.skipped_windows.assign_add(1)
            if lso and policy == "skip_window":
                _shrink_loss_scale(optimizer)
            return tf.constant(False)

        if ok is None:
            applied = apply()
        else:
            applied = tf.cond(ok, apply, skip)
        return applied

    def _maybe_finish_distributed(self, optimizer, variables, policy, ready):
        """The window's end under several replicas.

        The decision (window complete, finite on every replica) and the
        window's normaliser are global. The `tf.cond` runs in cross-replica
        context because the optimizer's update calls `merge_call`. Per
        update there are two reductions: the optimizer's all-reduce of the
        gradients and one of three scalars (micro-batches seen, accumulated,
        weight sum); none on the other micro-steps.
        """
        context = tf.distribute.get_replica_context()
        lso = is_loss_scale_optimizer(optimizer)
        target = optimizer.inner_optimizer if lso else optimizer

        def replica_apply(weight_sum):
            # Each replica holds its own weighted sum; the optimizer's SUM
            # all-reduce turns them into the global one.
            target.apply(self._window_grads(weight_sum), variables)

        def cross_replica(distribution, ready, counts):
            ready = distribution.experimental_local_results(ready)[0]

            def finish():
                totals = distribution.reduce(
                    tf.distribute.ReduceOp.SUM, counts, axis=None
                )
                steps, accumulated, weight_sum = tf.unstack(totals)
                if policy == "propagate":
                    ok = None
                elif policy == "skip_window":
                    ok = tf.equal(accumulated, steps)
                else:
                    ok = accumulated > 0
                weight_sum = tf.cast(weight_sum, self._weight_dtype)

                def apply():
                    distribution.extended.call_for_each_replica(
                        replica_apply, args=(weight_sum,)
                    )
                    if lso:
                        _grow_loss_scale(optimizer)
                    return tf.constant(True)

                def skip():
                    if lso and policy == "skip_window":
                        _shrink_loss_scale(optimizer)
                    return tf.constant(False)

                if lso and policy == "drop_micro_batch":
                    # Replicas cannot update the shared scale themselves:
                    # halve it once for a window that dropped anything.
                    def shrink():
                        _shrink_loss_scale(optimizer)
                        return tf.constant(True)

                    tf.cond(
                        accumulated < steps, shrink, lambda: tf.constant(False)
                    )
                if ok is None:
                    return apply()
                return tf.cond(ok, apply, skip)

            return tf.cond(ready, finish, lambda: tf.constant(False))

        counts = tf.stack(
            [
                tf.cast(self.micro_step, tf.float64),
                tf.cast(self.accumulated, tf.float64),
                tf.cast(self._weight_sum, tf.float64),
            ]
        )
        applied = context.merge_call(cross_replica, args=(ready, counts))

        def reset_local():
            self.reset()
            return tf.constant(True)

        tf.cond(ready, reset_local, lambda: tf.constant(False))
        skipped = tf.logical_and(ready, tf.logical_not(applied))
        self.skipped_windows.assign_add(tf.cast(skipped, tf.int64))
        self.update_applied.assign(applied)
        return applied


def run_if(pred, fn):
    """Returns `fn()` (a boolean tensor) if `pred`, else `False`.

    A `tf.cond`, except when XLA compiles for the CPU: there it is a loop
    that runs zero times or once. XLA gives a conditional a fresh output
    buffer for every variable one of its branches writes, so the branch that
    does nothing copies each variable, optimizer slot and accumulation
    buffer, on every micro-batch (and a conditional whose branches hold only
    elementwise ops is turned into a select that runs the update every
    time). A loop's state is updated in place: the micro-batches between
    updates copy nothing. On a GPU the `tf.cond` is kept: XLA reads a
    conditional's predicate, and a loop's condition, back to the host, a
    synchronisation per micro-batch that is expected (not yet measured) to
    cost more than the elementwise select it avoids.
    """
    if _xla_on_cpu():

        def body(count, _):
            return count + 1, fn()

        _, result = tf.while_loop(
            lambda count, _: count < tf.cast(pred, tf.int32),
            body,
            (tf.constant(0), tf.constant(False)),
        )
        return result
    return tf.cond(pred, fn, lambda: tf.constant(False))


def _xla_on_cpu():
    """Whether the function being traced is compiled by XLA, with no GPU."""
    return _in_xla_context() and not tf.config.list_logical_devices("GPU")


def _in_xla_context():
    """Whether the function being traced is compiled by XLA."""
    if tf.executing_eagerly():
        return False
    # `tf.function(jit_compile=True)` marks the graphs it traces with an XLA
    # control-flow context; TensorFlow's own control flow reads it the same
    # way. If that (internal) module ever moves, the plain graph forms are
    # used, which are exact too.
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - depends on the TF version
        return False
    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def _write_scaled(pairs, factors):
    """`buffer = factor * g` for each (buffer, g): a window's first addition.

    Args:
        pairs: list of (buffer variable, gradient), the gradient dense or
            `tf.IndexedSlices`.
        factors: dict from buffer dtype to the scalar factor in that dtype.

    Returns:
        `True`, as a tensor (a `tf.cond` branch).
    """
    for buffer, g in pairs:
        c = factors[buffer.dtype]
        if isinstance(g, tf.IndexedSlices):
            buffer.assign(tf.zeros_like(buffer))
            _scatter_add_scaled(buffer, g, c)
        else:
            buffer.assign(tf.cast(g, buffer.dtype) * c)
    return tf.constant(True)


def _add_scaled(pairs, factors):
    """`buffer += factor * g` for each (buffer, g), in place and in one pass.

    `buffer.assign_add(g * factor)` would first write the product to a
    temporary tensor the size of the buffer; the gradient descent kernel
    (`buffer -= alpha * g`, with `alpha = -factor`) reads both operands once
    and writes the buffer once.

    Args:
        pairs: as for `_write_scaled`.
        factors: as for `_write_scaled`.

    Returns:
        `True`, as a tensor (a `tf.cond` branch).
    """
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


def _tensors(gradients):
    """The dense tensors of `gradients` (for control dependencies)."""
    return [
        g.values if isinstance(g, tf.IndexedSlices) else g
        for g in gradients
        if g is not None
    ]


def assign_per_replica(variable, values):
    """Assigns one value per replica (a plain variable takes the first)."""
    components = getattr(variable, "values", None)
    if isinstance(variable, tf.distribute.DistributedValues) and components:
        for component, value in zip(components, values):
            component.assign(value)
    else:
        variable.assign(values[0])


def per_replica_values(variable):
    """The numpy value of each replica's copy (one for a plain variable)."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return [np.asarray(c.numpy()) for c in variable.values]
    return [np.asarray(variable.numpy())]


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


def _short_name(variable):
    name = getattr(variable, "path", None) or getattr(variable, "name", "var")
    return name.replace("/", "_").replace(":", "_")
