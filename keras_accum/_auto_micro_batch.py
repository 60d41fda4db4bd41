"""`micro_batch_size="auto"`: the largest micro-batch that fits, per input
shape, and a train step that runs out of memory rolled back and trained
again with half the micro-batch (docs/design.md, "Training in small memory")."""

import contextlib
import gc
import math
import os
import warnings

import keras
import tensorflow as tf

from keras_accum._tf_utils import components

_MIB = 2**20


def _mib(value):
    return f"{value / _MIB:,.0f} MiB"


class DeviceMemory:
    """The memory of the device that trains: its limit and its peak."""

    def __init__(self):
        gpus = tf.config.list_physical_devices("GPU")
        self.limit = None
        if gpus:
            self.device = "GPU:0"
            config = tf.config.get_logical_device_configuration(gpus[0])
            if config and config[0].memory_limit:
                self.limit = config[0].memory_limit * _MIB
        else:
            self.device = "CPU:0"
            bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower()
            limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "")
            if bfc in ("true", "1") and limit.isdigit():
                self.limit = int(limit) * _MIB

    @property
    def crashes_at_limit(self):
        """Whether reaching the limit can end the process instead of raising
        `ResourceExhaustedError`: on a CPU with a limit, XLA's runtime
        aborts, and a graph constant that cannot be allocated crashes it."""
        return self.device == "CPU:0" and self.limit is not None

    @contextlib.contextmanager
    def raising_at_limit(self):
        """A block whose functions raise at the limit rather than crash.

        Grappler's constant folding makes graph constants of some tensors of
        a micro-batch's shape (in BatchNormalization's gradients), which
        TensorFlow (2.21) fails to allocate with a segmentation fault at a
        CPU's limit; where `crashes_at_limit`, the block's functions are
        optimized without it (docs/design.md, "Training in small memory").
        """
        if not self.crashes_at_limit:
            yield
            return
        options = tf.config.optimizer
        before = options.get_experimental_options().get("constant_folding")
        options.set_experimental_options({"constant_folding": False})
        try:
            yield
        finally:
            restored = True if before is None else before
            options.set_experimental_options({"constant_folding": restored})

    @property
    def unlimited(self):
        """Whether nothing but the host's memory limits a CPU's tensors."""
        return self.device == "CPU:0" and self.limit is None

    def describe(self):
        if self.limit is not None:
            return _mib(self.limit)
        return "the GPU's memory" if self.device != "CPU:0" else "memory"

    def reset_peak(self):
        try:
            tf.config.experimental.reset_memory_stats(self.device)
        except (ValueError, RuntimeError):  # no allocator statistics
            pass

    def peak(self):
        """int bytes, the peak since `reset_peak()`; `None` if unknown."""
        try:
            peak = tf.config.experimental.get_memory_info(self.device)["peak"]
        except (ValueError, RuntimeError):
            return None
        return peak or None

    def check(self, jit_compile=False):
        """Warns where "auto" cannot find a limit, or may crash at one."""
        if jit_compile is True and self.crashes_at_limit:
            warnings.warn(
                "`micro_batch_size='auto'` trains without XLA on a CPU with "
                "a memory limit, and evaluates and predicts without it: "
                "XLA's CPU runtime aborts the process, instead of raising "
                "`ResourceExhaustedError`, when the limit is reached.",
                stacklevel=3,
            )
        if self.unlimited:
            warnings.warn(
                "`micro_batch_size='auto'` chooses the largest micro-batch "
                "that fits in the device's memory, but this CPU has no "
                "memory limit: each batch is trained as one micro-batch. To "
                "give the CPU a limit, set TF_CPU_ALLOCATOR_USE_BFC=true and "
                "TF_CPU_BFC_MEM_LIMIT_IN_MB before TensorFlow starts.",
                stacklevel=3,
            )
        elif self.device == "CPU:0" and (
            os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") != "0"
        ):
            warnings.warn(
                "A CPU memory limit is set while oneDNN's kernels are on: "
                "some of them crash the process, instead of raising "
                "`ResourceExhaustedError`, when the limit is reached. Set "
                "TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow starts.",
                stacklevel=3,
            )


class StepRollback:
    """What a train step writes before its update (a test step: the
    metrics), saved and put back (docs/design.md, "Training in small
    memory")."""

    def __init__(self, model):
        self.model = model

    def _variables(self, kind, with_buffers):
        model = self.model
        if kind != "train":
            variables = model.metrics_variables if kind == "test" else []
            return [c for v in variables for c in components(_value(v))]
        accumulator = model.gradient_accumulator
        variables = [
            v
            for name, v in accumulator.state().items()
            if with_buffers or not name.startswith("buffer_")
        ]
        variables += list(model.window_batch_norm_statistics.state().values())
        variables += list(model.non_trainable_variables)
        variables += list(model.metrics_variables)
        optimizer = model.optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            variables += [optimizer.dynamic_scale, optimizer.step_counter]
        return [c for v in variables for c in components(_value(v))]

    def take(self, kind):
        """The values to restore if the step of `kind` fails."""
        pending = kind == "train" and (
            int(self.model.gradient_accumulator.micro_step.numpy()) > 0
        )
        return {
            id(c): (c, tf.identity(c.read_value()))
            for c in self._variables(kind, with_buffers=pending)
        }

    def restore(self, saved, kind):
        """Puts `take()`'s values back; zeroes variables made since then."""
        for c in self._variables(kind, with_buffers=True):
            if id(c) in saved:
                c.assign(saved[id(c)][1])
            elif not c.name.startswith("buffer_"):
                c.assign(tf.zeros_like(c))


def _value(variable):
    """The backend variable of a `keras.Variable` (else itself)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _tensors(data):
    """The first replica's tensors of `data`."""
    return [components(t)[0] for t in keras.tree.flatten(data) if t is not None]


def _signature(data):
    """The input's shapes and dtypes per row."""
    return tuple((tuple(t.shape[1:]), t.dtype.name) for t in _tensors(data))


def _row_elements(signature):
    return sum(math.prod(shape) for shape, _ in signature) or 1


# Per kind of step: what its chosen size is said of, and how it is said to
# run again after running out of memory.
_SAID = {
    "train": ("Micro-batches", "the step was rolled back and is trained again"),
    "test": (
        "Evaluation: micro-batches",
        "the evaluation step was rolled back and runs again",
    ),
    "predict": ("Prediction: micro-batches", "the prediction step runs again"),
}


class AutoMicroBatch:
    """Chooses the micro-batch of `micro_batch_size="auto"` per input
    signature, for training, evaluation and prediction each, and recovers
    a step that runs out of memory."""

    def __init__(self, model):
        self.model = model
        self.memory = DeviceMemory()
        self.rollback = StepRollback(model)
        self.verbose = 0
        self.size = None
        # Per kind: signature -> [size to try, smallest that failed].
        self._sizes = {"train": {}, "test": {}, "predict": {}}
        self._functions = {}  # (kind, size) -> Keras' function
        self._said = {}  # (kind, signature) -> the size last reported
        self._checked = False

    def reset(self):
        """Forgets the traced functions and the sizes (after a retrace)."""
        for sizes in self._sizes.values():
            sizes.clear()
        self._functions.clear()
        self._said.clear()

    def function(self, kind, make_function):
        """A `kind` (train, test, predict) function as Keras calls it, from
        `make_function(size)`: Keras' function with micro-batches of
        `size`."""
        if not self._checked:
            self._checked = True
            self.memory.check(self.model.jit_compile)
        if kind == "predict":

            def predict(data):  # a list of batches
                outputs = [
                    self._run(kind, batch, make_function) for batch in data
                ]
                if len(outputs) == 1:
                    return outputs[0]
                return keras.tree.map_structure(
                    lambda *parts: tf.concat(parts, 0), *outputs
                )

            return predict

        def run(iterator):
            logs = None
            for data in _fetch(iterator, self.model.steps_per_execution):
                logs = self._run(kind, data, make_function)
            return logs

        return run

    def _function(self, kind, size, make_function):
        if (kind, size) not in self._functions:
            self._functions[kind, size] = make_function(size)
        return self._functions[kind, size]

    def _first_size(self, kind, signature, rows):
        trained = self._sizes["train"]
        if kind != "train" and signature in trained:
            return min(rows, trained[signature][0])
        known = self._sizes[kind] or trained
        if not known:
            return rows
        last, (size, _) = next(reversed(known.items()))
        scaled = size * _row_elements(last) / _row_elements(signature)
        return max(1, min(rows, 2 ** int(math.log2(max(scaled, 1)))))

    def _run(self, kind, data, make_function):
        signature = _signature(data)
        rows = int(_tensors(data)[0].shape[0])
        sizes = self._sizes[kind]
        if signature not in sizes:
            sizes[signature] = [self._first_size(kind, signature, rows), None]
        state = sizes[signature]
        size = min(state[0], rows)
        failed = False
        while True:
            saved = self.rollback.take(kind)
            self.memory.reset_peak()
            function = self._function(kind, size, make_function)
            try:
                with self.memory.raising_at_limit():
                    if kind == "predict":
                        result = function([data])
                    else:
                        result = function(iter([data]))
                break
            except (tf.errors.ResourceExhaustedError,
                    tf.errors.InvalidArgumentError) as error:
                if not _out_of_memory(error):
                    raise
                self.rollback.restore(saved, kind)
                # The failed size's function holds memory (constants).
                del function
                self._functions.pop((kind, size), None)
                gc.collect()
                state[1] = size if state[1] is None else min(state[1], size)
                size = self._halved(kind, size, rows, data, error)
                failed = True
        if kind == "train":
            self.size = size
        if failed or size == state[0]:
            # A batch shorter than the size says nothing about it.
            state[0] = size
            if rows > size and (state[1] is None or 2 * size < state[1]):
                state[0] = 2 * size  # the next batch of this shape tries it
            else:
                self._say_chosen(kind, size, rows, signature)
        return result

    def _halved(self, kind, size, rows, data, error):
        size = min(size, rows)
        shape = tuple(_tensors(data)[0].shape)
        if size <= 1:
            peak = self.memory.peak()
            raise tf.errors.ResourceExhaustedError(
                None,
                None,
                "Not even one row of the batch fits: a micro-batch of 1 row "
                f"of input shape {(1,) + shape[1:]} (the batch: {shape}) ran "
                f"out of {self.memory.describe()}"
                + (f" (peak {_mib(peak)})" if peak else "")
                + ". Use smaller inputs, a smaller model, mixed precision "
                "or a device with more memory. The error was: "
                f"{error.message.splitlines()[0]}",
            ) from error
        halved = (size + 1) // 2
        if self.verbose:
            print(
                f"Out of memory with micro-batches of {size} of the batch "
                f"of {rows} (input shape {shape}): {_SAID[kind][1]} with "
                f"micro-batches of {halved}."
            )
        return halved

    def _say_chosen(self, kind, size, rows, signature):
        if self._said.get((kind, signature)) == size:
            return
        self._said[kind, signature] = size
        if not self.verbose:
            return
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        peak = self.memory.peak()
        line = (
            f"{_SAID[kind][0]} of {size} of the batch of {rows}"
            f"{' per replica' if replicas > 1 else ''}"
        )
        if len(self._sizes[kind]) > 1:
            line += f" (rows of shape {signature[0][0]})"
        if self.memory.unlimited:
            line += " (no memory limit on this CPU)"
        else:
            line += f" fit in {self.memory.describe()}"
        if peak:
            line += f" (peak {_mib(peak)})"
        print(line + ".")


def _out_of_memory(error):
    """Whether `error` is a failed allocation (also of a traced constant)."""
    return isinstance(error, tf.errors.ResourceExhaustedError) or (
        "Cannot parse tensor from proto" in (error.message or "")
    )


def _fetch(iterator, count):
    """Up to `count` batches, taken out of the iterator before training."""
    get = getattr(iterator, "get_next", None) or (lambda: next(iterator))
    batches = []
    for _ in range(count):
        try:
            batches.append(get())
        except (StopIteration, tf.errors.OutOfRangeError):
            if not batches:
                raise
            break
    return batches


def out_of_memory_hint(model, error):
    """The out-of-memory error of a fixed micro-batch, saying what to try."""
    size = model.micro_batch_size
    if size is None:
        what = "the whole batch as one micro-batch (`micro_batch_size=None`)"
        suggestion = "a `micro_batch_size` of half the batch"
    else:
        what = f"micro-batches of {size} rows (`micro_batch_size={size}`)"
        suggestion = (
            f"`micro_batch_size={max(1, size // 2)}`" if size > 1
            else "a smaller input or model"
        )
    return tf.errors.ResourceExhaustedError(
        error.node_def,
        error.op,
        f"Out of memory in a train step with {what}. Try {suggestion}, or "
        "`micro_batch_size='auto'` to train with the largest micro-batch "
        "that fits and recover from out-of-memory errors. The error was: "
        f"{error.message}",
    )
