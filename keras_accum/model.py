"""`GradientAccumulationModel`: a `keras.Model` that trains with accumulation."""

import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend
from keras.src import tree
from keras.src.models import functional
from keras.src.models.model import functional_init_arguments
from keras.src.losses import loss as keras_loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_accum import loss_normalizer
from keras_accum.accumulator import GradientAccumulator
from keras_accum.accumulator import is_loss_scale_optimizer
from keras_accum.accumulator import per_replica_values
from keras_accum.batch_norm import WindowBatchNormStatistics
from keras_accum.callbacks import BackupAndRestore

# Keys of the window's state in Keras' weights stores.
_STATE_PREFIX = "keras_accum:"

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


def _to_replicas(values, replicas):
    """Saved per-replica window state, made to fit `replicas` replicas.

    The same number of replicas takes the values as saved. Otherwise the
    window is merged into the first replica: the buffers, normaliser sums
    and BatchNormalization statistics are combined exactly, as the window's
    end would combine them, and the other replicas hold nothing (a window
    with dropped micro-batches cannot be split that way and is discarded,
    with a warning).
    """
    accumulator = values.get("accumulator", {})
    saved = len(accumulator.get("micro_step", [None]))
    if saved == replicas:
        return values
    merged = {"accumulator": {}, "batch_norm": {}}
    for name, per_replica in accumulator.items():
        merged["accumulator"][name] = [per_replica[0]] * replicas
    pending = int(accumulator.get("micro_step", [0])[0])
    if not pending:
        return merged
    accumulated = [int(a) for a in accumulator["accumulated"]]
    if any(a != pending for a in accumulated):
        warnings.warn(
            "The saved window was accumulated on "
            f"{saved} replicas and dropped non-finite micro-batches; it "
            f"cannot be split over {replicas} replicas and is discarded.",
            stacklevel=3,
        )
        for name in ("micro_step", "accumulated"):
            merged["accumulator"][name] = [np.zeros((), np.int64)] * replicas
        return merged
    for name, per_replica in accumulator.items():
        if name == "weight_sum" or name.startswith("buffer_"):
            total = np.sum(per_replica, axis=0)
            merged["accumulator"][name] = [total] + [
                np.zeros_like(total)
            ] * (replicas - 1)
    statistics = values.get("batch_norm", {})
    for name in statistics:
        if not name.endswith("_count"):
            continue
        group = name[: -len("_count")]
        counts = np.asarray(statistics[name])
        means = np.asarray(statistics[group + "_mean"])
        m2s = np.asarray(statistics[group + "_m2"])
        count = counts.sum(axis=0)
        safe = np.where(count > 0, count, 1)
        mean = (counts * means).sum(axis=0) / safe
        m2 = (m2s + counts * (means - mean) ** 2).sum(axis=0)
        for field, value in (("count", count), ("mean", mean), ("m2", m2)):
            merged["batch_norm"][f"{group}_{field}"] = [value] + [
                np.zeros_like(value)
            ] * (replicas - 1)
    return merged


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

    `fit()` feeds micro-batches as usual; their gradients are accumulated in
    float32 buffers and every `gradient_accumulation_steps` micro-batches one
    optimizer update is applied: the update that one batch holding all the
    window's samples would give, to float tolerance. Each micro-batch's
    gradient is weighted by the normaliser of its loss (its number of samples,
    of valid pixels under `ignore_class` or a mask, or its sum of sample
    weights for `reduction="mean_with_sample_weight"`), and the window's sum
    is divided by the window's total, never a mean of per-micro-batch means.
    `optimizer.iterations`, learning-rate schedules, EMA, weight decay and
    clipping count updates. A partial window at the end of an epoch is
    applied, normalised by what it holds, so an epoch equals one epoch of
    `dataset.batch(N * B)`.

    The pending window is saved and restored with the model by every Keras
    saving path and by `tf.train.Checkpoint`; input of unknown length trains
    as the same batches of known length would; the partial window is applied
    before validation and before other callbacks see the epoch's end.
    `keras_accum.callbacks.BackupAndRestore` resumes a killed `fit()`
    exactly.

    Use it like `keras.Model`: functional
    (`GradientAccumulationModel(inputs, outputs, gradient_accumulation_steps=4)`),
    subclassed (`class UNet(GradientAccumulationModel)` with a `call()`), or
    around an existing model with `GradientAccumulationModel.from_model()`.
    A subclass with its own `train_step` can use `self.gradient_accumulator`.

    Args:
        gradient_accumulation_steps: int >= 1, micro-batches per update.
            `1` trains exactly like `keras.Model`.
        flush_at_epoch_end: bool. If `True` (default) a partial window is
            applied at the end of every epoch; if `False` it is carried over
            into the next epoch and applied at the latest when `fit()` ends.
        non_finite_policy: str, what to do with non-finite gradients:
            `"auto"` (default: `"skip_window"` with a `LossScaleOptimizer`,
            else `"propagate"`), `"skip_window"`, `"drop_micro_batch"` or
            `"propagate"`. See `keras_accum.GradientAccumulator`.
        window_batch_norm: bool. If `True` (default) the moving mean and
            variance of every trainable `keras.layers.BatchNormalization`
            are updated once per window, from the statistics of all the
            window's samples, as with one big batch; training-time
            normalisation stays per micro-batch. If `False` they are updated
            on every micro-batch, as Keras does. See
            `keras_accum.batch_norm.WindowBatchNormStatistics`.
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
        if cls is GradientAccumulationModel and functional_init_arguments(
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
        if functional_init_arguments(args, kwargs) and not isinstance(
            self, functional.Functional
        ):
            # A subclass built functionally becomes `Functional`, as Keras
            # does for subclasses of `keras.Model`, but by adding the base to
            # that subclass only: Keras would rewrite the bases of every
            # class above it, this one included, which breaks subclassed
            # models created afterwards.
            cls = type(self)
            cls.__bases__ = cls.__bases__ + (functional.Functional,)
        super().__init__(*args, **kwargs)
        self._flush_function = None
        self._warned_inexact = False
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

        The new model shares the layers (and so the weights) of `model`.

        Args:
            model: a built functional or `Sequential` `keras.Model`.
            gradient_accumulation_steps: int >= 1, micro-batches per update.
            **kwargs: other `GradientAccumulationModel` arguments.

        Returns:
            A `GradientAccumulationModel` with the same inputs and outputs.

        Raises:
            ValueError: if `model` has no symbolic inputs and outputs.

        Example:

        ```python
        import keras
        import keras_accum

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

    # ------------------------------------------------------------------
    # Compile / fit plumbing
    # ------------------------------------------------------------------
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        # Checked before Keras installs anything: a `compile()` that raises
        # leaves the model as it was.
        optimizer = keras.optimizers.get(optimizer)
        inner = optimizer
        if is_loss_scale_optimizer(inner):
            inner = inner.inner_optimizer
        if inner is not None and inner.gradient_accumulation_steps:
            raise ValueError(
                "The optimizer accumulates gradients itself "
                "(`gradient_accumulation_steps="
                f"{inner.gradient_accumulation_steps}`), and so does "
                "`GradientAccumulationModel`: gradients would be accumulated "
                "twice. Drop `gradient_accumulation_steps` from the optimizer "
                "and set it on the model instead."
            )
        # Keras wraps the optimizer for `mixed_float16` (`auto_scale_loss`).
        loss_scaled = is_loss_scale_optimizer(optimizer) or (
            kwargs.get("auto_scale_loss", True)
            and self.dtype_policy.name == "mixed_float16"
        )
        self.gradient_accumulator.resolve_policy(loss_scaled)
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
        inner = self.train_function

        def train_function(iterator):
            try:
                if self._batches_to_skip:
                    return self._skip_batches(iterator)
                return inner(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                # The end of an epoch of unknown length: the window's end
                # comes before validation and the epoch's callbacks.
                self._batches_to_skip = 0
                if self.flush_at_epoch_end:
                    self.flush_gradients()
                raise

        self.train_function = train_function
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

    def _skip_batches(self, iterator):
        """Consumes one call's batches without training on them."""
        count = min(self.steps_per_execution, self._batches_to_skip)
        for _ in range(count):
            if hasattr(iterator, "get_next"):
                iterator.get_next()
            else:
                next(iterator)
        self._batches_to_skip -= count
        return self.get_metrics_result()

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras averages a distributed batch across replicas (`reduce("MEAN")`)
        # only to learn its shapes, which fails under
        # `MultiWorkerMirroredStrategy`; one replica's batch has the shapes.
        if self._distribute_strategy is None or iterator is None:
            return super()._maybe_symbolic_build(iterator, data_batch)
        for _, _, it in iterator:
            data_batch = next(it)
            break
        strategy = self.distribute_strategy
        data_batch = tree.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues)
            else v,
            data_batch,
        )
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def fit(self, *args, callbacks=None, **kwargs):
        # The window's end comes before any other callback sees the epoch's
        # or the training's end, and after they all saw the last batch.
        first, last = [_WindowEnd()], [_LastWindowEnd()]
        if isinstance(callbacks, keras.callbacks.CallbackList):
            for callback in first + last:
                callback.set_model(self)
                callback.set_params(callbacks.params)
            callbacks.callbacks[:0] = first
            callbacks.callbacks.extend(last)
        else:
            callbacks = list(callbacks or [])
            # Our `BackupAndRestore` restores before any other callback
            # starts, and backs up after the window's end.
            backups = [c for c in callbacks if isinstance(c, BackupAndRestore)]
            rest = [c for c in callbacks if c not in backups]
            callbacks = first + backups + rest + last
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
            # Nothing pending (e.g. the epoch ended on a window boundary):
            # no flush function to trace or run. `micro_step` aggregates as
            # `ONLY_FIRST_REPLICA`, so this read is local to the worker even
            # under `tf.distribute`, and all workers see the same count.
            return False
        if self._flush_function is None:

            def flush_step():
                applied = self.gradient_accumulator.flush(
                    self.optimizer, self.trainable_variables
                )
                self._batch_norm_statistics.end_window(applied)
                return applied

            def flush():
                result = self.distribute_strategy.run(flush_step)
                return self.distribute_strategy.experimental_local_results(
                    result
                )[0]

            self._flush_function = (
                flush if self.run_eagerly else tf.function(flush)
            )
        return bool(self._flush_function())

    # ------------------------------------------------------------------
    # The train step
    # ------------------------------------------------------------------
    def train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        batch_size = tf.shape(
            next(i for i in tree.flatten(x) if i is not None)
        )[0]

        with tf.GradientTape() as tape:
            # BatchNormalization moving statistics: once per window.
            with self._batch_norm_statistics.record(self):
                if self._call_has_training_arg:
                    y_pred = self(x, training=True)
                else:
                    y_pred = self(x)
            self._install_loss_recording(x, y, y_pred, sample_weight)
            with loss_normalizer.record_loss_terms() as recording:
                loss = self._compute_loss(
                    x=x,
                    y=y,
                    y_pred=y_pred,
                    sample_weight=sample_weight,
                    training=True,
                )
            self._loss_tracker.update_state(
                keras_loss_module.unscale_loss_for_distribution(loss),
                sample_weight=batch_size,
            )
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)

        if self.trainable_weights:
            trainable_weights = self.trainable_weights
            gradients = tape.gradient(loss, trainable_weights)
            weight = self._micro_batch_weight(recording, batch_size)
            self.gradient_accumulator.accumulate_and_maybe_apply(
                gradients,
                self.optimizer,
                trainable_weights,
                weight=weight,
                # Keras divides each replica's mean loss by the number of
                # replicas; the window's normaliser is global instead.
                gradient_scale=keras_loss_module.unscale_loss_for_distribution(
                    tf.ones(())
                ),
            )
            self._batch_norm_statistics.end_step(self.gradient_accumulator)
        else:
            warnings.warn("The model does not have any trainable weights.")
        return self._multi_worker_logs(
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        )

    def test_step(self, data):
        return self._multi_worker_logs(super().test_step(data))

    def _multi_worker_logs(self, logs):
        """Logs that Keras can average across workers.

        Under multi-worker `tf.distribute`, Keras averages each log with
        `strategy.reduce("MEAN", value, axis=0)`, which fails for scalars;
        give scalars a leading axis of one (the mean is the same).
        """
        strategy = self.distribute_strategy
        multi_worker = isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy
        ) and strategy.extended._in_multi_worker_mode()
        if not multi_worker:
            return logs
        return tree.map_structure(
            lambda v: tf.reshape(v, [1]) if v.shape.rank == 0 else v, logs
        )

    def _install_loss_recording(self, x, y, y_pred, sample_weight):
        """Wraps the compiled losses so that their normalisers are seen.

        Without a distribution strategy Keras builds `CompileLoss` lazily, on
        its first call; build it here first, symbolically (no side effects),
        as Keras' own `_symbolic_build` does.
        """
        compile_loss = self._compile_loss
        if compile_loss is None:
            return
        if not compile_loss.built:

            def spec(value):
                if value is None:
                    return None
                return keras.KerasTensor(value.shape, value.dtype)

            backend.compute_output_spec(
                self._compute_loss,
                tree.map_structure(spec, x),
                tree.map_structure(spec, y),
                tree.map_structure(spec, y_pred),
                sample_weight=tree.map_structure(spec, sample_weight),
                training=False,
            )
        loss_normalizer.install(compile_loss)

    def _micro_batch_weight(self, recording, batch_size):
        """The normaliser `D` of this micro-batch's loss.

        `D` is `None` for a loss that is a sum (`reduction="sum"`).
        """
        terms = recording.terms
        if len(terms) == 1 and recording.unknown_terms == 0:
            return terms[0].normalizer
        if recording.unknown_terms or any(
            t.data_dependent or t.normalizer is None for t in terms
        ):
            if not self._warned_inexact:
                self._warned_inexact = True
                warnings.warn(
                    "GradientAccumulationModel: the model's loss has several "
                    "terms whose normalisers differ (masked or weighted "
                    "outputs, `reduction='sum'`, or a custom loss object). "
                    "Micro-batches are weighted by their number of samples, "
                    "which equals the big batch only when every term is a "
                    "per-sample mean. See the README's 'Exactness' section.",
                    stacklevel=2,
                )
        return batch_size

    # ------------------------------------------------------------------
    # Serialization
    # ------------------------------------------------------------------
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

    # ------------------------------------------------------------------
    # The window's state in Keras' weights files
    # ------------------------------------------------------------------
    def save_own_variables(self, store):
        """Saves the model's own variables and the pending window's state.

        The window's state (`gradient_accumulator.state()` and the
        BatchNormalization window statistics, one value per replica) is
        saved under keys of its own beside Keras' numbered ones, so `.keras`
        files, `.weights.h5` files, `ModelCheckpoint` and `BackupAndRestore`
        keep a window that is part-way through.
        """
        super().save_own_variables(store)
        for part, obj in self._window_state_parts():
            for name, variable in obj.state().items():
                for r, value in enumerate(per_replica_values(variable)):
                    store[f"{_STATE_PREFIX}{part}:{name}:{r}"] = value

    def load_own_variables(self, store):
        """Loads what `save_own_variables` saved.

        A file without window state (saved by keras_accum 0.1, or by a plain
        `keras.Model`) loads with an empty window. The optimizer is built
        first if need be, so that its saved state is loaded too.
        """
        if self.built:
            self._build_window_state()
        own = {}
        saved = {}
        for key in store.keys():
            if key.startswith(_STATE_PREFIX):
                part, name, replica = key[len(_STATE_PREFIX) :].split(":")
                saved.setdefault(part, {}).setdefault(name, {})[
                    int(replica)
                ] = np.asarray(store[key])
            else:
                own[key] = store[key]
        super().load_own_variables(own if saved else store)
        values = {
            part: {
                name: [per_replica[r] for r in sorted(per_replica)]
                for name, per_replica in names.items()
            }
            for part, names in saved.items()
        }
        values = _to_replicas(
            values, self.distribute_strategy.num_replicas_in_sync
        )
        for part, obj in self._window_state_parts():
            obj.restore(values.get(part, {}))
        self._flush_function = None

    def _window_state_parts(self):
        return (
            ("accumulator", self.gradient_accumulator),
            ("batch_norm", self._batch_norm_statistics),
        )

@keras.saving.register_keras_serializable(package="keras_accum")
class FunctionalGradientAccumulationModel(
    GradientAccumulationModel, functional.Functional
):
    """The class of `GradientAccumulationModel(inputs, outputs, ...)`."""


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
