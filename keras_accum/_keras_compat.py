"""The one seam to Keras' private API.

Every `keras.src` import of the package is here, with the private attributes
that the exact paths need. They are checked when keras_accum is imported: a
Keras without them fails then, with an error that names its version, rather
than training inexactly later.
"""

import contextlib
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


# The oldest Keras the tests pass on (docs/compatibility.md).
MIN_KERAS = (3, 11)


def _version(text):
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


if _version(keras.__version__) < MIN_KERAS:  # pragma: no cover
    raise ImportError(
        "keras_accum needs Keras >= "
        f"{'.'.join(map(str, MIN_KERAS))}; Keras {keras.__version__} is "
        "installed. Upgrade it with `pip install -U keras`."
    )

try:
    from keras.src.backend import compute_output_spec  # noqa: F401
    from keras.src.backend import get_keras_mask  # noqa: F401
    from keras.src.backend import name_scope  # noqa: F401
    from keras.src.losses import loss as loss_module
    from keras.src.models.functional import Functional  # noqa: F401
    from keras.src.models import model as model_module
    from keras.src.models.model import functional_init_arguments  # noqa: F401
    from keras.src.random import seed_generator as _seed_generator  # noqa: F401
    from keras.src.trainers.compile_utils import CompileLoss
    from keras.src.trainers.data_adapters.data_adapter_utils import (  # noqa: F401
        unpack_x_y_sample_weight,
    )
except ImportError as error:  # pragma: no cover - depends on the version
    raise _missing(f"modules import ({error})") from error

for _module, _names in (
    (
        loss_module,
        (
            "Loss",
            "apply_mask",
            "reduce_weighted_values",
            "squeeze_or_expand_to_same_rank",
            "standardize_reduction",
            "unscale_loss_for_distribution",
        ),
    ),
    (keras.Model, ("_compute_loss", "_symbolic_build", "_maybe_symbolic_build")),
    (model_module, ("inject_functional_model_class",)),
    (keras.layers.BatchNormalization, ("_moments",)),
    (
        keras.optimizers.LossScaleOptimizer,
        ("_stateful_handle_non_finite_grads",),
    ),
    (
        keras.callbacks.ProgbarLogger,
        ("_maybe_init_progbar", "_update_progbar", "_finalize_progbar"),
    ),
    (keras.layers.Layer, ("_flatten_layers",)),
    (CompileLoss, ("metrics",)),
    (CompileLoss.Loss, ("loss_weights",)),
):
    for _name in _names:
        if not hasattr(_module, _name):  # pragma: no cover
            raise _missing(f"`{getattr(_module, '__name__', _module)}.{_name}`")

def flat_losses(compile_loss):
    """The mutable list of a built `CompileLoss`'s loss entries."""
    flat = getattr(compile_loss, "_flat_losses", None)
    if flat is None:
        raise _missing("`CompileLoss` keeps its losses in `_flat_losses`")
    return flat


def layers_of(model):
    """Every layer of `model`, nested models included, `model` first."""
    return model._flatten_layers(include_self=True, recursive=True)


def reduction_axes(layer):
    """The axes a `BatchNormalization` layer's moments reduce over."""
    return layer._reduction_axes


def global_seed_generator(create=False):
    """Keras' global `SeedGenerator` (of `keras.random` calls without a
    seed), or `None` if none was made yet and `create` is `False`."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    if create:
        return seed_generator.global_seed_generator()
    return global_state.get_global_attribute(
        seed_generator.GLOBAL_SEED_GENERATOR
    )


def set_initial_epoch(model, epoch):
    """The epoch `fit()` starts from (as Keras' `BackupAndRestore` sets)."""
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
    """A count that Keras' progress bar, which divides every value by 1 and
    formats it as a float, prints as an integer."""

    def __truediv__(self, other):
        return _Count(float(self) / other)

    def __format__(self, spec):
        return str(self)

    def __str__(self):
        return str(int(self))

    __repr__ = __str__


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


def _with_count(logs):
    if not logs or "updates" not in logs:
        return logs
    return dict(logs, updates=_Count(logs["updates"]))


def in_multi_worker_mode(strategy):
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


def first_replica_batch(strategy, epoch_iterator):
    """The first batch of a Keras epoch iterator, as one replica sees it."""
    for _, _, iterator in epoch_iterator:
        batch = next(iterator)
        break
    return keras.tree.map_structure(
        lambda v: strategy.experimental_local_results(v)[0]
        if isinstance(v, tf.distribute.DistributedValues)
        else v,
        batch,
    )


# Instances whose `__init__` is running, per thread, with the class each
# takes when a parent builds it functionally (`building_functionally`).
_building = threading.local()
_inject_functional_model_class = model_module.inject_functional_model_class


def _inject(cls):
    """Keras' `inject_functional_model_class`, except for ours being built."""
    for instance, functional_class in reversed(getattr(_building, "stack", [])):
        if cls is type(instance) and not issubclass(cls, Functional):
            instance.__class__ = functional_class(cls)
            return instance.__class__
    return _inject_functional_model_class(cls)


# Installed once, at import: it changes nothing for other models.
model_module.inject_functional_model_class = _inject


@contextlib.contextmanager
def building_functionally(instance, functional_class):
    """While `instance` is initialised, a functional build gives it
    `functional_class(cls)` (docs/design.md, "Every model class")."""
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
    model._loss_tracker.update_state(
        loss_module.unscale_loss_for_distribution(loss),
        sample_weight=batch_size,
    )


def loss_trackers(model):
    """The trackers of each compiled loss term's value (`<output>_loss`, for
    a model with several outputs): `[]` if none, or not built yet."""
    compiled = compile_loss(model)
    return list(compiled.metrics) if compiled is not None else []


def loss_weights(model):
    """The loss weight of each compiled loss term (1 where none is given);
    `[]` without a built compiled loss."""
    compiled = compile_loss(model)
    if compiled is None or not compiled.built:
        return []
    return [
        1.0 if entry.loss_weights is None else float(entry.loss_weights)
        for entry in flat_losses(compiled)
    ]


def track_loss_term(tracker, value, rows):
    """Adds a term's (distribution-scaled) value to its tracker, weighted by
    `rows` (Keras' `CompileLoss` weights by the static row count, `None`
    where it is unknown)."""
    tracker.update_state(
        loss_module.unscale_loss_for_distribution(value), sample_weight=rows
    )


class TrainerHooks:
    """Overrides of private `keras.Model` methods; mixed in before it."""

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras averages a distributed batch over the replicas only to
        # learn its shapes, which fails under `MultiWorkerMirroredStrategy`.
        if self._distribute_strategy is None or iterator is None:
            return super()._maybe_symbolic_build(iterator, data_batch)
        with self.distribute_strategy.scope():
            self._symbolic_build(
                data_batch=first_replica_batch(
                    self.distribute_strategy, iterator
                )
            )


def moments(layer):
    """A `BatchNormalization` layer's `_moments(inputs, mask)`."""
    return layer._moments


_MISSING = object()


class MomentsPatch:
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
