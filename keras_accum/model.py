"""`GradientAccumulationModel`: a `keras.Model` that trains with accumulation."""

import warnings

import keras
import tensorflow as tf

from keras_accum import _keras_compat as compat
from keras_accum import _model_classes as classes
from keras_accum import loss_normalizer
from keras_accum import _window_state as window_state
from keras_accum.accumulator import GradientAccumulator
from keras_accum.accumulator import is_loss_scale_optimizer
from keras_accum.accumulator import resolve_policy
from keras_accum.batch_norm import WindowBatchNormStatistics
from keras_accum._fit_hooks import window_train_function
from keras_accum._fit_hooks import with_window_callbacks

_CONFIG_KEYS = (
    "gradient_accumulation_steps",
    "flush_at_epoch_end",
    "non_finite_policy",
    "window_batch_norm",
)


def _window_parts(
    gradient_accumulation_steps,
    flush_at_epoch_end,
    non_finite_policy,
    window_batch_norm,
):
    """Validates the model's own arguments; builds the window's parts."""
    if not isinstance(flush_at_epoch_end, bool):
        raise ValueError(
            "`flush_at_epoch_end` must be a bool. Received: "
            f"flush_at_epoch_end={flush_at_epoch_end!r}"
        )
    batch_norm_statistics = WindowBatchNormStatistics(window_batch_norm)
    accumulator = GradientAccumulator(
        gradient_accumulation_steps, non_finite_policy=non_finite_policy
    )
    return flush_at_epoch_end, accumulator, batch_norm_statistics


def _check_optimizer(optimizer, policy, wrapped_for_loss_scaling):
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
    """Logs that Keras can average across workers.

    Under multi-worker `tf.distribute` Keras averages each log with
    `strategy.reduce("MEAN", value, axis=0)`, which fails for scalars: give
    them a leading axis of one (the mean is the same).
    """
    if not compat.in_multi_worker_mode(strategy):
        return logs
    return keras.tree.map_structure(
        lambda v: tf.reshape(v, [1]) if v.shape.rank == 0 else v, logs
    )


def _check_backend():
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "keras_accum requires the TensorFlow backend. Received: "
            f"backend={keras.backend.backend()!r}. Set the environment "
            "variable KERAS_BACKEND=tensorflow before importing keras."
        )


def _convert(model, gradient_accumulation_steps, kwargs):
    """`GradientAccumulationModel.from_model()`."""
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
    defaults = dict(zip(_CONFIG_KEYS[1:], (True, "auto", True)))
    window = _window_parts(gradient_accumulation_steps, **{**defaults, **kwargs})
    if getattr(model, "optimizer", None) is not None:
        _check_optimizer(model.optimizer, window[1].non_finite_policy, False)
    model.__class__ = classes.accumulating_class(type(model))
    model._init_window(window)
    return model


def _checked_compile_arguments(model, args, kwargs):
    """`compile()`'s arguments, an optimizer given resolved and checked.

    Checked before Keras installs anything: a `compile()` that raises leaves
    the model as it was. (`"auto"`: a keras-hub task's default.)
    """
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


def _flush_function(model):
    """A function that applies `model`'s pending window."""
    strategy = model.distribute_strategy

    def flush():
        applied = strategy.run(
            model.gradient_accumulator.flush,
            args=(model.optimizer, model.trainable_variables),
        )
        return strategy.experimental_local_results(applied)[0]

    return flush if model.run_eagerly else tf.function(flush)


@keras.saving.register_keras_serializable(package="keras_accum")
class GradientAccumulationModel(compat.TrainerHooks, keras.Model):
    """A `keras.Model` that applies one update every N micro-batches.

    `fit()` feeds micro-batches as usual; every `gradient_accumulation_steps`
    of them one optimizer update is applied: the update one batch of all
    their samples would give (each micro-batch weighted by its loss's
    normaliser: samples, valid pixels, or sample-weight sum). Everything that
    counts steps (`iterations`, schedules, EMA, weight decay, clipping)
    counts updates. The pending window is saved with the model, input of
    unknown length trains as known length would, and a partial window is
    applied before validation and before other callbacks see an epoch's end.
    See the README for the semantics and docs/design.md for the mechanism.

    Use it like `keras.Model`: functional, subclassed (with a `call()`), or
    around an existing model with `from_model()`. A subclass with its own
    `train_step` can use `self.gradient_accumulator`.

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
        **kwargs,
    ):
        _check_backend()
        window = _window_parts(
            gradient_accumulation_steps,
            flush_at_epoch_end,
            non_finite_policy,
            window_batch_norm,
        )
        # A parent that builds a functional graph (a keras-hub task) makes
        # this instance `Functional` without Keras rewriting any class.
        with compat.functional_class_for(self, classes.functional_class):
            super().__init__(*args, **kwargs)
        self._init_window(window)

    def _init_window(self, window):
        self._flush_function = None
        # Batches that the next train calls consume without training (set
        # by `keras_accum.callbacks.BackupAndRestore` to resume mid-epoch).
        self._batches_to_skip = 0
        self._set_window_parts(*window)
        if getattr(self, "optimizer", None) is not None:
            # Compiled by a parent's `__init__`, or before `from_model()`.
            _check_optimizer(self.optimizer, self.non_finite_policy, False)
            self.train_function = None

    def _set_window_parts(
        self, flush_at_epoch_end, accumulator, batch_norm_statistics
    ):
        self.flush_at_epoch_end = flush_at_epoch_end
        self.gradient_accumulator = accumulator
        self._batch_norm_statistics = batch_norm_statistics
        accumulator.add_window_end_listener(batch_norm_statistics)

    @property
    def gradient_accumulation_steps(self):
        """int: micro-batches per update.

        Settable between `fit()` calls or from a callback: the window in
        progress keeps its N and the next window takes the new one (see
        `keras_accum.callbacks.GradientAccumulationScheduler`).
        """
        return self.gradient_accumulator.gradient_accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value):
        accumulator = self.gradient_accumulator
        accumulated = accumulator.accumulates
        accumulator.gradient_accumulation_steps = value
        if accumulator.accumulates != accumulated:
            # From 1 to more: buffers, and a train step that fills them.
            self._flush_function = None
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

        The model keeps everything it has: it stays an instance of its
        class (a keras-hub task keeps its preprocessor, `generate()` and
        compile defaults; a subclassed model its `call()`), its weights and
        its compile state. Its class becomes a subclass of that class and of
        `GradientAccumulationModel`, and it is saved and loaded as such.

        Args:
            model: a `keras.Model` of any kind: functional, `Sequential`,
                subclassed, or a keras-hub task.
            gradient_accumulation_steps: int >= 1, micro-batches per update.
            **kwargs: the other `GradientAccumulationModel` arguments
                (`flush_at_epoch_end`, `non_finite_policy`,
                `window_batch_norm`).

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
        return _convert(model, gradient_accumulation_steps, kwargs)

    def compile(self, *args, **kwargs):
        args, kwargs = _checked_compile_arguments(self, args, kwargs)
        super().compile(*args, **kwargs)
        if "gradient_accumulator" in vars(self):
            # The parent's default optimizer, if none was given.
            _check_optimizer(self.optimizer, self.non_finite_policy, False)
        self._flush_function = None

    def compile_from_config(self, config):
        # Keras skips `compile_from_config` for models that override
        # `compile()`; ours only adds checks, so restore it on load.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._build_window_state()
        super().make_train_function(force=force)
        self.train_function = window_train_function(self, self.train_function)
        self._flush_function = None
        return self.train_function

    def _build_window_state(self):
        """Creates the window's variables (and the optimizer's) if needed."""
        with self.distribute_strategy.scope():
            self.gradient_accumulator.build(self.trainable_variables)
            self._batch_norm_statistics.build(self)
            optimizer = getattr(self, "optimizer", None)
            if optimizer is not None and not optimizer.built:
                if self.built and self.trainable_variables:
                    optimizer.build(self.trainable_variables)

    def fit(self, x=None, *args, callbacks=None, **kwargs):
        callbacks = with_window_callbacks(self, callbacks, x, kwargs)
        return super().fit(x, *args, callbacks=callbacks, **kwargs)

    def flush_gradients(self):
        """Applies the pending partial window, if any.

        Returns:
            bool: whether an update was applied.
        """
        if (
            self.optimizer is None
            or not self.gradient_accumulator.built
            or not self.gradient_accumulator.accumulates
        ):
            return False
        if int(self.gradient_accumulator.micro_step.numpy()) == 0:
            # Nothing pending: nothing to trace or run. (A local read, also
            # under `tf.distribute`; every worker counts the same.)
            return False
        if self._flush_function is None:
            self._flush_function = _flush_function(self)
        return bool(self._flush_function())

    def train_step(self, data):
        x, y, sample_weight = compat.unpack_x_y_sample_weight(data)
        batch_size = tf.shape(
            next(i for i in keras.tree.flatten(x) if i is not None)
        )[0]

        with tf.GradientTape() as tape:
            # BatchNormalization moving statistics: once per window.
            with self._batch_norm_statistics.record(self):
                y_pred = compat.call_for_training(self, x)
            loss_normalizer.install(self, x, y, y_pred, sample_weight)
            with loss_normalizer.record_loss_terms() as recording:
                loss = compat.compute_loss(
                    self, x=x, y=y, y_pred=y_pred,
                    sample_weight=sample_weight, training=True,
                )
            compat.track_loss(self, loss, batch_size)
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)

        if self.trainable_weights:
            trainable_weights = self.trainable_weights
            gradients = tape.gradient(loss, trainable_weights)
            normalizer = recording.normalizer(batch_size)
            self.gradient_accumulator.accumulate_and_maybe_apply(
                gradients,
                self.optimizer,
                trainable_weights,
                normalizer=normalizer,
                # Keras divides each replica's mean loss by the number of
                # replicas; the window's normaliser is global instead.
                gradient_scale=compat.unscale_loss_for_distribution(
                    tf.ones(())
                ),
            )
        else:
            warnings.warn("The model does not have any trainable weights.")
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if self.gradient_accumulator.accumulates and self.optimizer is not None:
            logs = dict(logs, updates=self.optimizer.iterations)
        return _multi_worker_logs(self.distribute_strategy, logs)

    def test_step(self, data):
        return _multi_worker_logs(
            self.distribute_strategy, super().test_step(data)
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "flush_at_epoch_end": self.flush_at_epoch_end,
                "non_finite_policy": self.non_finite_policy,
                "window_batch_norm": self.window_batch_norm,
            }
        )
        base = getattr(type(self), "_converted_from", None)
        if base is not None:
            config["converted_from"] = classes.class_spec(base)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if "converted_from" in config:
            # A model made accumulating by `from_model()`: its own class
            # rebuilds it, then it is converted again.
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
            model._configure(**own)
            return model
        return super().from_config(config, custom_objects=custom_objects)

    def _configure(
        self,
        gradient_accumulation_steps=1,
        flush_at_epoch_end=True,
        non_finite_policy="auto",
        window_batch_norm=True,
    ):
        self._set_window_parts(
            *_window_parts(
                gradient_accumulation_steps,
                flush_at_epoch_end,
                non_finite_policy,
                window_batch_norm,
            )
        )

    def save_own_variables(self, store):
        """Saves the model's own variables and its pending window.

        The window (see `keras_accum.GradientAccumulator.state`, one value
        per replica) goes under keys of its own beside Keras' numbered ones.
        """
        super().save_own_variables(store)
        window_state.save(self._window_parts(), store)

    def load_own_variables(self, store):
        """Loads what `save_own_variables` saved.

        A file without a window (from keras_accum 0.1, or from a plain
        `keras.Model`) loads with an empty one. The optimizer is built first
        if need be, so that its saved state loads too.
        """
        if self.built:
            self._build_window_state()
        own = window_state.load(
            self._window_parts(),
            store,
            self.distribute_strategy.num_replicas_in_sync,
        )
        super().load_own_variables(own)
        self._flush_function = None

    def _window_parts(self):
        return {
            "accumulator": self.gradient_accumulator,
            "batch_norm": self._batch_norm_statistics,
        }


@keras.saving.register_keras_serializable(package="keras_accum")
class FunctionalGradientAccumulationModel(
    GradientAccumulationModel, compat.Functional
):
    """The class of `GradientAccumulationModel(inputs, outputs, ...)`."""
