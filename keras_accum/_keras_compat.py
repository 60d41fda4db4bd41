"""The one seam to Keras' private API: every Keras internal that keras_accum
reads is named here (docs/keras_internals.md lists them, and for each where
it is checked and how it fails).

Module-level names, class attributes and what Keras' own code must do with
them are checked when keras_accum is imported (`check_keras()`); the
attributes of Keras' objects where they are first read (the first `fit()`,
or the step being traced). A Keras that lacks one raises an error that
names it and the installed Keras version: no missing internal falls back to
another behaviour.
"""

import contextlib
import inspect
import re
import threading
import types

import keras
import tensorflow as tf


def _message(internal, what):
    """The message of an error for a missing Keras internal."""
    detail = f" ({what})" if what else ""
    return (
        f"keras_accum needs the Keras internal `{internal}`{detail}, which "
        f"the installed Keras {keras.version()} does not have. See "
        "docs/compatibility.md for the Keras versions keras_accum supports, "
        "and docs/keras_internals.md for the internals it reads."
    )


def _missing(internal, what=""):
    """The `ImportError` of a Keras that lacks `internal` (at import)."""
    return ImportError(_message(internal, what))


def missing_internal(internal, what=""):
    """The `RuntimeError` of a Keras object that lacks `internal` (in use)."""
    return RuntimeError(_message(internal, what))


# 3.11: the oldest Keras the tests pass on (docs/compatibility.md).
if tuple(map(int, re.findall(r"\d+", keras.version())[:2])) < (3, 11):
    raise ImportError(  # pragma: no cover
        f"keras_accum needs Keras >= 3.11; Keras {keras.version()} is "
        "installed. Upgrade it with `pip install -U keras`."
    )

try:
    from keras.src import backend as backend_module
    from keras.src.backend.common import global_state
    from keras.src.backend.common import masking
    from keras.src.backend.common import variables as variables_module
    from keras.src.losses import loss as loss_module
    from keras.src.models import functional as functional_module
    from keras.src.models import model as model_module
    from keras.src.ops import symbolic_arguments
    from keras.src.random import seed_generator
    from keras.src.trainers import compile_utils
    from keras.src.trainers import epoch_iterator as epoch_iterator_module
except ImportError as error:  # pragma: no cover - depends on the version
    raise _missing(f"{error.name or error}", "a module") from error

# Module-level names read (looked up when used, in the module).
_MODULE_NAMES = (
    (backend_module, "compute_output_spec"),
    (global_state, "get_global_attribute set_global_attribute"),
    (masking, "get_keras_mask set_keras_mask"),
    (variables_module, "get_autocast_scope"),
    (
        loss_module,
        "Loss apply_mask reduce_weighted_values squeeze_or_expand_to_same_rank "
        "standardize_reduction unscale_loss_for_distribution",
    ),
    (functional_module, "Functional"),
    (model_module, "functional_init_arguments inject_functional_model_class"),
    (seed_generator, "global_seed_generator"),
    (compile_utils, "CompileLoss"),
    (epoch_iterator_module, "EpochIterator"),
    (symbolic_arguments, "SymbolicArguments"),
)

# Attributes of Keras' classes: (name, the class, its attributes read).
_CLASS_ATTRIBUTES = (
    (
        "Model", lambda: keras.Model,
        "_symbolic_build _maybe_symbolic_build _get_metrics_result_or_logs",
    ),
    ("Layer", lambda: keras.layers.Layer, "_flatten_layers _get_call_context"),
    ("BatchNormalization", lambda: keras.layers.BatchNormalization, "_moments"),
    (
        "LossScaleOptimizer",
        lambda: keras.optimizers.LossScaleOptimizer,
        "_stateful_handle_non_finite_grads",
    ),
    (
        "ProgbarLogger",
        lambda: keras.callbacks.ProgbarLogger,
        "_maybe_init_progbar _update_progbar _finalize_progbar",
    ),
    ("Functional", lambda: functional_module.Functional, "_run_through_graph"),
    ("CompileLoss", lambda: compile_utils.CompileLoss, "metrics Loss"),
    ("CompileLoss.Loss", lambda: compile_utils.CompileLoss.Loss,
     "loss loss_weights _replace"),
    ("EpochIterator", lambda: epoch_iterator_module.EpochIterator,
     "_get_iterator"),
    ("SymbolicArguments", lambda: symbolic_arguments.SymbolicArguments,
     "fill_in"),
    ("Variable", lambda: keras.Variable, "overwrite_with_gradient"),
)

# What Keras' own code must do with an internal for keras_accum to take
# effect: (internal, what, the function, names its code uses).
_USES = (
    (
        "Model._maybe_symbolic_build",
        "called by `fit()` with its epoch iterator",
        lambda: keras.Model.fit,
        "_maybe_symbolic_build",
    ),
    (
        "Model._get_metrics_result_or_logs",
        "what `fit()` logs at an epoch's end",
        lambda: keras.Model.fit,
        "_get_metrics_result_or_logs",
    ),
    (
        "Model._initial_epoch",
        "read by `fit()`, which a resume sets",
        lambda: keras.Model.fit,
        "_initial_epoch",
    ),
    (
        "BatchNormalization._moments",
        "called by `BatchNormalization.call()`",
        lambda: keras.layers.BatchNormalization.call,
        "_moments",
    ),
    (
        "Variable.assign",
        "how `BatchNormalization.call()` updates its moving statistics",
        lambda: keras.layers.BatchNormalization.call,
        "moving_mean moving_variance assign",
    ),
    (
        "StatelessScope.add_update",
        "how `Variable.assign()` writes in a stateless scope",
        lambda: keras.Variable.assign,
        "add_update",
    ),
    (
        "Functional._run_through_graph",
        "called by `Functional.call()`",
        lambda: functional_module.Functional.call,
        "_run_through_graph",
    ),
    (
        "CompileLoss._flat_losses",
        "the losses `CompileLoss.call()` computes",
        lambda: compile_utils.CompileLoss.call,
        "_flat_losses",
    ),
)

# Global state keys and a warning's text, each with the function whose code
# holds it: (internal, what, the function, the string).
_AUTOCAST_SCOPE = "autocast_scope"
_CALL_CONTEXT = "current_call_ctx"
# How Keras' warning that an optimizer's variables were not loaded begins.
SKIPPED_LOADING = "Skipping variable loading"
_STRINGS = (
    (
        f"global_state[{_AUTOCAST_SCOPE!r}]",
        "the global state key of the autocast scope",
        lambda: variables_module.get_autocast_scope,
        _AUTOCAST_SCOPE,
    ),
    (
        f"global_state[{_CALL_CONTEXT!r}]",
        "the global state key of a layer's call context",
        lambda: keras.layers.Layer._get_call_context,
        _CALL_CONTEXT,
    ),
    (
        f"the warning {SKIPPED_LOADING!r}",
        "how `Optimizer.load_own_variables()` says it loaded nothing",
        lambda: keras.optimizers.Optimizer.load_own_variables,
        SKIPPED_LOADING,
    ),
)


def _codes(function):
    """The code of `function` (unwrapped) and the code nested in it."""
    function = inspect.unwrap(function)
    pending, found = [function.__code__], []
    while pending:
        code = pending.pop()
        found.append(code)
        pending.extend(
            c for c in code.co_consts if isinstance(c, types.CodeType)
        )
    return found


def _uses(function, name):
    """Whether `function`'s code reads the global or attribute `name`."""
    return any(name in code.co_names for code in _codes(function))


def _holds(function, text):
    """Whether a string constant of `function`'s code is `text`, or a
    message that begins with it (a word follows)."""
    return any(
        isinstance(c, str) and (c == text or c.startswith(text + " "))
        for code in _codes(function)
        for c in code.co_consts
    )


def _global_seed_key():
    """The global state key of Keras' global `SeedGenerator`: the constant
    `GLOBAL_SEED_GENERATOR` (Keras 3.15), or the same string written out in
    `global_seed_generator()` (Keras 3.11)."""
    function = seed_generator.global_seed_generator
    if "GLOBAL_SEED_GENERATOR" in vars(seed_generator) and _uses(
        function, "GLOBAL_SEED_GENERATOR"
    ):
        return seed_generator.GLOBAL_SEED_GENERATOR
    if _holds(function, "global_seed_generator"):
        return "global_seed_generator"
    raise _missing(
        "seed_generator.GLOBAL_SEED_GENERATOR",
        "the global state key of the global `SeedGenerator`",
    )


def check_keras():
    """Checks the Keras internals that Keras' modules and classes hold.

    Run when keras_accum is imported.

    Returns:
        The global state key of Keras' global `SeedGenerator`.

    Raises:
        ImportError: naming the first internal that the installed Keras
            lacks, and its version.
    """
    for module, names in _MODULE_NAMES:
        for name in names.split():
            if name not in vars(module):
                raise _missing(f"{module.__name__}.{name}")
    for owner, resolve, names in _CLASS_ATTRIBUTES:
        try:
            cls = resolve()
        except AttributeError as error:
            raise _missing(owner) from error
        for name in names.split():
            if not hasattr(cls, name):
                raise _missing(f"{owner}.{name}")
    for internal, what, function, names in _USES:
        for name in names.split():
            if not _uses(function(), name):
                raise _missing(internal, what)
    for internal, what, function, text in _STRINGS:
        if not _holds(function(), text):
            raise _missing(internal, what)
    return _global_seed_key()


_GLOBAL_SEED_GENERATOR = check_keras()

Functional = functional_module.Functional
unpack_x_y_sample_weight = keras.utils.unpack_x_y_sample_weight
_ABSENT = object()


def attribute(obj, name, owner, what=""):
    """`obj.<name>`, a Keras internal of a Keras object (`owner` its class's
    name, `what` what it is).

    Raises:
        RuntimeError: if `obj` lacks it, naming it and the Keras version.
    """
    value = getattr(obj, name, _ABSENT)
    if value is _ABSENT:
        raise missing_internal(f"{owner}.{name}", what)
    return value


# The model's attributes read (each with what it is), checked at the start
# of each `fit()`, `evaluate()` and `predict()`.
_MODEL_ATTRIBUTES = {
    "_compile_loss": "the compiled loss, read to record its normalisers",
    "_compile_metrics": "the compiled metrics",
    "_loss_tracker": "the tracker of the logged loss",
    "_initial_epoch": "the epoch `fit()` starts at, set to resume",
    "_call_has_training_arg": "whether `call()` takes `training`",
    "_distribute_strategy": "the strategy the model was created in",
}
# The epoch iterator's, read to resume mid-epoch.
_EPOCH_ITERATOR_ATTRIBUTES = (
    "steps_per_epoch", "_num_batches", "_steps_seen", "data_adapter"
)


def check_model(model):
    """Checks the model's attributes that keras_accum reads (every `fit()`,
    `evaluate()` and `predict()` first)."""
    for name in _MODEL_ATTRIBUTES:
        model_attribute(model, name)


def model_attribute(model, name):
    """The model's internal attribute `name` (of `_MODEL_ATTRIBUTES`)."""
    return attribute(model, name, "Model", _MODEL_ATTRIBUTES[name])


def check_epoch_iterator(epoch_iterator):
    """Checks the attributes of `fit()`'s epoch iterator that a resume
    reads (`replay_epochs()`)."""
    for name in _EPOCH_ITERATOR_ATTRIBUTES:
        attribute(
            epoch_iterator, name, "EpochIterator",
            "read to resume mid-epoch",
        )
    attribute(
        epoch_iterator.data_adapter, "on_epoch_begin", "DataAdapter",
        "read to resume mid-epoch",
    )


def skipped_loading(message):
    """Whether a warning's `message` is Keras' that an optimizer's
    variables were not loaded (checked at import: `SKIPPED_LOADING`)."""
    return SKIPPED_LOADING in str(message)


def compute_output_spec(fn, *args, **kwargs):
    """Keras' `backend.compute_output_spec`: `fn`'s outputs, traced
    symbolically."""
    return backend_module.compute_output_spec(fn, *args, **kwargs)


def get_keras_mask(x):
    """The Keras mask of tensor `x`, or `None`."""
    return masking.get_keras_mask(x)


def set_keras_mask(x, mask):
    """Sets the Keras mask of tensor `x`."""
    return masking.set_keras_mask(x, mask)


def functional_init_arguments(args, kwargs):
    """Whether `keras.Model` arguments build a functional model."""
    return model_module.functional_init_arguments(args, kwargs)


def flat_losses(compile_loss):
    """The mutable list of a built `CompileLoss`'s loss entries."""
    flat = attribute(
        compile_loss, "_flat_losses", "CompileLoss",
        "the losses it computes, wrapped to record their normalisers",
    )
    if flat is None:
        raise missing_internal(
            "CompileLoss._flat_losses", "a list once the loss is built"
        )
    return flat


def with_loss(entry, loss):
    """A `CompileLoss` entry (`CompileLoss.Loss`) with another `loss`."""
    return entry._replace(loss=loss)


def all_built(model):
    """Whether every layer of `model` is built (Keras' own test before its
    symbolic build)."""
    return all(layer.built for layer in layers_of(model))


def layers_of(model):
    """Every layer of `model`, nested models included, `model` first."""
    return model._flatten_layers(include_self=True, recursive=True)


def reduction_axes(layer):
    """The axes a `BatchNormalization` layer's moments reduce over."""
    return attribute(
        layer, "_reduction_axes", "BatchNormalization",
        "the axes its moments reduce over, set by `build()`",
    )


def moments(layer):
    """A `BatchNormalization` layer's `_moments(inputs, mask)`."""
    return attribute(layer, "_moments", "BatchNormalization")


def global_seed_generator(create=False):
    """Keras' global `SeedGenerator` (`None` if none yet and not `create`)."""
    if create:
        return seed_generator.global_seed_generator()
    return global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)


def compile_metrics(model):
    """The model's `CompileMetrics`, or `None` if it has no compiled
    metrics."""
    return model_attribute(model, "_compile_metrics")


def metrics_built(model):
    """Whether the model's compiled metrics and loss are built (or none)."""
    return all(
        c is None or c.built
        for c in (compile_metrics(model), compile_loss(model))
    )


def build_metrics(model, data_batch):
    """Builds the compiled metrics and loss from a batch's shapes, as Keras'
    `fit()` does before a distributed first step."""
    if not metrics_built(model):
        model._symbolic_build(data_batch=data_batch)


def set_initial_epoch(model, epoch):
    """Has the model's next `fit()` start at `epoch` (`None`: as given)."""
    model_attribute(model, "_initial_epoch")
    model._initial_epoch = epoch


def loss_scale(optimizer):
    """A `LossScaleOptimizer`'s scale variable."""
    return attribute(optimizer, "dynamic_scale", "LossScaleOptimizer")


def shrink_loss_scale(optimizer):
    """Halves a `LossScaleOptimizer`'s scale, as Keras does on overflow."""
    optimizer._stateful_handle_non_finite_grads()
    return tf.constant(True)


def grow_loss_scale(optimizer):
    """Counts a finite update of a `LossScaleOptimizer`, as Keras does."""
    counter = attribute(optimizer, "step_counter", "LossScaleOptimizer")
    growth_steps = attribute(
        optimizer, "dynamic_growth_steps", "LossScaleOptimizer"
    )
    scale = loss_scale(optimizer)

    def upscale():
        counter.assign(0)
        scale.assign(scale * 2.0)
        return tf.constant(True)

    def increment():
        counter.assign_add(1)
        return tf.constant(False)

    tf.cond(tf.equal(counter, growth_steps - 1), upscale, increment)


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
        progbar = attribute(self, "progbar", "ProgbarLogger")
        stateful = attribute(progbar, "stateful_metrics", "Progbar")
        if stateful is not None:
            stateful.add("updates")

    def _update_progbar(self, batch, logs=None):
        super()._update_progbar(batch, _with_count(logs))

    def _finalize_progbar(self, logs):
        super()._finalize_progbar(_with_count(logs))


def in_multi_worker_mode(strategy):
    """Whether `strategy` is a `MultiWorkerMirroredStrategy` of several
    workers (TensorFlow's own test, an internal of TensorFlow)."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    check = getattr(strategy.extended, "_in_multi_worker_mode", _ABSENT)
    if check is _ABSENT:
        raise RuntimeError(
            "keras_accum needs the TensorFlow internal "
            "`MultiWorkerMirroredStrategy.extended._in_multi_worker_mode`, "
            f"which the installed TensorFlow {tf.__version__} does not have. "
            "See docs/compatibility.md for the versions keras_accum supports."
        )
    return check()


# Keras' `Model.__init__` calls `inject_functional_model_class` to give a
# subclass built from inputs and outputs `Functional` as a base, rewriting
# the class. While one of our classes is initialised (and only then: a
# counted scope, as models may be built in threads), the module's function
# is replaced by `_inject`, which gives that instance a derived class
# instead (docs/design.md, "Every model class").
_building = threading.local()  # per thread: (instance, functional_class)
_inject_lock = threading.Lock()
_injecting = {"users": 0, "keras": None}


def _inject(cls):
    """Keras' `inject_functional_model_class`, except for ours being built."""
    for instance, functional_class in reversed(getattr(_building, "stack", [])):
        if cls is type(instance) and not issubclass(cls, Functional):
            instance.__class__ = functional_class(cls)
            return instance.__class__
    return _injecting["keras"](cls)


def _scope_inject(users):
    """Adds `users` (1 or -1) to the scopes that replace the function:
    replaced by the first, put back by the last."""
    with _inject_lock:
        if users > 0 and not _injecting["users"]:
            _injecting["keras"] = model_module.inject_functional_model_class
            model_module.inject_functional_model_class = _inject
        _injecting["users"] += users
        if users < 0 and not _injecting["users"]:
            model_module.inject_functional_model_class = _injecting["keras"]
            _injecting["keras"] = None


@contextlib.contextmanager
def building_functionally(instance, functional_class):
    """While `instance` is initialised, its functional build gives it the
    class `functional_class(cls)` of its class `cls`; Keras' function is
    in place again after it."""
    stack = _building.__dict__.setdefault("stack", [])
    stack.append((instance, functional_class))
    _scope_inject(1)
    try:
        yield
    finally:
        _scope_inject(-1)
        stack.pop()


def call_model(model, x, training):
    """The model's forward pass, as Keras' train and test steps call it."""
    if model_attribute(model, "_call_has_training_arg"):
        return model(x, training=training)
    return model(x)


def symbolic(data):
    """`KerasTensor`s of the shapes and types of `data`'s tensors."""
    return keras.tree.map_structure(
        lambda t: None if t is None else keras.KerasTensor(t.shape, t.dtype),
        data,
    )


def compute_loss(model, x=None, y=None, y_pred=None, sample_weight=None,
                 training=True):
    """The model's `compute_loss()` (compiled losses and regularisers), as
    Keras' steps call it: without `training` where an override does not
    take it (`Model._compute_loss()`, the same test)."""
    if "training" in inspect.signature(model.compute_loss).parameters:
        return model.compute_loss(
            x, y, y_pred, sample_weight, training=training
        )
    return model.compute_loss(x, y, y_pred, sample_weight)


def compile_loss(model):
    """The model's `CompileLoss`, or `None` if it has no compiled loss."""
    return model_attribute(model, "_compile_loss")


def track_loss(model, loss, batch_size):
    """Adds a step's (distribution-scaled) loss to the logged `loss`."""
    tracker = model_attribute(model, "_loss_tracker")
    track_loss_term(tracker, loss, batch_size)


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
    had given (with `steps_per_epoch`, one goes on across epochs). Its
    attributes were checked when `fit()` started (`check_epoch_iterator`)."""
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

    # The keys keras_accum adds to a train step's logs.
    own_log_keys = ("updates", "remat")

    def _get_metrics_result_or_logs(self, logs):
        # Keras logs the metrics' results where a step's logs have the same
        # keys, else the last step's logs: with the keys keras_accum adds,
        # the latter, which under a strategy average the replicas' results
        # instead of reading each metric across them (as `keras.Model`).
        if not isinstance(logs, dict):
            return super()._get_metrics_result_or_logs(logs)
        own = {k: v for k, v in logs.items() if k in self.own_log_keys}
        rest = {k: v for k, v in logs.items() if k not in own}
        result = super()._get_metrics_result_or_logs(rest)
        return dict(result, **own) if isinstance(result, dict) else result

    def build_before_tracing(self):
        """Whether `fit()` and `evaluate()` build the model (and its
        optimizer) from the first batch's shapes before the first step is
        traced, as Keras does under a strategy."""
        return False

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # `fit()`, `evaluate()` and `predict()` call it first (`fit()` with
        # its epoch iterator): the internals read are checked here.
        check_model(self)
        if iterator is not None and "input_position" in vars(self):
            check_epoch_iterator(iterator)
            self.input_position.capture(iterator)
        # Without a strategy Keras builds the model in its first traced
        # step; what `build_before_tracing()` says needs it built before.
        first = self._distribute_strategy is None and self.build_before_tracing()
        if first and iterator is None:
            with self.distribute_strategy.scope():
                return self._symbolic_build(data_batch=data_batch)
        # Keras averages a distributed batch over the replicas only to
        # learn its shapes, which fails under `MultiWorkerMirroredStrategy`.
        if not first and (self._distribute_strategy is None or iterator is None):
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
    """`_moments` and the moving statistics' `assign` of one layer, patched
    (on the instances, while a forward pass of training runs)."""

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


def moving_statistics_not_assigned(layer):
    """The error of a recorded `BatchNormalization` call whose moving
    statistics were not updated with `Variable.assign` (which keras_accum
    suppresses, to update them once per window)."""
    return missing_internal(
        "Variable.assign",
        "how `BatchNormalization.call()` updates its moving statistics; "
        f"layer {layer.name!r} did not call it",
    )


# Recomputation (keras_accum/remat.py): what a layer's `__call__` sets up
# around `call()`, the graph of a functional model, and seed generators.


def call_state():
    """The autocast scope and call context a layer's `call()` runs in."""
    return (
        global_state.get_global_attribute(_AUTOCAST_SCOPE),
        global_state.get_global_attribute(_CALL_CONTEXT),
    )


@contextlib.contextmanager
def entered_call_state(state):
    """Runs a block in the `call_state()` captured when it first ran."""
    autocast, call_context = state
    previous = call_state()
    global_state.set_global_attribute(_AUTOCAST_SCOPE, autocast)
    global_state.set_global_attribute(_CALL_CONTEXT, call_context)
    try:
        yield
    finally:
        global_state.set_global_attribute(_AUTOCAST_SCOPE, previous[0])
        global_state.set_global_attribute(_CALL_CONTEXT, previous[1])


def stored_value(variable):
    """`variable.value` outside any autocast scope: the backend's variable
    in its own dtype, not a cast of it."""
    previous = global_state.get_global_attribute(_AUTOCAST_SCOPE)
    global_state.set_global_attribute(_AUTOCAST_SCOPE, None)
    try:
        return variable.value
    finally:
        global_state.set_global_attribute(_AUTOCAST_SCOPE, previous)


def direct_layers(layer):
    """The layers `layer` holds itself (not those they hold)."""
    return layer._flatten_layers(include_self=False, recursive=False)


def seed_generators(layer):
    """The `SeedGenerator`s of `layer` and of the layers it holds."""
    found = []
    for sublayer in layers_of(layer):
        found.extend(
            attribute(
                sublayer, "_seed_generators", "Layer",
                "the layer's seed generators",
            )
        )
    return found


def graph_of(model):
    """The `Functional` whose graph `model` runs (a `Sequential`'s own), or
    `None` for a subclassed model."""
    if isinstance(model, Functional):
        return model
    if isinstance(model, keras.Sequential):
        model.build() if not model.built else None
        return attribute(
            model, "_functional", "Sequential", "the graph it runs"
        )
    return None


def graph_nodes(functional):
    """The nodes of `functional`'s graph in the order Keras runs them."""
    by_depth = attribute(
        functional, "_nodes_by_depth", "Functional", "the nodes of its graph"
    )
    nodes = []
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            operation = attribute(node, "operation", "Node")
            attribute(node, "arguments", "Node")
            attribute(node, "outputs", "Node")
            is_input = attribute(node, "is_input", "Node")
            if operation is not None and not is_input:
                nodes.append(node)
    return nodes


# The method of a `Functional` that runs its graph (checked at import).
RUN_THROUGH_GRAPH = "_run_through_graph"


def run_through_graph(functional):
    """`functional`'s own run of its graph, `_run_through_graph`."""
    return getattr(functional, RUN_THROUGH_GRAPH)


def fill_in(node, tensors):
    """A node's call arguments, its input tensors taken from `tensors` (by
    the id of the symbolic tensor)."""
    return node.arguments.fill_in(tensors)


def outputs_structure(functional):
    """The structure `functional`'s outputs are returned in."""
    return attribute(
        functional, "_outputs_struct", "Functional",
        "the structure of its outputs",
    )
