"""TensorFlow helpers: per-replica state variables and XLA on a CPU."""

import keras
import numpy as np
import tensorflow as tf


def state_variable(initial_value, name, aggregation=None, dtype=None):
    """A non-trainable variable local to each replica (docs/design.md)."""
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
    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
    )


def components(value):
    """The per-replica parts of a distributed value; `[value]` otherwise."""
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def assign_per_replica(variable, values):
    """Assigns `values` (one per replica) to `variable`'s components: with
    several workers, those of this worker's replicas ids out of all."""
    parts = components(variable)
    if len(values) > len(parts) > 0 and isinstance(
        variable, tf.distribute.DistributedValues
    ):
        strategy = variable.distribute_strategy
        if len(values) == strategy.num_replicas_in_sync:
            ids = strategy.experimental_distribute_values_from_function(
                lambda context: tf.constant(context.replica_id_in_sync_group)
            )
            local = strategy.experimental_local_results(ids)
            values = [values[int(i)] for i in local]
    for component, value in zip(parts, values):
        component.assign(value)


def per_replica_values(variable):
    return [np.asarray(c.numpy()) for c in components(variable)]


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


def current_graph():
    """The graph being built, or `None` when executing eagerly."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()


# XLA on a CPU: every decision it needs is here (docs/design.md).

_CONVOLUTIONS = tuple(
    getattr(keras.layers, f"{kind}Conv{rank}D{transpose}")
    for kind, transpose in (("", ""), ("", "Transpose"), ("Separable", ""),
                            ("Depthwise", ""))
    for rank in ((1, 2, 3) if not kind else (1, 2))
)


def xla_placement(jit_compile, in_step, layers, xla_aborts=False,
                  collects=False):
    """What XLA compiles of a step: `"step"`, `"micro_batch"` or `None`.

    `collects`: the step collects its micro-batches' outputs (prediction)
    in an array that XLA cannot grow.
    """
    if jit_compile is not True or xla_aborts:
        return None
    cpu_only = not (
        tf.config.list_logical_devices("GPU")
        or tf.config.list_logical_devices("TPU")
    )
    if in_step and (collects or cpu_only and any(
        isinstance(layer, _CONVOLUTIONS) for layer in layers
    )):
        return "micro_batch"
    return "step"


def xla_on_cpu():
    """Whether the function being traced is compiled by XLA for a CPU."""
    graph = current_graph()
    if graph is None or tf.config.list_logical_devices("GPU"):
        return False
    # TensorFlow's own control flow reads the XLA context this way. If that
    # internal module moves, the plain graph forms are used (exact too).
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - depends on the TF version
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def run_if(pred, fn):
    """`fn()` if `pred`, else `False`: a `tf.cond` or a 0/1-trip loop."""
    if not xla_on_cpu():
        return tf.cond(pred, fn, lambda: tf.constant(False))
    _, result = tf.while_loop(
        lambda count, _: count < tf.cast(pred, tf.int32),
        lambda count, _: (count + 1, fn()),
        (tf.constant(0), tf.constant(False)),
    )
    return result


def in_xla_context():
    """Whether the function being traced is compiled by XLA (any device)."""
    graph = current_graph()
    if graph is None:
        return False
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - depends on the TF version
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def optimization_barrier(tensors):
    """`tensors` through XLA's optimization barrier: XLA neither moves a
    computation on the outputs before the barrier nor merges it with one on
    the inputs. Only inside a function that XLA compiles."""
    from tensorflow.compiler.tf2xla.python import xla

    return list(xla.optimization_barrier(*tensors))


def stop_recording():
    """A block whose operations no gradient tape records."""
    from tensorflow.python.eager import record

    return record.stop_recording()


# Stateful operations that a recomputation may run again: they read state
# (or only check or print) and change nothing that a second run would see.
_REPLAYABLE = frozenset({
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "Assert", "Print", "PrintV2", "NoOp",
})


def operations_since(graph, count):
    """The operations added to `graph` after its first `count`."""
    return graph.get_operations()[count:]


def unreplayable_operations(operations, graph):
    """The stateful operations of `operations` (and of the functions they
    call: conditionals, loops) that do more than read state: a variable
    written other than through `keras.Variable.assign`, a stateful random
    draw, a Python function. Returns `[(type, name)]`."""
    from tensorflow.python.framework import op_def_registry

    found, seen = [], set()

    def stateful(kind):
        definition = op_def_registry.get(kind)
        return definition is None or definition.is_stateful

    def functions(attributes):
        for value in attributes.values():
            if value.HasField("func"):
                yield value.func.name
            elif value.HasField("list"):
                yield from (f.name for f in value.list.func)

    def visit(kind, name, attributes):
        called = list(functions(attributes))
        if op_def_registry.get(kind) is None:
            called.append(kind)  # a function called as an operation
        elif not called and stateful(kind) and kind not in _REPLAYABLE:
            found.append((kind, name))
        for function in called:
            if function in seen:
                continue
            seen.add(function)
            definition = _function(graph, function)
            if definition is None:
                found.append((kind, name))
                continue
            for node in definition.definition.node_def:
                visit(node.op, f"{name}/{node.name}", node.attr)

    for operation in operations:
        node = operation.node_def
        visit(node.op, node.name, node.attr)
    return found


def _function(graph, name):
    """The function `name` as the graph being built (or one it is nested
    in) holds it, or `None`."""
    while graph is not None:
        found = graph._get_function(name)
        if found is not None:
            return found
        graph = getattr(graph, "outer_graph", None)
    return None
