"""What each guarantee costs per step, each against its plain counterpart.

**What it measures.** For each feature of `GradientAccumulationModel`, the
time per micro-batch of a model with the feature (B) over the time per
micro-batch of its counterpart without it (A), at the same micro-batch of B
rows, on the same data, from the same initial weights:

| row | B (with the feature) | A (its counterpart) |
| --- | --- | --- |
| `aa` | `keras.Model` | an identical `keras.Model` (A/A control) |
| `across` | `gradient_accumulation_steps=4`, batch B | `keras.Model`, batch B |
| `in_step` | `micro_batch_size=B`, batches of 4B rows | `keras.Model`, batch B |
| `auto` | `micro_batch_size="auto"`, batches of 4B | `micro_batch_size=<what "auto" chose>` |
| `window_bn` | `window_batch_norm=True`, N=4 | `window_batch_norm=False`, N=4 |
| `non_finite` | `non_finite_policy="skip_window"`, N=4 | `"propagate"`, N=4 |
| `mixed_float16` | N=4 under `mixed_float16` | `keras.Model` under `mixed_float16` |
| `backup` | N=4 + our `BackupAndRestore` | N=4 + `keras.callbacks.BackupAndRestore` |

Under `mixed_float16` both models get Keras' `LossScaleOptimizer` from
`compile()` (ours then resolves `non_finite_policy="auto"` to
`"skip_window"`). Both backup callbacks save every 8 batches
(`save_freq=8`), each into its own temporary folder; ours also backs up at
the end of every epoch (here: of every `fit()` call, so 9 backups per 64
steps against Keras' 8) and syncs the weights file to disk, and its train
step records each batch's fingerprint: all of that is in the ratio.
`window_bn` runs only on networks with BatchNormalization. "auto" runs on a
device without a memory limit here (a CPU without
`TF_CPU_BFC_MEM_LIMIT_IN_MB`, or a whole GPU), so it keeps whole batches of
4B rows: the row shows what choosing costs, not what a smaller micro-batch
saves.

Two networks: `small_mlp` (32 features, 2 x 64 ReLU units, 10 classes,
batch 32: overhead-bound, a step is almost all fixed per-step cost) and
`conv_bn` (16x16x3 inputs, 12 blocks of Conv2D(16, 3x3) +
BatchNormalization + ReLU, batch 32: compute-bound, BatchNormalization-heavy),
each in graph mode and with `jit_compile=True` (XLA).

**How.** One process. Row by row: both models of the row are built and
compiled, then warmed up (two `fit()` calls of the timed length: tracing,
XLA compilation, the optimizer's and the window's variables, "auto"'s
choice), then `--rounds` (7) interleaved rounds follow: in each, each model
runs `model.fit(dataset, epochs=1, steps_per_epoch=..., verbose=0)` over
`--steps` (64) micro-batches of B rows (a model fed batches of 4B rows makes
a quarter as many steps), A then B in even rounds, B then A in odd ones. The
data is a fixed synthetic batch set, cached and repeated in `tf.data`;
batches of 4B rows hold the same rows as four batches of B. Each `fit()` is
timed by process CPU time (`time.process_time()`: all threads, less
sensitive to other load on a shared machine) and by wall time, up to after
the last step's results are on the host. The ratio B/A is taken round by
round; reported: its median and min-max, next to the A/A control's (the
noise band) of the same network and mode. A ratio above 1 means the feature
costs time. Every `fit()` call has a fixed cost of its own (callbacks, a new
data iterator: a few milliseconds on 2 CPU cores, more for ours, whose
`fit()` adds its own callbacks), the same in every round and counted in both
A and B: at the default 64 steps it is a few percent of the small MLP's time
per call (less of the conv net's); at `--quick`'s 8 steps it is not
amortised.

One command (the full run; `--quick` for a smoke test: 2 rounds, 8 steps,
a 3-block conv net):

    python benchmarks/features.py --json benchmarks/results/features_cpu.json \
        --plot benchmarks/results/features_cpu.png

Runtime: not measured yet (most of it is the conv net, in particular under
`mixed_float16`, where a CPU has no fast float16 kernels).
"""

import argparse
import collections
import gc
import os
import shutil
import sys
import tempfile
import time
import warnings

import common
import keras  # after common, which sets TF's logging level first
from common import fmt
from common import markdown_table
from common import median

N = 4  # micro-batches per update wherever ours accumulates
SAVE_FREQ = 8  # batches between backups, both callbacks
WARMUP_FITS = 2
ROWS = ("aa", "across", "in_step", "auto", "window_bn", "non_finite",
        "mixed_float16", "backup")

# One model of a row. kind: "plain", "ours" (across steps) or "ours-instep";
# batch_x: rows per train step, in micro-batches of B; backup: None, "keras"
# or "ours".
Side = collections.namedtuple(
    "Side", ["kind", "n", "batch_x", "micro_batch_size", "accum_kwargs",
             "policy", "backup"],
    defaults=[1, 1, None, None, None, None],
)


def network_specs(quick):
    return {
        "small_mlp": {
            "arch": "mlp", "input_shape": [32], "num_classes": 10,
            "width": 64, "depth": 2, "batch_size": 32, "batch_norm": False,
            "title": "small MLP, 32 -> 64 -> 64 -> 10, B=32 (overhead-bound)",
        },
        "conv_bn": {
            "arch": "conv_bn", "input_shape": [16, 16, 3], "num_classes": 10,
            "filters": 8 if quick else 16, "blocks": 3 if quick else 12,
            "batch_size": 32, "batch_norm": True,
            "title": (f"Conv2D + BatchNormalization x {3 if quick else 12}, "
                      f"{8 if quick else 16} filters, 16x16x3, B=32 "
                      "(compute-bound)"),
        },
    }


def sides(row, b, chosen=None):
    """The row's (A, B) models: A the counterpart, B the feature."""
    ours = Side("ours", n=N)
    if row == "aa":
        return Side("plain"), Side("plain")
    if row == "across":
        return Side("plain"), ours
    if row == "in_step":
        return Side("plain"), Side("ours-instep", batch_x=N, micro_batch_size=b)
    if row == "auto":
        return (Side("ours-instep", batch_x=N, micro_batch_size=chosen),
                Side("ours-instep", batch_x=N, micro_batch_size="auto"))
    if row == "window_bn":
        return (ours._replace(accum_kwargs={"window_batch_norm": False}),
                ours._replace(accum_kwargs={"window_batch_norm": True}))
    if row == "non_finite":
        return (ours._replace(accum_kwargs={"non_finite_policy": "propagate"}),
                ours._replace(accum_kwargs={"non_finite_policy": "skip_window"}))
    if row == "mixed_float16":
        return (Side("plain", policy="mixed_float16"),
                ours._replace(policy="mixed_float16"))
    if row == "backup":
        return ours._replace(backup="keras"), ours._replace(backup="ours")
    raise ValueError(row)


def feature_label(row, b, chosen=None):
    """What the row compares, "B vs A"."""
    return {
        "aa": "A/A control: keras.Model vs an identical keras.Model",
        "across": f"across steps: gradient_accumulation_steps={N} vs keras.Model",
        "in_step": (f"in-step: micro_batch_size={b}, batches of {N}x{b} vs "
                    f"keras.Model, batch {b}"),
        "auto": (f"micro_batch_size='auto' (chose {chosen}) vs "
                 f"micro_batch_size={chosen}, batches of {N * b}"),
        "window_bn": f"window_batch_norm=True vs False, N={N}",
        "non_finite": f"non_finite_policy='skip_window' vs 'propagate', N={N}",
        "mixed_float16": (f"mixed_float16: N={N} vs keras.Model (both with "
                          "LossScaleOptimizer)"),
        "backup": ("keras_accum BackupAndRestore vs keras.callbacks."
                   f"BackupAndRestore, save_freq={SAVE_FREQ}, N={N}"),
    }[row]


class Runner:
    """One model of a row, its data and callbacks; times `fit()` calls."""

    def __init__(self, spec, side, jit_compile, weights, data, steps):
        self.side = side
        self.folder = None
        policy = keras.mixed_precision.global_policy().name
        if side.policy:
            keras.mixed_precision.set_global_policy(side.policy)
        try:
            with warnings.catch_warnings():
                # "auto" warns that a CPU without a limit keeps whole batches.
                warnings.simplefilter("ignore")
                self.model = common.build_model(
                    spec, side.kind, side.n, jit_compile=jit_compile,
                    weights=weights, micro_batch_size=side.micro_batch_size,
                    accum_kwargs=side.accum_kwargs,
                )
        finally:
            keras.mixed_precision.set_global_policy(policy)
        self.dataset = data[side.batch_x]
        self.calls = steps // side.batch_x
        self.callbacks = []
        if side.backup:
            self.folder = tempfile.mkdtemp(prefix=f"features-{side.backup}-")
            backup_dir = os.path.join(self.folder, "backup")
            if side.backup == "ours":
                from keras_accum.callbacks import BackupAndRestore
            else:
                BackupAndRestore = keras.callbacks.BackupAndRestore
            self.callbacks = [BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)]

    def fit(self):
        self.model.fit(
            self.dataset, epochs=1, steps_per_epoch=self.calls, verbose=0,
            shuffle=False, callbacks=self.callbacks,
        )
        common.sync(self.model)

    def warm_up(self):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(WARMUP_FITS):
                self.fit()
        return time.perf_counter() - t0

    def timed(self):
        """(wall seconds, process CPU seconds) of one `fit()` call."""
        gc.collect()
        gc.disable()
        try:
            c0 = time.process_time()
            t0 = time.perf_counter()
            self.fit()
            return time.perf_counter() - t0, time.process_time() - c0
        finally:
            gc.enable()

    def close(self):
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def summarize(values):
    return {"median": median(values), "min": min(values), "max": max(values)}


def run_row(row, net, spec, mode, weights, data, args):
    """Builds, warms up and times the row's two models; returns its entry."""
    b = spec["batch_size"]
    jit = mode == "xla"
    t_row = time.perf_counter()
    runners = {}
    warmup = {}
    chosen = None
    side_a, side_b = sides(row, b)
    if row == "auto":  # B first: A takes the micro-batch that B chose
        runners["b"] = Runner(spec, side_b, jit, weights, data, args.steps)
        warmup["b"] = runners["b"].warm_up()
        chosen = runners["b"].model.micro_batch_size
        side_a, side_b = sides(row, b, chosen)
        runners["a"] = Runner(spec, side_a, jit, weights, data, args.steps)
        warmup["a"] = runners["a"].warm_up()
    else:
        for key, side in (("a", side_a), ("b", side_b)):
            runners[key] = Runner(spec, side, jit, weights, data, args.steps)
        for key in ("a", "b"):
            warmup[key] = runners[key].warm_up()
    wall = {"a": [], "b": []}
    cpu = {"a": [], "b": []}
    try:
        for r in range(args.rounds):
            for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
                w, c = runners[key].timed()
                wall[key].append(w)
                cpu[key].append(c)
    finally:
        for runner in runners.values():
            runner.close()
    ratios = {
        clock: [tb / ta for ta, tb in zip(times["a"], times["b"])]
        for clock, times in (("cpu", cpu), ("wall", wall))
    }
    entry = {
        "network": net, "mode": mode, "row": row,
        "feature": feature_label(row, b, chosen),
        "a": side_a._asdict(), "b": side_b._asdict(),
        "chosen_micro_batch": chosen,
        "micro_batches_per_fit": args.steps,
        "fit_calls_steps": {k: runners[k].calls for k in runners},
        "wall_seconds": wall, "cpu_seconds": cpu,
        # ms per micro-batch of B rows, per round
        "cpu_ms": {k: [1000.0 * t / args.steps for t in cpu[k]] for k in cpu},
        "wall_ms": {k: [1000.0 * t / args.steps for t in wall[k]] for k in wall},
        "ratios": ratios,
        "ratio": {clock: summarize(v) for clock, v in ratios.items()},
        "warmup_s": warmup,
        "row_seconds": time.perf_counter() - t_row,
    }
    del runners
    keras.backend.clear_session()  # frees the row's models and their traces
    return entry


def range_cell(s, digits=3):
    return f"{fmt(s['min'], digits)}–{fmt(s['max'], digits)}"


def band_cell(s, digits=3):
    if s is None:
        return "n/a"
    return f"{fmt(s['median'], digits)} ({range_cell(s, digits)})"


def results_table(results, clock):
    """Markdown rows for one clock ("cpu" or "wall")."""
    bands = {(e["network"], e["mode"]): e["ratio"][clock]
             for e in results if e["row"] == "aa"}
    rows = []
    for e in results:
        ms = e[f"{clock}_ms"]
        rows.append([
            e["network"], e["mode"], e["feature"],
            fmt(median(ms["a"]), 2), fmt(median(ms["b"]), 2),
            fmt(e["ratio"][clock]["median"], 3), range_cell(e["ratio"][clock]),
            band_cell(bands.get((e["network"], e["mode"]))),
        ])
    return markdown_table(
        ["network", "mode", "feature: ours (B) vs plain (A)",
         "plain, A (ms/step)", "ours, B (ms/step)", "ratio B/A (median)",
         "ratio range", "A/A band, median (min–max)"],
        rows, align=["l", "l", "l", "r", "r", "r", "r", "r"],
    )


def draw(payload, path):
    """The figure (benchmarks/plot.py); says so if matplotlib is missing."""
    try:
        import plot
    except ImportError as exc:
        print(f"\n--plot: no figure drawn, matplotlib is not importable ({exc}).")
        return
    plot.plot_features(payload, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--networks", default="small_mlp,conv_bn",
                        help="comma list from: small_mlp, conv_bn")
    parser.add_argument("--modes", default="graph,xla",
                        help="comma list from: graph, xla (jit_compile=True)")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help="comma list from: " + ", ".join(ROWS) +
                             " (the A/A control 'aa' always runs)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved timing rounds (default 7, quick 2)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"micro-batches per fit() call, a multiple of {N} "
                             "(default 64, quick 8)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 rounds, 8 steps, a 3-block conv net")
    parser.add_argument("--intra", type=int, default=None, help="TF intra-op threads")
    parser.add_argument("--inter", type=int, default=None, help="TF inter-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write raw results here")
    parser.add_argument("--plot", default=None,
                        help="draw the ratios into this PNG (needs matplotlib)")
    args = parser.parse_args(argv)

    args.rounds = args.rounds or (2 if args.quick else 7)
    args.steps = args.steps or (8 if args.quick else 64)
    if args.steps % N:
        parser.error(f"--steps must be a multiple of {N} (whole windows, and "
                     f"whole in-step batches of {N} micro-batches)")
    specs = network_specs(args.quick)
    networks = [s.strip() for s in args.networks.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    for name, given, known in (("--networks", networks, specs),
                               ("--modes", modes, ("graph", "xla")),
                               ("--rows", wanted, ROWS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"{name}: unknown {', '.join(unknown)}")
    rows = [r for r in ROWS if r == "aa" or r in wanted]

    intra, inter = common.configure_threads(args.intra, args.inter)
    common.enable_memory_growth()
    env = common.environment(intra, inter)
    common.print_environment(env)
    if not common.have_accum():
        print("keras_accum is not importable: nothing to compare.")
        return 1
    print(f"\n{args.rounds} rounds x {args.steps} micro-batches per fit() "
          f"call, N={N}; rows: {', '.join(rows)}", flush=True)

    t_start = time.perf_counter()
    results = []
    skipped = []
    for net in networks:
        spec = specs[net]
        weights = common.reference_weights(spec, seed=args.seed)
        b = spec["batch_size"]
        # The same rows: 4 batches of B, or 1 batch of 4B.
        data = {1: common.make_data(spec, b, num_batches=N, seed=args.seed),
                N: common.make_data(spec, N * b, num_batches=1, seed=args.seed)}
        for mode in modes:
            for row in rows:
                if row == "window_bn" and not spec["batch_norm"]:
                    skipped.append(f"{net}, {mode}: window_bn (no BatchNormalization)")
                    continue
                entry = run_row(row, net, spec, mode, weights, data, args)
                results.append(entry)
                r = entry["ratio"]
                print(f"  {net}, {mode}, {row}: ratio B/A {r['cpu']['median']:.3f} "
                      f"(CPU time), {r['wall']['median']:.3f} (wall); "
                      f"{entry['row_seconds']:.0f} s", flush=True)

    for clock, name in (("cpu", "process CPU time"), ("wall", "wall time")):
        print(f"\n### Time per micro-batch of B rows, {name}\n")
        print(results_table(results, clock))
    print(f"\nms/step: median over {args.rounds} rounds of one fit() call's "
          f"time / {args.steps} micro-batches of B rows. Ratio B/A: per round, "
          "then median and min–max over rounds; > 1 = the feature costs time. "
          "A/A band: the A/A control's ratio in the same network and mode.")
    for line in skipped:
        print(f"Skipped: {line}")
    for net in networks:
        print(f"{net}: {specs[net]['title']}")
    total = time.perf_counter() - t_start
    print(f"\nTotal benchmark time: {total:.0f} s")
    payload = {
        "benchmark": "features",
        "environment": env,
        "settings": {
            "rounds": args.rounds, "steps": args.steps, "n": N,
            "save_freq": SAVE_FREQ, "warmup_fits": WARMUP_FITS,
            "quick": args.quick, "rows": rows, "modes": modes,
            "networks": {k: specs[k] for k in networks},
        },
        "results": results,
        "skipped": skipped,
        "total_seconds": total,
    }
    common.write_json(args.json, payload)
    if args.plot:
        draw(payload, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
