"""Trains under a `tf.distribute` strategy and compares with one big batch.

Run by `tests/test_distribute.py` in subprocesses, so that the logical device
setup and the cluster do not leak into other tests. Prints one JSON line
per case.

Usage:
    python worker.py --strategy mirrored --case masked
    python worker.py --strategy mirrored --case batchnorm default masked:schedule
    python worker.py --strategy mirrored --case save masked masked:in_step
    python worker.py --strategy mirrored --case masked:unknown,carry
    TF_CONFIG=... python worker.py --strategy multiworker --case default

`save` (mirrored only, run first, before the reductions are counted) is
`save_worker.py`'s run, printed as its JSON line with `"case": "save"`.

Options after the case, separated by commas: `schedule`, `in_step` (as the
flags below), and, under `MirroredStrategy` only, input of unknown length:
`unknown` (a `tf.data` pipeline with `.filter()`), `generator` (a
`Dataset.from_generator`), `carry` (`flush_at_epoch_end=False`). On such
input Keras calls the train function once more at each epoch's end, and
that call's input runs out: it must count nothing. `n1`: N = 1, one update
per train step (Keras' own step on one replica; across replicas, still the
big batch's update).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_MICRO_BATCH = 4  # samples per micro-batch over all replicas
STEPS = 3  # micro-batches per update
SAMPLES = 30  # 8 micro-batches per epoch: windows of 3, 3 and a short 2
# Input of unknown length: epochs that end on a full window (6 micro-batches,
# 2 windows), or with `carry` on a pending one (7 micro-batches, the window
# carried over into the next epoch).
UNKNOWN_SAMPLES = 24
CARRY_SAMPLES = 28
OPTIONS = ("schedule", "in_step", "unknown", "generator", "carry", "n1")
UNKNOWN_LENGTH = ("unknown", "generator")
DROPPED = (0, 4, 8)  # "dropped" case: one non-finite sample per micro-batch
CASES = ("default", "masked", "overflow", "batchnorm", "dropped")


class ReductionCounter:
    """Counts, at run time, the cross-device reductions actually executed.

    Wraps the strategy's cross-device ops (`reduce` and `batch_reduce`, and
    the collective ops' `batch_all_reduce`) so that each executed call adds
    one to a counter variable. Calls inside a `tf.cond` branch that does not
    run are not counted.
    """

    def __init__(self, strategy, enabled=True):
        self.counter = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.tensors = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._depth = 0
        if not enabled:
            return
        # Every cross-device reduction goes through these methods of
        # `tf.distribute.CrossDeviceOps` (also the temporary
        # `ReductionToOneDevice` used for CPU destinations), or through the
        # collective ops' `batch_all_reduce` in replica context.
        base = tf.distribute.CrossDeviceOps
        for method in ("reduce", "batch_reduce"):
            setattr(base, method, self._counting(getattr(base, method), method))
        for value in list(vars(strategy.extended).values()):
            if hasattr(value, "batch_all_reduce"):
                value.batch_all_reduce = self._counting(
                    value.batch_all_reduce, "batch_all_reduce", bound=True
                )

    def _counting(self, original, method, bound=False):
        def wrapper(*args, **kwargs):
            self._depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            # Only reductions inside the compiled train/flush functions:
            # eager reads of replica-local variables are not communication
            # of the training step.
            if self._depth == 0 and not tf.executing_eagerly():
                n = _count_tensors(method, args if bound else args[1:])
                with tf.control_dependencies(tf.nest.flatten(result)):
                    self.counter.assign_add(1)
                    self.tensors.assign_add(n)
            return result

        return wrapper


def _count_tensors(method, args):
    """Tensors reduced by one call (`args` without `self`)."""
    if method == "reduce":
        return 1
    if method == "batch_reduce":
        return len(args[1])
    return len(args[0])


def build_model(cls, keras, case, synchronized=True, **kwargs):
    if case == "batchnorm":
        return build_batch_norm_model(cls, keras, synchronized, **kwargs)
    if case == "masked":
        inputs = keras.Input((6, 6, 2))
        h = keras.layers.Conv2D(3, 3, padding="same", activation="tanh")(
            inputs
        )
        outputs = keras.layers.Conv2D(3, 1)(h)
    else:
        inputs = keras.Input((6,))
        h = keras.layers.Dense(5, activation="tanh")(inputs)
        outputs = keras.layers.Dense(3)(h)
    return cls(inputs, outputs, **kwargs)


def build_batch_norm_model(cls, keras, synchronized=True, **kwargs):
    """BatchNormalization layers directly on the input, on side branches.

    Their moving statistics depend on the input only, so they must equal the
    reference's whatever the weights. A frozen all-zero `Dense` adds exactly
    zero to the logits: the gradients of the BatchNormalization weights are
    exactly zero and every other weight must also equal the reference's
    (with BatchNormalization on the main path, each micro-batch is normalised
    by its own statistics and the weights cannot equal one big batch's).
    Layers: a plain one, a `synchronized=True` one (not with
    `micro_batch_size`, which refuses it) and one called twice.
    """
    layers = keras.layers
    inputs = keras.Input((6,))
    h = layers.Dense(5, activation="tanh")(inputs)
    logits = layers.Dense(3)(h)
    shared = layers.BatchNormalization(momentum=0.6)
    side = layers.Concatenate()(
        [
            layers.BatchNormalization(momentum=0.7)(inputs),
            layers.BatchNormalization(
                momentum=0.8, synchronized=synchronized
            )(inputs),
            shared(inputs),
            shared(layers.Rescaling(-2.0, offset=1.0)(inputs)),
        ]
    )
    zero = layers.Dense(
        3, use_bias=False, kernel_initializer="zeros", trainable=False
    )(side)
    outputs = layers.Add()([logits, zero])
    return cls(inputs, outputs, **kwargs)


def make_data(case, samples=SAMPLES):
    rng = np.random.default_rng(0)
    masked, overflow = case == "masked", case == "overflow"
    if case == "batchnorm":
        # Each sample's place in its micro-batch sets its scale and offset:
        # every replica (and worker) holds different places, so the
        # per-replica statistics differ from each other and from the
        # global ones.
        place = (np.arange(samples) % GLOBAL_MICRO_BATCH)[:, None]
        x = rng.normal(size=(samples, 6)) * (1.0 + place) + 2.0 * place
        x = x * np.linspace(0.5, 2.0, 6) + np.linspace(-1.0, 1.0, 6)
        y = rng.integers(0, 3, size=(samples,))
    elif masked:
        x = rng.normal(size=(samples, 6, 6, 2))
        y = rng.integers(0, 3, size=(samples, 6, 6))
        for i in range(samples):  # 0% .. 80% ignored, varying per sample
            y[i][rng.random((6, 6)) < (i % 5) / 5.0] = 255
    else:
        x = rng.normal(size=(samples, 6))
        y = rng.integers(0, 3, size=(samples,))
    if overflow:
        x[5] = np.nan  # micro-batch 1 (of window 0), on one replica only
    if case == "dropped":
        # Every micro-batch of window 0 on the first replica only (it holds
        # samples 0-1, 4-5 and 8-9): that replica adds nothing to the window.
        x[list(DROPPED)] = np.nan
    return x, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["mirrored", "multiworker"])
    parser.add_argument(
        "--case", nargs="+", default=["default"],
        help="Cases to run one after the other, one JSON line each; "
        "CASE:schedule runs CASE as with --schedule, CASE:in_step as with "
        "--in-step, CASE:unknown,carry on input of unknown length without "
        "flush at epoch end (see the module docstring); save: "
        "save_worker.py's run.",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--no-count", action="store_true")
    parser.add_argument(
        "--schedule", action="store_true",
        help="N = 3 in epoch 0, then 2 (GradientAccumulationScheduler).",
    )
    parser.add_argument(
        "--in-step", action="store_true",
        help="Windows of 3 micro-batches inside one train step "
        "(micro_batch_size), on batches of 12.",
    )
    args = parser.parse_args()
    runs = []
    save = "save" in args.case
    if save and args.strategy != "mirrored":
        parser.error("the save case runs under --strategy mirrored only")
    for spec in args.case:
        if spec == "save":
            continue
        case, _, option = spec.partition(":")
        options = set(option.split(",")) - {""}
        if case not in CASES or not options <= set(OPTIONS) or (
            options - {"schedule", "in_step"}
            and args.strategy != "mirrored"
        ):
            parser.error(f"invalid case: {spec!r}")
        runs.append(argparse.Namespace(
            **dict(
                vars(args), case=case,
                schedule=args.schedule or "schedule" in options,
                in_step=args.in_step or "in_step" in options,
            ),
            input="generator" if "generator" in options else (
                "unknown" if "unknown" in options else "arrays"
            ),
            carry="carry" in options,
            steps=1 if "n1" in options else STEPS,
            spec=spec,
        ))

    if args.strategy == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        worker, workers = 0, 1
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        resolver = strategy.cluster_resolver
        worker = resolver.task_id
        workers = strategy.num_replicas_in_sync  # one replica per worker

    import keras

    keras.config.disable_traceback_filtering()

    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    if save:
        # First, while the strategy's reductions are not wrapped yet.
        import save_worker

        result = save_worker.run(strategy)
        print(json.dumps(dict(result, case="save")))
        sys.stdout.flush()
    counter = ReductionCounter(strategy, enabled=not args.no_count)
    for run in runs:
        result = run_case(run, strategy, counter, worker, workers)
        print(json.dumps(dict(result, case=run.spec)))
        sys.stdout.flush()


def run_case(args, strategy, counter, worker, workers):
    """Trains ours and the reference for `args.case`; returns the results."""
    import keras

    import keras_accum

    masked = args.case == "masked"
    samples = SAMPLES
    if args.input in UNKNOWN_LENGTH:
        samples = CARRY_SAMPLES if args.carry else UNKNOWN_SAMPLES
    x, y = make_data(args.case, samples)

    def loss():
        return keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=255 if masked else None
        )

    keras.utils.set_random_seed(0)
    reference = build_model(keras.Model, keras, args.case)
    initial = reference.get_weights()

    counter.counter.assign(0)
    counter.tensors.assign(0)
    refused = None
    if args.in_step and args.case == "batchnorm":
        # A synchronized layer all-reduces inside the step's loop: refused.
        with strategy.scope():
            model = build_model(
                keras_accum.GradientAccumulationModel, keras, args.case,
                micro_batch_size=2,
            )
            model.compile(optimizer="sgd", loss=loss())
        try:
            model.fit(x[:4], y[:4], batch_size=4, verbose=0)
        except ValueError as error:
            refused = "synchronized=True" in str(error)
    with strategy.scope():
        ours = build_model(
            keras_accum.GradientAccumulationModel, keras, args.case,
            synchronized=not args.in_step,
            gradient_accumulation_steps=1 if args.in_step else args.steps,
            micro_batch_size=(
                GLOBAL_MICRO_BATCH // strategy.num_replicas_in_sync
                if args.in_step else None
            ),
            # With N = 1, the default, which leaves Keras' own step to N = 1
            # on one replica.
            non_finite_policy=(
                "drop_micro_batch" if args.case == "dropped"
                else "auto" if args.steps == 1 else "skip_window"
            ),
            flush_at_epoch_end=not args.carry,
        )
        ours.set_weights(initial)
        ours.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())

    import keras as keras_module

    class StepReductions(keras_module.callbacks.Callback):
        """Reductions executed inside each train step (flushes excluded)."""

        def __init__(self):
            super().__init__()
            self.steps = []

        def on_train_batch_begin(self, batch, logs=None):
            self._start = int(counter.counter.numpy())

        def on_train_batch_end(self, batch, logs=None):
            # Reading a replica-local variable is itself a collective under
            # multi-worker training: only read it with one worker.
            applied = None
            if args.strategy == "mirrored":
                applied = bool(
                    self.model.gradient_accumulator.update_applied.numpy()
                )
            self.steps.append((applied, int(counter.counter.numpy()) - self._start))

    spy = StepReductions()
    steps_by_epoch = [args.steps] * args.epochs
    if args.schedule:
        steps_by_epoch[1:] = [2] * (args.epochs - 1)
        spy = [spy, keras_accum.callbacks.GradientAccumulationScheduler({1: 2})]
    else:
        spy = [spy]
    replicas = strategy.num_replicas_in_sync
    if args.strategy == "mirrored":
        batch = GLOBAL_MICRO_BATCH * (STEPS if args.in_step else 1)
        if args.input == "arrays":
            ours.fit(x, y, batch_size=batch, epochs=args.epochs,
                     shuffle=False, verbose=0, callbacks=spy)
        else:
            ours.fit(unknown_length(args.input, x, y, batch),
                     epochs=args.epochs, verbose=0, callbacks=spy)
    else:
        # Each worker reads its own shard: worker w holds the w-th of the
        # equal parts of every micro-batch (the short last one included).
        def shard(context):
            w = context.input_pipeline_id
            dataset = None
            for k in range(0, samples, GLOBAL_MICRO_BATCH):
                size = min(GLOBAL_MICRO_BATCH, samples - k) // workers
                part = slice(k + w * size, k + (w + 1) * size)
                piece = tf.data.Dataset.from_tensors((x[part], y[part]))
                dataset = piece if dataset is None else dataset.concatenate(
                    piece
                )
            return dataset

        dataset = strategy.distribute_datasets_from_function(shard)
        ours.fit(dataset, epochs=args.epochs, verbose=0, callbacks=spy)

    # The reference: one device, one big batch per window of the same samples.
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
    if args.carry:
        # The windows run across epochs; the last one is flushed at the end.
        x, y = (np.concatenate([a] * args.epochs) for a in (x, y))
        samples *= args.epochs
        steps_by_epoch = [STEPS]
    for epoch_steps in steps_by_epoch:
        window = GLOBAL_MICRO_BATCH * epoch_steps
        for start in range(0, samples, window):
            xb, yb = x[start : start + window], y[start : start + window]
            if args.case == "overflow" and start == 0:
                continue  # the window with a non-finite micro-batch is skipped
            if args.case == "dropped" and start == 0:
                # What the second replica holds; the first one's micro-batches
                # (each with a non-finite sample) are dropped whole.
                held = [
                    i for i in range(window)
                    if i % GLOBAL_MICRO_BATCH >= GLOBAL_MICRO_BATCH // 2
                ]
                xb, yb = x[held], y[held]
            reference.train_on_batch(xb, yb)

    def difference(weights):
        """max over weights of max|change - reference's| / max|reference's|.

        A weight the reference leaves unchanged contributes its absolute
        change.
        """
        diff = 0.0
        for w0, a, b in weights:
            da, db = a - w0, b - w0
            scale = float(np.max(np.abs(da)))
            change = float(np.max(np.abs(da - db)))
            diff = max(diff, change / scale if scale > 0 else change)
        return diff

    weights = list(zip(initial, reference.get_weights(), ours.get_weights()))
    diff = difference(weights)
    moving = [
        i for i, v in enumerate(reference.weights)
        if "moving_mean" in v.path or "moving_variance" in v.path
    ]
    moving_diff = difference([weights[i] for i in moving])
    micro_batches = len(steps_by_epoch) * -(-samples // GLOBAL_MICRO_BATCH)
    return {
        "worker": worker,
        "replicas": replicas,
        "relative_update_difference": diff,
        "moving_statistics": len(moving),
        "moving_statistics_difference": moving_diff,
        "iterations": int(ours.optimizer.iterations.numpy()),
        "reference_iterations": int(reference.optimizer.iterations.numpy()),
        "skipped_windows": int(ours.skipped_windows.numpy()),
        "micro_batches": micro_batches,
        "reductions": int(counter.counter.numpy()),
        "reduced_tensors": int(counter.tensors.numpy()),
        "trainable_tensors": len(ours.trainable_variables),
        "reductions_per_step": spy[0].steps,
        "synchronized_refused": refused,
    }


def unknown_length(kind, x, y, batch):
    """Batches of `x, y` in order, of unknown length (`tf.data` cardinality
    -2): a pipeline with `.filter()`, or a `from_generator` dataset."""
    if kind == "unknown":
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).filter(
            lambda *_: True
        )

    def generator():
        for start in range(0, len(x), batch):
            yield x[start : start + batch], y[start : start + batch]

    return tf.data.Dataset.from_generator(
        generator,
        output_signature=(
            tf.TensorSpec((None,) + x.shape[1:], tf.as_dtype(x.dtype)),
            tf.TensorSpec((None,) + y.shape[1:], tf.as_dtype(y.dtype)),
        ),
    )


if __name__ == "__main__":
    main()
