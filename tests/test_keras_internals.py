"""A new Keras that renames an internal keras_accum reads fails loudly.

Each test renames one Keras internal as a new release would: everywhere in
Keras' loaded code (`keras.src`), so that Keras itself keeps working under
the new name where it can (`rename_in_keras`). keras_accum must then raise
an error that names the internal and the Keras version, where the internal
is first read: at import (`check_keras()`, which importing keras_accum
runs), or at the start of `fit()`, or in the traced step. The list of
internals, and where each is checked, is docs/keras_internals.md.
"""

import collections
import importlib.util
import inspect
import re
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_accum
from keras_accum import _keras_compat as compat

_IMPORT_ERROR = ImportError
_RUN_ERROR = RuntimeError


def _functions():
    """Every function of Keras' loaded modules and classes (methods,
    properties, and the functions decorators wrap), each once."""
    found, seen = [], set()

    def visit(value):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for part in (value.fget, value.fset, value.fdel):
                visit(part)
            return
        if not isinstance(value, types.FunctionType) or id(value) in seen:
            return
        seen.add(id(value))
        found.append(value)
        visit(getattr(value, "__wrapped__", None))
        for cell in value.__closure__ or ():
            try:
                visit(cell.cell_contents)
            except ValueError:  # an empty cell
                pass

    for module in _keras_modules():
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                for member in list(vars(value).values()):
                    visit(member)
            elif getattr(value, "__module__", None) == module.__name__:
                visit(value)
    return found


def _keras_modules():
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None
        and (name == "keras.src" or name.startswith("keras.src."))
    ]


def _keras_classes():
    return [
        value
        for module in _keras_modules()
        for value in list(vars(module).values())
        if isinstance(value, type) and value.__module__ == module.__name__
    ]


_FUNCTIONS = []  # [the number of Keras' modules, their functions]


def _renamed_code(code, names, constant):
    consts = tuple(
        _renamed_code(c, names, constant)
        if isinstance(c, types.CodeType)
        else constant(c) if isinstance(c, str) else c
        for c in code.co_consts
    )
    co_names = tuple(names.get(n, n) for n in code.co_names)
    if consts == code.co_consts and co_names == code.co_names:
        return code
    return code.replace(co_consts=consts, co_names=co_names)


def rename_in_keras(monkeypatch, old, new, strings=False, where=None,
                    names=True):
    """Renames `old` to `new` in Keras, as a release that renamed it would:
    in the names Keras' code reads (globals and attributes), the attributes
    of its modules and classes and, with `strings`, its string constants
    equal to `old` (only those if not `names`). `where`: the modules (name
    prefixes) it is renamed in; all of Keras' if `None`."""
    if len(_FUNCTIONS) != 2 or _FUNCTIONS[0] != len(_keras_modules()):
        # Once, and again if Keras has loaded modules since.
        _FUNCTIONS[:] = [len(_keras_modules()), _functions()]

    def inside(module_name):
        return where is None or module_name.startswith(tuple(where))

    renamed = {old: new} if names else {}

    def constant(value):
        return new if strings and value == old else value

    for function in _FUNCTIONS[1]:
        if not inside(function.__module__ or ""):
            continue
        code = _renamed_code(function.__code__, renamed, constant)
        if code is not function.__code__:
            monkeypatch.setattr(function, "__code__", code)
    owners = [m for m in _keras_modules() if inside(m.__name__)]
    owners += [c for c in _keras_classes() if inside(c.__module__)]
    for owner in owners if names else ():
        if old in vars(owner):
            value = vars(owner)[old]
            monkeypatch.delattr(owner, old)
            monkeypatch.setattr(owner, new, value, raising=False)


def _named(internal):
    """The message of an error that names `internal` and the version."""
    return (
        r"`([\w.]+\.)?" + re.escape(f"{internal}`") + ".*"
        + re.escape(keras.version())
    )


# Internals that Keras' modules and classes hold: checked at import.
_AT_IMPORT = [
    # (name to rename, where, the internal the error names)
    ("compute_output_spec", None, "keras.src.backend.compute_output_spec"),
    ("get_global_attribute", None, "get_global_attribute"),
    ("set_global_attribute", None, "set_global_attribute"),
    ("get_keras_mask", None, "get_keras_mask"),
    ("set_keras_mask", None, "set_keras_mask"),
    ("get_autocast_scope", None, "get_autocast_scope"),
    ("apply_mask", None, "keras.src.losses.loss.apply_mask"),
    ("reduce_weighted_values", None, "reduce_weighted_values"),
    ("squeeze_or_expand_to_same_rank", None, "squeeze_or_expand_to_same_rank"),
    ("standardize_reduction", None, "standardize_reduction"),
    ("unscale_loss_for_distribution", None, "unscale_loss_for_distribution"),
    ("Functional", ["keras.src.models"], "functional.Functional"),
    ("functional_init_arguments", None, "functional_init_arguments"),
    ("inject_functional_model_class", None, "inject_functional_model_class"),
    ("global_seed_generator", None, "global_seed_generator"),
    ("CompileLoss", None, "keras.src.trainers.compile_utils.CompileLoss"),
    ("EpochIterator", None, "EpochIterator"),
    ("SymbolicArguments", None, "SymbolicArguments"),
    ("_symbolic_build", None, "Model._symbolic_build"),
    ("_maybe_symbolic_build", None, "Model._maybe_symbolic_build"),
    (
        "_get_metrics_result_or_logs",
        None,
        "Model._get_metrics_result_or_logs",
    ),
    ("_flatten_layers", None, "Layer._flatten_layers"),
    ("_get_call_context", None, "Layer._get_call_context"),
    ("_moments", None, "BatchNormalization._moments"),
    (
        "_stateful_handle_non_finite_grads",
        None,
        "LossScaleOptimizer._stateful_handle_non_finite_grads",
    ),
    ("_maybe_init_progbar", None, "ProgbarLogger._maybe_init_progbar"),
    ("_update_progbar", None, "ProgbarLogger._update_progbar"),
    ("_finalize_progbar", None, "ProgbarLogger._finalize_progbar"),
    ("_run_through_graph", None, "Functional._run_through_graph"),
    ("_get_iterator", None, "EpochIterator._get_iterator"),
    ("fill_in", ["keras.src.ops", "keras.src.models"], "fill_in"),
    ("overwrite_with_gradient", None, "Variable.overwrite_with_gradient"),
    # Read by Keras' code, not held by a class: its uses are checked.
    ("_initial_epoch", None, "Model._initial_epoch"),
    ("_flat_losses", None, "CompileLoss._flat_losses"),
]
if hasattr(sys.modules["keras.src.random.seed_generator"],
           "GLOBAL_SEED_GENERATOR"):  # from Keras 3.15: the key's constant
    _AT_IMPORT.append(
        ("GLOBAL_SEED_GENERATOR", None, "seed_generator.GLOBAL_SEED_GENERATOR")
    )


@pytest.mark.parametrize(
    "old, where, internal", _AT_IMPORT, ids=[case[0] for case in _AT_IMPORT]
)
def test_renamed_at_import(monkeypatch, old, where, internal):
    rename_in_keras(monkeypatch, old, old + "_renamed", where=where)
    with pytest.raises(_IMPORT_ERROR, match=_named(internal)):
        compat.check_keras()


@pytest.mark.parametrize(
    "owner, method, name, internal",
    [
        ("Model", "fit", "_maybe_symbolic_build", None),
        ("Model", "fit", "_initial_epoch", None),
        ("Model", "fit", "_get_metrics_result_or_logs", None),
        ("BatchNormalization", "call", "_moments", None),
        ("Functional", "call", "_run_through_graph", None),
        ("CompileLoss", "call", "_flat_losses", None),
        # A variable's write in a stateless scope, which recomputation's
        # scopes hold back and replay.
        ("Variable", "assign", "add_update", "StatelessScope.add_update"),
    ],
)
def test_keras_stops_using_internal(monkeypatch, owner, method, name,
                                    internal):
    """Keras' own code reads the internal under another name, the old one
    kept: what keras_accum sets or overrides would be ignored."""
    from keras.src.trainers import compile_utils

    cls = {
        "Model": keras.Model,
        "BatchNormalization": keras.layers.BatchNormalization,
        "Functional": compat.Functional,
        "CompileLoss": compile_utils.CompileLoss,
        "Variable": keras.Variable,
    }[owner]
    function = inspect.unwrap(getattr(cls, method))
    code = _renamed_code(
        function.__code__, {name: name + "_renamed"}, lambda c: c
    )
    monkeypatch.setattr(function, "__code__", code)
    with pytest.raises(
        _IMPORT_ERROR, match=_named(internal or f"{owner}.{name}")
    ):
        compat.check_keras()


@pytest.mark.parametrize("key", ["autocast_scope", "current_call_ctx"])
def test_renamed_global_state_key(monkeypatch, key):
    """The string constant, renamed in Keras' code."""
    rename_in_keras(
        monkeypatch, key, key + "_renamed", strings=True, names=False
    )
    with pytest.raises(_IMPORT_ERROR, match=re.escape(f"[{key!r}]")):
        compat.check_keras()


def test_renamed_global_seed_generator_key(monkeypatch):
    """The global seed generator's key: from Keras 3.15 the module's
    constant `GLOBAL_SEED_GENERATOR`, whose value keras_accum reads (a new
    value is no failure; a new name is, test_renamed_at_import); before,
    a string written out in `global_seed_generator()`."""
    from keras.src.random import seed_generator

    key = "global_seed_generator"
    rename_in_keras(
        monkeypatch, key, key + "_renamed", strings=True, names=False
    )
    if "GLOBAL_SEED_GENERATOR" in vars(seed_generator):
        monkeypatch.setattr(
            seed_generator, "GLOBAL_SEED_GENERATOR", key + "_renamed"
        )
        assert compat.check_keras() == key + "_renamed"
    else:
        with pytest.raises(
            _IMPORT_ERROR, match=_named("seed_generator.GLOBAL_SEED_GENERATOR")
        ):
            compat.check_keras()


def test_reworded_skipped_loading_warning(monkeypatch):
    function = keras.optimizers.Optimizer.load_own_variables
    code = _renamed_code(
        function.__code__, {},
        lambda c: c.replace(compat.SKIPPED_LOADING, "Not loading variables"),
    )
    monkeypatch.setattr(function, "__code__", code)
    with pytest.raises(_IMPORT_ERROR, match=compat.SKIPPED_LOADING):
        compat.check_keras()


def test_renamed_compile_loss_field(monkeypatch):
    from keras.src.trainers import compile_utils

    renamed = collections.namedtuple(
        "Loss", ["path", "loss", "loss_weight", "name"]
    )
    monkeypatch.setattr(compile_utils.CompileLoss, "Loss", renamed)
    with pytest.raises(
        _IMPORT_ERROR, match=_named("CompileLoss.Loss.loss_weights")
    ):
        compat.check_keras()


@pytest.mark.parametrize(
    "module, owner, name, internal",
    [
        ("keras.src.trainers.compile_utils", "CompileLoss", "metrics",
         "CompileLoss.metrics"),
        ("keras.src.trainers.compile_utils", "CompileLoss", "Loss",
         "CompileLoss.Loss"),
        ("keras.src.losses.loss", None, "Loss", "keras.src.losses.loss.Loss"),
    ],
)
def test_removed(monkeypatch, module, owner, name, internal):
    """Names too common to rename in all of Keras: removed where held."""
    holder = sys.modules[module]
    if owner is not None:
        holder = getattr(holder, owner)
    monkeypatch.delattr(holder, name)
    with pytest.raises(_IMPORT_ERROR, match=_named(internal)):
        compat.check_keras()


def test_batch_norm_updates_otherwise(monkeypatch):
    """`BatchNormalization.call()` updates its moving statistics with a
    renamed `Variable.assign`: at import, and in the traced step."""
    bn_call = keras.layers.BatchNormalization.call
    monkeypatch.setattr(
        keras.Variable, "assign_renamed", keras.Variable.assign, raising=False
    )
    code = _renamed_code(
        bn_call.__code__, {"assign": "assign_renamed"}, lambda c: c
    )
    monkeypatch.setattr(bn_call, "__code__", code)
    with pytest.raises(_IMPORT_ERROR, match=_named("Variable.assign")):
        compat.check_keras()
    model = _model(keras.layers.BatchNormalization())
    with pytest.raises(_RUN_ERROR, match=_named("Variable.assign")):
        _fit(model)


def test_import_runs_the_checks(monkeypatch):
    """Importing keras_accum (its seam module) with a Keras that lacks an
    internal fails, naming it."""
    from keras.src.backend.common import masking

    monkeypatch.delattr(masking, "get_keras_mask")
    spec = importlib.util.spec_from_file_location(
        "keras_accum._keras_compat_again", compat.__file__
    )
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(_IMPORT_ERROR, match=_named(
        "keras.src.backend.common.masking.get_keras_mask"
    )):
        spec.loader.exec_module(module)


def test_check_keras_passes():
    assert compat.check_keras() == compat._GLOBAL_SEED_GENERATOR


# Instance attributes: checked where first read.


def _model(*layers, steps=2, **kwargs):
    inputs = keras.Input((3,))
    x = inputs
    for layer in layers + (keras.layers.Dense(1),):
        x = layer(x)
    return keras_accum.GradientAccumulationModel(
        inputs, x, gradient_accumulation_steps=steps, **kwargs
    )


def _fit(model, **kwargs):
    if not model.compiled:
        model.compile(optimizer="sgd", loss="mse", run_eagerly=False,
                      jit_compile=False)
    x = np.ones((8, 3), "float32")
    y = np.zeros((8, 1), "float32")
    kwargs.setdefault("verbose", 0)
    return model.fit(x, y, batch_size=4, epochs=1, **kwargs)


@pytest.mark.parametrize(
    "old",
    [
        "_compile_loss",
        "_compile_metrics",
        "_loss_tracker",
        "_initial_epoch",
        "_call_has_training_arg",
        "_distribute_strategy",
    ],
)
def test_renamed_model_attribute_at_fit(monkeypatch, old):
    rename_in_keras(monkeypatch, old, old + "_renamed")
    model = _model()
    with pytest.raises(_RUN_ERROR, match=_named(f"Model.{old}")):
        _fit(model)


@pytest.mark.parametrize(
    "old", ["steps_per_epoch", "_num_batches", "_steps_seen", "data_adapter"]
)
def test_renamed_epoch_iterator_attribute_at_fit(monkeypatch, old):
    rename_in_keras(
        monkeypatch, old, old + "_renamed",
        where=["keras.src.trainers.epoch_iterator",
               "keras.src.backend.tensorflow.trainer"],
    )
    model = _model()
    with pytest.raises(_RUN_ERROR, match=_named(f"EpochIterator.{old}")):
        _fit(model)


def test_renamed_progbar(monkeypatch):
    rename_in_keras(
        monkeypatch, "progbar", "progbar_renamed",
        where=["keras.src.callbacks.progbar_logger"],
    )
    model = _model()
    with pytest.raises(_RUN_ERROR, match=_named("ProgbarLogger.progbar")):
        _fit(model, verbose=1)


def test_renamed_reduction_axes(monkeypatch):
    rename_in_keras(monkeypatch, "_reduction_axes", "_reduction_axes_renamed")
    model = _model(keras.layers.BatchNormalization())
    with pytest.raises(
        _RUN_ERROR, match=_named("BatchNormalization._reduction_axes")
    ):
        _fit(model)


def test_renamed_flat_losses(monkeypatch):
    rename_in_keras(monkeypatch, "_flat_losses", "_flat_losses_renamed")
    model = _model()
    with pytest.raises(_RUN_ERROR, match=_named("CompileLoss._flat_losses")):
        _fit(model)


@pytest.mark.parametrize(
    "old, where, read",
    [
        ("_seed_generators", None, "seed_generators"),
        ("_nodes_by_depth", None, "graph_nodes"),
        ("_outputs_struct", None, "outputs_structure"),
        ("is_input", ["keras.src.ops.node", "keras.src.ops.function",
                      "keras.src.models"], "graph_nodes"),
    ],
)
def test_renamed_graph_attribute(monkeypatch, old, where, read):
    """What recomputation (`remat=`) reads of a model's graph and layers."""
    rename_in_keras(monkeypatch, old, old + "_renamed", where=where)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dropout(0.5), keras.layers.Dense(1)]
    )
    functional = compat.graph_of(model)
    target = model if read == "seed_generators" else functional
    with pytest.raises(_RUN_ERROR, match=re.escape(f".{old}`")):
        getattr(compat, read)(target)


def test_renamed_sequential_graph(monkeypatch):
    rename_in_keras(
        monkeypatch, "_functional", "_functional_renamed",
        where=["keras.src.models.sequential"],
    )
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(_RUN_ERROR, match=_named("Sequential._functional")):
        compat.graph_of(model)


@pytest.mark.parametrize("old", ["step_counter", "dynamic_growth_steps"])
def test_renamed_loss_scale_attribute(monkeypatch, old):
    rename_in_keras(
        monkeypatch, old, old + "_renamed",
        where=["keras.src.optimizers.loss_scale_optimizer"],
    )
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    with pytest.raises(
        _RUN_ERROR, match=_named(f"LossScaleOptimizer.{old}")
    ):
        compat.grow_loss_scale(optimizer)


def test_tensorflow_multi_worker_internal(monkeypatch):
    class Strategy:
        extended = object()

    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy", Strategy)
    with pytest.raises(RuntimeError, match=re.escape(
        "extended._in_multi_worker_mode`"
    ) + ".*" + re.escape(tf.__version__)):
        compat.in_multi_worker_mode(Strategy())


def test_unchanged_keras_trains():
    """The same checks pass, and a model trains, with Keras as it is."""
    model = _model(keras.layers.BatchNormalization())
    history = _fit(model, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert int(model.optimizer.iterations.numpy()) == 1


def test_compute_loss_without_training():
    """`Model.compute_loss()` (public) is called as Keras' `_compute_loss()`
    calls it: `x` given, and `training` only where it is taken."""
    seen = []

    class Model(keras_accum.GradientAccumulationModel):
        def compute_loss(self, x, y, y_pred, sample_weight, **kwargs):
            seen.append((x is not None, sorted(kwargs)))
            return super().compute_loss(x, y, y_pred, sample_weight)

    inputs = keras.Input((3,))
    model = Model(
        inputs, keras.layers.Dense(1)(inputs), gradient_accumulation_steps=2
    )
    _fit(model)
    assert seen and all(entry == (True, []) for entry in seen)


# No global patch.


def _is_keras_inject(function):
    return (
        function.__module__ == "keras.src.models.model"
        and function.__qualname__ == "inject_functional_model_class"
    )


def test_no_global_patch():
    """After `import keras_accum`, Keras' `inject_functional_model_class` is
    Keras' own, except while one of our classes is initialised."""
    from keras.src.models import model as model_module

    assert _is_keras_inject(model_module.inject_functional_model_class)
    seen = {}

    class Plain(keras.Model):
        def __init__(self, *args, **kwargs):
            seen["plain"] = model_module.inject_functional_model_class
            super().__init__(*args, **kwargs)

    class Ours(keras_accum.GradientAccumulationModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(inputs)
    plain = Plain(inputs, outputs)
    assert _is_keras_inject(seen["plain"])
    assert isinstance(plain, compat.Functional)
    assert type(keras.Model(inputs, outputs)) is compat.Functional

    original = keras.Model.__init__

    def spy(self, *args, **kwargs):
        seen.setdefault("ours", model_module.inject_functional_model_class)
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keras.Model, "__init__", spy)
        ours = Ours(inputs, outputs, gradient_accumulation_steps=2)
    assert seen["ours"] is compat._inject
    assert isinstance(ours, compat.Functional)
    # Our class is not rewritten (a derived class is made instead).
    assert compat.Functional not in Ours.__bases__
    assert _is_keras_inject(model_module.inject_functional_model_class)
