"""What `BackupAndRestore(save_before_preemption=True)` costs per batch.

**What it measures.** Wall time per train batch of two workers under
`MultiWorkerMirroredStrategy` (two processes on localhost, CPU), training
the same small MLP (`--width` 64, batches of 32, N=4) on the same batches,
with `keras_accum.callbacks.BackupAndRestore(save_freq=False)`:

| side | callback |
| --- | --- |
| `off` | `save_before_preemption=False` |
| `off_again` | the same again: the A/A control, whose ratio to `off` is the noise band |
| `on` | `save_before_preemption=True`: agreed through the coordination service |
| `collective` | `off` plus one all-gather of one number per batch (the former way) |

With `on`, SIGTERM is agreed through TensorFlow's coordination service and
a batch end reads local flags only; `collective` is how the workers agreed
before, what `on` no longer pays.

No signal arrives: this is the cost on the batches without one.

**How.** Each worker builds the model once, warms up (one `fit()` per
side), then runs `--rounds` (7) interleaved rounds: in each, each side's
`fit(steps_per_epoch=--steps)` (200), the order reversed every other round
(both workers run the same sequence). A callback times the batches after
the first 10 of each call (wall clock, worker 0). Reported: ms per batch
(median over rounds) and the ratio to `off` round by round (median,
min-max).

    python benchmarks/preemption.py                 # about two minutes
    python benchmarks/preemption.py --rounds 3 --steps 100
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(1, _REPO_ROOT)

SIDES = ("off", "off_again", "on", "collective")
SKIP = 10  # batches of each call not timed


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker(args):
    """One worker's runs; worker 0 prints one JSON line per timed call."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_accum
    from keras_accum import _workers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index, _ = _workers.workers(strategy)

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == SKIP:
                self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.end = time.perf_counter()
            self.batches = batch + 1 - SKIP

    class PerBatchCollective(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            _workers.any_worker(strategy, False)

    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((32,))
        h = keras.layers.Dense(args.width, activation="relu")(inputs)
        h = keras.layers.Dense(args.width, activation="relu")(h)
        model = keras_accum.GradientAccumulationModel(
            inputs, keras.layers.Dense(1)(h), gradient_accumulation_steps=4
        )
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    rows = 32 * args.steps
    x = rng.normal(size=(rows, 32)).astype("float32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    folder = tempfile.mkdtemp()

    def run(side):
        timer = Timer()
        callbacks = [
            keras_accum.callbacks.BackupAndRestore(
                os.path.join(folder, f"{side}-{index}"), save_freq=False,
                save_before_preemption=side == "on",
            ),
            timer,
        ]
        if side == "collective":
            callbacks.append(PerBatchCollective())
        model.fit(dataset, epochs=1, steps_per_epoch=args.steps,
                  callbacks=callbacks, verbose=0)
        return (timer.end - timer.start) / timer.batches * 1000

    for side in SIDES:  # warm-up
        run(side)
    for round_ in range(args.rounds):
        order = SIDES if round_ % 2 == 0 else SIDES[::-1]
        for side in order:
            ms = run(side)
            if index == 0:
                print(json.dumps({"round": round_, "side": side, "ms": ms}),
                      flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(2)]}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    processes = []
    for index in (0, 1):
        env_i = dict(env, TF_CONFIG=json.dumps({
            "cluster": cluster, "task": {"type": "worker", "index": index},
        }))
        argv = [sys.executable, os.path.abspath(__file__),
                "--worker", str(index), "--rounds", str(args.rounds),
                "--steps", str(args.steps), "--width", str(args.width)]
        processes.append(subprocess.Popen(
            argv, env=env_i, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        ))
    out, _ = processes[0].communicate()
    processes[1].wait()
    if processes[0].returncode or processes[1].returncode:
        raise SystemExit(
            f"a worker failed: {[p.returncode for p in processes]}"
        )
    results = [json.loads(line) for line in out.splitlines() if line]
    ms = {side: {} for side in SIDES}
    for r in results:
        ms[r["side"]][r["round"]] = r["ms"]
    print(f"Two workers, MultiWorkerMirroredStrategy on localhost (CPU), "
          f"MLP width {args.width}, {args.rounds} rounds of {args.steps} "
          "batches.\n")
    print("| side | ms/batch (median) | ratio to off (median) | "
          "ratio range |")
    print("| :--- | ---: | ---: | ---: |")
    for side in SIDES:
        ratios = [ms[side][r] / ms["off"][r] for r in ms["off"]]
        print(f"| {side} | {statistics.median(ms[side].values()):.3f} | "
              f"{statistics.median(ratios):.3f} | "
              f"{min(ratios):.3f}–{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
