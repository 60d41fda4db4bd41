"""The classes of converted and functionally built models; no existing
class is rewritten (docs/design.md, "Every model class")."""

import importlib
import threading

import keras

from keras_accum import _keras_compat as compat

_CLASSES = {}  # bases -> the class derived from them
_CLASSES_LOCK = threading.Lock()  # models may be built in threads


def _derive(cls, bases, saved_as, **attrs):
    """`bases`' subclass named as `cls` (made once), saved as `saved_as`."""
    with _CLASSES_LOCK:
        if bases not in _CLASSES:
            attrs.update(__module__=cls.__module__, __doc__=cls.__doc__)
            derived = type(cls.__name__, bases, attrs)
            name = keras.saving.get_registered_name(saved_as)
            if name != derived.__name__:
                package, _, short = name.rpartition(">")
                register = keras.saving.register_keras_serializable(
                    package, short
                )
                register(derived)
                register(saved_as)
            _CLASSES[bases] = derived
        return _CLASSES[bases]


def functional_class(cls, accumulating, functional):
    """`cls` built functionally (`functional` for `accumulating`)."""
    if cls is accumulating:
        return functional
    return _derive(cls, (cls, compat.Functional), cls)


def accumulating_class(cls, accumulating, functional):
    """The class `from_model()` gives an instance of `cls`."""
    if cls is compat.Functional:
        return functional
    return _derive(cls, (accumulating, cls), accumulating, _converted_from=cls)


def class_from_config(spec, custom_objects=None):
    """The model class that `get_config()` named in `converted_from`."""
    cls = keras.saving.get_registered_object(
        spec["registered_name"], custom_objects
    )
    if cls is None and spec["module"].split(".")[0] in ("keras", "keras_hub"):
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
