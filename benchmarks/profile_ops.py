"""Where does the time of one micro-batch go? Op-level profile, plain vs ours.

Runs ``--steps`` micro-batches of each configuration (plain ``keras.Model``,
``GradientAccumulationModel`` with N, built-in SGD(gradient_accumulation_steps=N))
under the TensorFlow profiler (``tf.profiler.experimental.start/stop``), after a
warm-up, and aggregates the op events the TF executor records (op type,
duration) from the profiler's XSpace file. Printed per configuration, per
micro-batch:

  * number of TF ops executed (deterministic: not affected by machine load);
  * summed op time and the ``train_function`` call time (both inflated alike
    by other load on the machine);
  * per-op-type time, side by side, with the difference to plain.

The op counts, and the time of the ops that only the accumulating
configurations run (accumulator ``AssignAddVariableOp``s, window
bookkeeping), put next to the convolutions' time, show what accumulation
costs independently of machine load. In XLA mode the step is one compiled
cluster, so only its total is visible.

Usage:
    python benchmarks/profile_ops.py                      # U-Net, N=4, graph mode
    python benchmarks/profile_ops.py --network convnet --n 16
    python benchmarks/profile_ops.py --jit                # XLA (totals only)
"""

import argparse
import collections
import glob
import os
import shutil
import sys
import tempfile

import common
import tensorflow as tf  # noqa: E402
import throughput  # noqa: E402  (Runner, network_specs)
from common import fmt
from common import markdown_table


def profile(runner, steps, logdir):
    tf.profiler.experimental.start(logdir)
    try:
        runner.run(steps)
    finally:
        tf.profiler.experimental.stop()
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    space = xplane_pb2.XSpace()
    with open(files[0], "rb") as f:
        space.ParseFromString(f.read())
    op_time = collections.Counter()  # op type -> picoseconds
    op_count = collections.Counter()
    call_ps = 0
    for plane in space.planes:
        md = plane.event_metadata
        for line in plane.lines:
            if line.name.startswith("tf_Compute"):
                for ev in line.events:
                    op_type = md[ev.metadata_id].display_name
                    if op_type:
                        op_time[op_type] += ev.duration_ps
                        op_count[op_type] += 1
            elif line.name == "python":
                for ev in line.events:
                    if md[ev.metadata_id].name == "multi_step_on_iterator":
                        call_ps += ev.duration_ps
    return {
        "op_ms": {k: v / 1e9 / steps for k, v in op_time.items()},
        "op_count": {k: v / steps for k, v in op_count.items()},
        "call_ms": call_ps / 1e9 / steps,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--network", choices=("mlp", "convnet", "unet"), default="unet")
    parser.add_argument("--unet-size", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="accumulation steps")
    parser.add_argument("--steps", type=int, default=32,
                        help="profiled micro-batches, a multiple of N (default 32)")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True")
    parser.add_argument("--window-bn-off", action="store_true",
                        help="add GradientAccumulationModel(window_batch_norm=False)")
    parser.add_argument("--top", type=int, default=20, help="op types to list")
    parser.add_argument("--intra", type=int, default=None)
    parser.add_argument("--inter", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps % args.n:
        parser.error("--steps must be a multiple of --n")

    intra, inter = common.configure_threads(args.intra, args.inter)
    common.enable_memory_growth()
    env = common.environment(intra, inter)
    common.print_environment(env)
    spec = throughput.network_specs(argparse.Namespace(unet_size=args.unet_size))[
        args.network]
    weights = common.reference_weights(spec, seed=args.seed)
    dataset = common.make_data(spec, spec["batch_size"], seed=args.seed)
    configs = [("plain", 1)]
    if common.have_accum():
        configs.append(("ours", args.n))
        if args.window_bn_off:
            configs.append(("ours-nobn", args.n))
    if args.n >= 2:
        configs.append(("builtin", args.n))

    results = {}
    tmp = tempfile.mkdtemp(prefix="profile_ops_")
    try:
        for kind, n in configs:
            model = common.build_model(spec, kind, n, args.jit, weights)
            runner = throughput.Runner(model, dataset, "function")
            runner.warm_up()
            results[(kind, n)] = profile(runner, args.steps,
                                         os.path.join(tmp, f"{kind}{n}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = results[("plain", 1)]
    labels = [common.config_label(k, n) for k, n in configs]
    print(f"\n### Op profile per micro-batch: {spec['title']}, "
          f"{'XLA' if args.jit else 'graph mode'}, {args.steps} profiled micro-batches\n")
    summary = []
    base_total = sum(base["op_ms"].values())
    for (kind, n), lab in zip(configs, labels):
        r = results[(kind, n)]
        total = sum(r["op_ms"].values())
        summary.append([
            lab, fmt(sum(r["op_count"].values()), 1), fmt(total, 2),
            fmt(100.0 * (total / base_total - 1.0), 1), fmt(r["call_ms"], 2),
        ])
    print(markdown_table(
        ["configuration", "TF ops executed / micro-batch", "summed op time (ms)",
         "op time vs plain (%)", "train_function call (ms)"], summary))
    print("\nOp times are summed executor op durations; like wall time they are "
          "inflated by other load on the machine (compare the convolution rows "
          "across columns to see how much); op counts are not.")

    op_types = set()
    for r in results.values():
        op_types.update(r["op_ms"])
    ranked = sorted(op_types, key=lambda t: -max(r["op_ms"].get(t, 0.0)
                                                  for r in results.values()))
    rows = []
    for t in ranked[: args.top]:
        row = [t]
        for kind, n in configs:
            r = results[(kind, n)]
            row.append(f"{fmt(r['op_ms'].get(t, 0.0), 3)} "
                       f"(x{fmt(r['op_count'].get(t, 0.0), 1)})")
        rows.append(row)
    print(f"\nTop {args.top} op types: ms per micro-batch (ops executed per micro-batch)\n")
    print(markdown_table(["op type"] + labels, rows))

    # Op types whose time differs most from plain.
    for kind, n in configs[1:]:
        r = results[(kind, n)]
        diffs = sorted(op_types, key=lambda t: -(r["op_ms"].get(t, 0.0)
                                                 - base["op_ms"].get(t, 0.0)))
        rows = []
        for t in diffs[:8]:
            d_ms = r["op_ms"].get(t, 0.0) - base["op_ms"].get(t, 0.0)
            d_n = r["op_count"].get(t, 0.0) - base["op_count"].get(t, 0.0)
            rows.append([t, fmt(d_ms, 3), fmt(d_n, 2)])
        print(f"\nLargest additions vs plain: {common.config_label(kind, n)}\n")
        print(markdown_table(["op type", "extra ms / micro-batch",
                              "extra ops / micro-batch"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
