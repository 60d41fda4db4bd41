"""What `micro_batch_size="auto"` costs per step against a fixed size.

**What it measures.** CPU time per train step of three models that train
the same batches of B rows as one micro-batch each, from the same initial
weights, on a device without a memory limit (where "auto" keeps whole
batches):

| side | model |
| --- | --- |
| `fixed` | `GradientAccumulationModel(micro_batch_size=B)` |
| `fixed_again` | a second `fixed` model: the A/A control (its ratio is the noise) |
| `auto` | `GradientAccumulationModel(micro_batch_size="auto")` |

"auto" takes each batch out of the iterator on the host (so that a step
that runs out of memory can be trained again on the same batch), and its
step first copies the state it may write (to put it back after an
out-of-memory error) before it writes any of it: what this benchmark
weighs against the fixed size.

**How.** One process. The models are built, compiled and warmed up (two
`fit()` calls of the timed length), then `--rounds` (21) interleaved
rounds follow: in each, each model runs `fit(..., epochs=1)` of `--steps`
steps (256 for the small MLP, 64 for the conv net), the order reversed
every other round. A callback reads the process CPU time and the wall time
at each batch's begin and end: a round's figure is the median step (the
first two steps aside), so that `fit()`'s own set-up does not count.
Reported, for each clock: ms per step (median over rounds), and the ratio
to `fixed` round by round (median, min-max). With several threads the CPU
time also counts threads that wait busily; the wall time counts what
other processes take.

Two networks (benchmarks/features.py's): `small_mlp` (overhead-bound) and
`conv_bn` (12 blocks of Conv2D + BatchNormalization, compute-bound), B=32.
`--input` chooses what `fit()` gets: a `tf.data` pipeline (`dataset`, the
default) or NumPy arrays (`arrays`, `fit(x, y, batch_size=B)`);
`--threads 1` pins TensorFlow to one intra- and one inter-op thread (the
default: TensorFlow's own).

    python benchmarks/auto_overhead.py                 # about two minutes
    python benchmarks/auto_overhead.py --networks conv_bn --input arrays --threads 1
"""

import argparse
import time
import warnings

import common
import keras  # after common, which sets TF's logging level first
import numpy as np
from common import fmt
from common import markdown_table
from common import median
from features import network_specs

STEPS = {"small_mlp": 256, "conv_bn": 64}


def build(spec, micro_batch_size, weights):
    inputs, outputs = common.network_graph(spec)
    model = common.GradientAccumulationModel(
        inputs, outputs, micro_batch_size=micro_batch_size
    )
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(
            learning_rate=common.LEARNING_RATE, momentum=common.MOMENTUM
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class StepTimes(keras.callbacks.Callback):
    """The process CPU time and the wall time of each train step."""

    def __init__(self):
        super().__init__()
        self.seconds = []  # [(CPU, wall)]

    def on_train_batch_begin(self, batch, logs=None):
        self._start = (time.process_time(), time.perf_counter())

    def on_train_batch_end(self, batch, logs=None):
        cpu, wall = self._start
        self.seconds.append(
            (time.process_time() - cpu, time.perf_counter() - wall)
        )


def seconds_per_step(model, data, steps):
    """The median step of one `fit()` of `steps` steps, the first two
    aside: `(CPU, wall)` seconds."""
    times = StepTimes()
    if isinstance(data, tuple):  # arrays, `steps` batches of B
        x, y, b = data
        model.fit(x[: steps * b], y[: steps * b], batch_size=b, epochs=1,
                  verbose=0, shuffle=False, callbacks=[times])
    else:
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0,
                  shuffle=False, callbacks=[times])
    kept = times.seconds[2:]
    return median([c for c, _ in kept]), median([w for _, w in kept])


def arrays(spec, b, steps, seed=0):
    """`steps` batches of B samples as NumPy arrays, and B."""
    rng = np.random.default_rng(seed)
    n = b * steps
    x = rng.random((n,) + tuple(spec["input_shape"]), dtype=np.float32)
    y = rng.integers(0, spec["num_classes"], size=(n,), dtype=np.int32)
    return x, y, b


def run_network(name, spec, rounds, steps, input_kind):
    b = spec["batch_size"]
    weights = common.reference_weights(spec)
    if input_kind == "arrays":
        data = arrays(spec, b, steps)
    else:
        data = common.make_data(spec, b, num_batches=8)
    with warnings.catch_warnings():
        # "auto" warns that a CPU without a limit trains whole batches.
        warnings.simplefilter("ignore")
        models = {"fixed": build(spec, b, weights),
                  "fixed_again": build(spec, b, weights),
                  "auto": build(spec, "auto", weights)}
        for model in models.values():
            for _ in range(2):
                seconds_per_step(model, data, steps)
    times = {side: [] for side in models}
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for side in order:
            times[side].append(seconds_per_step(models[side], data, steps))
    rows = []
    for side, values in times.items():
        row = [name, side]
        for clock in (0, 1):  # CPU, wall
            ratios = [v[clock] / f[clock] for v, f in zip(values, times["fixed"])]
            row += [
                fmt(median([v[clock] for v in values]) * 1e3, 3),
                fmt(median(ratios), 3),
                f"{min(ratios):.3f}–{max(ratios):.3f}",
            ]
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--networks", default="small_mlp,conv_bn")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per fit() call (default: per network)")
    parser.add_argument("--input", choices=["dataset", "arrays"],
                        default="dataset")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra- and inter-op threads (default: TF's)")
    args = parser.parse_args()
    if args.threads:
        common.configure_threads(args.threads, args.threads)
    common.print_environment(common.environment(args.threads, args.threads))
    specs = network_specs(quick=False)
    rows = []
    for name in args.networks.split(","):
        rows += run_network(
            name, specs[name], args.rounds, args.steps or STEPS[name],
            args.input,
        )
    print(markdown_table(
        ["network", "side", "CPU ms/step", "CPU ratio", "CPU range",
         "wall ms/step", "wall ratio", "wall range"], rows,
    ))


if __name__ == "__main__":
    main()
