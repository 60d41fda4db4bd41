"""`micro_batch_size="auto"` (docs/design.md, "Training in small memory")."""

import contextlib
import gc
import math
import os
import warnings

import keras
import tensorflow as tf

from keras_accum import _keras_compat as compat
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
        self._updates_begun = None  # see `_update_counter()`
        self.reset()

    def reset(self):
        """Forgets the traced functions and the sizes (after a retrace)."""
        # Per kind: signature -> [size to try, smallest that failed].
        self._sizes = {"train": {}, "test": {}, "predict": {}}
        self._functions = {}  # (kind, size) -> Keras' function
        # kind -> (its variables, the traced copy): kept while no new
        # function has run (a function's first call may make variables).
        self._snapshots = {}
        self._in_step = None  # the train step's own `_StepSnapshot`
        self._said = {}  # (kind, signature) -> the size last reported

    def function(self, kind, make_function):
        """A `kind` (train, test, predict) function as Keras calls it, from
        `make_function(size)`: Keras' function with micro-batches of
        `size`."""
        if not self._checked:
            self._checked = True
            self.memory.check(self.model.jit_compile)

        def run(data):  # an iterator (to predict: a list of batches)
            if kind != "predict":  # taken out before training, to retrain
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
            outputs = [self._run(kind, batch, make_function) for batch in data]
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
            variables.append(self._update_counter())
        return [
            c
            for v in variables
            for c in components(v.value if isinstance(v, keras.Variable) else v)
        ]

    def _update_counter(self):
        """The count of window updates begun, copied with the rest: a step
        that fails once it moved may have written part of an update, which
        no put-back undoes (the weights and the optimizer's variables are
        not copied: that would double their memory)."""
        if self._updates_begun is None:
            with self.model.distribute_strategy.scope():
                self._updates_begun = tf.Variable(
                    0, dtype=tf.int64, trainable=False,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
            self.model.gradient_accumulator.add_update_begin_listener(
                lambda strategy: self._updates_begun.assign_add(1)
            )
        return self._updates_begun

    def _check_no_update_begun(self, saved, size, error):
        """Raises if the failed step had begun to apply an update."""
        variables, values = saved
        counters = {id(c) for c in components(self._update_counter())}
        for c, value in zip(variables, values):
            if id(c) in counters and int(c.numpy()) != int(value.numpy()):
                raise tf.errors.ResourceExhaustedError(
                    None,
                    None,
                    "Out of memory after the optimizer began to apply the "
                    f"window's update, with micro-batches of {size}: some "
                    "weights and optimizer variables may hold the update and "
                    "others not, so the step cannot be put back and run "
                    "again exactly, and was not. Resume from the last backup "
                    "(`keras_accum.callbacks.BackupAndRestore`) with more "
                    "memory, or with a fixed `micro_batch_size` that fits. "
                    f"The error was: {error.message}",
                ) from error

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

    def _forget_snapshot(self, kind):
        self._snapshots.pop(kind, None)

    def snapshot_in_step(self):
        """Called where the train step is traced, before anything it
        writes: copies the state that the step may write into the variables
        kept for it (`StepSnapshots`), and returns the op that the step's
        writes wait for; `None` under a distribution strategy, whose steps
        are snapshotted by a call of their own (`_saved()`)."""
        if tf.distribute.has_strategy() or self._in_step is None:
            return None
        return self._in_step.take()

    def _prepare_in_step(self):
        """Before a new train function's first call: the copies that its
        step will write (variables are made here, not while tracing)."""
        if self._in_step is None:
            self._in_step = StepSnapshots()
        variables = self._variables("train", with_buffers=True)
        frozen = self._frozen()
        self._in_step.prepare(
            [c for c in variables if id(c) not in frozen], variables
        )

    def _frozen(self):
        """The ids of the variables of frozen layers (`trainable=False`):
        a train step does not write them, their seed generators aside."""
        layers = [
            layer
            for layer in compat.layers_of(self.model)
            if not layer.trainable
        ]
        seeds = {
            id(c)
            for layer in layers
            for generator in compat.seed_generators(layer)
            for c in components(generator.state.value)
        }
        return {
            id(c)
            for layer in layers
            for v in layer.non_trainable_variables
            for c in components(v.value)
        } - seeds

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

    def _roll_back(self, saved, kind, known=None):
        """Puts `_saved()`'s values back; puts variables made since (not in
        `known`, the ids of the variables at the time, by default those
        saved) back to the values they were made with."""
        variables, values = saved
        saved = {id(c): value for c, value in zip(variables, values)}
        known = saved if known is None else known
        for c in self._variables(kind, with_buffers=True):
            if id(c) in saved:
                value = saved[id(c)]
                if value.shape.num_elements() == 0 and (
                    c.shape.num_elements() != 0
                ):
                    continue  # a buffer with no window pending
                c.assign(value)
            elif id(c) not in known and not c.name.startswith("buffer_"):
                c.assign(_initial_value(c))

    def _put_back(self, kind, saved, size, error):
        """Puts back the state before a step that failed: from the step's
        own snapshot if it was taken, otherwise from `saved`.

        Raises:
            ResourceExhaustedError: if the step had begun an update.
        """
        taken = kind == "train" and self._in_step.used and self._in_step.taken()
        known = None
        if taken:
            saved, known = taken
        elif saved is None:
            return  # the step failed before its snapshot: it wrote nothing
        if kind == "train":
            self._check_no_update_begun(saved, size, error)
        self._roll_back(saved, kind, known)

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

    def _run(self, kind, data, make_function):
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
            new = (kind, size) not in self._functions
            if kind == "train" and new:
                self._prepare_in_step()
            # A traced train step snapshots in itself (the first call of a
            # new function also by a call of its own, in case it does not).
            in_step = kind == "train" and self._in_step.used
            saved = None if in_step and not new else self._saved(kind)
            self.memory.reset_peak()
            if new:
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
                self._put_back(kind, saved, size, error)
                # The failed size's function holds memory (constants).
                self._functions.pop((kind, size), None)
                gc.collect()
                if kind == "train" and size <= 1 and self._recompute(shape):
                    continue
                state[1] = size if state[1] is None else min(state[1], size)
                size = self._halved(kind, size, shape, error)
        if kind == "train" and self._in_step.used:
            self._in_step.succeeded()
            if new and self._in_step.missing(self._variables(kind, True)):
                # Variables made by its first call, which the copies lack:
                # the train functions are made again, with new copies.
                self._functions = {
                    key: f for key, f in self._functions.items()
                    if key[0] != "train"
                }
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


def _initial_value(variable):
    """The value `variable` was made with (zeros where TensorFlow kept
    none)."""
    try:
        value = variable.initial_value
    except (AttributeError, RuntimeError, NotImplementedError):
        value = None
    if value is None or not tf.is_tensor(value):
        return tf.zeros_like(variable)
    return value


class StepSnapshots:
    """The state a train step may write, copied by the step itself before
    it writes any of it (the writes wait for the copy).

    Sets of copies are made on the host (one per list of variables), before
    a new train function is first called; the traced step copies into the
    set prepared last, then records the set's index and counts one copy
    more. A step that fails before its copy is complete has written
    nothing; one that fails after it is put back from its copies."""

    def __init__(self):
        self._sets = []  # [(variables, their copies, ids of all at the time)]
        self._done = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._last = tf.Variable(-1, dtype=tf.int64, trainable=False)
        self._counted = 0  # completed copies, as the host knows them
        self._prepared = None  # the set that a trace copies into
        self._traced = None  # the set of the step traced last
        self.used = False  # whether a traced step copies

    def prepare(self, variables, known):
        """Makes (or finds) the set of copies of `variables` that the next
        trace copies into; `known`: every variable of the step now, to tell
        those made since."""
        ids = [id(c) for c in variables]
        for index, (held, _, _) in enumerate(self._sets):
            if [id(c) for c in held] == ids:
                self._prepared = index
                return
        copies = [
            tf.Variable(tf.zeros(c.shape, c.dtype), trainable=False)
            for c in variables
        ]
        self._sets.append((variables, copies, {id(c) for c in known}))
        self._prepared = len(self._sets) - 1

    def take(self):
        """The copy, traced in the step; the op its writes wait for."""
        index = self._traced = self._prepared
        self.used = True
        variables, copies, _ = self._sets[index]
        writes = [copy.assign(c.read_value()) for copy, c in zip(copies, variables)]
        with tf.control_dependencies(writes):
            last = self._last.assign(index)
        with tf.control_dependencies([last]):
            return self._done.assign_add(1)

    def succeeded(self):
        """Counts the completed copy of a step that succeeded."""
        self._counted += 1

    def taken(self):
        """After a step failed: `(saved, known)` for `_roll_back()` if its
        copy was completed, else `None`."""
        done = int(self._done.numpy())
        if done == self._counted:
            return None
        self._counted = done
        variables, copies, known = self._sets[int(self._last.numpy())]
        return (variables, [c.read_value() for c in copies]), known

    def missing(self, variables):
        """Whether `variables` holds one made after the last step's trace."""
        known = set() if self._traced is None else self._sets[self._traced][2]
        return any(id(c) not in known for c in variables)


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
