"""`GradientAccumulationModel`: a `keras.Model` that trains with accumulation."""

import warnings

import keras
import tensorflow as tf

from keras_accum import _keras_compat as compat
from keras_accum import loss_normalizer
from keras_accum import _window_state as window_state
from keras_accum.accumulator import GradientAccumulator
from keras_accum.accumulator import is_loss_scale_optimizer
from keras_accum.accumulator import resolve_policy
from keras_accum.batch_norm import WindowBatchNormStatistics
from keras_accum.callbacks import BackupAndRestore

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


@keras.saving.register_keras_serializable(package="keras_accum")
class GradientAccumulationModel(keras.Model):
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
        # Like `keras.Model(inputs, outputs)` returning a `Functional`, the
        # functional form returns `FunctionalGradientAccumulationModel`.
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
        if compat.functional_init_arguments(args, kwargs) and not isinstance(
            self, compat.Functional
        ):
            # A subclass built functionally becomes `Functional`, as Keras
            # does for subclasses of `keras.Model`, but by adding the base to
            # that subclass only: Keras would rewrite the bases of every
            # class above it, this one included, which breaks subclassed
            # models created afterwards.
            cls = type(self)
            cls.__bases__ = cls.__bases__ + (compat.Functional,)
        super().__init__(*args, **kwargs)
        self._flush_function = None
        # Batches that the next train calls consume without training (set
        # by `keras_accum.callbacks.BackupAndRestore` to resume mid-epoch).
        self._batches_to_skip = 0
        self._set_window_parts(*window)

    def _set_window_parts(
        self, flush_at_epoch_end, accumulator, batch_norm_statistics
    ):
        self.flush_at_epoch_end = flush_at_epoch_end
        self.gradient_accumulator = accumulator
        self._batch_norm_statistics = batch_norm_statistics
        accumulator.add_window_end_listener(batch_norm_statistics)

    @property
    def gradient_accumulation_steps(self):
        return self.gradient_accumulator.gradient_accumulation_steps

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
        """Wraps an existing functional or `Sequential` model.

        Args:
            model: a built functional or `Sequential` `keras.Model`; its
                layers (and weights) are shared.
            gradient_accumulation_steps: int >= 1, micro-batches per update.
            **kwargs: other `GradientAccumulationModel` arguments.

        Returns:
            A `GradientAccumulationModel` with the same inputs and outputs.

        Raises:
            ValueError: if `model` has no symbolic inputs and outputs.

        Example:

        ```python
        base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model = keras_accum.GradientAccumulationModel.from_model(
            base, gradient_accumulation_steps=8
        )
        ```
        """
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            inputs = outputs = None
        if not inputs or not outputs:
            raise ValueError(
                "`from_model()` needs a functional or `Sequential` model with "
                "defined inputs and outputs (e.g. built from `keras.Input`). "
                f"Received: model={model.name!r} of type "
                f"{type(model).__name__}. For a subclassed model, derive it "
                "from `GradientAccumulationModel` instead of `keras.Model`."
            )
        if isinstance(model, keras.Sequential) or len(inputs) == 1:
            inputs = inputs[0] if len(inputs) == 1 else inputs
        if len(outputs) == 1:
            outputs = outputs[0]
        return cls(
            inputs,
            outputs,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=kwargs.pop("name", model.name),
            **kwargs,
        )

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        # Checked before Keras installs anything: a `compile()` that raises
        # leaves the model as it was.
        optimizer = keras.optimizers.get(optimizer)
        _check_optimizer(
            optimizer,
            self.non_finite_policy,
            # Keras wraps it for `mixed_float16` (`auto_scale_loss`).
            kwargs.get("auto_scale_loss", True)
            and self.dtype_policy.name == "mixed_float16",
        )
        super().compile(optimizer, *args, **kwargs)
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
        self.train_function = _window_train_function(self, self.train_function)
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

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras averages a distributed batch over the replicas only to learn
        # its shapes, which fails under `MultiWorkerMirroredStrategy`.
        if self._distribute_strategy is None or iterator is None:
            return super()._maybe_symbolic_build(iterator, data_batch)
        with self.distribute_strategy.scope():
            self._symbolic_build(
                data_batch=compat.first_replica_batch(
                    self.distribute_strategy, iterator
                )
            )

    def fit(self, *args, callbacks=None, **kwargs):
        callbacks = _with_window_callbacks(self, callbacks)
        return super().fit(*args, callbacks=callbacks, **kwargs)

    def flush_gradients(self):
        """Applies the pending partial window, if any.

        Returns:
            bool: whether an update was applied.
        """
        if (
            self.optimizer is None
            or not self.gradient_accumulator.built
            or self.gradient_accumulation_steps == 1
        ):
            return False
        if int(self.gradient_accumulator.micro_step.numpy()) == 0:
            # Nothing pending: nothing to trace or run. (A local read, also
            # under `tf.distribute`; every worker counts the same.)
            return False
        if self._flush_function is None:
            strategy = self.distribute_strategy

            def flush():
                applied = strategy.run(
                    self.gradient_accumulator.flush,
                    args=(self.optimizer, self.trainable_variables),
                )
                return strategy.experimental_local_results(applied)[0]

            self._flush_function = (
                flush if self.run_eagerly else tf.function(flush)
            )
        return bool(self._flush_function())

    def train_step(self, data):
        x, y, sample_weight = compat.unpack_x_y_sample_weight(data)
        batch_size = tf.shape(
            next(i for i in keras.tree.flatten(x) if i is not None)
        )[0]

        with tf.GradientTape() as tape:
            # BatchNormalization moving statistics: once per window.
            with self._batch_norm_statistics.record(self):
                if self._call_has_training_arg:
                    y_pred = self(x, training=True)
                else:
                    y_pred = self(x)
            loss_normalizer.install(self, x, y, y_pred, sample_weight)
            with loss_normalizer.record_loss_terms() as recording:
                loss = self._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                    training=True,
                )
            self._loss_tracker.update_state(
                compat.unscale_loss_for_distribution(loss),
                sample_weight=batch_size,
            )
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
        return _multi_worker_logs(
            self.distribute_strategy,
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight),
        )

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
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
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


def _window_train_function(model, train_function):
    """Keras' train function, with the window's end when the input runs out.

    It also consumes, without training, the batches that a resumed run
    skips (see `keras_accum.callbacks.BackupAndRestore`).
    """

    def window_train_function(iterator):
        try:
            if model._batches_to_skip:
                count = min(model.steps_per_execution, model._batches_to_skip)
                for _ in range(count):
                    getattr(iterator, "get_next", lambda: next(iterator))()
                model._batches_to_skip -= count
                return model.get_metrics_result()
            return train_function(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            # An epoch of unknown length ended: the window ends before
            # validation and the epoch's callbacks.
            model._batches_to_skip = 0
            if model.flush_at_epoch_end:
                model.flush_gradients()
            raise

    return window_train_function


def _with_window_callbacks(model, callbacks):
    """`callbacks` with the window's end first and last.

    The window ends before any other callback sees an epoch's or the
    training's end, and after all saw the last batch. Our `BackupAndRestore`
    restores before other callbacks start and backs up after the window's
    end.
    """
    first, last = [_WindowEnd()], [_LastWindowEnd()]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        for callback in first + last:
            callback.set_model(model)
            callback.set_params(callbacks.params)
        callbacks.callbacks[:0] = first
        callbacks.callbacks.extend(last)
        return callbacks
    callbacks = list(callbacks or [])
    backups = [c for c in callbacks if isinstance(c, BackupAndRestore)]
    rest = [c for c in callbacks if c not in backups]
    return first + backups + rest + last


class _WindowEnd(keras.callbacks.Callback):
    """Applies a partial window before other callbacks see an epoch's end.

    Runs first. The last epoch's window is applied here even without
    `flush_at_epoch_end`, so before Keras finalizes the weights (EMA).
    """

    def on_epoch_end(self, epoch, logs=None):
        epochs = self.params.get("epochs") if self.params else None
        if (
            self.model.flush_at_epoch_end
            or self.model.stop_training
            or (epochs is not None and epoch + 1 >= epochs)
        ):
            self.model.flush_gradients()

    def on_train_end(self, logs=None):
        self.model.flush_gradients()


class _LastWindowEnd(keras.callbacks.Callback):
    """Applies a partial window after the epoch's last batch, before validation.

    Runs last: every callback sees the last batch as it left the train step.
    For input of unknown length the train function ends the window when the
    input runs out. A window carried over the epoch is applied here when a
    callback stopped the training at the epoch's end.
    """

    def on_train_batch_end(self, batch, logs=None):
        steps = self.params.get("steps") if self.params else None
        if self.model.flush_at_epoch_end and steps and batch + 1 >= steps:
            self.model.flush_gradients()

    def on_epoch_end(self, epoch, logs=None):
        if self.model.stop_training:
            self.model.flush_gradients()
