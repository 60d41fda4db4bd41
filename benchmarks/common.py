"""Shared helpers for the benchmark scripts.

Import this module before TensorFlow so that the logging level is set in time.
It defines the benchmark networks (dense networks of any width and depth, a
small conv net, a stack of Conv2D + BatchNormalization blocks and a U-Net),
the synthetic data, the model/optimizer factories for the configurations
being compared (plain ``keras.Model``, ``GradientAccumulationModel`` across
train steps or within one step with ``micro_batch_size``, and the built-in
``gradient_accumulation_steps`` optimizer option), plus small statistics and
Markdown-table utilities.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402

# Benchmark the working tree's package when run from a checkout
# (``python benchmarks/throughput.py``), even if it is not installed.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(1, _REPO_ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

try:  # The package under test; the scripts degrade gracefully without it.
    from keras_accum import GradientAccumulationModel  # noqa: E402

    ACCUM_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the checkout
    GradientAccumulationModel = None
    ACCUM_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"



def have_accum():
    return GradientAccumulationModel is not None


LEARNING_RATE = 1e-3
MOMENTUM = 0.9


# --------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------
def configure_threads(intra=None, inter=None):
    """Pin TF's thread pools (must run before the first TF op).

    Defaults: intra-op = number of visible CPUs, inter-op = 2. The same
    values apply to every configuration in a process; child processes get
    them passed explicitly.
    """
    ncpu = os.cpu_count() or 1
    intra = ncpu if not intra else intra
    inter = 2 if not inter else inter
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    return intra, inter


def gpus():
    return tf.config.list_physical_devices("GPU")


def enable_memory_growth():
    for gpu in gpus():
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:
            pass


def device_description():
    gpu_list = gpus()
    if gpu_list:
        names = []
        for gpu in gpu_list:
            try:
                details = tf.config.experimental.get_device_details(gpu)
                names.append(details.get("device_name", gpu.name))
            except Exception:
                names.append(gpu.name)
        return "GPU: " + ", ".join(names)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU only: {os.cpu_count()} cores ({cpu})"


def source_revision():
    """Commit of the checkout being benchmarked, '+dirty' if keras_accum/ has
    uncommitted changes; None outside a git checkout."""
    import subprocess

    try:
        rev = subprocess.run(
            ["git", "-C", _REPO_ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", _REPO_ROOT, "status", "--porcelain", "--", "keras_accum"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) if rev else None


def environment(intra=None, inter=None):
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "device": device_description(),
        "cpu_count": os.cpu_count(),
        "intra_op_threads": intra,
        "inter_op_threads": inter,
        "revision": source_revision(),
        "keras_accum": (
            "available"
            if GradientAccumulationModel is not None
            else f"NOT importable ({ACCUM_IMPORT_ERROR})"
        ),
    }


def print_environment(env):
    print(
        f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, "
        f"Python {env['python']}; {env['device']}; TF threads "
        f"intra={env['intra_op_threads']} inter={env['inter_op_threads']}; "
        f"revision {env['revision']}"
    )
    if GradientAccumulationModel is None:
        print(
            "\nNOTE: keras_accum is not importable "
            f"({ACCUM_IMPORT_ERROR}); the GradientAccumulationModel rows "
            "are skipped.\n"
        )


# --------------------------------------------------------------------------
# Networks
# --------------------------------------------------------------------------
def conv_net_graph(input_shape=(32, 32, 3), num_classes=10):
    """Small VGG-style classifier, ~42k parameters."""
    L = keras.layers
    inputs = keras.Input(shape=input_shape, name="image")
    x = inputs
    for filters in (16, 32):
        x = L.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = L.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = L.MaxPooling2D()(x)
    x = L.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    x = L.Dense(64, activation="relu")(x)
    outputs = L.Dense(num_classes, name="logits")(x)
    return inputs, outputs


def unet_graph(input_shape=(64, 64, 3), num_classes=3, base_filters=16, depth=3,
               downsample="max_pool"):
    """Standard U-Net: (conv-BN-ReLU)x2 blocks, max-pool down (or, with
    `downsample="strided"`, a 2x2 convolution of stride 2), transposed-conv
    up, skip concatenations, 1x1 conv to class logits."""
    L = keras.layers

    def block(x, filters):
        for _ in range(2):
            x = L.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = L.BatchNormalization()(x)
            x = L.Activation("relu")(x)
        return x

    inputs = keras.Input(shape=input_shape, name="image")
    skips = []
    x = inputs
    for level in range(depth):
        x = block(x, base_filters * 2**level)
        skips.append(x)
        if downsample == "strided":
            x = L.Conv2D(x.shape[-1], 2, strides=2, use_bias=False)(x)
        else:
            x = L.MaxPooling2D()(x)
    x = block(x, base_filters * 2**depth)
    for level in reversed(range(depth)):
        filters = base_filters * 2**level
        x = L.Conv2DTranspose(filters, 2, strides=2, padding="same")(x)
        x = L.Concatenate()([x, skips[level]])
        x = block(x, filters)
    outputs = L.Conv2D(num_classes, 1, name="logits", dtype="float32")(x)
    return inputs, outputs


def mlp_graph(input_shape=(1024,), num_classes=10, width=1024, depth=4):
    """Dense network: ``depth`` hidden ReLU layers of ``width`` units.

    At the defaults, a parameter-heavy net (~4.2M parameters): little
    compute per parameter, so the per-step cost of the optimizer update and
    of the accumulation is a large share of the step, and this network shows
    their overhead, which the convolutional ones hide. With a small width
    and depth (the ``small_mlp`` network: 32 features, 2 x 64 units, ~7k
    parameters) a step does almost no arithmetic and its time is the fixed
    per-step overhead (function call, host round trip, op dispatch).
    """
    L = keras.layers
    inputs = keras.Input(shape=input_shape, name="features")
    x = inputs
    for _ in range(depth):
        x = L.Dense(width, activation="relu")(x)
    outputs = L.Dense(num_classes, name="logits")(x)
    return inputs, outputs


def conv_bn_graph(input_shape=(16, 16, 3), num_classes=10, filters=16,
                  blocks=12):
    """A stack of ``blocks`` (Conv2D 3x3 -> BatchNormalization -> ReLU)
    blocks of ``filters`` channels at the input's resolution, then global
    average pooling and the logits: compute-bound (every block is a full
    convolution), with as many BatchNormalization layers as convolutions."""
    L = keras.layers
    inputs = keras.Input(shape=input_shape, name="image")
    x = inputs
    for _ in range(blocks):
        x = L.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = L.BatchNormalization()(x)
        x = L.Activation("relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    outputs = L.Dense(num_classes, name="logits", dtype="float32")(x)
    return inputs, outputs


def network_graph(spec):
    if spec["arch"] == "conv_bn":
        return conv_bn_graph(
            tuple(spec["input_shape"]),
            spec["num_classes"],
            spec.get("filters", 16),
            spec.get("blocks", 12),
        )
    if spec["arch"] == "mlp":
        return mlp_graph(
            tuple(spec["input_shape"]),
            spec["num_classes"],
            spec.get("width", 1024),
            spec.get("depth", 4),
        )
    if spec["arch"] == "convnet":
        return conv_net_graph(tuple(spec["input_shape"]), spec["num_classes"])
    if spec["arch"] == "unet":
        return unet_graph(
            tuple(spec["input_shape"]),
            spec["num_classes"],
            spec.get("base_filters", 16),
            spec.get("depth", 3),
        )
    raise ValueError(spec["arch"])


def make_data(spec, batch_size, num_batches=4, seed=0):
    """Synthetic in-memory data, repeated forever: ``num_batches`` distinct
    batches of ``batch_size`` samples, cached after batching."""
    rng = np.random.default_rng(seed)
    n = batch_size * num_batches
    x = rng.random((n,) + tuple(spec["input_shape"]), dtype=np.float32)
    if spec["arch"] == "unet":
        y_shape = (n,) + tuple(spec["input_shape"][:2])
    else:
        y_shape = (n,)
    y = rng.integers(0, spec["num_classes"], size=y_shape, dtype=np.int32)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    return ds.batch(batch_size, drop_remainder=True).cache().repeat()


# --------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------
def config_label(kind, n, micro_batch_size=None):
    if kind == "ours-instep":
        b = "B" if micro_batch_size is None else str(micro_batch_size)
        return (f"GradientAccumulationModel(micro_batch_size={b}) in-step, "
                f"batch {n}x{b}")
    if kind == "plain":
        return "plain keras.Model" if n in (None, 1) else f"plain keras.Model, batch x{n}"
    if kind == "ours":
        return f"GradientAccumulationModel N={n}"
    if kind == "builtin":
        return f"built-in SGD(gradient_accumulation_steps={n})"
    if kind == "ours-nobn":
        return f"GradientAccumulationModel N={n}, window_batch_norm=False"
    raise ValueError(kind)


def build_model(spec, kind, n=1, jit_compile=False, weights=None,
                micro_batch_size=None, accum_kwargs=None):
    """Build and compile one configuration.

    kind: "plain"     -> keras.Model, plain SGD
          "ours"      -> GradientAccumulationModel(..., gradient_accumulation_steps=n)
          "ours-instep" -> GradientAccumulationModel(...,
                         micro_batch_size=micro_batch_size): each train step
                         splits its batch (fed as n * micro_batch_size rows)
                         into n micro-batches and applies one update
          "ours-nobn" -> the same with window_batch_norm=False (BatchNormalization
                         moving statistics updated per micro-batch, as Keras does)
          "builtin"   -> keras.Model, SGD(..., gradient_accumulation_steps=n)
    All use SGD(lr=1e-3, momentum=0.9) and sparse categorical cross-entropy
    from logits, no metrics. ``accum_kwargs``: further keyword arguments of
    ``GradientAccumulationModel`` (e.g. ``non_finite_policy``) for the
    "ours" kinds.
    """
    inputs, outputs = network_graph(spec)
    opt_kwargs = {}
    if kind == "plain":
        model = keras.Model(inputs, outputs)
    elif kind in ("ours", "ours-nobn"):
        if GradientAccumulationModel is None:
            raise RuntimeError(f"keras_accum not importable: {ACCUM_IMPORT_ERROR}")
        extra = {"window_batch_norm": False} if kind == "ours-nobn" else {}
        extra.update(accum_kwargs or {})
        model = GradientAccumulationModel(
            inputs, outputs, gradient_accumulation_steps=n, **extra
        )
    elif kind == "ours-instep":
        if GradientAccumulationModel is None:
            raise RuntimeError(f"keras_accum not importable: {ACCUM_IMPORT_ERROR}")
        if micro_batch_size is None:
            raise ValueError("ours-instep needs micro_batch_size")
        model = GradientAccumulationModel(
            inputs, outputs, micro_batch_size=micro_batch_size,
            **(accum_kwargs or {})
        )
    elif kind == "builtin":
        model = keras.Model(inputs, outputs)
        opt_kwargs["gradient_accumulation_steps"] = n
    else:
        raise ValueError(kind)
    if weights is not None:
        model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(
            learning_rate=LEARNING_RATE, momentum=MOMENTUM, **opt_kwargs
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def reference_weights(spec, seed=0):
    keras.utils.set_random_seed(seed)
    inputs, outputs = network_graph(spec)
    return keras.Model(inputs, outputs).get_weights()


def trainable_param_bytes(model):
    """Bytes of ONE float32 copy of the trainable parameters."""
    count = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    return count, 4 * count


def sync(model, logs=None):
    """Block until all queued work is finished (matters on GPU)."""
    if logs is not None:
        for value in tf.nest.flatten(logs):
            if hasattr(value, "numpy"):
                value.numpy()
    model.trainable_weights[-1].numpy()


# --------------------------------------------------------------------------
# Statistics and output
# --------------------------------------------------------------------------
def median(values):
    return statistics.median(values)


def fmt(x, digits=2):
    if x is None:
        return "n/a"
    return f"{x:.{digits}f}"


def fmt_bytes(n, unit="MiB"):
    if n is None:
        return "n/a"
    div = {"MiB": 2**20, "GiB": 2**30, "KiB": 2**10}[unit]
    return f"{n / div:.1f}"


def markdown_table(headers, rows, align=None):
    align = align or ["l"] + ["r"] * (len(headers) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def write_json(path, payload):
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
    print(f"\nRaw results written to {path}")
