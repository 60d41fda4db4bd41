"""Graph size of the traced train step, side by side.

Traces one train step (`model.train_step` under `tf.function`, the function
Keras compiles) of each configuration on the memory benchmark's U-Net and the
conv net, each in a fresh process, and counts its graph nodes, those of the
functions it calls (the branches of conditionals and loops) included. Prints
a table with the ratio to plain `keras.Model`. A smaller graph is less to
build, optimise and hold.

Configurations: plain `keras.Model` (batch B), `GradientAccumulationModel`
across train steps (N = `--steps`, batch B), the built-in
`SGD(gradient_accumulation_steps=N)` (batch B) and, where the package has
it, `GradientAccumulationModel(micro_batch_size=B)` fed N*B rows ("in-step":
the micro-batch loop is one `tf.while_loop`, so its size does not depend on
N). `--kinds` selects them.

    python benchmarks/graph_size.py
"""

import argparse
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from common import build_model  # noqa: E402
from common import config_label  # noqa: E402
from common import make_data  # noqa: E402

KINDS = ("plain", "ours", "builtin", "ours-instep")

NETWORKS = {
    "unet": {"arch": "unet", "input_shape": [64, 64, 3], "num_classes": 3},
    "convnet": {"arch": "convnet", "input_shape": [32, 32, 3], "num_classes": 10},
}


def graph_nodes(model, spec, batch_size):
    """Nodes of the traced train step and of every function it calls."""
    data = next(iter(make_data(spec, batch_size, num_batches=1)))
    model.make_train_function()  # builds the window's state, as `fit()` does
    step = tf.function(model.train_step, jit_compile=False)
    graph = step.get_concrete_function(data).graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", choices=sorted(NETWORKS), nargs="*",
                        default=sorted(NETWORKS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="comma list from: " + ", ".join(KINDS))
    parser.add_argument("--one", nargs=2, metavar=("NETWORK", "KIND"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        name, kind = args.one
        n = 1 if kind == "plain" else args.steps
        if kind == "ours-instep":
            model = build_model(NETWORKS[name], kind, n,
                                micro_batch_size=args.batch_size)
            print(graph_nodes(model, NETWORKS[name], n * args.batch_size))
        else:
            model = build_model(NETWORKS[name], kind, n)
            print(graph_nodes(model, NETWORKS[name], args.batch_size))
        return
    print("| network | configuration | graph nodes | / plain |")
    print("|---|---|---:|---:|")
    for name in args.network:
        plain = None
        for kind in [k.strip() for k in args.kinds.split(",") if k.strip()]:
            run = subprocess.run(
                [sys.executable, __file__, "--one", name, kind,
                 "--steps", str(args.steps),
                 "--batch-size", str(args.batch_size)],
                capture_output=True, text=True,
            )
            if run.returncode != 0:
                reason = (run.stderr.strip().splitlines() or ["failed"])[-1]
                print(f"| {name} | {kind} | failed: {reason[:80]} | |")
                continue
            nodes = int(run.stdout.split()[-1])
            plain = plain or nodes
            n = 1 if kind == "plain" else args.steps
            print(f"| {name} | {config_label(kind, n, args.batch_size)} | {nodes} | "
                  f"{nodes / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
