"""Peak memory and step time of one train step with and without `remat=True`.

Configurations, side by side, each in its own fresh child process (this
script re-executes itself with ``--child``):

  * models: ``res8`` (8 residual blocks, each a custom ``keras.layers.Layer``
    (``res8_subclassed``: the same blocks as attributes of a
    ``keras.Model`` subclass that ``fit()`` builds, converted with
    ``from_model()``),
    holding Conv2D(32, 3) + BatchNormalization + ReLU + Conv2D(32, 3) +
    Dropout(0.1), output x + h, on 64x64x32 inputs, then
    GlobalAveragePooling2D + Dense(2), mse), ``unet``
    (``common.unet_graph((128, 128, 3), base_filters=16, depth=3)``, a
    functional graph of plain layers, per-pixel sparse categorical
    cross-entropy from logits) and ``gpt2`` (a keras-hub
    ``GPT2Backbone(vocabulary_size=1000, num_layers=4, num_heads=4,
    hidden_dim=256, intermediate_dim=1024, max_sequence_length=512)`` built
    from its config, no download, in a functional model with inputs
    ``token_ids`` and ``padding_mask`` of length 512 and a Dense(1000) head:
    per-token logits, sparse categorical cross-entropy from logits);
  * micro-batches 1 and 8 (``fit(batch_size=B)``,
    ``gradient_accumulation_steps=1``);
  * graph mode and ``jit_compile=True`` (XLA);
  * ``GradientAccumulationModel(inputs, outputs)`` without and with
    ``remat=True``. Without remat and with N = 1 the model runs Keras' own
    train step; with it, the window's step (one float32 gradient buffer),
    in which each block (res8: the residual blocks; gpt2: the backbone's 4
    transformer layers) or each segment of the graph (unet: about sqrt(n)
    segments) keeps only its inputs in the forward pass and runs again in
    the backward pass.

All use SGD (lr 1e-3, momentum 0.9), the same initial weights (seeded
build) and synthetic data: two distinct batches, cached, repeated.

In the child (run with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before
TensorFlow starts, so that ``tf.config.experimental.get_memory_info("CPU:0")``
reports tensor memory as on a GPU): build and compile, one ``fit`` whose
first step is the warm-up (it traces, or compiles with XLA); after it,
``gc.collect()``, baseline = ``current``, ``reset_memory_stats``; then
``--steps`` timed train steps, each timed from the callback before it to
the callback after it with the step's logs and a weight read back; then
``peak``. Reported: peak - baseline (the memory one train step adds on top
of the weights, optimizer slots, buffers and the cached data), the median
wall time per step and the median process CPU time per step (all threads).
With XLA the step's intermediate values are one temp buffer that XLA asks
TF's allocator for at once, and the BFC allocator counts the region it
takes it from (up to twice the request: a power of two), so the XLA peaks
are coarse; the XLA children therefore also dump the compiled step
(``XLA_FLAGS=--xla_dump_to=<temporary folder>``, removed afterwards) and a
second table gives the temp buffer's exact size from XLA's buffer
assignment.

``--limit-mb N`` is a demonstration instead: one model (``--limit-model``,
default the U-Net at ``--size``, default 512x512x3, base 16, depth 3) trained
at micro-batch 1 in a CPU "device" of N MiB (children run with
``TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=N
TF_ENABLE_ONEDNN_OPTS=0``; oneDNN's convolutions crash the process at the
limit instead of raising) three ways: plain ``keras.Model``,
``GradientAccumulationModel`` without remat, and with ``remat=True``; one
warm-up and ``--limit-timed`` timed steps each. A ``ResourceExhaustedError``,
or a child that crashes, counts as out of memory. ``--limit-mode`` is
``xla`` by default: in graph mode the U-Net's limit is set by the
convolution gradients' im2col buffers (two of 288 MiB at 512x512, often at
the same time), the same with and without remat (benchmarks/README.md).
``--find-limit`` chooses N: it first measures each way's total peak (since
the process started: the limit applies to everything TensorFlow holds)
without a limit, takes N halfway between remat's peak and the smaller of the
other two, runs the three at N and, while the outcome is not "only remat
trains", moves N (up if remat ran out of memory, down if another trained) by
bisection, at most ``--find-steps`` times.

Usage:
    python benchmarks/remat.py --json benchmarks/results/remat_cpu.json
    python benchmarks/remat.py --quick
    python benchmarks/remat.py --models unet --batches 8 --modes graph
    python benchmarks/remat.py --find-limit \
        --json benchmarks/results/remat_limit_cpu.json
    python benchmarks/remat.py --limit-mb 306 --size 512
    python benchmarks/remat.py --find-limit --limit-model gpt2 --limit-mode graph
"""

import argparse
import json
import os
import subprocess
import sys
import time

RESULT_TAG = "REMAT_RESULT "
LIMIT_TAG = "REMAT_LIMIT_RESULT "
MIB = 2**20
# `unet_strided`: the U-Net with strided convolutions instead of max
# pooling, a diagnosis of what XLA's CPU max pooling keeps (not in the
# default list).
MODELS = ("res8", "unet", "gpt2", "unet_strided", "res8_subclassed")
DEFAULT_MODELS = ("res8", "unet", "gpt2")
SEQUENCE_LENGTH = 512
VOCABULARY = 1000


# --------------------------------------------------------------------------
# Models (built in the child, after TensorFlow starts)
# --------------------------------------------------------------------------
def residual_block_class():
    import keras

    L = keras.layers

    class ResidualBlock(keras.layers.Layer):
        """Conv-BN-ReLU-Conv-Dropout, added to the input: a layer that
        holds layers and weights (what `remat=True` recomputes)."""

        def __init__(self, filters, **kwargs):
            super().__init__(**kwargs)
            self.conv1 = L.Conv2D(filters, 3, padding="same")
            self.bn = L.BatchNormalization()
            self.relu = L.ReLU()
            self.conv2 = L.Conv2D(filters, 3, padding="same")
            self.dropout = L.Dropout(0.1)

        def build(self, input_shape):
            self.conv1.build(input_shape)
            shape = self.conv1.compute_output_shape(input_shape)
            self.bn.build(shape)
            self.conv2.build(shape)
            self.built = True

        def call(self, x, training=None):
            h = self.conv1(x)
            h = self.bn(h, training=training)
            h = self.relu(h)
            h = self.conv2(h)
            h = self.dropout(h, training=training)
            return x + h

        def compute_output_shape(self, input_shape):
            return input_shape

    return ResidualBlock


def res8_graph(blocks=8, side=64, channels=32):
    import keras

    ResidualBlock = residual_block_class()
    inputs = keras.Input((side, side, channels), name="features")
    x = inputs
    for i in range(blocks):
        x = ResidualBlock(channels, name=f"res_block_{i}")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(2, name="head")(x)
    return inputs, outputs


def res8_subclassed(blocks=8, channels=32):
    """`res8` as a `keras.Model` subclass, its blocks attributes, built by
    `fit()` in its first step (the model is not built before)."""
    import keras

    ResidualBlock = residual_block_class()

    class Res8(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [
                ResidualBlock(channels, name=f"res_block_{i}")
                for i in range(blocks)
            ]
            self.pool = keras.layers.GlobalAveragePooling2D()
            self.head = keras.layers.Dense(2, name="head")

        def call(self, x, training=None):
            for block in self.blocks:
                x = block(x, training=training)
            return self.head(self.pool(x))

    return Res8(name="res8_subclassed")


def gpt2_graph():
    import keras
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=4, num_heads=4,
        hidden_dim=256, intermediate_dim=1024,
        max_sequence_length=SEQUENCE_LENGTH,
    )
    token_ids = keras.Input((SEQUENCE_LENGTH,), dtype="int32", name="token_ids")
    padding_mask = keras.Input((SEQUENCE_LENGTH,), dtype="int32",
                               name="padding_mask")
    hidden = backbone({"token_ids": token_ids, "padding_mask": padding_mask})
    logits = keras.layers.Dense(VOCABULARY, name="logits")(hidden)
    return {"token_ids": token_ids, "padding_mask": padding_mask}, logits


def model_graph(name, size=None):
    import common

    if name == "res8":
        return res8_graph()
    if name in ("unet", "unet_strided"):
        side = size or 128
        return common.unet_graph(
            (side, side, 3), base_filters=16, depth=3,
            downsample="strided" if name == "unet_strided" else "max_pool",
        )
    if name == "gpt2":
        return gpt2_graph()
    raise ValueError(name)


def model_loss(name):
    import keras

    if name.startswith("res8"):
        return "mse"
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_data(name, batch, num_batches=2, seed=0, size=None):
    """Synthetic data, `num_batches` distinct batches, cached, repeated."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    n = batch * num_batches
    if name.startswith("res8"):
        x = rng.random((n, 64, 64, 32), dtype=np.float32)
        y = rng.random((n, 2), dtype=np.float32)
    elif name in ("unet", "unet_strided"):
        side = size or 128
        x = rng.random((n, side, side, 3), dtype=np.float32)
        y = rng.integers(0, 3, size=(n, side, side), dtype=np.int32)
    elif name == "gpt2":
        x = {
            "token_ids": rng.integers(0, VOCABULARY, (n, SEQUENCE_LENGTH),
                                      dtype=np.int32),
            "padding_mask": np.ones((n, SEQUENCE_LENGTH), np.int32),
        }
        y = rng.integers(0, VOCABULARY, (n, SEQUENCE_LENGTH), dtype=np.int32)
    else:
        raise ValueError(name)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    return ds.batch(batch, drop_remainder=True).cache().repeat()


def build(name, kind, jit, seed, size=None):
    """kind: "plain" (keras.Model), "off" (GradientAccumulationModel) or
    "remat" (GradientAccumulationModel(remat=True)); compiled."""
    import common
    import keras

    keras.utils.set_random_seed(seed)  # the same initial weights everywhere
    if name == "res8_subclassed":
        model = res8_subclassed()
        if kind != "plain":
            model = common.GradientAccumulationModel.from_model(
                model, gradient_accumulation_steps=1, remat=(kind == "remat")
            )
        model.compile(
            optimizer=keras.optimizers.SGD(
                learning_rate=common.LEARNING_RATE, momentum=common.MOMENTUM),
            loss=model_loss(name), jit_compile=jit,
        )
        return model
    inputs, outputs = model_graph(name, size)
    if kind == "plain":
        model = keras.Model(inputs, outputs)
    else:
        model = common.GradientAccumulationModel(
            inputs, outputs, remat=(kind == "remat"))
    model.compile(
        optimizer=keras.optimizers.SGD(
            learning_rate=common.LEARNING_RATE, momentum=common.MOMENTUM),
        loss=model_loss(name), jit_compile=jit,
    )
    return model


def remat_plan(model):
    """What `remat=True` recomputes in `model`, in words."""
    try:
        from keras_accum import remat as remat_lib

        found = remat_lib.plan(model, True)
        parts = []
        if found.blocks:
            parts.append(f"{len(found.blocks)} blocks")
        for functional, segments in found.graphs:
            parts.append(f"{len(segments)} segments of its graph")
        return ", ".join(parts) or "nothing"
    except Exception as exc:  # pragma: no cover - depends on the checkout
        return f"n/a ({type(exc).__name__})"


def step_recorder(device, reset=True):
    """A callback: after the first (warm-up) step, the baseline (tensor
    memory in use) and, with `reset`, a reset of the peak; the time of every
    later step, its logs and a weight read back before the clock stops."""
    import gc

    import common
    import keras
    import tensorflow as tf

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.cpu_times = [], []
            self.baseline = self.start = self.cpu_start = None
            self.warmup_seconds = None

        def on_train_batch_begin(self, batch, logs=None):
            self.cpu_start = time.process_time()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            common.sync(self.model, logs)
            elapsed = time.perf_counter() - self.start
            cpu = time.process_time() - self.cpu_start
            if batch == 0:
                self.warmup_seconds = elapsed
                gc.collect()
                self.baseline = tf.config.experimental.get_memory_info(
                    device)["current"]
                if reset:
                    tf.config.experimental.reset_memory_stats(device)
            else:
                self.times.append(elapsed)
                self.cpu_times.append(cpu)

    return Recorder()


# --------------------------------------------------------------------------
# Child: one configuration
# --------------------------------------------------------------------------
def run_child(args):
    import common
    import tensorflow as tf

    common.configure_threads(args.intra, args.inter)
    common.enable_memory_growth()
    device = "GPU:0" if common.gpus() else "CPU:0"
    record = {"model": args.model, "batch": args.batch,
              "remat": args.kind == "remat", "jit_compile": args.jit,
              "device": device}
    t0 = time.perf_counter()
    model = build(args.model, args.kind, args.jit, args.seed)
    data = model_data(args.model, args.batch, seed=args.seed)
    recorder = step_recorder(device)
    record["build_seconds"] = time.perf_counter() - t0
    model.fit(data, steps_per_epoch=1 + args.steps, epochs=1, verbose=0,
              shuffle=False, callbacks=[recorder])
    # After `fit()`: a subclassed model is built by it.
    n_params, _ = common.trainable_param_bytes(model)
    record["trainable_params"] = n_params
    if args.kind == "remat":
        record["recomputed"] = remat_plan(model)
    info = tf.config.experimental.get_memory_info(device)
    record.update(
        baseline=recorder.baseline, peak=info["peak"],
        attributable=info["peak"] - recorder.baseline,
        step_seconds=recorder.times,
        median_step_seconds=common.median(recorder.times),
        step_cpu_seconds=recorder.cpu_times,
        median_step_cpu_seconds=common.median(recorder.cpu_times),
        warmup_seconds=recorder.warmup_seconds,
    )
    print(RESULT_TAG + json.dumps(record), flush=True)
    return 0


def child_command(args, model, batch, kind, jit):
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child",
        "--model", model, "--batch", str(batch), "--kind", kind,
        "--steps", str(args.steps), "--seed", str(args.seed),
    ]
    if args.intra:
        cmd += ["--intra", str(args.intra)]
    if args.inter:
        cmd += ["--inter", str(args.inter)]
    if jit:
        cmd.append("--jit")
    return cmd


def child_env():
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Lets get_memory_info('CPU:0') report tensor memory, as on a GPU.
    env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    return env


XLA_DUMP_FLAGS = ("--xla_dump_hlo_as_text "
                  "--xla_dump_hlo_module_re=.*one_step_on.*")


def xla_buffer_sizes(directory):
    """From XLA's dump of the compiled train step (after optimizations): the
    size of its preallocated temp buffer (every intermediate value of the
    step, as XLA's buffer assignment packs them) and the total it uses
    (temp, parameters, outputs), per module; the module with the largest
    temp buffer."""
    import glob
    import re

    found = []
    for path in glob.glob(os.path.join(
            directory, "*after_optimizations-buffer-assignment.txt")):
        with open(path) as f:
            text = f.read()
        temps = [int(v) for v in re.findall(
            r"^allocation \d+: size (\d+), preallocated-temp", text, re.M)]
        total = re.search(r"^Total bytes used: (\d+)", text, re.M)
        found.append({"module": os.path.basename(path).split(".cpu_")[0],
                      "temp": sum(temps),
                      "total": int(total.group(1)) if total else None})
    if not found:
        return None
    best = max(found, key=lambda m: m["temp"])
    return dict(best, modules=len(found))


def run_config(args, model, batch, kind, jit):
    import shutil
    import tempfile

    t0 = time.perf_counter()
    env = child_env()
    dump = None
    if jit:
        # XLA asks TF's allocator for its whole temp buffer at once, and the
        # BFC allocator counts the region it took it from (a power of two
        # up to twice the request): XLA's own buffer assignment is the
        # exact figure next to it.
        dump = tempfile.mkdtemp(prefix="remat_xla_dump_")
        env["XLA_FLAGS"] = " ".join(filter(None, [
            env.get("XLA_FLAGS"), f"--xla_dump_to={dump}", XLA_DUMP_FLAGS]))
    try:
        proc = subprocess.run(child_command(args, model, batch, kind, jit),
                              capture_output=True, text=True, env=env)
        xla = xla_buffer_sizes(dump) if dump else None
    finally:
        if dump:
            shutil.rmtree(dump, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-6000:]
        print(f"  child {model} B={batch} {kind} "
              f"{'XLA' if jit else 'graph'} FAILED (exit {proc.returncode}):"
              f"\n{tail}", flush=True)
        return {"model": model, "batch": batch, "remat": kind == "remat",
                "jit_compile": jit, "error": tail, "exit": proc.returncode,
                "seconds": seconds}
    record = json.loads(lines[-1][len(RESULT_TAG):])
    record["seconds"] = seconds
    if xla is not None:
        record["xla_buffers"] = xla
    return record


# --------------------------------------------------------------------------
# --limit-mb / --find-limit: what trains in a device of N MiB
# --------------------------------------------------------------------------
LIMIT_KINDS = ("plain", "off", "remat")
LIMIT_NAMES = {
    "plain": "plain keras.Model",
    "off": "GradientAccumulationModel",
    "remat": "GradientAccumulationModel(remat=True)",
}


def limit_title(args):
    model = {
        "unet": f"U-Net {args.size}x{args.size}x3, base 16, depth 3",
        "res8": MODEL_TITLES["res8"],
        "res8_subclassed": MODEL_TITLES["res8_subclassed"],
        "gpt2": MODEL_TITLES["gpt2"],
    }[args.limit_model]
    mode = "XLA" if args.limit_mode == "xla" else "graph mode"
    return f"{model}, micro-batch 1, {mode}"


def run_limit_child(args):
    """One way (`--kind`) at micro-batch 1 under whatever limit the
    environment sets: one warm-up and `--limit-timed` timed steps; prints
    whether it trained, the total peak (since the process started) and the
    step times."""
    import common
    import tensorflow as tf

    common.configure_threads(args.intra, args.inter)
    device = "CPU:0"
    name = args.limit_model
    size = args.size if name == "unet" else None
    record = {"kind": args.kind, "model": name, "size": size,
              "jit_compile": args.jit, "limit_mib": args.limit_mib}
    times = []
    try:
        model = build(name, args.kind, args.jit, args.seed, size=size)
        if args.kind == "remat":
            record["recomputed"] = remat_plan(model)
        data = model_data(name, 1, num_batches=1, seed=args.seed, size=size)
        # No reset: the peak is the high-water mark since the process
        # started, warm-up step included (what the limit must hold).
        recorder = step_recorder(device, reset=False)
        model.fit(data, steps_per_epoch=1 + args.limit_timed, epochs=1,
                  verbose=0, shuffle=False, callbacks=[recorder])
        times = recorder.times
        record["trained"] = True
    except tf.errors.ResourceExhaustedError as error:
        lines = [ln for ln in error.message.splitlines()
                 if "OOM" in ln or "out of memory" in ln.lower()]
        record["trained"] = False
        record["error"] = (lines or [ln for ln in error.message.splitlines()
                                     if ln.strip()] or [""])[0][:300]
    record["peak"] = tf.config.experimental.get_memory_info(device)["peak"]
    record["step_seconds"] = times
    if times:
        record["median_step_seconds"] = common.median(times)
    print(LIMIT_TAG + json.dumps(record), flush=True)
    return 0


def limit_env(limit_mib):
    """TF's CPU BFC allocator (limited to `limit_mib` MiB unless 0), oneDNN
    off: its convolutions crash the process at the limit instead of
    raising ResourceExhaustedError."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    if limit_mib:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(int(limit_mib))
    else:
        env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    return env


def crash_summary(text):
    """The error lines of a child that crashed (without the log prefix)."""
    import re

    keep = [re.sub(r"^[FEWI]\d{4} [\d:.]+\s+\d+ \S+\] ", "", ln.strip())
            for ln in text.splitlines()
            if ("Error" in ln and ":" in ln and not ln.lstrip().startswith(
                ("File ", "raise "))) or "{{node" in ln
            or "Check failed" in ln]
    return "\n".join(keep[-3:])


def limit_probe(args, kind, limit_mib, probes):
    """`kind` in a fresh child under `limit_mib` (0: no limit)."""
    cmd = [
        sys.executable, os.path.abspath(__file__), "--limit-child",
        "--kind", kind, "--limit-model", args.limit_model,
        "--size", str(args.size), "--seed", str(args.seed),
        "--limit-mib", str(limit_mib), "--limit-timed", str(args.limit_timed),
    ]
    if args.limit_mode == "xla":
        cmd.append("--jit")
    if args.intra:
        cmd += ["--intra", str(args.intra)]
    if args.inter:
        cmd += ["--inter", str(args.inter)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=limit_env(limit_mib))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(LIMIT_TAG)]
    tail = (proc.stderr or proc.stdout)[-3000:]
    if lines:
        record = json.loads(lines[-1][len(LIMIT_TAG):])
        if proc.returncode != 0:
            # It reported, then died (XLA: a BFC check fails at exit after
            # an out-of-memory error).
            record["exit_after_report"] = proc.returncode
            record["exit_error"] = crash_summary(tail)
    else:  # A crash counts as out of memory; say how it ended.
        record = {"kind": kind, "model": args.limit_model,
                  "limit_mib": limit_mib, "trained": False,
                  "crashed": proc.returncode,
                  "error": crash_summary(tail) or tail[-600:]}
    record["seconds"] = time.perf_counter() - t0
    probes.append(record)
    limit = f"{limit_mib} MiB" if limit_mib else "no limit"
    print(f"    {limit:9s} {LIMIT_NAMES[kind]:40s} {outcome(record):24s} "
          f"{record['seconds']:5.0f} s", flush=True)
    return record


def outcome(record):
    if record.get("trained"):
        return "trained"
    code = record.get("crashed")
    if code is None:
        return "out of memory"
    return (f"crashed (signal {-code})" if code < 0
            else f"crashed (exit {code})")


def only_remat_trains(runs):
    return (runs["remat"]["trained"] and not runs["plain"]["trained"]
            and not runs["off"]["trained"])


def find_limit(args, probes, at_limit):
    """The search of `--find-limit`: total peaks without a limit, then N
    halfway between remat's and the smaller of the other two, moved by
    bisection (up while remat runs out of memory, down while another
    trains) until only remat trains, at most `--find-steps` tries."""
    print("  without a limit (total peaks):", flush=True)
    free = {kind: limit_probe(args, kind, 0, probes) for kind in LIMIT_KINDS}
    if not all(r["trained"] for r in free.values()):
        print("A run failed without a limit; no search.")
        return {"unlimited_failed": True}
    peaks = {k: free[k]["peak"] / MIB for k in LIMIT_KINDS}
    search = {"unlimited_peaks_mib": peaks, "tries": []}
    lo, hi = peaks["remat"], min(peaks["plain"], peaks["off"])
    if lo >= hi:
        print(f"remat's peak ({lo:.1f} MiB) is not below the others' "
              f"({hi:.1f} MiB): no search.")
        return search
    limit = int(round((lo + hi) / 2))
    for _ in range(args.find_steps):
        print(f"  at {limit} MiB (between {lo:.0f} and {hi:.0f}):", flush=True)
        runs = at_limit[limit] = {
            k: limit_probe(args, k, limit, probes) for k in LIMIT_KINDS}
        search["tries"].append(
            {"limit_mib": limit,
             "trained": {k: r["trained"] for k, r in runs.items()}})
        if only_remat_trains(runs):
            search["found_mib"] = limit
            break
        if not runs["remat"]["trained"]:
            lo = limit
        else:
            hi = limit
        new = int(round((lo + hi) / 2))
        if new == limit:
            break
        limit = new
    if "found_mib" not in search:
        print("No limit found at which only remat=True trains.")
    return search


def main_limit(args, limits):
    import common

    intra, inter = common.configure_threads(args.intra, args.inter)
    env = common.environment(intra, inter)
    common.print_environment(env)
    if common.gpus():
        print("--limit-mb / --find-limit limit the CPU's allocator; on a GPU "
              "use memory.py's logical devices.")
        return 1
    if not common.have_accum():
        print("keras_accum is not importable: no limit run.")
        return 1
    t_start = time.perf_counter()
    probes = []
    at_limit = {}  # limit -> {kind: record}, the search's runs
    search = {}
    print(f"\n{limit_title(args)}; TF's CPU BFC allocator, oneDNN off; each "
          "run a fresh process ...", flush=True)
    if args.find_limit:
        search = find_limit(args, probes, at_limit)
        if "found_mib" in search:
            limits = [search["found_mib"]] + [v for v in limits
                                              if v != search["found_mib"]]
    results = []
    for limit in limits:
        runs = at_limit.get(limit)
        if runs is None:
            print(f"  at {limit} MiB:", flush=True)
            runs = {k: limit_probe(args, k, limit, probes) for k in LIMIT_KINDS}
        results.append({"limit_mib": limit, "runs": runs,
                        "only_remat_trains": only_remat_trains(runs)})
    if search.get("unlimited_peaks_mib"):
        print(f"\n### Total peak without a limit, {limit_title(args)} "
              "(TF's CPU BFC allocator, oneDNN off, MiB)\n")
        print(common.markdown_table(
            ["way", "total peak (MiB)"],
            [[LIMIT_NAMES[k], common.fmt(v, 1)]
             for k, v in search["unlimited_peaks_mib"].items()]))
        tries = "; ".join(
            f"{t['limit_mib']} MiB: " + ", ".join(
                f"{k} {'trained' if v else 'OOM'}"
                for k, v in t["trained"].items())
            for t in search["tries"])
        if tries:
            print(f"\nTried: {tries}")
    rows = []
    for entry in results:
        for kind in LIMIT_KINDS:
            r = entry["runs"][kind]
            note = r.get("recomputed", "") if r.get("trained") else (
                (r.get("error") or "").splitlines() or [""])[0][:100]
            if r.get("exit_after_report"):
                note += (f"; then exit {r['exit_after_report']}"
                         + (f" ({r['exit_error'].splitlines()[-1][:80]})"
                            if r.get("exit_error") else ""))
            rows.append([
                f"{entry['limit_mib']:,}", LIMIT_NAMES[kind], outcome(r),
                common.fmt_bytes(r.get("peak")) if r.get("trained") else "",
                common.fmt(1e3 * r["median_step_seconds"], 0)
                if r.get("median_step_seconds") else "",
                note,
            ])
    if rows:
        print(f"\n### {limit_title(args)} in a CPU device of N MiB\n")
        print(common.markdown_table(
            ["N (MiB)", "way", "outcome", "total peak (MiB)",
             "ms / step", "error / recomputed"],
            rows, align=["r", "l", "l", "r", "r", "l"]))
        print("\nTotal peak: TF's CPU BFC allocator, since the process "
              "started (warm-up step included); ms / step: median of "
              f"{args.limit_timed} steps after the warm-up one.")
    total = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {total:.0f} s ({len(probes)} processes)")
    common.write_json(args.json, {
        "benchmark": "remat_limit",
        "environment": env,
        "settings": {"model": args.limit_model, "size": args.size,
                     "base_filters": 16, "depth": 3, "batch": 1,
                     "mode": args.limit_mode,
                     "limit_timed": args.limit_timed, "limits_mib": limits,
                     "find_limit": args.find_limit,
                     "find_steps": args.find_steps},
        "search": search,
        "results": results,
        "probes": probes,
        "total_seconds": total,
    })
    return 0

# --------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------
def combine(records):
    """One configuration's repeats as one record: the first, with the
    median peak and the median over all their timed steps."""
    import common

    good = [r for r in records if "error" not in r]
    if not good:
        return records[0]
    if len(good) == 1 and len(records) == 1:
        return good[0]
    record = dict(good[0])
    record["repeats"] = records
    record["attributable"] = common.median([r["attributable"] for r in good])
    for key in ("step_seconds", "step_cpu_seconds"):
        record[key] = [t for r in good for t in r[key]]
    record["median_step_seconds"] = common.median(record["step_seconds"])
    record["median_step_cpu_seconds"] = common.median(
        record["step_cpu_seconds"])
    return record


def _ratio(a, b):
    import common

    return common.fmt(a / b, 2) if a and b else "n/a"


def result_row(results, model, batch, mode):
    """One table row: peaks, step times and their ratios, remat on / off."""
    import common

    off = results[model, batch, mode, "off"]
    on = results[model, batch, mode, "remat"]

    def value(r, key, scale=1.0):
        return None if "error" in r else scale * r[key]

    def shown(v, text):
        return "FAILED" if v is None else text(v)

    peaks = [value(r, "attributable") for r in (off, on)]
    walls = [value(r, "median_step_seconds", 1e3) for r in (off, on)]
    cpus = [value(r, "median_step_cpu_seconds", 1e3) for r in (off, on)]
    return [
        model, batch, "XLA" if mode == "xla" else "graph",
        *(shown(v, common.fmt_bytes) for v in peaks), _ratio(peaks[1], peaks[0]),
        *(shown(v, lambda x: common.fmt(x, 1)) for v in walls),
        _ratio(walls[1], walls[0]), _ratio(cpus[1], cpus[0]),
    ]


def xla_row(results, model, batch):
    """XLA's temp buffer of the compiled step, remat off and on."""
    import common

    temps = [(results[model, batch, "xla", kind].get("xla_buffers") or {})
             .get("temp") for kind in ("off", "remat")]
    return [model, batch, common.fmt_bytes(temps[0]),
            common.fmt_bytes(temps[1]), _ratio(temps[1], temps[0])]


MODEL_TITLES = {
    "res8": "res8 (8 residual blocks, 64x64x32)",
    "res8_subclassed": "res8_subclassed (res8 as a keras.Model subclass, "
                       "built by fit())",
    "unet": "unet (128x128x3, base 16, depth 3)",
    "unet_strided": "unet_strided (the same, strided convolutions for max pooling)",
    "gpt2": "gpt2 (4 layers, 256 wide, 512 tokens)",
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fast sanity run: 2 timed steps, micro-batch 1 "
                             "only")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--batches", default=None,
                        help="comma list of micro-batches (default 1,8; "
                             "quick 1)")
    parser.add_argument("--modes", default="graph,xla",
                        help="comma list of graph, xla")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed train steps after the warm-up one "
                             "(default 10, quick 2)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh processes per configuration, the pair's "
                             "order alternating; medians over all (default 1)")
    parser.add_argument("--intra", type=int, default=None)
    parser.add_argument("--inter", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write raw results here")
    parser.add_argument(
        "--limit-mb", default=None,
        help="comma list of CPU device sizes in MiB: the U-Net at micro-batch "
             "1 as plain keras.Model, GradientAccumulationModel and with "
             "remat=True in each; which run out of memory")
    parser.add_argument(
        "--find-limit", action="store_true",
        help="search a size at which only remat=True trains (peaks without "
             "a limit, then bisection), and report it as --limit-mb would")
    parser.add_argument("--find-steps", type=int, default=4,
                        help="--find-limit: tries at most (default 4)")
    parser.add_argument("--size", type=int, default=512,
                        help="--limit-mb / --find-limit: U-Net input side "
                             "(default 512)")
    parser.add_argument("--limit-model", choices=MODELS, default="unet",
                        help="--limit-mb / --find-limit: the model (default "
                             "unet)")
    parser.add_argument("--limit-mode", choices=("graph", "xla"),
                        default="xla",
                        help="--limit-mb / --find-limit: graph mode or "
                             "jit_compile=True (default xla: in graph mode "
                             "the U-Net's limit is set by the convolution "
                             "gradients' workspace, see benchmarks/README.md)")
    parser.add_argument("--limit-timed", type=int, default=2,
                        help="--limit-mb: timed steps after the warm-up one "
                             "(default 2)")
    # child-only
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--limit-child", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--limit-mib", type=int, default=0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--jit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 10)

    if args.child:
        return run_child(args)
    if args.limit_child:
        return run_limit_child(args)
    limits = [int(v) for v in (args.limit_mb or "").split(",") if v.strip()]
    if limits or args.find_limit:
        return main_limit(args, limits)

    import common

    models = [m for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            parser.error(f"unknown model {m!r}")
    batches = [int(v) for v in (args.batches or ("1" if args.quick else "1,8"))
               .split(",") if v.strip()]
    modes = [m for m in args.modes.split(",") if m.strip()]
    if not set(modes) <= {"graph", "xla"}:
        parser.error("--modes: graph, xla")
    intra, inter = common.configure_threads(args.intra, args.inter)
    env = common.environment(intra, inter)
    common.print_environment(env)
    if not common.have_accum():
        print("keras_accum is not importable: nothing to compare.")
        return 1
    t_start = time.perf_counter()
    # Repeats alternate the order of the pair (off, on; on, off; ...).
    plan = [(m, b, mode, kind, rep) for m in models for b in batches
            for mode in modes for rep in range(args.repeats)
            for kind in (("off", "remat") if rep % 2 == 0
                         else ("remat", "off"))]
    print(f"\nRunning {len(plan)} child processes ({args.steps} timed steps "
          "each, after one warm-up step) ...", flush=True)
    runs = {}
    for m, b, mode, kind, rep in plan:
        rec = run_config(args, m, b, kind, mode == "xla")
        runs.setdefault((m, b, mode, kind), []).append(rec)
        status = "FAILED" if "error" in rec else (
            f"{rec['attributable'] / MIB:8.1f} MiB "
            f"{1e3 * rec['median_step_seconds']:8.1f} ms/step")
        state = "on " if kind == "remat" else "off"
        print(f"  {m:5s} B={b:<2d} {mode:5s} remat={state} {status}  "
              f"({rec['seconds']:.0f} s)", flush=True)
    results = {key: combine(recs) for key, recs in runs.items()}

    rows = [result_row(results, m, b, mode)
            for m in models for b in batches for mode in modes]
    print("\n### Peak TensorFlow memory of one train step (peak - baseline, "
          "MiB) and median time per step, without and with remat=True\n")
    for m in models:
        ref = next((r for k, r in results.items()
                    if k[0] == m and "error" not in r), {})
        plan_text = next((r.get("recomputed") for k, r in results.items()
                          if k[0] == m and k[3] == "remat"
                          and "recomputed" in r), "n/a")
        print(f"* {MODEL_TITLES[m]}: {ref.get('trainable_params', 0):,} "
              f"trainable parameters; remat=True recomputes {plan_text}")
    print()
    print(common.markdown_table(
        ["model", "micro-batch", "mode", "peak, remat off (MiB)",
         "peak, remat=True (MiB)", "peak on / off", "ms / step, off",
         "ms / step, remat=True", "time on / off", "CPU time on / off"],
        rows, align=["l", "r", "l", "r", "r", "r", "r", "r", "r", "r"]))
    xla_rows = [xla_row(results, m, b)
                for m in models for b in batches if "xla" in modes]
    print(f"\nPeak: TF's CPU BFC allocator (get_memory_info('CPU:0')), the "
          "peak over the timed steps minus what was in use after the warm-up "
          f"step; time: median wall time of {args.steps} timed steps"
          + (f" x {args.repeats} processes" if args.repeats > 1 else "")
          + "; CPU time: the process's (all threads), median per step. "
          "Each row's two configurations run in fresh processes, one after "
          "the other.")
    if xla_rows:
        print("\n### XLA: the compiled train step's temp buffer (XLA's buffer "
              "assignment, MiB)\n")
        print(common.markdown_table(
            ["model", "micro-batch", "temp buffer, remat off (MiB)",
             "temp buffer, remat=True (MiB)", "on / off"], xla_rows))
        print("\nUnder XLA the step's intermediate values live in one temp "
              "buffer that XLA asks TF's allocator for at once; the BFC "
              "allocator counts the chunk it gives, the whole region when "
              "that is less than twice the request, so the XLA rows of the "
              "peak table are rounded up to powers of two. This table is "
              "the exact size XLA assigned (from its dump of the compiled "
              "step, after optimizations).")
    total = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {total:.0f} s")
    common.write_json(args.json, {
        "benchmark": "remat",
        "environment": env,
        "settings": {"models": models, "batches": batches, "modes": modes,
                     "steps": args.steps, "repeats": args.repeats,
                     "quick": args.quick,
                     "seed": args.seed},
        "results": [dict(v, mode=k[2], kind=k[3]) for k, v in results.items()],
        "table": rows,
        "xla_table": xla_rows,
        "total_seconds": total,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
