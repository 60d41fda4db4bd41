"""Peak training memory of each configuration, each in its own fresh process.

Configurations (U-Net, micro-batch B, N in {2, 4, 8, 16}):
  * plain ``keras.Model`` at batch B                 (the reference)
  * plain ``keras.Model`` at batch N*B               (what accumulation avoids)
  * ``GradientAccumulationModel`` at (B, N)
  * built-in ``SGD(gradient_accumulation_steps=N)`` at (B, N)
  * ``GradientAccumulationModel(micro_batch_size=B)`` fed batches of S = N*B
    rows ("in-step": N micro-batches inside each train step, one update per
    step), N in {2, 8, 32}

Every configuration runs in a new child process (this script re-executes
itself with ``--child``), so allocator state never leaks between them. In the
child: build + compile the model, create the data, ``gc.collect()``, then take
the baseline; train with ``model.fit``; then read the peak.

  * RSS (always): the baseline is the resident set size (VmRSS) after the
    model is built; the kernel's peak-RSS counter (VmHWM) is reset to that
    value by writing 5 to /proc/self/clear_refs, and read again after
    training. It contains everything training adds: optimizer slots,
    accumulators, activations, gradients, data batches in flight, and also
    the traced graphs / runtime caches (host-side, not tensors).
  * Tensor memory: ``tf.config.experimental.get_memory_info(device)``;
    baseline = ``current`` after the build, ``reset_memory_stats``, then
    ``peak`` after training. On GPU this is the GPU memory measure. On CPU
    it needs TF's BFC allocator for CPU tensors, so by default the children
    run with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (``--cpu-allocator default``
    turns that off and leaves only RSS).
  "Training-attributable" = peak - baseline.

B-sized configurations train ``--steps`` micro-batches (default 32: two full
windows at N=16); plain N*B trains 3 steps of N*B samples; in-step trains
max(2, steps / N) steps of N*B rows, from one distinct cached batch (so the
data held is exactly one input batch). All use SGD (lr=1e-3, momentum=0.9),
identical initial weights and synthetic data.

Goals reported: training-attributable peak of ours at (B, N)
    <= 1.05 * (plain at B + one float32 copy of the trainable parameters);
of in-step at (B, N)
    <= plain at B + one float32 copy of the parameters + the input batch
       (S rows of inputs and labels), and flat as N grows.

With ``--limit-mb 256,512,1024`` it measures instead what trains in a
device of each size (on a CPU: TF's BFC allocator limited by
``TF_CPU_BFC_MEM_LIMIT_IN_MB``, oneDNN off; on a GPU: a logical device),
each probe in a fresh child process with the limit set (U-Net 64x64, base 8,
depth 3 unless given):
  * the largest batch a plain ``keras.Model`` trains (doubling from
    ``--limit-start``, then ``--limit-bisect`` bisection steps);
  * the largest effective batch ``GradientAccumulationModel(
    micro_batch_size="auto")`` trains, fed batches of that size (powers of
    two down from ``--limit-cap``), and the micro-batch it chose;
  * the largest fixed ``micro_batch_size`` that trains at that effective
    batch (doubling from twice what "auto" chose, then bisection);
  * samples per second of each at those sizes (median step time over
    ``--limit-timed`` steps after ``--limit-warmup``).

Usage:
    python benchmarks/memory.py
    python benchmarks/memory.py --quick
    python benchmarks/memory.py --limit-mb 256,512,1024 \
        --json benchmarks/results/memory_limits_cpu.json
    python benchmarks/memory.py --json benchmarks/results/memory_cpu.json
    python benchmarks/memory.py --in-step-only --in-step-ns 2,8,32
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

RESULT_TAG = "MEMORY_RESULT "


def _read_status():
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024  # kB -> bytes
    return values


def _reset_peak_rss():
    """Reset VmHWM to the current RSS (Linux >= 4.0). Returns success."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------
# Child: one configuration
# --------------------------------------------------------------------------
def run_child(args):
    import gc

    import common
    import tensorflow as tf

    common.configure_threads(args.intra, args.inter)
    common.enable_memory_growth()
    on_gpu = bool(common.gpus())
    spec = unet_spec(args)
    kind, n = args.kind, args.n
    # Identical initial weights in every child.
    weights = common.reference_weights(spec, seed=args.seed)
    num_batches = 2
    if kind == "plain-large":
        model = common.build_model(spec, "plain", 1, args.jit, weights)
        batch, steps = n * args.batch, args.large_steps
    elif kind == "ours-instep":
        model = common.build_model(spec, kind, n, args.jit, weights,
                                   micro_batch_size=args.batch)
        batch, steps = n * args.batch, max(2, args.steps // n)
        num_batches = 1
    else:
        model = common.build_model(spec, kind, n, args.jit, weights)
        batch, steps = args.batch, args.steps
    del weights
    n_params, param_bytes = common.trainable_param_bytes(model)
    dataset = common.make_data(spec, batch, num_batches=num_batches, seed=args.seed)
    gc.collect()
    side = spec["input_shape"][0] * spec["input_shape"][1]
    record = {
        "kind": kind, "n": n, "batch": batch, "steps": steps,
        "samples_per_update": (
            batch * (n if kind in ("ours", "builtin") else 1)),
        # One batch of float32 inputs (HxWx3) and int32 labels (HxW).
        "input_batch_bytes": batch * side * (3 * 4 + 4),
        "cached_batches": num_batches,
        "trainable_params": n_params, "param_bytes": param_bytes,
        "device": "GPU" if on_gpu else "CPU", "jit_compile": args.jit,
        "metrics": {},
    }
    if args.warmup_steps:
        # Trace (and compile) the train step before the baseline: the peak
        # then holds steady-state training only.
        model.fit(dataset, steps_per_epoch=args.warmup_steps, epochs=1,
                  verbose=0, shuffle=False)
        gc.collect()
        record["warmup_steps"] = args.warmup_steps
    tf_device = "GPU:0" if on_gpu else "CPU:0"
    try:  # GPU always; CPU only with TF_CPU_ALLOCATOR_USE_BFC=true
        tensors_baseline = tf.config.experimental.get_memory_info(tf_device)["current"]
        tf.config.experimental.reset_memory_stats(tf_device)
    except (ValueError, RuntimeError):
        tensors_baseline = None
    before = _read_status()
    peak_reset = _reset_peak_rss()
    rss_baseline = _read_status()["VmRSS"]

    t0 = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
    common.sync(model)
    record["train_seconds"] = time.perf_counter() - t0

    status = _read_status()
    if tensors_baseline is not None:
        peak = tf.config.experimental.get_memory_info(tf_device)["peak"]
        record["metrics"]["gpu" if on_gpu else "tensors"] = {
            "baseline": tensors_baseline, "peak": peak,
            "attributable": peak - tensors_baseline,
        }
    record["metrics"]["rss"] = {
        "baseline": rss_baseline, "peak": status["VmHWM"],
        "attributable": status["VmHWM"] - rss_baseline,
        "pre_baseline_peak": before["VmHWM"], "peak_reset": peak_reset,
        "after": status["VmRSS"],
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(RESULT_TAG + json.dumps(record), flush=True)
    return 0


def unet_spec(args):
    return {
        "arch": "unet",
        "input_shape": [args.size, args.size, 3],
        "num_classes": 3,
        "base_filters": args.base_filters,
        "depth": args.depth,
    }


# --------------------------------------------------------------------------
# --limit-mb: what trains in a device of a given size
# --------------------------------------------------------------------------
LIMIT_TAG = "LIMIT_RESULT "
AUTO_OOM_LINE = "Out of memory with micro-batches"
MIB = 2**20


def limit_env(limit_mb, on_gpu, base=None):
    """A child's environment for a device of `limit_mb` MiB. On a CPU,
    TensorFlow reads the limit from the environment when it starts, with
    oneDNN off (its kernels crash at the limit instead of raising
    ResourceExhaustedError); on a GPU the child makes a logical device."""
    env = dict(os.environ if base is None else base)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not on_gpu:
        env.update(TF_CPU_ALLOCATOR_USE_BFC="true",
                   TF_CPU_BFC_MEM_LIMIT_IN_MB=str(int(limit_mb)),
                   TF_ENABLE_ONEDNN_OPTS="0")
    return env


def set_gpu_limit(limit_mb):
    """A logical GPU of `limit_mb` MiB, before any GPU is used (no memory
    growth: the two cannot be combined)."""
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(
                memory_limit=int(limit_mb))])


def run_limit_child(args):
    """One probe in a device of `--limit-mib` MiB: `--kind plain` trains
    batches of `--rows`; `auto` (`micro_batch_size="auto"`) and `fixed`
    (`micro_batch_size=--micro`) train batches of `--rows` (the effective
    batch) split inside the step. Prints one LIMIT_RESULT line: whether it
    trained, the peak, the micro-batch of each step, the time of each."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        set_gpu_limit(args.limit_mib)
    import common
    import keras

    common.configure_threads(args.intra, args.inter)
    device = "GPU:0" if common.gpus() else "CPU:0"
    spec = unet_spec(args)
    keras.utils.set_random_seed(args.seed)
    kind, rows = args.kind, args.rows
    record = {"kind": kind, "rows": rows, "limit_mib": args.limit_mib,
              "micro": args.micro if kind == "fixed" else None}
    steps = args.limit_warmup + args.limit_timed
    times, sizes, peaks = [], [], []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats(device)
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            common.sync(self.model, logs)
            times.append(time.perf_counter() - self.start)
            sizes.append(getattr(self.model, "micro_batch_size", None))
            peaks.append(tf.config.experimental.get_memory_info(device)["peak"])

    try:
        model = common.build_model(
            spec, "plain" if kind == "plain" else "ours-instep", 1,
            args.jit, None,
            micro_batch_size={"auto": "auto", "fixed": args.micro}.get(kind))
        data = common.make_data(spec, rows, num_batches=1, seed=args.seed)
        model.fit(data, steps_per_epoch=steps, epochs=1, shuffle=False,
                  callbacks=[Record()], verbose=2 if kind == "auto" else 0)
        record["trained"] = True
    except tf.errors.ResourceExhaustedError as error:
        lines = [ln for ln in error.message.splitlines() if "OOM" in ln]
        record["trained"] = False
        record["error"] = (lines or error.message.splitlines() or [""])[0][:300]
    record.update(step_seconds=times, micro_batch_sizes=sizes,
                  peak=max(peaks) if peaks else None)
    timed = times[args.limit_warmup:]
    if record["trained"] and timed:
        record["samples_per_second"] = rows / common.median(timed)
    print(LIMIT_TAG + json.dumps(record), flush=True)
    return 0


def limit_child_command(args, limit_mib, kind, rows, micro=None, script=None):
    cmd = [
        sys.executable, script or os.path.abspath(__file__), "--limit-child",
        "--limit-mib", str(limit_mib), "--kind", kind, "--rows", str(rows),
        "--micro", str(micro or 0), "--size", str(args.size),
        "--base-filters", str(args.base_filters), "--depth", str(args.depth),
        "--seed", str(args.seed), "--limit-warmup", str(args.limit_warmup),
        "--limit-timed", str(args.limit_timed),
    ]
    if args.intra:
        cmd += ["--intra", str(args.intra)]
    if args.inter:
        cmd += ["--inter", str(args.inter)]
    if args.jit:
        cmd.append("--jit")
    return cmd


class LimitProber:
    """Runs probes in fresh child processes and remembers them."""

    def __init__(self, args, on_gpu, script=None):
        self.args, self.on_gpu, self.script = args, on_gpu, script
        self.probes = []

    def __call__(self, limit_mib, kind, rows, micro=None):
        """The child's record. It trains all the warm-up and timed steps:
        a batch that fits in the first step can run out of memory in the
        second (the input pipeline then holds the next batch as well)."""
        t0 = time.perf_counter()
        proc = subprocess.run(
            limit_child_command(self.args, limit_mib, kind, rows, micro,
                                self.script),
            capture_output=True, text=True,
            env=limit_env(limit_mib, self.on_gpu))
        lines = [ln for ln in proc.stdout.splitlines()
                 if ln.startswith(LIMIT_TAG)]
        if lines:
            record = json.loads(lines[-1][len(LIMIT_TAG):])
        else:  # A crash is not an answer: say so, and count it as no fit.
            tail = (proc.stderr or proc.stdout)[-2000:]
            record = {"kind": kind, "rows": rows, "micro": micro,
                      "limit_mib": limit_mib, "trained": False,
                      "crashed": proc.returncode, "error": crash_summary(tail)}
        record["auto_out_of_memory_lines"] = [
            ln.strip() for ln in proc.stdout.splitlines()
            if AUTO_OOM_LINE in ln]
        record["seconds"] = time.perf_counter() - t0
        self.probes.append(record)
        what = f"{kind} rows={rows}" + (f" micro={micro}" if micro else "")
        result = "fits" if record["trained"] else (
            "CRASHED" if "crashed" in record else "out of memory")
        print(f"    {limit_mib} MiB  {what:28s} {result:14s} "
              f"{record['seconds']:5.0f} s", flush=True)
        if "crashed" in record:
            print("      " + (record["error"] or tail[-600:]).replace(
                "\n", "\n      "))
        return record


def crash_summary(text):
    """The error lines of a child that crashed (no file paths)."""
    keep = [ln.strip() for ln in text.splitlines()
            if ("Error" in ln and ":" in ln and not ln.lstrip().startswith(
                ("File ", "raise "))) or "{{node" in ln]
    return "\n".join(keep[-3:])


def failure(record):
    """How a probe that did not train ended: "out of memory", or how it
    crashed (a signal, or an error that is not ResourceExhaustedError)."""
    if not record or record.get("trained"):
        return None
    code = record.get("crashed")
    if code is None:
        return "out of memory"
    if code < 0:
        return f"crashed: signal {-code}"
    errors = [ln.strip() for ln in (record.get("error") or "").splitlines()
              if "Error" in ln and ":" in ln]
    return "crashed: " + (errors[-1].split(":")[0].split(".")[-1]
                          if errors else f"exit {code}")


def largest_that_fits(fits, start, cap=None, bisect=2):
    """The largest n that `fits(n)`: doubling from `start` (halving if it
    does not fit) up to `cap`, then `bisect` bisection steps between the
    largest that fitted and the smallest that did not.

    Returns:
        (largest that fitted or 0, smallest that did not or None).
    """
    lo, hi, n = 0, None, max(1, start)
    if cap:
        n = min(n, cap)
    if fits(n):
        lo = n
        while not cap or lo < cap:
            n = min(2 * lo, cap) if cap else 2 * lo
            if fits(n):
                lo = n
            else:
                hi = n
                break
    else:
        hi = n
        while n > 1:
            n //= 2
            if fits(n):
                lo = n
                break
            hi = n
    for _ in range(bisect):
        if not lo or hi is None or hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def run_limits(args, limits, on_gpu, script=None):
    """Per limit: the largest batch of plain `keras.Model`, the largest
    effective batch of "auto" (up to `args.limit_cap`), its micro-batch and
    the largest fixed micro-batch at that effective batch, and the samples
    per second of each. Returns (rows for the table, raw results)."""
    probe = LimitProber(args, on_gpu, script)
    results = []
    plain_start = args.limit_start
    for limit in limits:
        t0 = time.perf_counter()
        print(f"\n  limit {limit} MiB", flush=True)
        entry = {"limit_mib": limit}

        runs = {}

        def fits(kind, rows, micro=None):
            runs[kind, rows, micro] = probe(limit, kind, rows, micro)
            return runs[kind, rows, micro]["trained"]

        # 1. plain keras.Model: the largest batch (and its speed).
        plain, plain_fail = largest_that_fits(
            lambda n: fits("plain", n), plain_start, bisect=args.limit_bisect)
        entry["plain"] = {"largest_batch": plain, "smallest_failed": plain_fail,
                          "failed_how": failure(runs.get(("plain", plain_fail, None)))}
        if plain:
            entry["plain"]["timed"] = runs["plain", plain, None]
            plain_start = plain  # A larger limit holds at least as much.

        # 2. "auto": the largest effective batch up to the cap (powers of
        # two down from it).
        effective, effective_fail = largest_that_fits(
            lambda n: fits("auto", n), args.limit_cap, cap=args.limit_cap,
            bisect=0)
        entry["auto"] = {"largest_effective_batch": effective,
                         "smallest_failed": effective_fail,
                         "failed_how": failure(runs.get(("auto", effective_fail, None))),
                         "cap": args.limit_cap}
        if effective:
            run = runs["auto", effective, None]
            chosen = [s for s in run["micro_batch_sizes"] if s != "auto"]
            entry["auto"].update(
                timed=run, micro_batch_size=chosen[-1] if chosen else None,
                micro_batch_sizes=run["micro_batch_sizes"],
                out_of_memory_errors=len(run["auto_out_of_memory_lines"]))

            # 3. The largest fixed micro-batch at that effective batch:
            # from twice what "auto" chose, which ran out there.
            micro = entry["auto"]["micro_batch_size"] or 1
            fixed, fixed_fail = largest_that_fits(
                lambda m: fits("fixed", effective, m),
                min(2 * micro, effective), cap=effective,
                bisect=args.limit_bisect)
            entry["fixed"] = {"largest_micro_batch": fixed,
                              "smallest_failed": fixed_fail,
                              "failed_how": failure(runs.get(("fixed", effective, fixed_fail)))}
            if fixed:
                entry["fixed"]["timed"] = runs["fixed", effective, fixed]
        entry["seconds"] = time.perf_counter() - t0
        results.append(entry)
    return limit_table(results), results, probe.probes


def _sps(run):
    value = (run or {}).get("samples_per_second")
    return value


def limit_table(results):
    """Markdown rows of the limit run, one per limit."""
    import common

    def upto(part, lo, hi):
        how = part.get("failed_how") or "out of memory"
        how = "did not" if how == "out of memory" else how
        return f"{lo}" + (f" ({hi}: {how})" if hi else "")

    def peak(run):
        return common.fmt_bytes((run or {}).get("peak"), "MiB")

    def ratio(a, b):
        return common.fmt(a / b, 2) if a and b else "n/a"

    rows = []
    for e in results:
        plain, auto, fixed = e["plain"], e["auto"], e.get("fixed", {})
        plain_sps = _sps(plain.get("timed"))
        auto_sps = _sps(auto.get("timed"))
        fixed_sps = _sps(fixed.get("timed"))
        rows.append([
            f"{e['limit_mib']:,}",
            upto(plain, plain["largest_batch"], plain["smallest_failed"]),
            peak(plain.get("timed")), common.fmt(plain_sps, 1),
            upto(auto, auto["largest_effective_batch"], auto["smallest_failed"])
            + (" (cap)" if auto["largest_effective_batch"] == auto["cap"]
               else ""),
            auto.get("micro_batch_size", "n/a"),
            upto(fixed, fixed.get("largest_micro_batch", "n/a"),
                 fixed.get("smallest_failed")),
            peak(auto.get("timed")), common.fmt(auto_sps, 1),
            common.fmt(fixed_sps, 1),
            ratio(auto["largest_effective_batch"], plain["largest_batch"]),
            ratio(auto.get("micro_batch_size"),
                  fixed.get("largest_micro_batch")),
            ratio(auto_sps, plain_sps), ratio(auto_sps, fixed_sps),
        ])
    return rows


LIMIT_HEADERS = [
    "limit (MiB)", "plain: largest batch", "plain peak (MiB)",
    "plain samples/s", "auto: largest effective batch",
    "micro-batch auto chose", "largest fixed micro-batch (search)",
    "auto peak (MiB)", "auto samples/s", "fixed micro-batch samples/s",
    "effective / plain batch", "auto micro / largest fixed",
    "auto / plain samples/s", "auto / fixed samples/s",
]


def print_limit_table(rows, args, env, device):
    import common

    print(f"\n### What trains in a device of a given size: U-Net "
          f"{args.size}x{args.size}x3, base {args.base_filters}, depth "
          f"{args.depth}; {device}\n")
    print(common.markdown_table(LIMIT_HEADERS, rows))
    print("\nplain: keras.Model at the batch; auto: GradientAccumulationModel("
          "micro_batch_size='auto') fed batches of the effective batch (one "
          "update per batch); fixed: micro_batch_size=<largest that fits> at "
          "the same effective batch. Every probe in a fresh process; peaks "
          "are the device's (TF's allocator) during the timed steps; samples/s"
          f" = batch / median step time over {args.limit_timed} steps after "
          f"{args.limit_warmup} warm-up step(s) (auto: its search included "
          "in the warm-up).")


def main_limits(args, limits):
    """`--limit-mb`: the limit table, and the JSON."""
    import common

    intra, inter = common.configure_threads(args.intra, args.inter)
    env = common.environment(intra, inter)
    common.print_environment(env)
    on_gpu = bool(common.gpus())
    if not common.have_accum():
        print("keras_accum is not importable: no limit run.")
        return 1
    t_start = time.perf_counter()
    print(f"\nLimits {', '.join(map(str, limits))} MiB on "
          f"{'the GPU (logical devices)' if on_gpu else 'the CPU (BFC allocator, oneDNN off)'}"
          f"; U-Net {args.size}x{args.size}, base {args.base_filters}, depth "
          f"{args.depth}; each probe a fresh process ...", flush=True)
    rows, results, probes = run_limits(args, limits, on_gpu)
    print_limit_table(rows, args, env, env["device"])
    total = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {total:.0f} s ({len(probes)} processes)")
    common.write_json(args.json, {
        "benchmark": "memory_limits",
        "environment": env,
        "settings": {
            "limits_mib": limits, "size": args.size,
            "base_filters": args.base_filters, "depth": args.depth,
            "cap": args.limit_cap, "start": args.limit_start,
            "bisect": args.limit_bisect, "warmup": args.limit_warmup,
            "timed": args.limit_timed, "jit_compile": args.jit,
            "device": "GPU" if on_gpu else "CPU",
        },
        "headers": LIMIT_HEADERS,
        "table": rows,
        "results": results,
        "probes": probes,
        "total_seconds": total,
    })
    return 0


# --------------------------------------------------------------------------
# Parent: orchestrate the children, print tables
# --------------------------------------------------------------------------
def child_command(args, kind, n):
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child",
        "--kind", kind, "--n", str(n),
        "--batch", str(args.batch), "--size", str(args.size),
        "--base-filters", str(args.base_filters), "--depth", str(args.depth),
        "--steps", str(args.steps), "--large-steps", str(args.large_steps),
        "--seed", str(args.seed), "--warmup-steps", str(args.warmup_steps),
    ]
    if args.intra:
        cmd += ["--intra", str(args.intra)]
    if args.inter:
        cmd += ["--inter", str(args.inter)]
    if args.jit:
        cmd.append("--jit")
    return cmd


def child_env(args):
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.cpu_allocator == "bfc":
        # Lets get_memory_info('CPU:0') report tensor memory, as on GPU.
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    else:
        env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    return env


def run_config(args, kind, n):
    records = []
    for _ in range(args.repeats):
        proc = subprocess.run(
            child_command(args, kind, n), capture_output=True, text=True,
            env=child_env(args),
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout)[-3000:]
            print(f"  child {kind} N={n} FAILED (exit {proc.returncode}):\n{tail}",
                  flush=True)
            return {"kind": kind, "n": n, "error": tail}
        records.append(json.loads(lines[-1][len(RESULT_TAG):]))
    chosen = dict(records[0])
    # Median over repeats, per metric (by training-attributable bytes).
    chosen["metrics"] = {}
    for metric in records[0]["metrics"]:
        runs = sorted((r["metrics"][metric] for r in records),
                      key=lambda m: m["attributable"])
        chosen["metrics"][metric] = dict(runs[len(runs) // 2])
        chosen["metrics"][metric]["repeats_attributable"] = [
            m["attributable"] for m in runs]
    return chosen


METRIC_TITLES = {
    "gpu": "GPU memory in use (tf.config.experimental.get_memory_info('GPU:0'))",
    "tensors": "TF tensor memory (CPU BFC allocator, "
               "tf.config.experimental.get_memory_info('CPU:0'))",
    "rss": "process resident set size (VmHWM / VmRSS)",
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fast sanity run: 32x32 U-Net, N in {2, 4}")
    parser.add_argument("--ns", default=None, help="comma list of N (default 2,4,8,16)")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch B")
    parser.add_argument("--size", type=int, default=None,
                        help="U-Net input side (default 64, quick 32)")
    parser.add_argument("--base-filters", type=int, default=None,
                        help="U-Net base filters (default 16; --limit-mb: 8)")
    parser.add_argument("--depth", type=int, default=None,
                        help="U-Net depth (default 4; --limit-mb: 3)")
    parser.add_argument("--steps", type=int, default=None,
                        help="micro-batches for B-sized configs, a multiple of "
                             "every N (default 32, quick 8)")
    parser.add_argument("--large-steps", type=int, default=3,
                        help="steps for plain N*B")
    parser.add_argument("--repeats", type=int, default=3,
                        help="fresh processes per configuration; the median "
                             "is reported (RSS varies by ~10 MiB between "
                             "identical processes)")
    parser.add_argument("--cpu-allocator", choices=("bfc", "default"), default="bfc",
                        help="CPU only: 'bfc' (default) sets TF_CPU_ALLOCATOR_USE_BFC "
                             "so tensor memory can be read as on GPU, besides RSS; "
                             "'default' keeps TF's default CPU allocator (RSS only)")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True (XLA)")
    parser.add_argument("--intra", type=int, default=None)
    parser.add_argument("--inter", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="train steps before the baseline (default 0: "
                        "the peak includes tracing the train step)")
    parser.add_argument("--in-step-ns", default="2,8,32",
                        help="N for GradientAccumulationModel(micro_batch_size=B) "
                             "fed N*B rows per step (default 2,8,32; '' for none)")
    parser.add_argument("--in-step-only", action="store_true",
                        help="plain at B and the in-step configurations only")
    parser.add_argument("--json", default=None, help="write raw results here")
    parser.add_argument(
        "--limit-mb", default=None,
        help="comma list of device sizes in MiB (e.g. 256,512,1024): per "
             "size, the largest batch of plain keras.Model, the largest "
             "effective batch of micro_batch_size='auto', its micro-batch "
             "next to the largest fixed one, and samples/s of each")
    parser.add_argument("--limit-cap", type=int, default=1024,
                        help="--limit-mb: largest effective batch tried with "
                             "'auto' (default 1024)")
    parser.add_argument("--limit-start", type=int, default=16,
                        help="--limit-mb: first batch plain tries (default "
                             "16; then the previous limit's largest)")
    parser.add_argument("--limit-bisect", type=int, default=1,
                        help="--limit-mb: bisection steps after doubling "
                             "(default 1: within a half)")
    parser.add_argument("--limit-warmup", type=int, default=1,
                        help="--limit-mb: steps before the timed ones "
                             "(default 1)")
    parser.add_argument("--limit-timed", type=int, default=2,
                        help="--limit-mb: timed steps (default 2)")
    # child-only
    parser.add_argument("--limit-child", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--limit-mib", type=int, default=0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    limits = [int(v) for v in (args.limit_mb or "").split(",") if v.strip()]
    limit_mode = bool(limits) or args.limit_child
    args.size = args.size or (32 if args.quick else 64)
    args.base_filters = args.base_filters or (8 if limit_mode else 16)
    args.depth = args.depth or (3 if limit_mode else 4)
    if args.limit_child:
        return run_limit_child(args)
    if limits:
        return main_limits(args, limits)
    args.steps = args.steps or (8 if args.quick else 32)
    ns = [int(v) for v in (args.ns or ("2,4" if args.quick else "2,4,8,16")).split(",")]
    if args.in_step_only:
        ns = []
    instep_ns = [int(v) for v in args.in_step_ns.split(",") if v.strip()]

    if args.child:
        return run_child(args)

    import common

    if ns and args.steps % max(ns):
        parser.error("--steps must be a multiple of every N (complete windows)")
    intra, inter = common.configure_threads(args.intra, args.inter)
    env = common.environment(intra, inter)
    common.print_environment(env)
    have_ours = common.GradientAccumulationModel is not None
    t_start = time.perf_counter()

    plan = [("plain", 1)]
    for n in ns:
        plan.append(("plain-large", n))
        if have_ours:
            plan.append(("ours", n))
        plan.append(("builtin", n))
    if have_ours:
        plan += [("ours-instep", n) for n in instep_ns]
    print(f"\nRunning {len(plan) * args.repeats} child processes "
          f"(U-Net {args.size}x{args.size}, base {args.base_filters}, "
          f"depth {args.depth}, B={args.batch}) ...", flush=True)
    results = {}
    for kind, n in plan:
        t0 = time.perf_counter()
        results[(kind, n)] = run_config(args, kind, n)
        print(f"  {kind:12s} N={n:<3d} {time.perf_counter() - t0:5.0f} s", flush=True)

    ref = results[("plain", 1)]
    if "error" in ref:
        print("The plain reference failed; no table.")
        return 1
    param_bytes = ref["param_bytes"]
    MiB = common.fmt_bytes
    names = {
        "plain": f"plain keras.Model, batch {args.batch}",
        "plain-large": None,
        "ours": f"GradientAccumulationModel, B={args.batch}",
        "builtin": f"built-in SGD(gradient_accumulation_steps), B={args.batch}",
        "ours-instep": f"GradientAccumulationModel(micro_batch_size={args.batch}) "
                       "in-step, batch N x B",
    }
    metrics = list(ref["metrics"])  # gpu | tensors, then rss
    limits = {}
    goal_rows = {}
    instep_goal = {}  # metric -> [(n, attributable, limit, ok)]
    for metric in metrics:
        ref_m = ref["metrics"][metric]
        limit = 1.05 * (ref_m["attributable"] + param_bytes)
        limits[metric] = limit
        rows = []
        for kind, n in plan:
            rec = results[(kind, n)]
            name = names[kind] or f"plain keras.Model, batch {n * args.batch}"
            if "error" in rec:
                rows.append([name, n, "FAILED", "", "", "", "", ""])
                continue
            m = rec["metrics"][metric]
            check = ""
            if kind == "ours-instep":
                instep_limit = (ref_m["attributable"] + param_bytes
                                + rec["input_batch_bytes"])
                ok = m["attributable"] <= instep_limit
                check = (f"{'met' if ok else 'MISSED'} ({MiB(m['attributable'])} vs "
                         f"{MiB(instep_limit)}, in-step limit)")
                instep_goal.setdefault(metric, []).append(
                    (n, m["attributable"], instep_limit, ok,
                     rec["input_batch_bytes"]))
            elif kind in ("ours", "builtin"):
                ok = m["attributable"] <= limit
                check = f"{'met' if ok else 'MISSED'} ({MiB(m['attributable'])} vs {MiB(limit)})"
                if kind == "ours":
                    goal_rows.setdefault(n, {})[metric] = (m["attributable"], ok)
            rows.append([
                name, "-" if kind == "plain" else n, rec["samples_per_update"],
                MiB(m["peak"]), MiB(m["baseline"]), MiB(m["attributable"]),
                common.fmt(m["attributable"] / ref_m["attributable"], 2), check,
            ])
        print(f"\n### Peak training memory, {METRIC_TITLES[metric]}, MiB\n")
        print(f"U-Net {args.size}x{args.size}x3, base {args.base_filters} filters, "
              f"depth {args.depth}, {'XLA' if args.jit else 'graph mode'}, "
              f"{ref['trainable_params']:,} trainable parameters (one float32 copy = "
              f"{MiB(param_bytes)} MiB). Goal limit = 1.05 x (plain B "
              f"{MiB(ref_m['attributable'])} + {MiB(param_bytes)}) = {MiB(limit)} MiB.\n")
        print(common.markdown_table(
            ["configuration", "N", "samples / update", "total peak",
             "baseline (after build)", "training-attributable (peak - baseline)",
             "attributable vs plain B", "goal: <= 1.05 x (plain B + params)"],
            rows, align=["l", "r", "r", "r", "r", "r", "r", "l"],
        ))
        if metric == "rss" and not ref_m.get("peak_reset", True):
            print("\nNote: /proc/self/clear_refs was not writable, so the RSS peak "
                  "may include memory used before training (import, build).")
    if goal_rows:
        print("\n### Goal: ours(B, N) training-attributable <= 1.05 x "
              "(plain(B) + one float32 copy of the parameters)\n")
        headers = ["N"]
        for metric in metrics:
            headers += [f"ours, {metric} (MiB)", f"limit, {metric} (MiB)", "result"]
        rows = []
        for n in ns:
            row = [n]
            for metric in metrics:
                value, ok = goal_rows[n][metric]
                row += [MiB(value), MiB(limits[metric]), "met" if ok else "MISSED"]
            rows.append(row)
        print(common.markdown_table(headers, rows))
    if instep_goal:
        print("\n### Goal: in-step(B, N) training-attributable <= plain(B) + one "
              "float32 copy of the parameters + the input batch (N*B rows), "
              "and flat as N grows\n")
        rows = []
        for metric in metrics:
            entries = instep_goal.get(metric, [])
            for n, value, limit, ok, batch_bytes in entries:
                rows.append([metric, n, f"{n * args.batch}", MiB(batch_bytes),
                             MiB(value), MiB(limit), "met" if ok else "MISSED",
                             common.fmt(value / ref["metrics"][metric]["attributable"], 2)])
            if len(entries) > 1:
                lo = min(e[1] for e in entries)
                hi = max(e[1] for e in entries)
                rows.append([metric, "spread over N", "", "",
                             f"{MiB(hi - lo)} ({MiB(lo)}–{MiB(hi)})", "", "", ""])
        print(common.markdown_table(
            ["measure", "N", "rows per step", "input batch (MiB)",
             "in-step attributable (MiB)", "limit (MiB)", "result",
             "vs plain B"], rows,
            align=["l", "r", "r", "r", "r", "r", "l", "r"]))
    total = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {total:.0f} s")
    common.write_json(args.json, {
        "benchmark": "memory",
        "environment": env,
        "settings": {
            "size": args.size, "base_filters": args.base_filters, "depth": args.depth,
            "batch": args.batch, "ns": ns, "in_step_ns": instep_ns,
            "steps": args.steps,
            "large_steps": args.large_steps, "repeats": args.repeats,
            "jit_compile": args.jit, "quick": args.quick,
            "cpu_allocator": args.cpu_allocator, "metrics": metrics,
        },
        "param_bytes": param_bytes,
        "limit_bytes": limits,
        "results": [dict(v, kind=k[0], n=k[1]) for k, v in results.items()],
        "total_seconds": total,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
