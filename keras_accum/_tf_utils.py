"""TensorFlow helpers shared by the accumulator and the BatchNorm statistics."""

import numpy as np
import tensorflow as tf


def state_variable(initial_value, name, aggregation=None, dtype=None):
    """A non-trainable variable local to each replica (plain without one);
    `ONLY_FIRST_REPLICA` makes an eager cross-replica read local."""
    return tf.Variable(
        initial_value,
        dtype=dtype,
        name=name,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregation or tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def accumulation_dtype(dtype):
    """float64 for float64 values, float32 for anything else."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def in_replica_context():
    """Whether this runs in a `tf.distribute` replica context (any count)."""
    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
    )


def assign_per_replica(variable, values):
    """Assigns one value per replica (a plain variable takes the first)."""
    if isinstance(variable, tf.distribute.DistributedValues):
        for component, value in zip(variable.values, values):
            component.assign(value)
    else:
        variable.assign(values[0])


def per_replica_values(variable):
    """The numpy value of each replica's copy (one for a plain variable)."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return [np.asarray(c.numpy()) for c in variable.values]
    return [np.asarray(variable.numpy())]


def assign_state(state, values):
    """Assigns saved per-replica `values` to `state`; returns the rest."""
    pending = {}
    for name, per_replica in values.items():
        variable = state.get(name)
        if variable is None:
            pending[name] = per_replica
        elif tuple(variable.shape) == tuple(np.shape(per_replica[0])):
            assign_per_replica(variable, per_replica)
        else:
            raise ValueError(
                f"The saved window state `{name}` has shape "
                f"{np.shape(per_replica[0])}, but the model's has "
                f"{tuple(variable.shape)}: the model differs from the one "
                "that was saved."
            )
    return pending


def run_if(pred, fn):
    """`fn()` (a boolean tensor) if `pred`, else `False`: a `tf.cond`, or
    under XLA on CPU a 0/1-trip loop (docs/design.md, "One window end")."""
    if in_xla_context() and not tf.config.list_logical_devices("GPU"):

        def body(count, _):
            return count + 1, fn()

        _, result = tf.while_loop(
            lambda count, _: count < tf.cast(pred, tf.int32),
            body,
            (tf.constant(0), tf.constant(False)),
        )
        return result
    return tf.cond(pred, fn, lambda: tf.constant(False))


def in_xla_context():
    """Whether the function being traced is compiled by XLA."""
    if tf.executing_eagerly():
        return False
    # TensorFlow's own control flow reads the XLA context this way. If that
    # internal module moves, the plain graph forms are used (exact too).
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - depends on the TF version
        return False
    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def current_graph():
    """The graph being built, or `None` when executing eagerly."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()


def components(variable):
    """The `tf.Variable`s behind a (distributed) variable."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return list(variable.values)
    return [variable]
