"""Training throughput (micro-batches per second) at a fixed micro-batch size.

Compares, at the same micro-batch size B:
  * plain ``keras.Model`` (one optimizer update per micro-batch),
  * a second, identical plain model (A/A control: shows the noise floor),
  * ``GradientAccumulationModel`` with N in {1, 4, 8, 16},
  * the built-in ``keras.optimizers.SGD(gradient_accumulation_steps=N)``
    with N in {4, 8, 16},
  * ``GradientAccumulationModel(micro_batch_size=B)`` fed batches of N*B
    rows ("in-step": each train step runs N micro-batches in a
    ``tf.while_loop`` and applies one update), N in {8} by default,
in graph mode and with ``jit_compile=True`` (XLA), on a small MLP (32
features, 2 x 64 units, B=8: overhead-bound), a parameter-heavy dense
network (1024 features, 4 x 1024 units, B=8), a small conv net (32x32x3,
B=32) and a small U-Net (64x64x3, base 8 filters, B=8).

``--batch-scaling-n N`` also times plain ``keras.Model`` at batch N*B in the
same rounds: its samples/s over plain at batch B shows how much of a step at
batch B is fixed per-step overhead (a ratio near N: almost all of it; near
1: none).

All rates are micro-batches (of B rows) per second, whatever the number of
micro-batches one train step runs, so the in-step configuration compares
directly with plain ``keras.Model`` at batch B.

Method: every configuration lives in this one process. All models of one
network start from identical weights. Each is warmed up first (tracing /
XLA compilation excluded from timing). Then ``--rounds`` interleaved rounds
follow; in each round every configuration (in a shuffled order) runs
``--steps`` micro-batches (a multiple of 16 and of every in-step N, so every
accumulation window is complete; the in-step configuration makes
``--steps / N`` calls of N micro-batches each) by calling
``model.train_function`` on a persistent iterator over
an in-memory, repeated ``tf.data`` dataset (``--via fit`` uses
``model.fit(steps_per_epoch=...)`` instead). The clock stops after the
results of the last step have been fetched to the host. Besides wall time,
the process's CPU time (user + system, all threads) per window is recorded:
it is less sensitive to other load on a shared machine. Ratios to plain are
computed round by round and summarised by their median (and min-max).

Usage:
    python benchmarks/throughput.py                # full run
    python benchmarks/throughput.py --quick        # fast sanity run
    python benchmarks/throughput.py --json benchmarks/results/throughput_cpu.json
    python benchmarks/throughput.py --in-step-only --networks mlp,unet   # in-step
    python benchmarks/throughput.py --in-step-only --networks small_mlp \
        --batch-scaling-n 8                      # in-step + batch 64 vs 8
"""

import argparse
import gc
import random
import resource
import sys
import time

import common
from common import fmt
from common import markdown_table
from common import median

WARMUP_STEPS = 16  # multiple of 16 -> windows start on an accumulation boundary
OURS_N = (1, 4, 8, 16)
BUILTIN_N = (4, 8, 16)
# In-step micro-batches/s over plain keras.Model at batch B (median of
# per-round ratios): the overhead-bound small MLP should gain from fewer
# updates and host round trips (the goal the issue sets); the same goal is
# kept for the parameter-heavy dense network ("mlp"); the convolutional
# networks should not lose.
INSTEP_GOAL = {"small_mlp": 1.5, "mlp": 1.5, "convnet": 0.98, "unet": 0.98}


def network_specs(args):
    return {
        "small_mlp": {
            "arch": "mlp",
            "input_shape": [32],
            "num_classes": 10,
            "width": 64,
            "depth": 2,
            "batch_size": 8,
            "title": "small MLP (2 x 64 units, overhead-bound), 32 features, B=8",
        },
        "mlp": {
            "arch": "mlp",
            "input_shape": [1024],
            "num_classes": 10,
            "width": 1024,
            "depth": 4,
            "batch_size": 8,
            "title": "parameter-heavy dense network (4 x 1024 units), "
                     "1024 features, B=8",
        },
        "convnet": {
            "arch": "convnet",
            "input_shape": [32, 32, 3],
            "num_classes": 10,
            "batch_size": 32,
            "title": "conv net, 32x32x3, B=32",
        },
        "unet": {
            "arch": "unet",
            "input_shape": [args.unet_size, args.unet_size, 3],
            "num_classes": 3,
            "base_filters": 8,
            "depth": 3,
            "batch_size": 8,
            "title": f"U-Net (base 8 filters), {args.unet_size}x{args.unet_size}x3, B=8",
        },
    }


def configurations(have_ours, ours_n=OURS_N, builtin_n=BUILTIN_N, nobn_n=(),
                   instep_n=(), batch_n=()):
    configs = [("plain", 1), ("plain-aa", 1)]
    configs += [("plain-batch", n) for n in batch_n]
    if have_ours:
        configs += [("ours", n) for n in ours_n]
        configs += [("ours-nobn", n) for n in nobn_n]
        configs += [("ours-instep", n) for n in instep_n]
    configs += [("builtin", n) for n in builtin_n]
    return configs


def label(kind, n, micro_batch_size=None):
    if kind == "plain-aa":
        return "plain keras.Model (A/A control)"
    if kind == "plain-batch":
        return (f"plain keras.Model, batch {n}x{micro_batch_size} "
                "(batch scaling)")
    return common.config_label(kind, n, micro_batch_size)


class Runner:
    """Runs a configuration for a number of micro-batches.

    ``micro_per_call``: micro-batches one train step runs (N for the in-step
    configuration, fed batches of N*B rows; 1 otherwise). ``run(steps)``
    always counts micro-batches and makes ``steps / micro_per_call`` calls.
    """

    def __init__(self, model, dataset, via, micro_per_call=1):
        self.model = model
        self.dataset = dataset
        self.via = via
        self.micro_per_call = micro_per_call
        self.iterator = None

    def warm_up(self):
        t0 = time.perf_counter()
        # fit() performs the symbolic build (optimizer / accumulator
        # variables) and traces/compiles the train function.
        self.model.fit(
            self.dataset, steps_per_epoch=max(1, WARMUP_STEPS // self.micro_per_call),
            epochs=1, verbose=0, shuffle=False,
        )
        strategy = self.model.distribute_strategy
        self.iterator = iter(strategy.experimental_distribute_dataset(self.dataset))
        self.run(WARMUP_STEPS)  # catches any retrace for the new iterator
        return time.perf_counter() - t0

    def run(self, steps):
        calls = max(1, steps // self.micro_per_call)
        if self.via == "fit":
            history = self.model.fit(
                self.dataset, steps_per_epoch=calls, epochs=1, verbose=0,
                shuffle=False,
            )
            common.sync(self.model)
            return history
        logs = None
        train_function = self.model.train_function
        for _ in range(calls):
            logs = train_function(self.iterator)
        common.sync(self.model, logs)
        return logs

    def timed(self, steps):
        """Returns (wall seconds, process CPU seconds) for `steps` micro-batches."""
        gc.collect()
        gc.disable()
        try:
            c0 = _cpu_seconds()
            t0 = time.perf_counter()
            self.run(steps)
            t1 = time.perf_counter()
            return t1 - t0, _cpu_seconds() - c0
        finally:
            gc.enable()


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def summarize(values):
    return {"median": median(values), "min": min(values), "max": max(values)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fast sanity run: 2 rounds x 16 steps, 32x32 U-Net")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved timing rounds (default 7, quick 2)")
    parser.add_argument("--steps", type=int, default=None,
                        help="micro-batches per config per round, multiple of 16 "
                             "(default 16)")
    parser.add_argument("--networks", default="small_mlp,mlp,convnet,unet",
                        help="comma list from: small_mlp, mlp, convnet, unet")
    parser.add_argument("--modes", default="graph,xla",
                        help="comma list from: graph, xla")
    parser.add_argument("--ours-n", default=None,
                        help="N values for GradientAccumulationModel across train "
                             "steps (default 1,4,8,16; none with --in-step-only)")
    parser.add_argument("--builtin-n", default=None,
                        help="N values for the built-in optimizer option "
                             "(default 4,8,16; none with --in-step-only)")
    parser.add_argument("--in-step-n", default="8",
                        help="N values for GradientAccumulationModel(micro_batch_size=B) "
                             "fed batches of N*B rows (default 8; '' for none)")
    parser.add_argument("--batch-scaling-n", default="",
                        help="also time plain keras.Model at batch N*B for these N "
                             "(e.g. 8), counted in micro-batches of B: its ratio "
                             "to plain at batch B is the samples/s ratio, which "
                             "shows how overhead-bound the network is")
    parser.add_argument("--in-step-only", action="store_true",
                        help="focused run: plain, A/A control and the in-step "
                             "configuration only (unless --ours-n / --builtin-n "
                             "are given)")
    parser.add_argument("--window-bn-off-n", default="",
                        help="also time GradientAccumulationModel(window_batch_norm="
                             "False) at these N (e.g. 4,16); shows the cost of the "
                             "per-window BatchNormalization statistics")
    parser.add_argument("--unet-size", type=int, default=None,
                        help="U-Net input side (default 64, quick 32)")
    parser.add_argument("--via", choices=("function", "fit"), default="function",
                        help="time model.train_function calls (default) or model.fit")
    parser.add_argument("--intra", type=int, default=None, help="TF intra-op threads")
    parser.add_argument("--inter", type=int, default=None, help="TF inter-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write raw results here")
    args = parser.parse_args(argv)

    args.rounds = args.rounds or (2 if args.quick else 7)
    args.steps = args.steps or 16
    args.unet_size = args.unet_size or (32 if args.quick else 64)
    if args.steps % 16:
        parser.error("--steps must be a multiple of 16 (complete windows)")
    if args.ours_n is None:
        args.ours_n = "" if args.in_step_only else "1,4,8,16"
    if args.builtin_n is None:
        args.builtin_n = "" if args.in_step_only else "4,8,16"
    instep_n = tuple(int(v) for v in args.in_step_n.split(",") if v.strip())
    batch_n = tuple(int(v) for v in args.batch_scaling_n.split(",") if v.strip())
    for n in instep_n + batch_n:
        if args.steps % n:
            parser.error(f"--steps must be a multiple of every --in-step-n and "
                         f"--batch-scaling-n ({n})")

    intra, inter = common.configure_threads(args.intra, args.inter)
    common.enable_memory_growth()
    env = common.environment(intra, inter)
    common.print_environment(env)
    have_ours = common.GradientAccumulationModel is not None

    specs = network_specs(args)
    networks = [s.strip() for s in args.networks.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    ours_n = tuple(int(v) for v in args.ours_n.split(",") if v.strip())
    builtin_n = tuple(int(v) for v in args.builtin_n.split(",") if v.strip())
    nobn_n = tuple(int(v) for v in args.window_bn_off_n.split(",") if v.strip())
    configs = configurations(have_ours, ours_n, builtin_n, nobn_n, instep_n,
                             batch_n)
    t_start = time.perf_counter()

    # ---- build everything first, identical weights per network ----------
    runners = {}  # (network, mode, kind, n) -> Runner
    for net in networks:
        spec = specs[net]
        weights = common.reference_weights(spec, seed=args.seed)
        dataset = common.make_data(spec, spec["batch_size"], seed=args.seed)
        instep_data = {  # batches of n*B rows (in-step, batch scaling)
            n: common.make_data(spec, n * spec["batch_size"], seed=args.seed)
            for n in set(instep_n + batch_n)
        }
        for mode in modes:
            for kind, n in configs:
                instep = kind == "ours-instep"
                big = instep or kind == "plain-batch"
                model = common.build_model(
                    spec,
                    "plain" if kind in ("plain-aa", "plain-batch") else kind,
                    n,
                    jit_compile=(mode == "xla"),
                    weights=weights,
                    micro_batch_size=spec["batch_size"] if instep else None,
                )
                runners[(net, mode, kind, n)] = Runner(
                    model, instep_data[n] if big else dataset, args.via,
                    micro_per_call=n if big else 1,
                )
    n_params = {}
    for net in networks:
        any_key = next(k for k in runners if k[0] == net)
        n_params[net] = common.trainable_param_bytes(runners[any_key].model)[0]

    # ---- warm up (trace / compile), not timed ----------------------------
    warmup = {}
    print(f"\nWarming up {len(runners)} configurations ...", flush=True)
    for key, runner in runners.items():
        warmup[key] = runner.warm_up()
    print(f"  warm-up took {sum(warmup.values()):.0f} s in total", flush=True)

    # ---- interleaved timing rounds ---------------------------------------
    rng = random.Random(args.seed)
    wall = {key: [] for key in runners}  # seconds per window
    cpu = {key: [] for key in runners}  # process CPU seconds per window
    keys = list(runners)
    for r in range(args.rounds):
        t_round = time.perf_counter()
        order = keys[:]
        rng.shuffle(order)
        for key in order:
            w, c = runners[key].timed(args.steps)
            wall[key].append(w)
            cpu[key].append(c)
        print(f"  round {r + 1}/{args.rounds}: {time.perf_counter() - t_round:.0f} s",
              flush=True)

    # ---- analysis ----------------------------------------------------------
    def speedup(a, b):
        """Per-round throughput ratio of config a to config b (from seconds)."""
        return [tb / ta for ta, tb in zip(a, b)]

    def cell(summary, digits=3):
        if summary is None:
            return ""
        return (f"{fmt(summary['median'], digits)} "
                f"({fmt(summary['min'], digits)}–{fmt(summary['max'], digits)})")

    results = []
    goal_rows = []
    instep_rows = []
    scaling_rows = []
    for net in networks:
        spec = specs[net]
        for mode in modes:
            base = (net, mode, "plain", 1)
            rows = []
            for kind, n in configs:
                key = (net, mode, kind, n)
                rates = [args.steps / t for t in wall[key]]
                bkey = (net, mode, "builtin", n)
                has_bi = kind in ("ours", "ours-nobn") and bkey in wall
                entry = {
                    "network": net, "mode": mode, "kind": kind, "n": n,
                    "label": label(kind, n, spec["batch_size"]),
                    "batch_size": spec["batch_size"],
                    "micro_batches_per_call": runners[key].micro_per_call,
                    "wall_seconds": wall[key], "cpu_seconds": cpu[key],
                    "rates": rates, "rate": summarize(rates),
                    "cpu_ms_per_microbatch": summarize(
                        [1000.0 * c / args.steps for c in cpu[key]]),
                    "ratio_vs_plain": summarize(speedup(wall[key], wall[base])),
                    "cpu_ratio_vs_plain": summarize(speedup(cpu[key], cpu[base])),
                    "ratio_vs_builtin": (summarize(speedup(wall[key], wall[bkey]))
                                         if has_bi else None),
                    "cpu_ratio_vs_builtin": (summarize(speedup(cpu[key], cpu[bkey]))
                                             if has_bi else None),
                    "warmup_s": warmup[key],
                }
                results.append(entry)
                s = entry["rate"]
                rows.append([
                    entry["label"],
                    fmt(s["median"], 2),
                    f"{fmt(s['min'], 2)}–{fmt(s['max'], 2)}",
                    fmt(1000.0 / s["median"], 1),
                    cell(entry["ratio_vs_plain"]),
                    cell(entry["ratio_vs_builtin"]),
                    fmt(entry["cpu_ms_per_microbatch"]["median"], 1),
                    fmt(entry["cpu_ratio_vs_plain"]["median"], 3),
                    "" if not has_bi else fmt(entry["cpu_ratio_vs_builtin"]["median"], 3),
                ])
            mode_name = "graph" if mode == "graph" else "XLA (jit_compile=True)"
            print(f"\n### {spec['title']}, {mode_name}, "
                  f"{n_params[net]:,} trainable parameters\n")
            print(markdown_table(
                ["configuration", "micro-batches/s (median)", "min–max",
                 "ms / micro-batch", "vs plain, median (min–max)",
                 "ours / built-in, median (min–max)",
                 "CPU ms / micro-batch", "vs plain, CPU time", "ours / built-in, CPU time"],
                rows,
            ))
            for n in batch_n:
                for clock, data in (("wall", wall), ("CPU time", cpu)):
                    def ratios(a, b):
                        return summarize(speedup(data[(net, mode) + a],
                                                 data[(net, mode) + b]))
                    scaling_rows.append([
                        f"{net}, {mode}", f"{n * spec['batch_size']} / "
                        f"{spec['batch_size']}", clock,
                        cell(ratios(("plain-aa", 1), ("plain", 1))),
                        cell(ratios(("plain-batch", n), ("plain", 1))),
                        fmt(n, 0),
                    ])
            for n in (instep_n if have_ours else ()):
                goal = INSTEP_GOAL.get(net)
                for clock, data in (("wall", wall), ("CPU time", cpu)):
                    def ratios(a, b):
                        return summarize(speedup(data[(net, mode) + a],
                                                 data[(net, mode) + b]))
                    aa = ratios(("plain-aa", 1), ("plain", 1))
                    r = ratios(("ours-instep", n), ("plain", 1))
                    cross = (cell(ratios(("ours-instep", n), ("ours", n)))
                             if n in ours_n else "n/a")
                    verdict = "" if goal is None else (
                        f" ({'met' if r['median'] >= goal else 'MISSED'})")
                    instep_rows.append([
                        f"{net}, {mode}", f"{n}x{spec['batch_size']}", clock,
                        cell(aa), cell(r) + verdict,
                        "-" if goal is None else f">= {goal:.2f}", cross,
                    ])
            if have_ours and ours_n:
                for clock, data in (("wall", wall), ("CPU time", cpu)):
                    def ratio(a, b):
                        return median(speedup(data[(net, mode) + a], data[(net, mode) + b]))
                    ours_plain = {n: ratio(("ours", n), ("plain", 1)) for n in ours_n}
                    ours_bi = {n: ratio(("ours", n), ("builtin", n))
                               for n in ours_n if n in builtin_n}
                    aa = ratio(("plain-aa", 1), ("plain", 1))
                    row = [f"{net}, {mode}", clock, fmt(aa, 3)]
                    for values, goal in ((ours_plain, 1.0), (ours_bi, 0.99)):
                        if values:
                            worst = min(values, key=values.get)
                            row.append(f"{fmt(values[worst], 3)} at N={worst} "
                                       f"({'met' if values[worst] >= goal else 'MISSED'})")
                        else:
                            row.append("n/a")
                    if 1 in ours_n and 16 in ours_n:
                        flat = ratio(("ours", 16), ("ours", 1))
                        row.append(f"{fmt(flat, 3)} ({'met' if flat >= 0.97 else 'MISSED'})")
                    else:
                        row.append("n/a")
                    goal_rows.append(row)

    print(f"\nEach value: {args.rounds} interleaved rounds x {args.steps} micro-batches "
          f"per configuration (timing via "
          f"{'model.train_function' if args.via == 'function' else 'model.fit'}). "
          "Ratios are throughput ratios (>1 = faster), medians of per-round ratios. "
          "'CPU time' = user+system CPU seconds of this process (all threads) per "
          "window, less sensitive than wall time to other load on the machine.")
    if goal_rows:
        print("\n### Goals\n")
        print(markdown_table(
            ["network, mode", "clock", "A/A control (plain / plain)",
             "worst ours / plain over N in --ours-n (goal >= 1.00)",
             "worst ours / built-in over common N (goal >= 0.99)",
             "ours N=16 / ours N=1 (goal >= 0.97)"],
            goal_rows, align=["l", "l", "r", "r", "r", "r"],
        ))
    if instep_rows:
        print("\n### In-step goals: GradientAccumulationModel(micro_batch_size=B) "
              "fed N*B rows per step vs plain keras.Model at batch B, "
              "micro-batches/s\n")
        print(markdown_table(
            ["network, mode", "batch (N x B)", "clock",
             "A/A control (plain / plain), median (min–max)",
             "in-step / plain, median (min–max)", "goal (median)",
             "in-step / ours across N steps, median (min–max)"],
            instep_rows, align=["l", "l", "l", "r", "r", "r", "r"],
        ))
    if scaling_rows:
        print("\n### Batch scaling: plain keras.Model samples/s at batch N*B "
              "over batch B (same rounds)\n")
        print(markdown_table(
            ["network, mode", "batch N*B / B", "clock",
             "A/A control (plain / plain), median (min–max)",
             "samples/s, batch N*B / batch B, median (min–max)",
             "if all overhead (N)"],
            scaling_rows, align=["l", "l", "l", "r", "r", "r"],
        ))
    total = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {total:.0f} s")
    common.write_json(args.json, {
        "benchmark": "throughput",
        "environment": env,
        "settings": {
            "rounds": args.rounds, "steps": args.steps, "via": args.via,
            "warmup_steps": 2 * WARMUP_STEPS, "quick": args.quick,
            "ours_n": ours_n, "builtin_n": builtin_n, "window_bn_off_n": nobn_n,
            "in_step_n": instep_n, "in_step_goals": INSTEP_GOAL,
            "batch_scaling_n": batch_n,
            "networks": {k: specs[k] for k in networks}, "modes": modes,
        },
        "trainable_params": n_params,
        "results": results,
        "total_seconds": total,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
