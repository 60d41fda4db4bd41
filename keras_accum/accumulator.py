"""`GradientAccumulator`: the accumulation primitive (TensorFlow backend)."""

import functools
import numbers

import tensorflow as tf
from keras import optimizers

from keras_accum import _keras_compat as compat
from keras_accum._tf_utils import in_replica_context
from keras_accum._tf_utils import run_if
from keras_accum._window_state import WindowState

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
    mean loss was divided by); when the window is complete the optimizer is
    applied once to `sum_k(D_k * g_k) / sum_k(D_k)`, what one batch of all
    the window's samples would give. A train step calls `add()` for each of
    its micro-batches, then `end_step()`; `accumulate_and_maybe_apply()` is
    both, for one micro-batch per step. The state (`window`: counters and
    float32 buffers, per replica) is saved with the model. With a
    `LossScaleOptimizer`, micro-batches are unscaled one by one and the
    inner optimizer takes one step per window.

    Args:
        gradient_accumulation_steps: int >= 1, train steps per update.
        non_finite_policy: str. `"skip_window"` skips a window with any
            non-finite micro-batch (a loss scale is halved);
            `"drop_micro_batch"` drops that micro-batch and normalises by
            what remains; `"propagate"` checks nothing; `"auto"` (default)
            is `"skip_window"` with loss scaling, else `"propagate"`.
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
        self._steps = validate_steps(gradient_accumulation_steps)
        policy = non_finite_policy
        if not isinstance(policy, str) or policy not in NON_FINITE_POLICIES:
            raise ValueError(
                "`non_finite_policy` must be one of "
                f"{', '.join(repr(p) for p in NON_FINITE_POLICIES)}. "
                f"Received: non_finite_policy={policy!r}"
            )
        self.non_finite_policy = policy
        self.window = WindowState(self._steps)
        self._accumulates = self._steps > 1
        object.__setattr__(self, "_listeners", [])
        object.__setattr__(self, "_update_begins", [])

    @property
    def built(self):
        return self.window.built

    @property
    def accumulates(self):
        """bool: whether windows go through the buffers (once set, kept)."""
        return self._accumulates

    @accumulates.setter
    def accumulates(self, value):
        if value and not self._accumulates:
            self._accumulates = True
            self.window.unbuild()  # the next `build()` creates the buffers

    @property
    def gradient_accumulation_steps(self):
        """int: train steps per update (the window in progress keeps its N)."""
        return self._steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value):
        self._steps = validate_steps(value)
        if self._steps > 1:
            self.accumulates = True
        self.window.set_steps(self._steps)

    @property
    def micro_step(self):
        """int variable: micro-batches in the current window."""
        return self.window.micro_step

    @property
    def update_applied(self):
        """bool variable: whether the last window end applied an update."""
        return self.window.update_applied

    @property
    def skipped_windows(self):
        """int variable: windows skipped by the non-finite policy."""
        return self.window.skipped_windows

    @property
    def dropped_micro_batches(self):
        """int variable: micro-batches dropped by `"drop_micro_batch"`."""
        return self.window.dropped_micro_batches

    def add_window_end_listener(self, listener):
        """Calls `listener.window_end(strategy, applied)` at every window's
        end, in cross-replica context, and `listener.reset()` after it, on
        every replica."""
        self._listeners.append(listener)

    def add_update_begin_listener(self, listener):
        """Calls `listener(strategy)` in cross-replica context right before
        the optimizer writes a window's update; the update waits for the op
        it returns."""
        self._update_begins.append(listener)

    def build(self, variables):
        """Creates the window's variables for `variables`, once."""
        self.window.build(list(variables), with_buffers=self._accumulates)

    def state(self):
        """The window's state variables by name: the counters,
        `normalizer_sum`, `has_gradient` and `buffer_<i>` per variable."""
        return self.window.state()

    def restore(self, values):
        """Assigns `{state() name: [value per replica]}`; what does not
        exist yet waits for `build()`."""
        self.window.restore(values)

    def add(
        self,
        gradients,
        optimizer,
        variables,
        normalizer=1.0,
        *,
        gradient_scale=1.0,
    ):
        """Adds one micro-batch to the window.

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

        Raises:
            ValueError: if `gradients` and `variables` differ in length.
        """
        gradients, variables = list(gradients), list(variables)
        if len(gradients) != len(variables):
            raise ValueError(
                "`gradients` and `variables` must have the same length. "
                f"Received: {len(gradients)} gradients and "
                f"{len(variables)} variables."
            )
        self.accumulates = True
        self.build(variables)
        if not optimizer.built:
            # Loss scaling state is read before the first update.
            optimizer.build(variables)
        window = self.window
        window.record_gradients(gradients)
        policy = self._policy(optimizer)
        # Nothing below runs before the gradients exist: a step whose input
        # ran out (Keras' end-of-data call) changes no state.
        with tf.control_dependencies(_tensors(gradients)):
            if is_loss_scale_optimizer(optimizer):
                # Unscaled through the buffers' factor (docs/design.md).
                scale = tf.cast(compat.loss_scale(optimizer), tf.float32)
                gradient_scale = gradient_scale / scale
            add = functools.partial(
                window.add, gradients, normalizer, gradient_scale
            )
            if policy == "propagate":
                add()
            else:

                def add_finite():
                    add()
                    return tf.constant(True)

                def drop():
                    if policy == "drop_micro_batch":
                        window.dropped_micro_batches.assign_add(1)
                        if is_loss_scale_optimizer(optimizer) and not (
                            in_replica_context()
                        ):
                            # Several replicas halve it at the window's end.
                            compat.shrink_loss_scale(optimizer)
                    return tf.constant(False)

                tf.cond(_all_finite(gradients), add_finite, drop)
            window.micro_step.assign_add(1)

    def end_step(self, optimizer, variables):
        """Ends a train step; applies the window once it is complete.

        Args and return value as for `flush()`.
        """
        self.window.count_step()
        return self._end_window(optimizer, variables, self.window.ready())

    def accumulate_and_maybe_apply(
        self,
        gradients,
        optimizer,
        variables,
        normalizer=1.0,
        *,
        gradient_scale=1.0,
    ):
        """`add()` one micro-batch, then `end_step()`: a window of N calls.

        Args:
            gradients, optimizer, variables, normalizer, gradient_scale: as
                for `add()`.

        Returns:
            A boolean tensor: whether an optimizer update was applied.
        """
        gradients = list(gradients)
        self.add(
            gradients, optimizer, variables, normalizer,
            gradient_scale=gradient_scale,
        )
        with tf.control_dependencies(_tensors(gradients)):
            return self.end_step(optimizer, variables)

    def flush(self, optimizer, variables):
        """Applies a partially filled window, if any.

        Args:
            optimizer, variables: as for `add()`.

        Returns:
            A boolean tensor: whether an update was applied.
        """
        if not self.built or not self._accumulates:
            return tf.constant(False)
        return self._end_window(optimizer, variables, self.window.pending())

    def reset(self):
        """Discards the pending window."""
        self.window.reset()
        for listener in self._listeners:
            listener.reset()

    def _policy(self, optimizer):
        return resolve_policy(
            self.non_finite_policy, is_loss_scale_optimizer(optimizer)
        )

    def _end_window(self, optimizer, variables, ready):
        """The one place where a window ends (docs/design.md)."""
        variables = list(variables)

        def end(strategy, ready):
            ready = strategy.experimental_local_results(ready)[0]
            return run_if(
                ready,
                functools.partial(
                    self._finish_window, strategy, optimizer, variables
                ),
            )

        context = tf.distribute.get_replica_context()
        applied = context.merge_call(end, args=(ready,))
        self.window.update_applied.assign(applied)
        return applied

    def _finish_window(self, strategy, optimizer, variables):
        """Applies or skips the window, in cross-replica context; resets it."""
        policy = self._policy(optimizer)
        lso = is_loss_scale_optimizer(optimizer)
        target = optimizer.inner_optimizer if lso else optimizer
        several = strategy.num_replicas_in_sync > 1
        window = self.window
        steps, added, normalizer = window.totals(strategy)

        def apply():
            begun = [listener(strategy) for listener in self._update_begins]

            def update():
                # Everything the optimizer does (weight decay first) waits.
                with tf.control_dependencies(begun):
                    target.apply(window.gradients(normalizer, several), variables)

            strategy.extended.call_for_each_replica(update)
            if lso:
                compat.grow_loss_scale(optimizer)
            return tf.constant(True)

        def skip():
            strategy.extended.call_for_each_replica(
                window.skipped_windows.assign_add, args=(1,)
            )
            if lso and policy == "skip_window":
                compat.shrink_loss_scale(optimizer)
            return tf.constant(False)

        if lso and policy == "drop_micro_batch" and several:
            # Halve the shared scale once for a window that dropped.
            run_if(
                added < steps,
                functools.partial(compat.shrink_loss_scale, optimizer),
            )
        if policy == "propagate":
            applied = apply()
        else:
            ok = added > 0
            if policy == "skip_window":
                ok = tf.equal(added, steps)
            applied = tf.cond(ok, apply, skip)
        for listener in self._listeners:
            listener.window_end(strategy, applied)
        strategy.extended.call_for_each_replica(self.reset)
        return applied


def _tensors(gradients):
    """The dense tensors of `gradients` (`IndexedSlices` values)."""
    return [
        g.values if isinstance(g, tf.IndexedSlices) else g
        for g in gradients
        if g is not None
    ]


def _all_finite(gradients):
    checks = [tf.reduce_all(tf.math.is_finite(g)) for g in _tensors(gradients)]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
