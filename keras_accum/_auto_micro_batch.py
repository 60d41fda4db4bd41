"""`micro_batch_size="auto"` (docs/design.md, "Training in small memory")."""

import contextlib
import gc
import math
import os
import warnings

import keras
import tensorflow as tf

from keras_accum._tf_utils import components

_MIB = 2**20
_OOM = (tf.errors.ResourceExhaustedError, tf.errors.InvalidArgumentError)


class DeviceMemory:
    """The memory of the device that trains: its limit and its peak."""

    def __init__(self):
        gpus = tf.config.list_physical_devices("GPU")
        self.device = "GPU:0" if gpus else "CPU:0"
        self.limit = None
        if gpus:
            config = tf.config.get_logical_device_configuration(gpus[0])
            if config and config[0].memory_limit:
                self.limit = config[0].memory_limit * _MIB
        else:
            bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower()
            limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "")
            if bfc in ("true", "1") and limit.isdigit():
                self.limit = int(limit) * _MIB
        cpu = self.device == "CPU:0"
        # Whether reaching the limit can end the process instead of raising.
        self.crashes_at_limit = cpu and self.limit is not None
        self._has_statistics = None  # whether `reset_peak()` can reset
        self.unlimited = cpu and self.limit is None

    @contextlib.contextmanager
    def raising_at_limit(self):
        """A block whose functions raise at the limit rather than crash."""
        if not self.crashes_at_limit:
            yield
            return
        options = tf.config.optimizer
        before = options.get_experimental_options()
        options.set_experimental_options({"constant_folding": False})
        try:
            yield
        finally:
            restored = before.get("constant_folding", True)
            options.set_experimental_options({"constant_folding": restored})

    def describe(self, unlimited="memory"):
        """The limit (`unlimited` on a CPU without one), then the peak since
        `reset_peak()` if known."""
        text = "the GPU's memory" if self.device != "CPU:0" else unlimited
        if self.limit is not None:
            text = f"{self.limit / _MIB:,.0f} MiB"
        with contextlib.suppress(ValueError, RuntimeError):  # no statistics
            peak = tf.config.experimental.get_memory_info(self.device)["peak"]
            text += f" (peak {peak / _MIB:,.0f} MiB)" if peak else ""
        return text

    def reset_peak(self):
        if self._has_statistics is False:
            return  # a device without statistics: nothing to reset
        try:
            tf.config.experimental.reset_memory_stats(self.device)
            self._has_statistics = True
        except (ValueError, RuntimeError):
            self._has_statistics = False

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
        elif self.crashes_at_limit and (
            os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") != "0"
        ):
            warnings.warn(
                "A CPU memory limit is set while oneDNN's kernels are on: "
                "some of them crash the process, instead of raising "
                "`ResourceExhaustedError`, when the limit is reached. Set "
                "TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow starts.",
                stacklevel=3,
            )


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
    """Chooses the micro-batch of `micro_batch_size="auto"` per kind of step
    and input signature, and recovers a step that runs out of memory."""

    def __init__(self, model):
        self.model = model
        self.memory = DeviceMemory()
        self.verbose = 0
        self.size = None
        self._checked = False
        self.reset()

    def reset(self):
        """Forgets the traced functions and the sizes (after a retrace)."""
        # Per kind: signature -> [size to try, smallest that failed].
        self._sizes = {"train": {}, "test": {}, "predict": {}}
        self._functions = {}  # (kind, size) -> Keras' function
        # kind -> (its variables, the traced copy): kept while no new
        # function has run (a function's first call may make variables).
        self._snapshots = {}
        self._takes = {}  # kind -> the batch and the copy in one call
        self._said = {}  # (kind, signature) -> the size last reported

    def function(self, kind, make_function):
        """A `kind` (train, test, predict) function as Keras calls it, from
        `make_function(size)`: Keras' function with micro-batches of
        `size`."""
        if not self._checked:
            self._checked = True
            self.memory.check(self.model.jit_compile)

        def run(data):  # an iterator (to predict: a list of batches)
            saved = None
            if kind != "predict" and self._takes_with_snapshot(kind, data):
                # The batch and the state to put back in one traced call.
                batch, saved = self._take(kind, data)
                data = [batch]
            elif kind != "predict":  # taken out before training, to retrain
                iterator, data = data, []
                get = getattr(iterator, "get_next", None) or (
                    lambda: next(iterator)
                )
                while len(data) < self.model.steps_per_execution:
                    try:
                        data.append(get())
                    except (StopIteration, tf.errors.OutOfRangeError):
                        if not data:
                            raise
                        break
            outputs = [
                self._run(kind, batch, make_function, saved if i == 0 else None)
                for i, batch in enumerate(data)
            ]
            if kind != "predict" or len(outputs) == 1:
                return outputs[-1]
            return keras.tree.map_structure(
                lambda *parts: tf.concat(parts, 0), *outputs
            )

        return run

    def _variables(self, kind, with_buffers):
        """What a step of `kind` writes before its update."""
        model = self.model
        variables = model.metrics_variables if kind == "test" else []
        if kind == "train":
            variables = [
                v
                for name, v in model.gradient_accumulator.state().items()
                if with_buffers or not name.startswith("buffer_")
            ]
            statistics = model.window_batch_norm_statistics.state()
            variables += list(statistics.values())
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

    def _saved(self, kind):
        """The values to put back if the step of `kind` fails: one traced
        call that copies them on the device, with no read on the host (the
        gradient buffers only where a window is pending: otherwise the step
        overwrites them)."""
        if kind not in self._snapshots:
            variables = self._variables(kind, with_buffers=True)
            self._snapshots[kind] = (
                variables, self._snapshot_function(kind, variables)
            )
        variables, snapshot = self._snapshots[kind]
        return variables, snapshot()

    def _takes_with_snapshot(self, kind, iterator):
        """Whether a train batch and its snapshot come in one traced call:
        one batch per call from a `tf.data` iterator, on one replica."""
        model = self.model
        return (
            kind == "train"
            and model.steps_per_execution == 1
            and isinstance(iterator, tf.data.Iterator)
            and model.distribute_strategy.num_replicas_in_sync == 1
        )

    def _take(self, kind, iterator):
        """The iterator's next batch and `_saved(kind)`, in one call (the
        eager `get_next()` and a second call cost as much again)."""
        if kind not in self._snapshots:
            self._saved(kind)
        variables, snapshot = self._snapshots[kind]
        take = self._takes.get(kind)
        if take is None:

            @tf.function(autograph=False)
            def take(iterator):
                return iterator.get_next(), snapshot()

            self._takes[kind] = take
        batch, values = take(iterator)
        return batch, (variables, values)

    def _forget_snapshot(self, kind):
        self._snapshots.pop(kind, None)
        self._takes.pop(kind, None)

    def _snapshot_function(self, kind, variables):
        buffers = {
            id(c)
            for name, v in self.model.gradient_accumulator.state().items()
            if name.startswith("buffer_")
            for c in components(v)
        } if kind == "train" else set()
        micro_step = self.model.gradient_accumulator.micro_step

        def copy(c):
            return tf.identity(c.read_value())

        in_buffers = [c for c in variables if id(c) in buffers]

        @tf.function(autograph=False)
        def snapshot():
            values = {id(c): copy(c) for c in variables if id(c) not in buffers}
            if in_buffers:
                # The buffers in one conditional: empty values (nothing to
                # put back) where no window is pending.
                pending = tf.reduce_any(
                    [s.read_value() > 0 for s in components(micro_step)]
                )
                copies = tf.cond(
                    pending,
                    lambda: [copy(c) for c in in_buffers],
                    lambda: [tf.zeros([0], c.dtype) for c in in_buffers],
                )
                values.update(zip(map(id, in_buffers), copies))
            return [values[id(c)] for c in variables]

        # Called as its concrete function, without `tf.function`'s matching
        # of arguments: a fifth less per call.
        return snapshot.get_concrete_function()

    def _roll_back(self, saved, kind):
        """Puts `_saved()`'s values back; zeroes variables made since."""
        variables, values = saved
        saved = {id(c): value for c, value in zip(variables, values)}
        for c in self._variables(kind, with_buffers=True):
            if id(c) in saved:
                value = saved[id(c)]
                if value.shape.num_elements() == 0 and (
                    c.shape.num_elements() != 0
                ):
                    continue  # a buffer with no window pending
                c.assign(value)
            elif not c.name.startswith("buffer_"):
                c.assign(tf.zeros_like(c))

    def _halved(self, kind, size, shape, error):
        """The size to try after `size` ran out of memory; says so."""
        if size <= 1:
            remat = "" if self.model.remat is not False else (
                "`remat=True` (or `remat='auto'`) to recompute activations, "
            )
            raise tf.errors.ResourceExhaustedError(
                None,
                None,
                "Not even one row of the batch fits: a micro-batch of 1 row "
                f"of input shape {(1,) + shape[1:]} (the batch: {shape}) ran "
                f"out of {self.memory.describe()}. Use {remat}smaller inputs, "
                "a smaller model, mixed precision or a device with more memory. "
                f"The error was: {error.message.splitlines()[0]}",
            ) from error
        if self.verbose:
            print(
                f"Out of memory with micro-batches of {size} of the batch of "
                f"{shape[0]} (input shape {shape}): {_SAID[kind][1]} with "
                f"micro-batches of {(size + 1) // 2}."
            )
        return (size + 1) // 2

    def _first_size(self, kind, signature, rows):
        trained = self._sizes["train"]
        if kind != "train" and signature in trained:
            return min(rows, trained[signature][0])
        known = self._sizes[kind] or trained
        if not known:
            return rows
        last, (size, _) = next(reversed(known.items()))
        elements = [
            sum(math.prod(shape) for shape, _ in s) or 1
            for s in (last, signature)
        ]
        scaled = size * elements[0] / elements[1]
        return max(1, min(rows, 2 ** int(math.log2(max(scaled, 1)))))

    def _run(self, kind, data, make_function, saved=None):
        tensors = [
            components(t)[0] for t in keras.tree.flatten(data) if t is not None
        ]
        signature = tuple((tuple(t.shape[1:]), t.dtype.name) for t in tensors)
        shape = tuple(tensors[0].shape)
        rows = int(shape[0])
        sizes = self._sizes[kind]
        if signature not in sizes:
            sizes[signature] = [self._first_size(kind, signature, rows), None]
        state = sizes[signature]
        size = min(state[0], rows)
        while True:
            if saved is None:
                saved = self._saved(kind)
            self.memory.reset_peak()
            if (kind, size) not in self._functions:
                self._functions[kind, size] = make_function(size)
                # Its first call may make variables: snapshot them next time.
                self._forget_snapshot(kind)
            try:
                with self.memory.raising_at_limit():
                    result = self._functions[kind, size](
                        [data] if kind == "predict" else iter([data])
                    )
                break
            except _OOM as error:
                # A failed allocation, also of a traced constant.
                parse = "Cannot parse tensor from proto" in str(error.message)
                if not (parse or isinstance(error, _OOM[0])):
                    raise
                self._roll_back(saved, kind)
                saved = None
                # The failed size's function holds memory (constants).
                self._functions.pop((kind, size), None)
                gc.collect()
                if kind == "train" and size <= 1 and self._recompute(shape):
                    continue
                state[1] = size if state[1] is None else min(state[1], size)
                size = self._halved(kind, size, shape, error)
        if kind == "train":
            self.size = size
        # A batch shorter than the size (and that fitted) says nothing of it.
        if size < rows or size == state[0]:
            state[0] = size
            if rows > size and (state[1] is None or 2 * size < state[1]):
                state[0] = 2 * size  # the next batch of this shape tries it
            else:
                self._say_chosen(kind, size, rows, signature)
        return result

    def _recompute(self, shape):
        """Turns `remat="auto"`'s recomputation on, if it is off; says so."""
        remat = self.model._remat
        if remat.spec != "auto" or remat.enabled:
            return False
        remat.enable()
        self._functions = {
            key: f for key, f in self._functions.items() if key[0] != "train"
        }
        self._forget_snapshot("train")
        if self.verbose:
            print(
                "Out of memory with micro-batches of 1 row of the batch of "
                f"{shape[0]} (input shape {shape}): the step was rolled back "
                "and is trained again recomputing activations in the backward "
                "pass (remat=True)."
            )
        return True

    def _say_chosen(self, kind, size, rows, signature):
        if self._said.get((kind, signature)) == size:
            return
        self._said[kind, signature] = size
        if not self.verbose:
            return
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        line = (
            f"{_SAID[kind][0]} of {size} of the batch of {rows}"
            f"{' per replica' if replicas > 1 else ''}"
        )
        if len(self._sizes[kind]) > 1:
            line += f" (rows of shape {signature[0][0]})"
        if self.memory.unlimited:
            line += " " + self.memory.describe("(no memory limit on this CPU)")
        else:
            line += " fit in " + self.memory.describe()
        print(line + ".")


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
    remat = ""
    if model.remat is False:
        remat = (
            " If one sample per micro-batch does not fit, `remat=True` "
            "recomputes activations in the backward pass instead of keeping "
            "them (`remat='auto'` with `micro_batch_size='auto'`: when "
            "needed)."
        )
    return tf.errors.ResourceExhaustedError(
        error.node_def,
        error.op,
        f"Out of memory in a train step with {what}. Try {suggestion}, or "
        "`micro_batch_size='auto'` to train with the largest micro-batch "
        f"that fits and recover from out-of-memory errors.{remat} The error "
        f"was: {error.message}",
    )
