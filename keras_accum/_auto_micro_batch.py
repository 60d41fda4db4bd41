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
                "a memory limit: XLA's CPU runtime aborts the process, "
                "instead of raising `ResourceExhaustedError`, when the limit "
                "is reached. (Evaluation and prediction keep "
                "`jit_compile=True`.)",
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
    """What a train step writes before its update, saved and put back
    (docs/design.md, "Training in small memory")."""

    def __init__(self, model):
        self.model = model

    def _variables(self, with_buffers):
        model = self.model
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
        return [
            c
            for v in variables
            for c in components(v.value if isinstance(v, keras.Variable) else v)
        ]

    def take(self):
        """The values to restore if the step fails."""
        pending = int(self.model.gradient_accumulator.micro_step.numpy()) > 0
        return {
            id(c): (c, tf.identity(c.read_value()))
            for c in self._variables(with_buffers=pending)
        }

    def restore(self, saved):
        """Puts `take()`'s values back; zeroes variables made since then."""
        for c in self._variables(with_buffers=True):
            if id(c) in saved:
                c.assign(saved[id(c)][1])
            elif not c.name.startswith("buffer_"):
                c.assign(tf.zeros_like(c))


def _tensors(data):
    """The first replica's tensors of `data`."""
    return [components(t)[0] for t in keras.tree.flatten(data) if t is not None]


def _signature(data):
    """The input's shapes and dtypes per row."""
    return tuple((tuple(t.shape[1:]), t.dtype.name) for t in _tensors(data))


def _row_elements(signature):
    return sum(math.prod(shape) for shape, _ in signature) or 1


class AutoMicroBatch:
    """Chooses the micro-batch of `micro_batch_size="auto"` per input
    signature and recovers a train step that runs out of memory."""

    def __init__(self, model):
        self.model = model
        self.memory = DeviceMemory()
        self.rollback = StepRollback(model)
        self.verbose = 0
        self.size = None
        self._sizes = {}  # signature -> [size to try, smallest that failed]
        self._functions = {}
        self._said = {}  # signature -> the size last reported
        self._checked = False

    def reset(self):
        """Forgets the traced functions and the sizes (after a retrace)."""
        self._sizes.clear()
        self._functions.clear()
        self._said.clear()

    def train_function(self, make_function):
        """A train function of an iterator, from `make_function(size)`."""
        if not self._checked:
            self._checked = True
            self.memory.check(self.model.jit_compile)

        def train(iterator):
            logs = None
            for data in _fetch(iterator, self.model.steps_per_execution):
                logs = self._train(data, make_function)
            return logs

        return train

    def _function(self, size, make_function):
        if size not in self._functions:
            self._functions[size] = make_function(size)
        return self._functions[size]

    def _first_size(self, signature, rows):
        if not self._sizes:
            return rows
        known, (size, _) = next(reversed(self._sizes.items()))
        scaled = size * _row_elements(known) / _row_elements(signature)
        return max(1, min(rows, 2 ** int(math.log2(max(scaled, 1)))))

    def _train(self, data, make_function):
        signature = _signature(data)
        rows = int(_tensors(data)[0].shape[0])
        if signature not in self._sizes:
            self._sizes[signature] = [self._first_size(signature, rows), None]
        state = self._sizes[signature]
        size = min(state[0], rows)
        failed = False
        while True:
            saved = self.rollback.take()
            self.memory.reset_peak()
            try:
                with self.memory.raising_at_limit():
                    logs = self._function(size, make_function)(iter([data]))
                break
            except (tf.errors.ResourceExhaustedError,
                    tf.errors.InvalidArgumentError) as error:
                if not _out_of_memory(error):
                    raise
                self.rollback.restore(saved)
                # The failed size's function holds memory (constants).
                self._functions.pop(size, None)
                gc.collect()
                state[1] = size if state[1] is None else min(state[1], size)
                size = self._halved(size, rows, data, error)
                failed = True
        self.size = size
        if failed or size == state[0]:
            # A batch shorter than the size says nothing about it.
            state[0] = size
            if rows > size and (state[1] is None or 2 * size < state[1]):
                state[0] = 2 * size  # the next batch of this shape tries it
            else:
                self._say_chosen(size, rows, signature)
        return logs

    def _halved(self, size, rows, data, error):
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
                f"of {rows} (input shape {shape}): the step was rolled back "
                f"and is trained again with micro-batches of {halved}."
            )
        return halved

    def _say_chosen(self, size, rows, signature):
        if self._said.get(signature) == size:
            return
        self._said[signature] = size
        if not self.verbose:
            return
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        peak = self.memory.peak()
        line = (
            f"Micro-batches of {size} of the batch of {rows}"
            f"{' per replica' if replicas > 1 else ''}"
        )
        if len(self._sizes) > 1:
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
