"""The one seam to Keras' private API, checked when keras_accum is imported
(docs/design.md, "Keras internals")."""

import contextlib
import operator
import re
import threading

import keras
import tensorflow as tf


def _missing(what):
    return ImportError(
        "keras_accum needs a Keras 3 with the TensorFlow backend whose "
        f"{what}; Keras {keras.__version__} has not. See "
        "docs/compatibility.md for the tested versions."
    )


# 3.11: the oldest Keras the tests pass on (docs/compatibility.md).
if tuple(map(int, re.findall(r"\d+", keras.__version__)[:2])) < (3, 11):
    raise ImportError(  # pragma: no cover
        f"keras_accum needs Keras >= 3.11; Keras {keras.__version__} is "
        "installed. Upgrade it with `pip install -U keras`."
    )

try:
    from keras.src.backend import compute_output_spec  # noqa: F401
    from keras.src.backend import name_scope  # noqa: F401
    from keras.src.backend.common import global_state
    # Not re-exported by `keras.src.backend` from Keras 3.16.
    from keras.src.backend.common.masking import get_keras_mask  # noqa: F401
    from keras.src.losses import loss as loss_module
    from keras.src.models.functional import Functional
    from keras.src.models import model as model_module
    from keras.src.models.model import functional_init_arguments  # noqa: F401
    from keras.src.random import seed_generator
    from keras.src.trainers.compile_utils import CompileLoss
    from keras.src.trainers.data_adapters.data_adapter_utils import (
        unpack_x_y_sample_weight,  # noqa: F401
    )
except ImportError as error:  # pragma: no cover - depends on the version
    raise _missing(f"modules import ({error})") from error

for _owner, _names in (
    (
        loss_module,
        "Loss apply_mask reduce_weighted_values squeeze_or_expand_to_same_rank "
        "standardize_reduction unscale_loss_for_distribution",
    ),
    (keras.Model, "_compute_loss _symbolic_build _maybe_symbolic_build"),
    (model_module, "inject_functional_model_class"),
    (keras.layers.BatchNormalization, "_moments"),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_non_finite_grads"),
    (
        keras.callbacks.ProgbarLogger,
        "_maybe_init_progbar _update_progbar _finalize_progbar",
    ),
    (keras.layers.Layer, "_flatten_layers"),
    (CompileLoss, "metrics"),
    (CompileLoss.Loss, "loss_weights"),
):
    for _name in _names.split():
        if not hasattr(_owner, _name):  # pragma: no cover
            raise _missing(f"`{getattr(_owner, '__name__', _owner)}.{_name}`")


def flat_losses(compile_loss):
    """The mutable list of a built `CompileLoss`'s loss entries."""
    flat = getattr(compile_loss, "_flat_losses", None)
    if flat is None:
        raise _missing("`CompileLoss` keeps its losses in `_flat_losses`")
    return flat


def layers_of(model):
    """Every layer of `model`, nested models included, `model` first."""
    return model._flatten_layers(include_self=True, recursive=True)


reduction_axes = operator.attrgetter("_reduction_axes")
moments = operator.attrgetter("_moments")


# The global state's key of the global `SeedGenerator`: a constant in newer
# Keras (3.15), the same string written out in Keras 3.11.
_GLOBAL_SEED_GENERATOR = getattr(
    seed_generator, "GLOBAL_SEED_GENERATOR", "global_seed_generator"
)


def global_seed_generator(create=False):
    """Keras' global `SeedGenerator` (`None` if none yet and not `create`)."""
    if create:
        return seed_generator.global_seed_generator()
    return global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)


def metrics_built(model):
    """Whether the model's compiled metrics and loss are built (or none)."""
    return all(
        c is None or c.built
        for c in (
            getattr(model, "_compile_metrics", None),
            compile_loss(model),
        )
    )


def build_metrics(model, data_batch):
    """Builds the compiled metrics and loss from a batch's shapes, as Keras'
    `fit()` does before a distributed first step."""
    if not metrics_built(model):
        model._symbolic_build(data_batch=data_batch)


def set_initial_epoch(model, epoch):
    model._initial_epoch = epoch


def shrink_loss_scale(optimizer):
    """Halves a `LossScaleOptimizer`'s scale, as Keras does on overflow."""
    optimizer._stateful_handle_non_finite_grads()
    return tf.constant(True)


def grow_loss_scale(optimizer):
    """Counts a finite update of a `LossScaleOptimizer`, as Keras does."""

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


class _Count(float):
    """A count that Keras' progress bar (a float / 1) prints as an integer."""

    def __truediv__(self, other):
        return _Count(float(self) / other)

    def __format__(self, spec):
        return str(int(self))


def _with_count(logs):
    if not logs or "updates" not in logs:
        return logs
    return dict(logs, updates=_Count(logs["updates"]))


class ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, showing the `updates` count as an integer."""

    def _maybe_init_progbar(self):
        super()._maybe_init_progbar()
        # Keras 3.11 averages a value over the epoch's steps unless it is
        # named stateful: the count is the last step's.
        if self.progbar.stateful_metrics is not None:
            self.progbar.stateful_metrics.add("updates")

    def _update_progbar(self, batch, logs=None):
        super()._update_progbar(batch, _with_count(logs))

    def _finalize_progbar(self, logs):
        super()._finalize_progbar(_with_count(logs))


def in_multi_worker_mode(strategy):
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


# Per thread, the instances whose `__init__` is running, each with the class
# it takes when a parent builds it functionally.
_building = threading.local()
_inject_functional_model_class = model_module.inject_functional_model_class


def _inject(cls):
    """Keras' `inject_functional_model_class`, except for ours being built."""
    for instance, functional_class in reversed(getattr(_building, "stack", [])):
        if cls is type(instance) and not issubclass(cls, Functional):
            instance.__class__ = functional_class(cls)
            return instance.__class__
    return _inject_functional_model_class(cls)


model_module.inject_functional_model_class = _inject


@contextlib.contextmanager
def building_functionally(instance, functional_class):
    """While `instance` is initialised, its functional build gives it the
    class `functional_class(cls)` of its class `cls`."""
    stack = _building.__dict__.setdefault("stack", [])
    stack.append((instance, functional_class))
    try:
        yield
    finally:
        stack.pop()


def call_model(model, x, training):
    """The model's forward pass, as Keras' train and test steps call it."""
    if model._call_has_training_arg:
        return model(x, training=training)
    return model(x)


def symbolic(data):
    """`KerasTensor`s of the shapes and types of `data`'s tensors."""
    return keras.tree.map_structure(
        lambda t: None if t is None else keras.KerasTensor(t.shape, t.dtype),
        data,
    )


def compute_loss(model, *args, **kwargs):
    """Keras' `Model._compute_loss` (compiled losses and regularisers)."""
    return model._compute_loss(*args, **kwargs)


def compile_loss(model):
    """The model's `CompileLoss`, or `None` if it has no compiled loss."""
    return getattr(model, "_compile_loss", None)


def track_loss(model, loss, batch_size):
    """Adds a step's (distribution-scaled) loss to the logged `loss`."""
    track_loss_term(model._loss_tracker, loss, batch_size)


def track_loss_term(tracker, value, rows):
    """Adds a (distribution-scaled) value to `tracker`, weighted by `rows`."""
    tracker.update_state(
        loss_module.unscale_loss_for_distribution(value), sample_weight=rows
    )


def loss_trackers(model):
    """The trackers of the compiled loss terms (`<output>_loss`), or `[]`."""
    compiled = compile_loss(model)
    return list(compiled.metrics) if compiled is not None else []


def loss_weights(model):
    """Each compiled loss term's weight (1 if none); `[]` if not built."""
    compiled = compile_loss(model)
    if compiled is None or not compiled.built:
        return []
    return [
        1.0 if entry.loss_weights is None else float(entry.loss_weights)
        for entry in flat_losses(compiled)
    ]


def replay_epochs(epoch_iterator, epochs):
    """Has `fit()`'s epoch iterator go through `epochs` epochs as in
    training, reading no batch: it makes the iterators of its input that
    they made, and each draws its order (a reshuffling pipeline's seeds).
    Returns how many batches the iterator that the next epoch goes on with
    had given (with `steps_per_epoch`, one goes on across epochs)."""
    sized = epoch_iterator.steps_per_epoch or epoch_iterator._num_batches
    for _ in range(epochs):
        if sized:
            for _ in epoch_iterator:
                pass
        else:  # One iterator an epoch, which ends when it runs out.
            epoch_iterator.data_adapter.on_epoch_begin()
            iter(epoch_iterator._get_iterator())
    if epoch_iterator.steps_per_epoch:
        return epoch_iterator._steps_seen
    return 0


class TrainerHooks:
    """Overrides of private `keras.Model` methods; mixed in before it."""

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # `fit()` calls it first with its epoch iterator.
        if iterator is not None and "input_position" in vars(self):
            self.input_position.capture(iterator)
        # Keras averages a distributed batch over the replicas only to
        # learn its shapes, which fails under `MultiWorkerMirroredStrategy`.
        if self._distribute_strategy is None or iterator is None:
            return super()._maybe_symbolic_build(iterator, data_batch)
        strategy = self.distribute_strategy
        with strategy.scope():
            for _, _, batches in iterator:
                batch = next(batches)
                break
            self._symbolic_build(
                data_batch=keras.tree.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues)
                    else v,
                    batch,
                )
            )


class MomentsPatch:
    """`_moments` and the moving statistics' `assign` of one layer, patched."""

    _MISSING = object()

    def __init__(self, layer):
        self.layer = layer
        self.users = 0
        self._assigned = False
        self._own = []  # [(object, name, own attribute or `_MISSING`)]

    def _set(self, obj, name, value):
        self._own.append((obj, name, obj.__dict__.get(name, self._MISSING)))
        object.__setattr__(obj, name, value)

    def install_moments(self, moments):
        self._set(self.layer, "_moments", moments)

    def install_assign(self, make_assign):
        if not self._assigned:
            self._assigned = True
            for var in (self.layer.moving_mean, self.layer.moving_variance):
                self._set(var, "assign", make_assign(self.layer, var.assign))

    def remove(self):
        for obj, name, own in reversed(self._own):
            if own is self._MISSING:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, own)
        self._own, self._assigned = [], False


# Recomputation (keras_accum/remat.py): what a layer's `__call__` sets up
# around `call()`, the graph of a functional model, and seed generators.
from keras.src.backend.common.masking import set_keras_mask  # noqa: E402,F401

if not hasattr(Functional, "_run_through_graph"):  # pragma: no cover
    raise _missing("`Functional._run_through_graph`")


def call_state():
    """The autocast scope and call context a layer's `call()` runs in."""
    return (
        global_state.get_global_attribute("autocast_scope"),
        global_state.get_global_attribute("current_call_ctx"),
    )


@contextlib.contextmanager
def entered_call_state(state):
    """Runs a block in the `call_state()` captured when it first ran."""
    autocast, call_context = state
    previous = call_state()
    global_state.set_global_attribute("autocast_scope", autocast)
    global_state.set_global_attribute("current_call_ctx", call_context)
    try:
        yield
    finally:
        global_state.set_global_attribute("autocast_scope", previous[0])
        global_state.set_global_attribute("current_call_ctx", previous[1])


def direct_layers(layer):
    """The layers `layer` holds itself (not those they hold)."""
    return layer._flatten_layers(include_self=False, recursive=False)


def seed_generators(layer):
    """The `SeedGenerator`s of `layer` and of the layers it holds."""
    found = []
    for sublayer in layers_of(layer):
        generators = vars(sublayer).get("_seed_generators")
        if generators is None:
            raise _missing("layers keep their seed generators in `_seed_generators`")
        found.extend(generators)
    return found


def graph_of(model):
    """The `Functional` whose graph `model` runs (a `Sequential`'s own), or
    `None` for a subclassed model."""
    if isinstance(model, Functional):
        return model
    if isinstance(model, keras.Sequential):
        model.build() if not model.built else None
        return vars(model).get("_functional")
    return None


def graph_nodes(functional):
    """The nodes of `functional`'s graph in the order Keras runs them."""
    by_depth = vars(functional).get("_nodes_by_depth")
    if by_depth is None:
        raise _missing("functional models keep their nodes in `_nodes_by_depth`")
    return [
        node
        for depth in sorted(by_depth, reverse=True)
        for node in by_depth[depth]
        if node.operation is not None and not node.is_input
    ]


def fill_in(node, tensors):
    """A node's call arguments, its input tensors taken from `tensors` (by
    the id of the symbolic tensor)."""
    return node.arguments.fill_in(tensors)


def outputs_structure(functional):
    """The structure `functional`'s outputs are returned in."""
    structure = vars(functional).get("_outputs_struct", _MISSING_ATTRIBUTE)
    if structure is _MISSING_ATTRIBUTE:
        raise _missing("functional models keep `_outputs_struct`")
    return structure


_MISSING_ATTRIBUTE = object()
