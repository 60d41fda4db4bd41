"""`GradientAccumulationModel`: a `keras.Model` that trains with accumulation."""

import collections
import functools
import numbers
import warnings

import keras
import tensorflow as tf

from keras_accum import _keras_compat as compat
from keras_accum import _model_classes as classes
from keras_accum import _saved_window as saved_window
from keras_accum import loss_normalizer
from keras_accum import remat as remat_lib
from keras_accum._auto_micro_batch import AutoMicroBatch
from keras_accum._fit_hooks import EpochEnd
from keras_accum._fit_hooks import is_backup
from keras_accum._fit_hooks import window_train_function
from keras_accum._fit_hooks import with_window_callbacks
from keras_accum._input_position import InputPosition
from keras_accum._tf_utils import xla_placement
from keras_accum.accumulator import GradientAccumulator
from keras_accum.accumulator import is_loss_scale_optimizer
from keras_accum.accumulator import resolve_policy
from keras_accum.accumulator import validate_steps
from keras_accum.batch_norm import WindowBatchNormStatistics

# One micro-batch's forward pass (`normalizer`: `None` for a sum; `terms`:
# `loss_normalizer.LossTerm`s, `None` if one is of an unknown kind).
_Pass = collections.namedtuple(
    "_Pass", ["y_pred", "loss", "normalizer", "batch_size", "terms"]
)

_CONFIG_KEYS = (
    "gradient_accumulation_steps",
    "flush_at_epoch_end",
    "non_finite_policy",
    "window_batch_norm",
    "micro_batch_size",
    "remat",
)


class _Window:
    """The model's own arguments, validated, and the window's parts."""

    def __init__(
        self,
        gradient_accumulation_steps=1,
        flush_at_epoch_end=True,
        non_finite_policy="auto",
        window_batch_norm=True,
        micro_batch_size=None,
        remat=False,
    ):
        if not isinstance(flush_at_epoch_end, bool):
            raise ValueError(
                "`flush_at_epoch_end` must be a bool. Received: "
                f"flush_at_epoch_end={flush_at_epoch_end!r}"
            )
        self.flush_at_epoch_end = flush_at_epoch_end
        self.micro_batch_size = _validate_micro_batch_size(micro_batch_size)
        self.remat = remat_lib.Rematerialization(
            _validate_remat(remat, self.micro_batch_size)
        )
        self.batch_norm_statistics = WindowBatchNormStatistics(
            window_batch_norm
        )
        self.accumulator = GradientAccumulator(
            gradient_accumulation_steps, non_finite_policy=non_finite_policy
        )
        # The window also for N = 1.
        self.accumulator.accumulates = (
            self.micro_batch_size is not None
            or self.remat.spec is not False
            or non_finite_policy in ("skip_window", "drop_micro_batch")
        )


def _validate_micro_batch_size(value):
    """`None`, `"auto"`, or an int >= 1; raises otherwise."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if (
        isinstance(value, (bool, str))
        or not isinstance(value, numbers.Integral)
        or value < 1
    ):
        raise ValueError(
            "`micro_batch_size` must be an integer >= 1, 'auto' or None. "
            f"Received: micro_batch_size={value!r}"
        )
    return validate_steps(value, "micro_batch_size")


def _validate_remat(value, micro_batch_size):
    """`remat`, validated (`"auto"` only with `micro_batch_size="auto"`)."""
    value = remat_lib.validate_remat(remat_lib.remat_from_config(value))
    if value == "auto" and micro_batch_size != "auto":
        raise ValueError(
            "`remat='auto'` turns recomputation on when one sample per "
            "micro-batch does not fit, which `micro_batch_size='auto'` finds "
            "out. Received: remat='auto' with "
            f"micro_batch_size={micro_batch_size!r}. Set "
            "`micro_batch_size='auto'`, or `remat=True`."
        )
    return value


def _check_optimizer(optimizer, policy, wrapped_for_loss_scaling=False):
    """Raises for an optimizer that accumulates, or a policy it cannot take."""
    lso = is_loss_scale_optimizer(optimizer)
    inner = optimizer.inner_optimizer if lso else optimizer
    if inner is not None and inner.gradient_accumulation_steps:
        raise ValueError(
            "The optimizer accumulates gradients itself "
            "(`gradient_accumulation_steps="
            f"{inner.gradient_accumulation_steps}`), and so does "
            "`GradientAccumulationModel`: gradients would be accumulated "
            "twice. Drop `gradient_accumulation_steps` from the optimizer "
            "and set it on the model instead."
        )
    resolve_policy(policy, lso or wrapped_for_loss_scaling)


def _multi_worker_logs(strategy, logs):
    """Logs with the leading axis of Keras' multi-worker reduction."""
    if not compat.in_multi_worker_mode(strategy):
        return logs
    return keras.tree.map_structure(
        lambda v: tf.reshape(v, [1]) if v.shape.rank == 0 else v, logs
    )


def _first_tensor(x):
    return next(i for i in keras.tree.flatten(x) if i is not None)


def _mean(total, weight):
    """`total / weight`, or `total` where the weight is 0 (a sum)."""
    return total / tf.where(weight > 0, weight, tf.ones_like(weight))


def _rows(data, start, length):
    """`length` rows of every tensor of `data`, from row `start`."""
    return keras.tree.map_structure(
        lambda t: None if t is None else tf.gather(t, start + tf.range(length)),
        data,
    )


def _replica_scale():
    """The replica count, which Keras divides each replica's mean loss by."""
    return float(tf.distribute.get_strategy().num_replicas_in_sync)


def _check_in_step_sync(model):
    """Raises for `micro_batch_size` with a synchronized layer on replicas."""
    replicas = model.distribute_strategy.num_replicas_in_sync
    if model.micro_batch_size is None or replicas == 1:
        return
    for layer in compat.layers_of(model):
        if getattr(layer, "synchronized", False) and layer.trainable:
            raise ValueError(
                "`micro_batch_size` cannot be used with a `synchronized=True` "
                f"BatchNormalization layer ({layer.name!r}) on {replicas} "
                "replicas: its moments are all-reduced in every forward "
                "pass, which TensorFlow does not allow inside the train "
                "step's loop. Received: micro_batch_size="
                f"{model.micro_batch_size}. Set `synchronized=False`, or "
                "`micro_batch_size=None` to accumulate across train steps."
            )


def _compile_of_own_class(cls):
    """The first class past ours with its own `compile(_from_config)()`."""
    for klass in cls.__mro__:
        if klass in (GradientAccumulationModel, compat.TrainerHooks):
            continue
        for name in ("compile_from_config", "compile"):
            method = vars(klass).get(name)
            if method is not None:
                if method is not getattr(keras.Model, name):
                    return klass
    return None


def _check_backend():
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "keras_accum requires the TensorFlow backend. Received: "
            f"backend={keras.backend.backend()!r}. Set the environment "
            "variable KERAS_BACKEND=tensorflow before importing keras."
        )


def _checked_compile_arguments(model, args, kwargs):
    """`compile()`'s arguments, with a given optimizer resolved and checked."""
    optimizer = args[0] if args else kwargs.get("optimizer")
    if optimizer is None or (isinstance(optimizer, str) and optimizer == "auto"):
        return args, kwargs
    optimizer = keras.optimizers.get(optimizer)
    if args:
        args = (optimizer,) + args[1:]
    else:
        kwargs = dict(kwargs, optimizer=optimizer)
    if "gradient_accumulator" in vars(model):
        _check_optimizer(
            optimizer,
            model.non_finite_policy,
            # Keras wraps it for `mixed_float16` (`auto_scale_loss`).
            kwargs.get("auto_scale_loss", True)
            and model.dtype_policy.name == "mixed_float16",
        )
    return args, kwargs


# Flushes run eagerly before one is traced (docs/design.md, "One window end").
_EAGER_FLUSHES = 4


def _flush_function(model):
    """Applies `model`'s pending window; traced after `_EAGER_FLUSHES`."""
    strategy = model.distribute_strategy

    def flush():
        applied = strategy.run(
            model.gradient_accumulator.flush,
            args=(model.optimizer, model.trainable_variables),
        )
        return strategy.experimental_local_results(applied)[0]

    if model.run_eagerly:
        return flush
    traced = tf.function(flush)
    if strategy.num_replicas_in_sync > 1:
        return traced
    calls = 0

    def first_eagerly():
        nonlocal calls
        calls += 1
        return flush() if calls <= _EAGER_FLUSHES else traced()

    return first_eagerly


@keras.saving.register_keras_serializable(package="keras_accum")
class GradientAccumulationModel(compat.TrainerHooks, keras.Model):
    """A `keras.Model` that applies one update every N micro-batches.

    Every `gradient_accumulation_steps` micro-batches of `fit()`, one
    optimizer update is applied: the update of one batch of all their
    samples (each weighted by its loss's normaliser). `iterations`,
    schedules, EMA, weight decay and clipping count updates. The pending
    window is saved with the model and applied before validation and
    before callbacks see an epoch's end (docs/semantics.md). Use it like
    `keras.Model`, or convert a model with `from_model()`.

    Args:
        gradient_accumulation_steps: int >= 1, micro-batches per update.
            `1` trains exactly like `keras.Model`.
        flush_at_epoch_end: bool. If `True` (default) a partial window is
            applied at the end of every epoch; if `False` it is carried over
            into the next epoch and applied at the latest when `fit()` ends.
        non_finite_policy: str, `"auto"` (default), `"skip_window"`,
            `"drop_micro_batch"` or `"propagate"`; see
            `keras_accum.GradientAccumulator`.
        window_batch_norm: bool. If `True` (default) BatchNormalization
            moving statistics move once per window, from all its samples;
            if `False`, every micro-batch, as in Keras.
        micro_batch_size: int >= 1, `"auto"` or `None` (default). If set,
            each train, test and predict step runs its batch in
            micro-batches of at most this many rows (per replica), and a
            window is `gradient_accumulation_steps` train steps. `"auto"`:
            the largest micro-batch that fits in the device's memory (a
            step that runs out of memory is run again with half of it).
        remat: `False` (default), `True`, `"auto"`, or a list of layer
            names and `keras.layers.Layer` classes. Recompute activations in
            the backward pass instead of keeping them: `True` recomputes
            each block (a layer that holds layers and weights; a nested
            model that holds blocks is looked into), or cuts a functional
            graph of plain layers into about sqrt(n) segments; a list
            recomputes the layers it names. `"auto"` (with
            `micro_batch_size="auto"`) turns `True` on once one sample per
            micro-batch does not fit. The update is unchanged
            (docs/semantics.md).
        *args, **kwargs: passed to `keras.Model`.

    Raises:
        ValueError: for an invalid argument, or at `compile()` for an
            optimizer that accumulates gradients itself.
        RuntimeError: if the Keras backend is not TensorFlow.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_accum

    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1)(inputs)
    model = keras_accum.GradientAccumulationModel(
        inputs, outputs, gradient_accumulation_steps=4
    )
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((64, 8)), np.zeros((64, 1))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 2 updates
    assert int(model.optimizer.iterations) == 2
    ```
    """

    def __new__(cls, *args, **kwargs):
        # As `keras.Model(inputs, outputs)` returns a `Functional`.
        if cls is GradientAccumulationModel and compat.functional_init_arguments(
            args, kwargs
        ):
            cls = FunctionalGradientAccumulationModel
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        gradient_accumulation_steps=1,
        flush_at_epoch_end=True,
        non_finite_policy="auto",
        window_batch_norm=True,
        micro_batch_size=None,
        remat=False,
        **kwargs,
    ):
        _check_backend()
        window = _Window(
            gradient_accumulation_steps,
            flush_at_epoch_end,
            non_finite_policy,
            window_batch_norm,
            micro_batch_size,
            remat,
        )
        # A parent's functional build (a keras-hub task): docs/design.md.
        with compat.building_functionally(self, self._functional_class):
            super().__init__(*args, **kwargs)
        self._init_window(window)

    @staticmethod
    def _functional_class(cls):
        return classes.functional_class(
            cls, GradientAccumulationModel, FunctionalGradientAccumulationModel
        )

    def _init_window(self, window):
        self.flush_at_epoch_end = window.flush_at_epoch_end
        self.gradient_accumulator = window.accumulator
        self._batch_norm_statistics = window.batch_norm_statistics
        window.accumulator.add_window_end_listener(self._batch_norm_statistics)
        self._flush_function = None
        # Per function kind: whether XLA compiles each micro-batch.
        self._micro_batches_in_xla = {}
        # How `keras_accum.callbacks.BackupAndRestore` resumes mid-epoch.
        self.input_position = InputPosition()
        self.epoch_end = EpochEnd()
        self._auto_micro_batch = self._micro_batch_size = None
        self._remat = window.remat
        self._use_micro_batch_size(window.micro_batch_size)
        if getattr(self, "optimizer", None) is not None:
            # Compiled by a parent's `__init__`, or before `from_model()`.
            _check_optimizer(self.optimizer, self.non_finite_policy)
            self.train_function = None

    def _use_micro_batch_size(self, value):
        """Takes a validated `micro_batch_size`; returns whether it changed.
        With "auto" the size is set per input shape, when tracing."""
        auto = value == "auto"
        if auto == (self._auto_micro_batch is not None) and (
            auto or value == self._micro_batch_size
        ):
            return False
        self._auto_micro_batch = AutoMicroBatch(self) if auto else None
        self._micro_batch_size = None if auto else value
        return True

    @property
    def gradient_accumulation_steps(self):
        """int: micro-batches per update; settable (the window in progress
        keeps its N)."""
        return self.gradient_accumulator.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value):
        accumulator = self.gradient_accumulator
        accumulated = accumulator.accumulates
        accumulator.gradient_accumulation_steps = value
        if accumulator.accumulates != accumulated:
            # From 1 to more: buffers, and a train step that fills them.
            self._retrace()

    @property
    def micro_batch_size(self):
        """int, `"auto"` or `None`: rows per micro-batch inside each step
        (with `"auto"`, the size chosen for the last batch); settable."""
        if self._auto_micro_batch is not None:
            return self._auto_micro_batch.size or "auto"
        return self._micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value):
        value = _validate_micro_batch_size(value)
        if value is not None:
            self.gradient_accumulator.accumulates = True
        if self._use_micro_batch_size(value):
            self._retrace()

    @property
    def remat(self):
        """`False`, `True`, `"auto"` or a tuple of layer names and classes:
        what the backward pass recomputes (docs/semantics.md); settable."""
        return self._remat.spec

    @remat.setter
    def remat(self, value):
        value = _validate_remat(value, self.micro_batch_size
                                if self._auto_micro_batch is None else "auto")
        if value == self._remat.spec:
            return
        self._remat = remat_lib.Rematerialization(value)
        if value is not False:
            self.gradient_accumulator.accumulates = True
        self._retrace()

    @property
    def remat_active(self):
        """bool: whether the backward pass recomputes now (with `"auto"`,
        once one sample per micro-batch did not fit)."""
        return self._remat.enabled

    def _retrace(self):
        self._remat.forget()
        self._flush_function = None
        self.test_function = self.predict_function = None
        if getattr(self, "train_function", None) is not None:
            self.make_train_function(force=True)

    @property
    def non_finite_policy(self):
        return self.gradient_accumulator.non_finite_policy

    @property
    def window_batch_norm(self):
        """bool: whether BatchNormalization statistics are per window."""
        return self._batch_norm_statistics.enabled

    @property
    def window_batch_norm_statistics(self):
        """The `WindowBatchNormStatistics` of the model's training."""
        return self._batch_norm_statistics

    @property
    def micro_step(self):
        """int tensor: micro-batches accumulated in the current window."""
        return self.gradient_accumulator.micro_step.read_value()

    @property
    def update_applied(self):
        """bool tensor: whether the last train step applied an update."""
        return self.gradient_accumulator.update_applied.read_value()

    @property
    def skipped_windows(self):
        """int tensor: windows skipped by the non-finite policy."""
        return self.gradient_accumulator.skipped_windows.read_value()

    @classmethod
    def from_model(cls, model, gradient_accumulation_steps, **kwargs):
        """Makes an existing model train with accumulation, in place.

        The model keeps its class (now also a `GradientAccumulationModel`),
        weights and compile state: a keras-hub task keeps its preprocessor,
        `generate()` and compile defaults.

        Args:
            model: a `keras.Model` of any kind: functional, `Sequential`,
                subclassed, or a keras-hub task.
            gradient_accumulation_steps: int >= 1, micro-batches per update.
            **kwargs: the other `GradientAccumulationModel` arguments
                (`flush_at_epoch_end`, `non_finite_policy`,
                `window_batch_norm`, `micro_batch_size`, `remat`).

        Returns:
            `model` itself, now accumulating.

        Raises:
            ValueError: for an invalid argument, for a model that already
                accumulates, or if its optimizer accumulates gradients
                itself.

        Example:

        ```python
        base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model = keras_accum.GradientAccumulationModel.from_model(
            base, gradient_accumulation_steps=8
        )
        assert model is base and isinstance(model, keras.Sequential)
        ```
        """
        _check_backend()
        if not isinstance(model, keras.Model):
            raise ValueError(
                "`from_model()` needs a `keras.Model`. Received: "
                f"model of type {type(model).__name__}"
            )
        if isinstance(model, GradientAccumulationModel):
            raise ValueError(
                f"The model {model.name!r} already accumulates gradients. "
                "Set `model.gradient_accumulation_steps` to change N."
            )
        unknown = set(kwargs) - set(_CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"Unrecognized arguments for `from_model()`: {sorted(unknown)}. "
                f"Expected some of {list(_CONFIG_KEYS[1:])}."
            )
        window = _Window(gradient_accumulation_steps, **kwargs)
        policy = window.accumulator.non_finite_policy
        if getattr(model, "optimizer", None) is not None:
            _check_optimizer(model.optimizer, policy)
        if window.remat.spec is not False:
            window.remat.check(model)
        model.__class__ = classes.accumulating_class(
            type(model),
            GradientAccumulationModel,
            FunctionalGradientAccumulationModel,
        )
        model._init_window(window)
        return model

    def compile(self, *args, **kwargs):
        # Checked before Keras' `compile()`: a refused one changes nothing.
        args, kwargs = _checked_compile_arguments(self, args, kwargs)
        super().compile(*args, **kwargs)
        if "gradient_accumulator" in vars(self):
            # The parent's default optimizer, if none was given.
            _check_optimizer(self.optimizer, self.non_finite_policy)
        self._flush_function = None

    def compile_from_config(self, config):
        # Compiled on load unless the model's own `compile()` does not take
        # the saved arguments (docs/design.md, "Exact resume").
        own = _compile_of_own_class(type(self))
        if own is not None and "compile_from_config" in vars(own):
            return own.compile_from_config(self, config)
        config = keras.saving.deserialize_keras_object(config)
        try:
            self.compile(**config)
        except TypeError as error:
            if own is None or "compile" not in vars(own):
                raise
            warnings.warn(
                "`compile()` was not called as part of model loading: the "
                f"`compile()` of {own.__name__} does not take the saved "
                f"arguments ({error}). Call `compile()` after loading.",
                stacklevel=2,
            )
            return
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        _check_in_step_sync(self)
        if self.distribute_strategy.num_replicas_in_sync > 1:
            # Keras' own step divides each replica's loss by that replica's
            # normaliser: across replicas N = 1 takes the window's exact one.
            self.gradient_accumulator.accumulates = True
        self._remat.check(self)
        self._remat.forget()
        self._build_window_state()
        auto = self._auto_micro_batch
        if auto is not None:
            auto.reset()
        function = self._function_of("train")
        self.train_function = window_train_function(self, function)
        self._flush_function = None
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self.test_function = self._function_of("test")
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:
            self.predict_function = self._function_of("predict")
        return self.predict_function

    def _function_of(self, kind):
        """Keras' `kind` (train, test, predict) function; with "auto", one
        that chooses its micro-batch per input signature."""
        make = functools.partial(self._keras_function, kind)
        if self._auto_micro_batch is not None:
            return self._auto_micro_batch.function(kind, make)
        return make()

    @property
    def auto_micro_batch(self):
        """The `AutoMicroBatch` of `micro_batch_size="auto"`, or `None`."""
        return self._auto_micro_batch

    def _keras_function(self, kind, micro_batch_size=None):
        """Keras' `kind` function, with micro-batches of this size if given."""
        if micro_batch_size is not None:
            self._micro_batch_size = micro_batch_size
        attribute = f"{kind}_function"
        current = getattr(self, attribute)
        auto = self._auto_micro_batch
        placement = xla_placement(
            self.jit_compile,
            self.micro_batch_size is not None,
            compat.layers_of(self),
            xla_aborts=auto is not None and auto.memory.crashes_at_limit,
            collects=kind == "predict",
        )
        self._micro_batches_in_xla[kind] = placement == "micro_batch"
        jit_compile = self.jit_compile
        if jit_compile is True and placement != "step":
            # Keras compiles the whole step with XLA: here only each
            # micro-batch, or (a CPU with a memory limit and "auto") nothing.
            self.jit_compile = False
        try:
            getattr(super(), f"make_{kind}_function")(force=True)
        finally:
            self.jit_compile = jit_compile
        function = getattr(self, attribute)
        setattr(self, attribute, current)
        if micro_batch_size is None:
            return function

        def run(data):
            # Read when the step is traced, also again for a new shape.
            self._micro_batch_size = micro_batch_size
            return function(data)

        return run

    def _build_window_state(self):
        """Creates the window's variables (and the optimizer's) if needed."""
        with self.distribute_strategy.scope():
            self.gradient_accumulator.build(self.trainable_variables)
            self._batch_norm_statistics.build(self)
            self.input_position.build()
            optimizer = getattr(self, "optimizer", None)
            if optimizer is not None and not optimizer.built:
                if self.built and self.trainable_variables:
                    optimizer.build(self.trainable_variables)

    def build_before_tracing(self):
        # Recomputation plans its blocks on a built model; "auto" copies the
        # variables before its first attempt, which must not make any; the
        # window's BatchNormalization statistics are made for the layers
        # there are (a layer made in the first step would get them in the
        # step's second trace, where TensorFlow makes no variable).
        return self.gradient_accumulator.accumulates and not compat.all_built(
            self
        )

    def fit(self, x=None, *args, callbacks=None, **kwargs):
        callbacks = with_window_callbacks(self, callbacks, x, kwargs)
        # With our `BackupAndRestore`, the train step records its input.
        backups = [
            c
            for c in getattr(callbacks, "callbacks", callbacks)
            if is_backup(c)
        ]
        if self.input_position.start_fit(bool(backups)):
            self.train_function = None
        try:
            return super().fit(x, *args, callbacks=callbacks, **kwargs)
        finally:
            # Keras skips `on_train_end` when `fit()` raises.
            for backup in backups:
                backup.release_signal_handler()

    def flush_gradients(self):
        """Applies the pending partial window, if any.

        Returns:
            bool: whether an update was applied.
        """
        accumulator = self.gradient_accumulator
        if (
            self.optimizer is None
            or not accumulator.built
            or not accumulator.accumulates
            # Nothing pending (every replica and worker counts the same).
            or not int(accumulator.micro_step.numpy())
        ):
            return False
        if self._flush_function is None:
            self._flush_function = _flush_function(self)
        return bool(self._flush_function())

    def train_step(self, data):
        auto = self._auto_micro_batch
        # With "auto", the step first copies what it may write, to put it
        # back if it runs out of memory; its writes wait for the copy.
        snapshot = auto.snapshot_in_step() if auto is not None else None
        with tf.control_dependencies([] if snapshot is None else [snapshot]):
            self.input_position.record(data)
            if not self.gradient_accumulator.accumulates:
                # N = 1 and no option that needs the window: Keras' own step.
                return self._step_logs(super().train_step(data))
            x, y, sample_weight = compat.unpack_x_y_sample_weight(data)
            return self._step_logs(self._window_step(x, y, sample_weight))

    def _forward(self, x, y, sample_weight, training=False):
        """One micro-batch's predictions, loss, normaliser and size."""
        batch_size = tf.shape(_first_tensor(x))[0]
        if training:
            if self._remat.enabled and not compat.all_built(self):
                # Traced before `fit()` built it (a step called directly):
                # built here, so that the plan sees its blocks.
                self._output_spec(x, training=True)
            with self._batch_norm_statistics.record(self), self._remat.active(
                self
            ):
                y_pred = compat.call_model(self, x, training=True)
        else:
            y_pred = compat.call_model(self, x, training=False)
        loss_normalizer.install(self, x, y, y_pred, sample_weight)
        with loss_normalizer.record_loss_terms() as recording:
            loss = compat.compute_loss(
                self, x=x, y=y, y_pred=y_pred,
                sample_weight=sample_weight, training=training,
            )
        return _Pass(
            y_pred, loss, recording.normalizer(batch_size), batch_size,
            recording.known_terms(),
        )

    def _forward_backward(self, x, y, sample_weight):
        """`_forward()` in training, its gradients added to the window."""
        with tf.GradientTape() as tape:
            forward = self._forward(x, y, sample_weight, training=True)
            scaled = forward.loss
            if self.optimizer is not None:
                scaled = self.optimizer.scale_loss(forward.loss)
        if not self.trainable_weights:
            warnings.warn("The model does not have any trainable weights.")
            return forward._replace(normalizer=None)
        gradients = tape.gradient(scaled, self.trainable_weights)
        self.gradient_accumulator.add(
            gradients,
            self.optimizer,
            self.trainable_weights,
            normalizer=forward.normalizer,
            # Keras divides a mean (and `add_loss` terms) by the replica
            # count, not a sum: a sum's gradient is each replica's own.
            gradient_scale=(
                1.0 if forward.normalizer is None else _replica_scale()
            ),
        )
        return forward

    def _window_step(self, x, y, sample_weight):
        """A train step that adds its batch to the window, then ends it."""
        if self._micro_batch_size is None:
            forward = self._forward_backward(x, y, sample_weight)
            compat.track_loss(self, forward.loss, forward.batch_size)
            logs = self.compute_metrics(x, y, forward.y_pred, sample_weight)
        else:
            self._micro_batches(
                (x, y, sample_weight), self._forward_backward, "train"
            )
            logs = self.get_metrics_result()
        if self.optimizer is not None and self.trainable_weights:
            # Counted after the micro-batches (`WindowState.count_step()`).
            self.gradient_accumulator.end_step(
                self.optimizer, self.trainable_weights
            )
        return logs

    def _micro_batches(self, data, step, kind):
        """Runs `step` on each micro-batch, updates the metrics and the
        logged loss; returns the whole batch's loss (docs/design.md)."""
        size = tf.shape(_first_tensor(data[0]))[0]
        zero = tf.zeros((), tf.float64)
        compiled = compat.compile_loss(self)
        if compiled is not None and not compiled.built:
            # Builds the compiled loss (and its trackers) symbolically, on
            # the outputs of the step's kind (a layer such as `RandomCrop`
            # may shape them otherwise in training).
            x, y, sample_weight = data
            spec = self._output_spec(x, training=kind == "train")
            loss_normalizer.install(self, x, y, spec, sample_weight)
        trackers = compat.loss_trackers(self)
        loss_weights = compat.loss_weights(self) if trackers else []
        # Put back after the micro-batches, which each update them.
        before = [[tf.identity(v.value) for v in t.variables] for t in trackers]
        recorded = [True]  # whether every term's value was recorded

        def weighted(value, normalizer):
            if normalizer is None:  # a sum: summed (with weight 0)
                return value, zero
            weight = tf.cast(normalizer, zero.dtype)
            return value * weight, weight

        def micro_batch(start, length):
            part = _rows(data, start, length)
            forward = step(*part)
            self.compute_metrics(part[0], part[1], forward.y_pred, part[2])
            loss = tf.cast(forward.loss, zero.dtype)
            if not trackers:
                return [weighted(loss, forward.normalizer)]
            terms = [
                (tf.cast(t.value, zero.dtype), t.normalizer)
                for t in forward.terms or ()
            ]
            if len(terms) != len(loss_weights):
                # A custom loss object: the loss averaged over the rows.
                recorded[0] = False
                terms = [(zero, None)] * len(loss_weights)
            for w, (value, _) in zip(loss_weights, terms):
                loss -= value if w == 1.0 else w * value
            return [weighted(loss, forward.batch_size)] + [
                weighted(*term) for term in terms
            ]

        def add(total, part):
            return [(a + c, b + d) for (a, b), (c, d) in zip(total, part)]

        sums = self._over_micro_batches(
            data[0], size, micro_batch, add,
            [(zero, zero)] * (1 + len(loss_weights)), kind,
        )
        terms = [_mean(*term) for term in sums[1:]]
        if trackers and recorded[0]:
            for tracker, values, term in zip(trackers, before, terms):
                for variable, value in zip(tracker.variables, values):
                    variable.assign(value)
                compat.track_loss_term(tracker, term, size)
        loss = _mean(*sums[0])
        for w, term in zip(loss_weights, terms):
            loss += term if w == 1.0 else w * term
        compat.track_loss(self, loss, size)
        return loss

    def _over_micro_batches(self, x, size, run, add, initial, kind):
        """`add`s up `run(start, length)` over the micro-batches of `x` (of
        `size` rows): the whole ones in a loop, then the rest."""
        rows = self._micro_batch_size
        full = size // rows

        def compiled(length):
            part = functools.partial(run, length=length)
            if self._micro_batches_in_xla.get(kind):
                part = tf.function(part, jit_compile=True, autograph=False)
            return part

        full_micro_batch = compiled(rows)

        def body(i, total):
            return i + 1, add(total, full_micro_batch(i * rows))

        _, total = tf.while_loop(
            lambda i, _: i < full,
            body,
            (tf.zeros((), tf.int32), initial),
            parallel_iterations=1,
        )
        static_size = _first_tensor(x).shape[0]
        if static_size is None:
            rest = size - full * rows
            return tf.cond(
                rest > 0,
                lambda: add(total, run(full * rows, rest)),
                lambda: total,
            )
        if static_size % rows:
            rest = static_size % rows
            return add(total, compiled(rest)(static_size - rest))
        return total

    def test_step(self, data):
        if self._micro_batch_size is None:
            logs = super().test_step(data)
        else:
            self._micro_batches(
                compat.unpack_x_y_sample_weight(data), self._forward, "test"
            )
            logs = self.get_metrics_result()
        return _multi_worker_logs(self.distribute_strategy, logs)

    def _output_spec(self, x, training=False):
        """The model's output spec for `x`, traced symbolically (nothing is
        written)."""
        return compat.compute_output_spec(
            functools.partial(compat.call_model, self, training=training),
            compat.symbolic(x),
        )

    def predict_step(self, data):
        if self._micro_batch_size is None:
            return super().predict_step(data)
        x, _, _ = compat.unpack_x_y_sample_weight(data)
        spec = self._output_spec(x)

        def run(start, length):
            y_pred = compat.call_model(self, _rows(x, start, length), False)
            return keras.tree.flatten(y_pred)

        def add(arrays, outputs):
            return [a.write(a.size(), o) for a, o in zip(arrays, outputs)]

        arrays = [
            tf.TensorArray(t.dtype, 0, dynamic_size=True, infer_shape=False)
            for t in keras.tree.flatten(spec)
        ]
        size = tf.shape(_first_tensor(x))[0]
        arrays = self._over_micro_batches(x, size, run, add, arrays, "predict")
        return keras.tree.pack_sequence_as(spec, [a.concat() for a in arrays])

    def _step_logs(self, logs):
        if self.gradient_accumulator.accumulates and self.optimizer is not None:
            logs = dict(logs, updates=self.optimizer.iterations)
        if self._remat.spec == "auto" and self._remat.enabled:
            logs = dict(logs, remat=tf.constant(1))
        return _multi_worker_logs(self.distribute_strategy, logs)

    def get_config(self):
        config = super().get_config()
        config.update({key: getattr(self, key) for key in _CONFIG_KEYS})
        config["remat"] = remat_lib.remat_config(self.remat)
        if self._auto_micro_batch is not None:
            config["micro_batch_size"] = "auto"
        base = getattr(type(self), "_converted_from", None)
        if base is not None:
            config["converted_from"] = classes.class_spec(base)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if "converted_from" in config:
            # Made accumulating by `from_model()`: rebuilt, then converted.
            base = classes.class_from_config(
                config.pop("converted_from"), custom_objects
            )
            own = {k: config.pop(k) for k in _CONFIG_KEYS if k in config}
            model = base.from_config(config)
            return cls.from_model(model, **own)
        functional_keys = ("name", "layers", "input_layers", "output_layers")
        if all(key in config for key in functional_keys):
            own = {k: config.pop(k) for k in _CONFIG_KEYS if k in config}
            model = super().from_config(config, custom_objects=custom_objects)
            model._init_window(_Window(**own))
            return model
        return super().from_config(config, custom_objects=custom_objects)

    def save_own_variables(self, store):
        """Saves the model's own variables and its pending window."""
        super().save_own_variables(store)
        saved_window.save(
            self._saved_parts(), store, self.distribute_strategy
        )

    def load_own_variables(self, store):
        """Loads what `save_own_variables` saved (no window: an empty one)."""
        if self.built:
            self._build_window_state()
        own = saved_window.load(
            self._saved_parts(),
            store,
            self.distribute_strategy.num_replicas_in_sync,
        )
        super().load_own_variables(own)
        self._flush_function = None
        self._take_saved_steps()

    def _take_saved_steps(self):
        """Takes the N the window was saved with, warning if it differs."""
        accumulator = self.gradient_accumulator
        saved = int(accumulator.window.next_window_steps.numpy())
        built = accumulator.gradient_accumulation_steps
        if saved != built:
            warnings.warn(
                "The loaded window state was saved with "
                f"`gradient_accumulation_steps={saved}`, and this model was "
                f"built with {built}: training goes on with {saved}, as "
                "saved. Set `model.gradient_accumulation_steps` after loading "
                "to change it.",
                stacklevel=3,
            )
            self.gradient_accumulation_steps = saved

    def _saved_parts(self):
        return {
            "accumulator": self.gradient_accumulator,
            "batch_norm": self._batch_norm_statistics,
        }


@keras.saving.register_keras_serializable(package="keras_accum")
class FunctionalGradientAccumulationModel(
    GradientAccumulationModel, compat.Functional
):
    """The class of `GradientAccumulationModel(inputs, outputs, ...)`."""
