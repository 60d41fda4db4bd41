"""The classes of converted and functionally built models; no existing
class is rewritten (docs/design.md, "Every model class")."""

import importlib

import keras

from keras_accum import _keras_compat as compat


_CLASSES = {}


def functional_class(cls):
    """`cls` built functionally: a subclass of `cls` and `Functional`."""
    from keras_accum.model import FunctionalGradientAccumulationModel
    from keras_accum.model import GradientAccumulationModel

    if cls is GradientAccumulationModel:
        return FunctionalGradientAccumulationModel
    if ("functional", cls) not in _CLASSES:
        twin = type(
            cls.__name__,
            (cls, compat.Functional),
            {"__module__": cls.__module__, "__doc__": cls.__doc__},
        )
        # Saved under the name of `cls`, whose `from_config` rebuilds it.
        compat.serialize_as(twin, keras.saving.get_registered_name(cls))
        _CLASSES["functional", cls] = twin
    return _CLASSES["functional", cls]


def accumulating_class(cls):
    """The class `from_model()` gives an instance of `cls`."""
    from keras_accum.model import FunctionalGradientAccumulationModel
    from keras_accum.model import GradientAccumulationModel

    if cls is compat.Functional:
        return FunctionalGradientAccumulationModel
    if ("accumulating", cls) not in _CLASSES:
        converted = type(
            cls.__name__,
            (GradientAccumulationModel, cls),
            {
                "__module__": cls.__module__,
                "__doc__": cls.__doc__,
                "_converted_from": cls,
            },
        )
        # Saved as a `GradientAccumulationModel` whose config names `cls`.
        compat.serialize_as(
            converted, keras.saving.get_registered_name(GradientAccumulationModel)
        )
        _CLASSES["accumulating", cls] = converted
    return _CLASSES["accumulating", cls]


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
