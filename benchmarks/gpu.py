"""GPU check: step time and peak memory, plain vs GradientAccumulationModel,
across precision policies and XLA on/off, on a realistically sized U-Net.

Default: U-Net 256x256x3 (base 32 filters, depth 4, ~7.8M parameters),
micro-batch B=16; configurations plain ``keras.Model``,
``GradientAccumulationModel`` N=4 and N=8 (across train steps) and
``GradientAccumulationModel(micro_batch_size=B)`` fed batches of 8*B rows
("in-step": 8 micro-batches in a ``tf.while_loop`` inside each train step,
one update per step; ``--in-step-ns``); policies float32, mixed_float16,
mixed_bfloat16; ``jit_compile`` off and on. Target: under 5 minutes on one
GPU (e.g. one H200).

Each policy runs in its own subprocess (the Keras dtype policy is global).
Inside it, for every (XLA, configuration):
  * build + compile, ``gc.collect()``; baseline = GPU memory in use;
    ``reset_memory_stats``; warm up (trace / compile, 16 micro-batches);
    "first-steps peak" = peak - baseline;
  * ``reset_memory_stats`` again and run ``--steps`` more micro-batches:
    "steady peak" = peak - baseline (persistent optimizer slots and
    accumulators included, one-time autotuning / compilation scratch not);
    "retained" = memory in use after training - baseline (the persistent
    training state: optimizer slots, accumulators);
then all configurations of that policy are timed in ``--rounds``
interleaved rounds of ``--steps`` micro-batches (``model.train_function``
on a persistent iterator over an in-memory repeated dataset; the clock stops
after the last step's results reach the host). Reported: median ms per
micro-batch (min-max over rounds) and the median of per-round ratios to plain.
The in-step configuration counts micro-batches too (``--steps / N`` calls of
N micro-batches), so its rows compare directly with plain at batch B.

Without a GPU it prints a note and runs on CPU (use ``--quick``: tiny U-Net);
memory is then TF's CPU tensor memory (BFC allocator enabled for the child).

``--limit-mb 4096,6144`` runs instead what ``benchmarks/memory.py
--limit-mb`` runs, on logical GPUs of 4 and 6 GiB (the same U-Net, float32,
XLA off): per size, the largest batch of a plain ``keras.Model``, the
largest effective batch ``micro_batch_size="auto"`` trains (up to
``--limit-cap``, default 256), the micro-batch it chose next to the largest
fixed ``micro_batch_size`` at that batch, and samples per second of each;
every probe in a fresh process. Without a GPU the limits apply to the CPU
(TF's BFC allocator, oneDNN off): use ``--quick`` and small limits there.

After the U-Net table, ``features.py`` (each guarantee's cost per step
against its plain counterpart, with an A/A control) and
``auto_overhead.py`` (``micro_batch_size="auto"`` against the fixed size it
keeps, with and without its per-step snapshot) run on the same device, each
in a process of its own (``--no-features`` skips them; with ``--json
PATH``, features.py's figures go to ``PATH`` with ``_features.json``).

Usage:
    python benchmarks/gpu.py                 # on a GPU machine
    python benchmarks/gpu.py --quick         # CPU smoke test
    python benchmarks/gpu.py --json benchmarks/results/gpu.json
    python benchmarks/gpu.py --limit-mb 4096,6144 \
        --json benchmarks/results/memory_limits_gpu.json
    python benchmarks/gpu.py --quick --limit-mb 128,256   # its CPU fallback
"""

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time

RESULT_TAG = "GPU_BENCH_RESULT "


def configs(ns, instep_ns=()):
    return ([("plain", 1)] + [("ours", n) for n in ns]
            + [("ours-instep", n) for n in instep_ns])


def unet_spec(args):
    return {
        "arch": "unet",
        "input_shape": [args.size, args.size, 3],
        "num_classes": 3,
        "base_filters": args.base_filters,
        "depth": args.depth,
    }


# --------------------------------------------------------------------------
# Child: one precision policy
# --------------------------------------------------------------------------
def run_child(args):
    import common
    import keras
    import tensorflow as tf

    common.configure_threads(args.intra, args.inter)
    common.enable_memory_growth()
    on_gpu = bool(common.gpus())
    device = "GPU:0" if on_gpu else "CPU:0"
    keras.mixed_precision.set_global_policy(args.policy)
    ns = [int(v) for v in args.ns.split(",") if v.strip()]
    instep_ns = [int(v) for v in args.in_step_ns.split(",") if v.strip()]
    xla_modes = [m.strip() == "on" for m in args.xla.split(",")]
    spec = unet_spec(args)
    weights = common.reference_weights(spec, seed=args.seed)
    dataset = common.make_data(spec, args.batch, num_batches=2, seed=args.seed)
    instep_data = {n: common.make_data(spec, n * args.batch, num_batches=2,
                                       seed=args.seed) for n in instep_ns}

    def mem():
        try:
            return tf.config.experimental.get_memory_info(device)
        except (ValueError, RuntimeError):
            return None

    def reset():
        try:
            tf.config.experimental.reset_memory_stats(device)
        except (ValueError, RuntimeError):
            pass

    def run(model, iterator, steps, per_call=1):
        """`steps` micro-batches: steps / per_call train-function calls."""
        logs = None
        for _ in range(max(1, steps // per_call)):
            logs = model.train_function(iterator)
        common.sync(model, logs)

    entries = []
    if not common.have_accum():
        print("keras_accum not importable: only plain rows", file=sys.stderr)
    for jit in xla_modes:
        for kind, n in configs(ns, instep_ns):
            if kind.startswith("ours") and not common.have_accum():
                continue
            instep = kind == "ours-instep"
            per_call = n if instep else 1
            data = instep_data[n] if instep else dataset
            t0 = time.perf_counter()
            model = common.build_model(spec, kind, n, jit, weights,
                                       micro_batch_size=args.batch if instep else None)
            gc.collect()
            info = mem()
            baseline = info["current"] if info else None
            reset()
            warm = args.warmup // 2
            model.fit(data, steps_per_epoch=max(1, warm // per_call), epochs=1,
                      verbose=0, shuffle=False)
            iterator = iter(model.distribute_strategy.experimental_distribute_dataset(data))
            run(model, iterator, args.warmup - warm, per_call)
            info = mem()
            first_peak = info["peak"] if info else None
            reset()
            run(model, iterator, args.steps, per_call)
            info = mem()
            steady_peak = info["peak"] if info else None
            retained = info["current"] if info else None
            entries.append({
                "policy": args.policy, "xla": jit, "kind": kind, "n": n,
                "model": model, "iterator": iterator, "per_call": per_call,
                "warmup_s": time.perf_counter() - t0,
                "baseline": baseline,
                "first_peak": first_peak, "steady_peak": steady_peak,
                "retained": retained,
                "params": common.trainable_param_bytes(model)[0],
                "times": [],
            })
            print(f"  [{args.policy}] xla={'on' if jit else 'off'} {kind} N={n}: "
                  f"warm-up {entries[-1]['warmup_s']:.1f} s", file=sys.stderr, flush=True)

    rng = random.Random(args.seed)
    for _ in range(args.rounds):
        order = entries[:]
        rng.shuffle(order)
        for e in order:
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                run(e["model"], e["iterator"], args.steps, e["per_call"])
                e["times"].append(time.perf_counter() - t0)
            finally:
                gc.enable()

    out = []
    for e in entries:
        out.append({k: v for k, v in e.items() if k not in ("model", "iterator")})
    print(RESULT_TAG + json.dumps({"policy": args.policy, "on_gpu": on_gpu,
                                   "device": common.device_description(),
                                   "entries": out}), flush=True)
    return 0


# --------------------------------------------------------------------------
# --limit-mb: what trains in a logical GPU of each size (memory.py's run)
# --------------------------------------------------------------------------
def main_limits(args, limits):
    import common
    import memory

    q = args.quick
    args.limit_cap = args.limit_cap or 256
    args.limit_start = args.limit_start or (16 if q else 2)
    args.jit = False
    intra, inter = common.configure_threads(args.intra, args.inter)
    env = common.environment(intra, inter)
    common.print_environment(env)
    on_gpu = bool(common.gpus())
    if not on_gpu:
        print("\nNOTE: no GPU found. The limits apply to the CPU instead (TF's "
              "BFC allocator, oneDNN off), and the samples/s are CPU "
              "figures; use --quick and limits of a few hundred MiB here.\n")
    if not common.have_accum():
        print("keras_accum is not importable: no limit run.")
        return 1
    t_start = time.perf_counter()
    print(f"\nLimits {', '.join(map(str, limits))} MiB; U-Net {args.size}x"
          f"{args.size}, base {args.base_filters}, depth {args.depth}; each "
          "probe a fresh process ...", flush=True)
    rows, results, probes = memory.run_limits(
        args, limits, on_gpu,
        script=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "memory.py"))
    memory.print_limit_table(rows, args, env, env["device"])
    total = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {total:.0f} s ({len(probes)} processes)")
    common.write_json(args.json, {
        "benchmark": "memory_limits",
        "environment": env,
        "settings": {k: getattr(args, k) for k in (
            "size", "base_filters", "depth", "limit_cap", "limit_start",
            "limit_bisect", "limit_warmup", "limit_timed", "quick")},
        "limits_mib": limits,
        "device": "GPU" if on_gpu else "CPU",
        "headers": memory.LIMIT_HEADERS,
        "table": rows,
        "results": results,
        "probes": probes,
        "total_seconds": total,
    })
    return 0


# --------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny U-Net (32x32, B=2, base 8, depth 3), 2 rounds x 8 steps")
    parser.add_argument("--policies", default="float32,mixed_float16,mixed_bfloat16")
    parser.add_argument("--xla", default="off,on", help="comma list from: off, on")
    parser.add_argument("--ns", default="4,8", help="accumulation steps for ours")
    parser.add_argument("--in-step-ns", default="8",
                        help="micro-batches per train step for "
                             "GradientAccumulationModel(micro_batch_size=B), fed "
                             "N*B rows (default 8; '' for none)")
    parser.add_argument("--size", type=int, default=None, help="input side (default 256)")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch (default 16)")
    parser.add_argument("--base-filters", type=int, default=None, help="default 32")
    parser.add_argument("--depth", type=int, default=None, help="default 4")
    parser.add_argument("--rounds", type=int, default=None, help="default 5")
    parser.add_argument("--steps", type=int, default=None,
                        help="micro-batches per timing window, a multiple of every N "
                             "(default 32)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up micro-batches, a multiple of 2*max(N) (default 16)")
    parser.add_argument("--intra", type=int, default=None)
    parser.add_argument("--inter", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--limit-mb", default=None,
        help="comma list of logical GPU sizes in MiB, e.g. 4096,6144: "
             "instead of the step times, what trains in a device of each "
             "size (benchmarks/memory.py --limit-mb)")
    parser.add_argument("--limit-cap", type=int, default=None,
                        help="--limit-mb: largest effective batch tried with "
                             "'auto' (default 256; --quick: 256)")
    parser.add_argument("--limit-start", type=int, default=None,
                        help="--limit-mb: first batch plain tries (default 2; "
                             "--quick: 16)")
    parser.add_argument("--limit-bisect", type=int, default=2,
                        help="--limit-mb: bisection steps (default 2)")
    parser.add_argument("--limit-warmup", type=int, default=2,
                        help="--limit-mb: steps before the timed ones "
                             "(default 2: cuDNN autotuning)")
    parser.add_argument("--limit-timed", type=int, default=3,
                        help="--limit-mb: timed steps (default 3)")
    parser.add_argument("--no-features", action="store_true",
                        help="skip features.py and auto_overhead.py (each "
                             "guarantee's cost per step, and 'auto' against "
                             "a fixed micro-batch), which run after the "
                             "U-Net table")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    q = args.quick
    args.size = args.size or (32 if q else 256)
    args.batch = args.batch or (2 if q else 16)
    args.base_filters = args.base_filters or (8 if q else 32)
    args.depth = args.depth or (3 if q else 4)
    args.rounds = args.rounds or (2 if q else 5)
    args.steps = args.steps or (8 if q else 32)
    args.warmup = args.warmup or 16
    limits = [int(v) for v in (args.limit_mb or "").split(",") if v.strip()]
    if limits and not args.child:
        return main_limits(args, limits)
    ns = [int(v) for v in args.ns.split(",") if v.strip()]
    ns += [int(v) for v in args.in_step_ns.split(",") if v.strip()]
    if args.steps % max(ns) or args.warmup % (2 * max(ns)):
        parser.error("--steps must be a multiple of max(N), --warmup of 2*max(N)")

    if args.child:
        return run_child(args)

    import common

    intra, inter = common.configure_threads(args.intra, args.inter)
    env = common.environment(intra, inter)
    common.print_environment(env)
    on_gpu = bool(common.gpus())
    if not on_gpu:
        print("\nNOTE: no GPU found. Running on CPU: the timings below are CPU "
              "timings and say nothing about GPU performance; memory is TF's CPU "
              "tensor memory (BFC allocator). Use --quick on CPU.\n")
    t_start = time.perf_counter()
    child_env = dict(os.environ)
    child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not on_gpu:
        child_env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    passthrough = [
        "--xla", args.xla, "--ns", args.ns, "--in-step-ns", args.in_step_ns,
        "--size", str(args.size),
        "--batch", str(args.batch), "--base-filters", str(args.base_filters),
        "--depth", str(args.depth), "--rounds", str(args.rounds),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--seed", str(args.seed),
    ]
    if args.intra:
        passthrough += ["--intra", str(args.intra)]
    if args.inter:
        passthrough += ["--inter", str(args.inter)]

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    per_policy = {}
    failures = {}
    for policy in policies:
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--child",
               "--policy", policy] + passthrough
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0 or not lines:
            failures[policy] = (proc.stderr or proc.stdout)[-3000:]
            print(f"  {policy}: FAILED after {elapsed:.0f} s (exit {proc.returncode})\n"
                  f"{failures[policy]}", flush=True)
            continue
        per_policy[policy] = json.loads(lines[-1][len(RESULT_TAG):])
        per_policy[policy]["seconds"] = elapsed
        print(f"  {policy}: {elapsed:.0f} s", flush=True)

    MiB = common.fmt_bytes
    rows = []
    for policy, res in per_policy.items():
        entries = res["entries"]
        for e in entries:
            plain = next(p for p in entries if p["kind"] == "plain" and p["xla"] == e["xla"])
            ms = [1000.0 * t / args.steps for t in e["times"]]
            ratio = [pt / t for t, pt in zip(e["times"], plain["times"])]
            e["ms_per_microbatch"] = ms
            e["throughput_ratio_vs_plain"] = ratio

            def attr(key):
                if e[key] is None or e["baseline"] is None:
                    return "n/a"
                return MiB(e[key] - e["baseline"])

            rows.append([
                policy, "on" if e["xla"] else "off",
                common.config_label(e["kind"], e["n"], args.batch),
                common.fmt(common.median(ms), 2),
                f"{common.fmt(min(ms), 2)}–{common.fmt(max(ms), 2)}",
                common.fmt(common.median(ratio), 3),
                attr("steady_peak"), attr("first_peak"), attr("retained"),
            ])
    if rows:
        what = "GPU" if on_gpu else "CPU tensor (BFC)"
        first = next(iter(per_policy.values()))["entries"][0]
        print(f"\n### U-Net {args.size}x{args.size}x3, base {args.base_filters}, "
              f"depth {args.depth} ({first['params']:,} parameters), B={args.batch}; "
              f"{env['device']}\n")
        print(common.markdown_table(
            ["policy", "XLA", "configuration", "ms / micro-batch (median)", "min–max",
             "throughput vs plain (median of rounds)",
             f"steady peak - baseline ({what} MiB)",
             f"first-steps peak - baseline ({what} MiB)",
             f"retained after training - baseline ({what} MiB)"],
            rows, align=["l", "l", "l", "r", "r", "r", "r", "r", "r"],
        ))
        print(f"\n{args.rounds} interleaved rounds x {args.steps} micro-batches per "
              "configuration; 'throughput vs plain' > 1 means faster than plain.")
    if not args.no_features:
        failures.update(run_feature_benchmarks(args, child_env))
    if not on_gpu:
        print("\nNOTE: no GPU was found; these are CPU numbers (smoke test only).")
    total = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {total:.0f} s")
    common.write_json(args.json, {
        "benchmark": "gpu",
        "environment": env,
        "settings": {k: getattr(args, k) for k in (
            "size", "batch", "base_filters", "depth", "rounds", "steps", "warmup",
            "xla", "ns", "in_step_ns", "quick")},
        "results": per_policy,
        "failures": failures,
        "total_seconds": total,
    })
    return 1 if failures else 0


def run_feature_benchmarks(args, env):
    """`features.py` (each guarantee's cost per step against its plain
    counterpart) and `auto_overhead.py` ("auto" against the fixed size it
    keeps), each in a process of its own on the same device; their tables
    are printed as they come. Returns `{script: error}` for those that
    failed."""
    here = os.path.dirname(os.path.abspath(__file__))
    features = ["--quick"] if args.quick else []
    if args.json:
        features += ["--json", args.json.replace(".json", "_features.json")]
    # 15 rounds (its default is 21), to keep this script's time.
    overhead = ["--rounds", "15"]
    if args.quick:
        overhead = ["--rounds", "2", "--steps", "8"]
    failures = {}
    for script, extra in (("features.py", features),
                          ("auto_overhead.py", overhead)):
        print(f"\n### {script} {' '.join(extra)}\n", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, os.path.join(here, script), *extra], env=env
        )
        print(f"{script}: {time.perf_counter() - t0:.0f} s", flush=True)
        if proc.returncode != 0:
            failures[script] = f"exit {proc.returncode}"
    return failures


if __name__ == "__main__":
    sys.exit(main())
