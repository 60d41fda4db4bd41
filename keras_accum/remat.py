"""Activation recomputation, `remat=` (docs/design.md, "Recomputation").

In the forward pass a recomputed unit (a block, or a segment of a
functional graph) keeps only its inputs; in the backward pass it runs again
from them, with the seed generators' values of the forward pass and without
writing any state, and its gradients are taken from that second run.
"""

import contextlib
import functools
import math
import threading
import warnings
import weakref

import keras
import tensorflow as tf

from keras_accum import _keras_compat as compat
from keras_accum._tf_utils import components
from keras_accum._tf_utils import current_graph
from keras_accum._tf_utils import in_xla_context
from keras_accum._tf_utils import operations_since
from keras_accum._tf_utils import optimization_barrier
from keras_accum._tf_utils import stop_recording
from keras_accum._tf_utils import unreplayable_operations

# A functional graph is cut into segments if it has at least this many
# layer calls (fewer: nothing worth recomputing).
_MIN_GRAPH_NODES = 4


def validate_remat(value):
    """`False`, `True`, `"auto"` or a tuple of layer names and classes.

    Raises:
        ValueError: for any other value.
    """
    if value is None or value is False:
        return False
    if value is True:
        return True
    if isinstance(value, str) and value == "auto":
        return "auto"
    if (
        isinstance(value, (list, tuple))
        and value
        and all(_is_layer_spec(item) for item in value)
    ):
        return tuple(value)
    raise ValueError(
        "`remat` must be True, False, 'auto', or a non-empty list of layer "
        "names and `keras.layers.Layer` subclasses. Received: "
        f"remat={value!r}"
    )


def _is_layer_spec(item):
    if isinstance(item, str):
        return bool(item)
    return isinstance(item, type) and issubclass(item, keras.layers.Layer)


def remat_config(value):
    """`value` as `get_config()` saves it (classes by registered name)."""
    if not isinstance(value, tuple):
        return value
    return [
        item if isinstance(item, str)
        else {"layer_class": keras.saving.get_registered_name(item)}
        for item in value
    ]


def remat_from_config(value, custom_objects=None):
    """What `remat_config()` saved, with the classes found again."""
    if not isinstance(value, list):
        return value
    found = []
    for item in value:
        if isinstance(item, dict):
            name = item["layer_class"]
            cls = keras.saving.get_registered_object(name, custom_objects)
            if cls is None:
                cls = getattr(keras.layers, name.rpartition(">")[2], None)
            if cls is None:
                raise ValueError(
                    f"Cannot find the layer class {name!r} named in `remat`. "
                    "Register it with "
                    "`keras.saving.register_keras_serializable()` or pass it "
                    "in `custom_objects`."
                )
            item = cls
        found.append(item)
    return tuple(found)


class Plan:
    """What one model recomputes: its blocks and its graphs' segments."""

    def __init__(self, blocks, graphs):
        self.blocks = blocks  # layers whose `call()` is recomputed
        self.graphs = graphs  # [(functional, [Segment])]

    @property
    def empty(self):
        return not self.blocks and not self.graphs


class Segment:
    """Consecutive calls of a functional graph, recomputed as one unit."""

    def __init__(self, nodes, input_ids, output_ids):
        self.nodes = nodes
        self.input_ids = input_ids  # ids of the symbolic tensors it reads
        self.output_ids = output_ids  # ... and of those read after it

    def layers(self):
        return [n.operation for n in self.nodes if _is_layer(n.operation)]


def _is_layer(operation):
    return isinstance(operation, keras.layers.Layer)


def _is_block(layer):
    """A layer that holds layers and has weights (a preprocessor has none)."""
    return bool(compat.direct_layers(layer)) and bool(layer.weights)


def plan(model, spec):
    """The `Plan` of `remat=spec` (`True`, or names and classes).

    `True`: each block (a layer that holds layers and has weights) is
    recomputed; a nested model that holds blocks is looked into instead; a
    functional graph (or `Sequential`) with no blocks, the model's or a
    nested one's, is cut into segments.

    Raises:
        ValueError: for a layer name that is not in the model.
    """
    if spec is True:
        blocks, graphs = [], []
        _plan_model(model, blocks, graphs)
        return Plan(blocks, graphs)
    layers = compat.layers_of(model)[1:]
    names = {layer.name for layer in layers}
    missing = [item for item in spec if isinstance(item, str)
               and item not in names]
    if missing:
        raise ValueError(
            f"`remat` names layers that are not in the model {model.name!r}: "
            f"{missing}. Received: remat={list(spec)!r}. The model's layers "
            f"are: {sorted(names)}"
        )
    classes = tuple(item for item in spec if isinstance(item, type))
    chosen = [
        layer for layer in layers
        if layer.name in spec or (classes and isinstance(layer, classes))
    ]
    # A layer inside a chosen one is recomputed with it, not on its own.
    inner = {
        id(sub) for layer in chosen
        for sub in compat.layers_of(layer)[1:]
    }
    return Plan([layer for layer in chosen if id(layer) not in inner], [])


def _plan_model(model, blocks, graphs):
    """Adds `model`'s units to `blocks` and `graphs`; returns whether it
    found any."""
    children = [c for c in compat.direct_layers(model) if _is_block(c)]
    for child in children:
        if not (isinstance(child, keras.Model)
                and _plan_model(child, blocks, graphs)):
            blocks.append(child)
    if children:
        return True
    # No block: a graph of plain layers, cut into segments.
    functional = compat.graph_of(model)
    if functional is not None:
        segments = cut_graph(functional)
        if len(segments) > 1:
            graphs.append((functional, segments))
            return True
    return False


def cut_graph(functional):
    """`functional`'s calls in segments of about `total / sqrt(n)` bytes of
    outputs each (per sample), each cut where the fewest bytes cross it
    (docs/design.md, "Recomputation")."""
    nodes = compat.graph_nodes(functional)
    if len(nodes) < _MIN_GRAPH_NODES:
        return []
    produced_at, size = {}, {}
    for tensor in functional.inputs:
        size[id(tensor)] = _bytes(tensor)
    for index, node in enumerate(nodes):
        for tensor in node.outputs:
            produced_at[id(tensor)] = index
            size[id(tensor)] = _bytes(tensor)
    last_read = {}
    for index, node in enumerate(nodes):
        for tensor in node.input_tensors:
            last_read[id(tensor)] = index
    end = len(nodes)
    for tensor in functional.outputs:
        last_read[id(tensor)] = end

    def crossing(boundary):
        """Bytes made before `boundary` (or inputs) and read after it."""
        return sum(
            size.get(tensor_id, 0) for tensor_id, read in last_read.items()
            if read >= boundary and produced_at.get(tensor_id, -1) < boundary
        )

    made = [sum(size[id(t)] for t in node.outputs) for node in nodes]
    budget = sum(made) / math.sqrt(len(nodes))
    bounds = [0]
    while True:
        start, total, candidates = bounds[-1], 0, []
        for boundary in range(start + 1, end):
            total += made[boundary - 1]
            if total > 1.5 * budget:
                break
            if total >= 0.5 * budget:
                candidates.append(boundary)
        if sum(made[start:]) <= 1.5 * budget:
            break
        if not candidates:
            candidates = [max(start + 1, boundary - 1)]
        bounds.append(min(candidates, key=lambda b: (crossing(b), -b)))
    bounds.append(end)
    segments = []
    for start, stop in zip(bounds, bounds[1:]):
        inside = nodes[start:stop]
        inner = {id(t) for node in inside for t in node.outputs}
        reads = []
        for node in inside:
            for tensor in node.input_tensors:
                if id(tensor) not in inner and id(tensor) not in reads:
                    reads.append(id(tensor))
        kept = [
            id(t) for node in inside for t in node.outputs
            if last_read.get(id(t), -1) >= stop
        ]
        segments.append(Segment(inside, reads, kept))
    return segments


def _bytes(tensor):
    """Bytes of one sample of a symbolic tensor (unknown sizes as 1)."""
    elements = math.prod(d or 1 for d in tensor.shape[1:])
    return elements * tf.as_dtype(tensor.dtype).size


class _Patches:
    """The model's blocks and graphs, patched while a forward pass of
    training runs (counted: replicas run their passes in threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._own = []  # [(object, name, own attribute or None)]

    @contextlib.contextmanager
    def installed(self, plan):
        with self._lock:
            self._users += 1
            if self._users == 1:
                for layer in plan.blocks:
                    self._set(layer, "call", functools.partial(
                        _recomputed_call, layer, layer.call
                    ))
                for functional, segments in plan.graphs:
                    self._set(functional, compat.RUN_THROUGH_GRAPH,
                              functools.partial(
                                  _segmented_run, functional, segments,
                                  compat.run_through_graph(functional),
                              ))
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for obj, name, own in reversed(self._own):
                        if own is None:
                            object.__delattr__(obj, name)
                        else:
                            object.__setattr__(obj, name, own)
                    self._own = []

    def _set(self, obj, name, value):
        self._own.append((obj, name, vars(obj).get(name)))
        object.__setattr__(obj, name, value)


class Rematerialization:
    """The model's `remat` setting and what it recomputes.

    Args:
        spec: a value `validate_remat()` returned.
    """

    def __init__(self, spec=False):
        self.spec = spec
        # "auto" is off until one sample per micro-batch does not fit.
        self.enabled = spec is not False and spec != "auto"
        self._plans = {}  # id(model) -> Plan
        self._patches = _Patches()
        self._warned = False

    def enable(self):
        """Turns `"auto"`'s recomputation on."""
        self.enabled = True

    def plan(self, model):
        """The model's `Plan` (warns once if it recomputes nothing)."""
        spec = True if self.spec == "auto" else self.spec
        found = plan(model, spec)
        if found.empty and not self._warned and compat.all_built(model):
            self._warned = True
            warnings.warn(
                f"`remat={self.spec!r}`: the model {model.name!r} has nothing "
                "to recompute (no layer that holds layers and weights, and "
                f"no functional graph of {_MIN_GRAPH_NODES} or more layer "
                "calls). It trains without recomputation. Pass a list of "
                "layer names or classes to choose what to recompute.",
                stacklevel=4,
            )
        return found

    def check(self, model):
        """Raises for a name not in `model` (at `compile()` or `fit()`; a
        model not built yet is checked when its plan is made)."""
        if self.spec is not False and compat.all_built(model):
            plan(model, True if self.spec == "auto" else self.spec)

    @contextlib.contextmanager
    def active(self, model):
        """The block in which `model`'s forward pass of training runs,
        recomputing what its plan says in the backward pass."""
        if not self.enabled:
            yield
            return
        found = self._plans.get(id(model))
        if found is None:
            found = self.plan(model)
            if compat.all_built(model):  # not an unbuilt model's plan
                self._plans[id(model)] = found
        with self._patches.installed(found):
            yield

    def forget(self):
        """Plans again at the next forward pass (after a retrace)."""
        self._plans = {}


def _differentiable(value):
    return tf.is_tensor(value) and value.dtype.is_floating


def _recomputed_call(layer, call, *args, **kwargs):
    """A block's `call()`, its activations recomputed in the backward pass."""
    structure = (args, kwargs)
    flat = keras.tree.flatten(structure)

    def run(*inputs):
        a, k = _filled(structure, flat, inputs)
        return call(*a, **k)

    return recompute(run, flat, compat.layers_of(layer), unit=layer)


def _filled(structure, flat, inputs):
    """`structure` with its differentiable leaves replaced by `inputs`."""
    inputs = iter(inputs)
    values = [next(inputs) if _differentiable(v) else v for v in flat]
    return keras.tree.pack_sequence_as(structure, values)


def _segmented_run(functional, segments, keras_run, inputs,
                   operation_fn=lambda op: op, call_fn=None):
    """Keras' run of `functional`'s graph (`keras_run`), each segment
    recomputed."""
    if call_fn is not None:  # symbolic runs: Keras' own
        return keras_run(inputs, operation_fn, call_fn)
    tensors = {
        id(x): y for x, y in zip(functional.inputs, keras.tree.flatten(inputs))
    }
    for segment in segments:
        if any(i not in tensors for i in segment.input_ids):
            # A graph whose inputs are not all given: Keras' own skipping.
            return keras_run(inputs, operation_fn)
        given = [tensors[i] for i in segment.input_ids]

        def run(*values, segment=segment, given=given):
            local = dict(tensors)
            local.update(zip(segment.input_ids, _filled(given, given, values)))
            for node in segment.nodes:
                args, kwargs = compat.fill_in(node, local)
                outputs = operation_fn(node.operation)(*args, **kwargs)
                for x, y in zip(node.outputs, keras.tree.flatten(outputs)):
                    local[id(x)] = y
            return [local[i] for i in segment.output_ids]

        outputs = recompute(run, given, _segment_layers(segment), unit=segment)
        tensors.update(zip(segment.output_ids, outputs))
    return keras.tree.pack_sequence_as(
        compat.outputs_structure(functional),
        [tensors[id(x)] for x in functional.outputs],
    )


def _segment_layers(segment):
    return [sub for layer in segment.layers() for sub in compat.layers_of(layer)]


class _HeldWrites(keras.StatelessScope):
    """The forward pass's scope: `keras.Variable.assign` is held back (and
    read back within the scope), and the variables written are listed, in
    the order of their first write."""

    def __init__(self):
        super().__init__(collect_losses=False)
        self.written = {}  # id -> variable

    def add_update(self, update):
        variable, _ = update
        self.written.setdefault(id(variable), variable)
        super().add_update(update)

    def apply(self):
        """Writes what the scope held back (after it is exited)."""
        for variable in self.written.values():
            variable.assign(self.get_current_value(variable))


class _Replay(keras.StatelessScope):
    """The recomputation's scope: every variable reads as it did in the
    forward pass, and nothing is written. A trainable variable that the
    forward pass wrote (`SpectralNormalization`'s kernel) reads as a tensor
    the tape watches, replaced on each write, as Keras' gradient of a
    variable sums over its reads and none flows through an assignment."""

    def __init__(self, read, tape):
        self._tape = tape
        self.watched = []  # [(variable, tensor)]
        super().__init__(
            state_mapping=[(v, self._watch(v, value)) for v, value in read],
            collect_losses=False,
        )

    def _watch(self, variable, value):
        if not (variable.trainable and value.dtype.is_floating):
            return value
        value = tf.stop_gradient(value)
        self._tape.watch(value)
        self.watched.append((variable, value))
        return value

    def add_update(self, update):
        variable, value = update
        super().add_update((variable, self._watch(variable, value)))


class UnreplayableLayerError(ValueError):
    """A recomputed layer whose forward pass a second run cannot repeat."""


def _refuse(unit, found):
    if isinstance(unit, keras.layers.Layer):
        what = f"the layer {unit.name!r} ({type(unit).__name__})"
        names = [unit.name]
    else:
        names = [layer.name for layer in unit.layers()]
        what = f"the graph segment of layers {names}"
    kind, name = found[0]
    return UnreplayableLayerError(
        f"`remat` cannot recompute {what} exactly: its forward pass runs "
        f"the stateful operation {kind} ({name!r}), which a second run in "
        "the backward pass would not repeat (a variable written other than "
        "with `keras.Variable.assign`, a random draw not from a "
        "`keras.random.SeedGenerator`, or a Python function). Leave it out: "
        "pass `remat=` a list of the layer names or classes to recompute "
        f"without {names}, or `remat=False`. Received: remat=True"
    )


# Units whose forward pass was checked while executing eagerly.
_CHECKED = weakref.WeakKeyDictionary()


def _check_eagerly(unit, run, values, layers):
    """Traces `run` once in a graph of its own and checks its operations
    (executing eagerly, the forward pass leaves none to check)."""
    if unit in _CHECKED:
        return
    with tf.__internal__.FuncGraph("remat_check").as_default() as graph:
        placeholders = [
            tf.compat.v1.placeholder(v.dtype, v.shape) for v in values
        ]
        with _HeldWrites(), _losses_recorded(layers, []):
            run(*placeholders)
        found = unreplayable_operations(graph.get_operations(), graph)
    if found:
        raise _refuse(unit, found)
    _CHECKED[unit] = True


def _kept_variables(layers):
    """The variables a recomputation reads as the forward pass read them,
    besides those it wrote: the layers' non-trainable ones (statistics,
    seeds, states), which another layer may write before the backward
    pass."""
    kept = {}
    for layer in layers:
        for variable in layer.non_trainable_variables:
            kept.setdefault(id(variable), variable)
    return kept


def recompute(run, flat_inputs, layers, unit=None):
    """`run(*differentiable inputs)`, its activations not kept but
    recomputed in the backward pass.

    The recomputation reads every variable that the forward pass wrote, and
    every non-trainable variable of `layers`, as the forward pass read it
    (the same `Dropout` masks, BatchNormalization renorm statistics,
    `SpectralNormalization` weights), writes no variable (no second
    BatchNormalization update), and records the losses `layers` add
    (`add_loss`, activity regularisers) as outputs, so that their gradients
    flow.

    Args:
        run: a function of the differentiable (floating) tensors of
            `flat_inputs`, in order, returning a structure of tensors.
        flat_inputs: the flat inputs; the others are used as they are.
        layers: every layer `run` may call.
        unit: the block (a layer) or `Segment` that `run` runs, named in
            the error of a forward pass that cannot be replayed.

    Returns:
        `run`'s outputs.

    Raises:
        UnreplayableLayerError: where the forward pass runs a stateful
            operation that a second run would not repeat.
    """
    inputs = [v for v in flat_inputs if _differentiable(v)]
    kept = _kept_variables(layers)
    state = compat.call_state()
    masks = [compat.get_keras_mask(x) for x in inputs]
    structure = {}

    def run_recording_losses(*values):
        added = []
        with _losses_recorded(layers, added):
            outputs = run(*values)
        structure["outputs"] = outputs
        return keras.tree.flatten(outputs), added

    if tf.executing_eagerly() and unit is not None:
        _check_eagerly(unit, run, inputs, layers)

    @tf.custom_gradient
    def unit_call(*values):
        graph = current_graph()
        count = 0 if graph is None else len(graph.get_operations())
        with stop_recording():
            with _HeldWrites() as held:
                outputs, losses = run_recording_losses(*values)
            if graph is not None and unit is not None:
                found = unreplayable_operations(
                    operations_since(graph, count), graph
                )
                if found:
                    raise _refuse(unit, found)
            # Read before the held-back writes: the values the forward pass
            # read (a variable it did not write may be written later on).
            variables = {**kept, **held.written}
            read = [
                (v, tf.identity(compat.stored_value(v)))
                for v in variables.values()
            ]
            held.apply()
        count = len(outputs)
        out_masks = [compat.get_keras_mask(o) for o in outputs]
        structure["masks"] = out_masks
        structure["losses"] = [layer for layer, _ in losses]
        results = outputs + [loss for _, loss in losses]

        def gradient(*upstream, variables=None):
            variables = list(variables or [])
            again_inputs = _after(values, upstream)
            with tf.GradientTape() as tape:
                tape.watch(again_inputs)
                tape.watch(variables)
                for x, mask in zip(again_inputs, masks):
                    if mask is not None:
                        compat.set_keras_mask(x, mask)
                replay = _Replay(read, tape)
                with compat.entered_call_state(state), replay:
                    again, again_losses = run_recording_losses(*again_inputs)
            again = again[:count] + [loss for _, loss in again_losses]
            pairs = [
                (a, u) for a, u in zip(again, upstream)
                if u is not None and tf.is_tensor(a) and a.dtype.is_floating
            ]
            watched = [value for _, value in replay.watched]
            grads = tape.gradient(
                [a for a, _ in pairs],
                list(again_inputs) + variables + watched,
                output_gradients=[u for _, u in pairs],
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            input_grads = grads[: len(values)]
            variable_grads = _with_watched(
                variables, grads[len(values): len(values) + len(variables)],
                replay.watched, grads[len(values) + len(variables):],
            )
            if not variables:
                return input_grads
            return input_grads, variable_grads

        return results, gradient

    results = unit_call(*inputs)
    outputs = list(results[: len(structure["masks"])])
    for output, mask in zip(outputs, structure["masks"]):
        if mask is not None:
            compat.set_keras_mask(output, mask)
    for layer, loss in zip(structure["losses"], results[len(outputs):]):
        layer.add_loss(loss)
    return keras.tree.pack_sequence_as(structure["outputs"], outputs)


def _with_watched(variables, grads, watched, watched_grads):
    """The gradients of `variables` (TensorFlow's), with those of the
    tensors that stood for written Keras variables in the recomputation
    added to their variable's."""
    grads = list(grads)
    for (variable, _), grad in zip(watched, watched_grads):
        backing = compat.stored_value(variable)
        for index, candidate in enumerate(variables):
            if candidate is backing or any(
                candidate is part for part in components(backing)
            ):
                grads[index] = tf.convert_to_tensor(grads[index]) + tf.cast(
                    grad, grads[index].dtype
                )
                break
    return grads


def _after(values, upstream):
    """`values` as tensors that depend on the upstream gradients, so that
    the recomputation runs in the backward pass, not with the forward."""
    values = [tf.identity(v) for v in values]
    anchor = next((u for u in upstream if u is not None), None)
    if anchor is None or tf.executing_eagerly():
        return values
    # A zero made from one element of the gradient, which no compiler can
    # fold (`0 * g` is NaN for an infinite `g`, so it is selected away): the
    # recomputation cannot run before the gradient exists, and XLA cannot
    # merge it with the forward pass's operations (other inputs).
    first = tf.reshape(anchor, [-1])[:1]
    first = tf.cast(tf.reduce_sum(first), tf.float32)
    zero = tf.where(tf.math.is_finite(first), first * 0.0, 0.0)
    values = [v + tf.cast(zero, v.dtype) for v in values]
    if in_xla_context():
        # Where XLA keeps the barrier, it also orders the recomputation.
        values = optimization_barrier(values + [anchor])[: len(values)]
    return values


@contextlib.contextmanager
def _losses_recorded(layers, added):
    """`add_loss` of `layers` appends `(layer, loss)` to `added` instead."""
    own = []
    for layer in {id(layer): layer for layer in layers}.values():
        own.append((layer, vars(layer).get("add_loss")))

        def record(loss, layer=layer):
            for value in keras.tree.flatten(loss):
                added.append((layer, value))

        object.__setattr__(layer, "add_loss", record)
    try:
        yield
    finally:
        for layer, previous in own:
            if previous is None:
                object.__delattr__(layer, "add_loss")
            else:
                object.__setattr__(layer, "add_loss", previous)
