"""The classes of converted and functionally built models; no existing
class is rewritten (docs/design.md, "Every model class")."""

import importlib

import keras

from keras_accum import _keras_compat as compat


_CLASSES = {}


def functional_class(cls, accumulating, functional):
    """`cls` built functionally: a subclass of `cls` and `Functional`
    (`functional` for `accumulating`, the `GradientAccumulationModel`)."""
    if cls is accumulating:
        return functional
    if ("functional", cls) not in _CLASSES:
        twin = type(
            cls.__name__,
            (cls, compat.Functional),
            {"__module__": cls.__module__, "__doc__": cls.__doc__},
        )
        # Saved under the name of `cls`, whose `from_config` rebuilds it.
        _save_as(twin, cls)
        _CLASSES["functional", cls] = twin
    return _CLASSES["functional", cls]


def accumulating_class(cls, accumulating, functional):
    """The class `from_model()` gives an instance of `cls`: a subclass of
    `accumulating` (`GradientAccumulationModel`) and `cls`."""
    if cls is compat.Functional:
        return functional
    if ("accumulating", cls) not in _CLASSES:
        converted = type(
            cls.__name__,
            (accumulating, cls),
            {
                "__module__": cls.__module__,
                "__doc__": cls.__doc__,
                "_converted_from": cls,
            },
        )
        # Saved as a `GradientAccumulationModel` whose config names `cls`.
        _save_as(converted, accumulating)
        _CLASSES["accumulating", cls] = converted
    return _CLASSES["accumulating", cls]


def _save_as(cls, target):
    """Has Keras save instances of `cls` under the name of `target`."""
    name = keras.saving.get_registered_name(target)
    if name == cls.__name__:
        return
    package, _, class_name = name.rpartition(">")
    register = keras.saving.register_keras_serializable(package, class_name)
    register(cls)
    register(target)


def class_from_config(spec, custom_objects=None):
    """The model class that `get_config()` named in `converted_from`."""
    cls = keras.saving.get_registered_object(
        spec["registered_name"], custom_objects
    )
    package = spec["module"].split(".")[0]
    if cls is None and package in ("keras", "keras_hub"):
        module = importlib.import_module(spec["module"])
        cls = getattr(module, spec["class_name"], None)
    if not (isinstance(cls, type) and issubclass(cls, keras.Model)):
        raise ValueError(
            "Cannot find the model class "
            f"`{spec['module']}.{spec['class_name']}` of a model made "
            "accumulating with `from_model()`. Register it with "
            "`keras.saving.register_keras_serializable()` or pass it in "
            "`custom_objects`."
        )
    return cls


def class_spec(cls):
    """What `class_from_config` needs to find `cls` again."""
    return {
        "module": cls.__module__,
        "class_name": cls.__name__,
        "registered_name": keras.saving.get_registered_name(cls),
    }
