"""The one seam to Keras' private API.

Every `keras.src` import of the package is here, with the private attributes
that the exact paths need. They are checked when keras_accum is imported: a
Keras without them fails then, with an error that names its version, rather
than training inexactly later.
"""

import contextlib
import re

import keras
import tensorflow as tf

_NEEDS = "keras_accum needs a Keras 3 with the TensorFlow backend whose"


def _missing(what):
    return ImportError(
        f"{_NEEDS} {what}; Keras {keras.__version__} has not. See the README's "
        "'Compatibility' section for the tested versions."
    )


# The oldest Keras the tests pass on (see the README's "Tested versions").
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
    from keras.src.saving import object_registration
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
    (object_registration, ("GLOBAL_CUSTOM_NAMES",)),
    (keras.layers.BatchNormalization, ("_moments",)),
    (keras.layers.Layer, ("_flatten_layers",)),
):
    for _name in _names:
        if not hasattr(_module, _name):  # pragma: no cover
            raise _missing(f"`{getattr(_module, '__name__', _module)}.{_name}`")

unscale_loss_for_distribution = loss_module.unscale_loss_for_distribution


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


def serialize_as(cls, registered_name):
    """Has Keras save instances of `cls` under `registered_name`."""
    object_registration.GLOBAL_CUSTOM_NAMES[cls] = registered_name


@contextlib.contextmanager
def functional_class_for(instance, functional_class):
    """`instance` built functionally takes `functional_class(cls)`: Keras
    rewrites no class (docs/design.md, "Every model class")."""
    original = model_module.inject_functional_model_class

    def inject(cls):
        if cls is type(instance) and not issubclass(cls, Functional):
            instance.__class__ = functional_class(cls)
            return instance.__class__
        return original(cls)

    model_module.inject_functional_model_class = inject
    try:
        yield
    finally:
        model_module.inject_functional_model_class = original


def call_for_training(model, x):
    """The model's training forward pass, as Keras' `train_step` calls it."""
    if model._call_has_training_arg:
        return model(x, training=True)
    return model(x)


def compute_loss(model, *args, **kwargs):
    """Keras' `Model._compute_loss` (compiled losses and regularisers)."""
    return model._compute_loss(*args, **kwargs)


def compile_loss(model):
    """The model's `CompileLoss`, or `None` if it has no compiled loss."""
    return getattr(model, "_compile_loss", None)


def track_loss(model, loss, batch_size):
    """Adds a step's (distribution-scaled) loss to the logged `loss`."""
    model._loss_tracker.update_state(
        unscale_loss_for_distribution(loss), sample_weight=batch_size
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
