"""Training runs on a small device, for `tests/test_small_memory.py`.

Usage: python child.py OUT_DIR GROUP:LIMIT_MB:SCENARIO[,SCENARIO...] ...

Imports TensorFlow once (oneDNN off: its kernels crash at the limit instead
of raising), runs no TensorFlow op, and forks one child process per GROUP,
all at once. Each child sets TensorFlow's CPU allocator limit to LIMIT_MB
before its first TensorFlow op (the allocator reads it when it is made, at
the first op), then runs its scenarios (see `CHILDREN` in the test) one
after the other and writes, per scenario, `OUT_DIR/GROUP/<scenario>.npz`
(final weights), `OUT_DIR/GROUP/<scenario>.json` (history, updates, the
chosen micro-batch, or the error raised) and, for a scenario that
predicts, `OUT_DIR/GROUP/<scenario>_predictions.npy`; its stderr goes to
`OUT_DIR/GROUP/stderr` and its exit code to `OUT_DIR/GROUP/returncode`.
Exits with 1 if a child failed.
"""

import json
import os
import sys

os.environ.update(
    TF_ENABLE_ONEDNN_OPTS="0",
    TF_CPP_MIN_LOG_LEVEL="3",
    KERAS_BACKEND="tensorflow",
)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
sys.path.insert(1, os.path.join(os.path.dirname(TESTS), "examples"))

import contextlib  # noqa: E402
import io  # noqa: E402
import warnings  # noqa: E402

import example_utils  # noqa: E402
import forking  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from small_memory import scenarios  # noqa: E402


def fork_group(folder, limit_mb, names):
    """Starts a child that runs `names` under a limit of `limit_mb` MiB and
    writes into `folder`; returns its process id. (The limit is read when
    TensorFlow's CPU allocator is made, at the first op.)"""
    os.makedirs(folder, exist_ok=True)

    def run():
        os.environ.update(example_utils.cpu_limit_environment(limit_mb))
        main(folder, names)

    return forking.fork(run, os.path.join(folder, "stderr"))


def main(out_dir, names):
    if "mirrored" in names:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * 2,
        )
    for name in names:
        info = {}
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout), warnings.catch_warnings(
                record=True
            ) as caught:
                warnings.simplefilter("always")
                model, history = scenarios.run(name, limited=True)
            info.update(
                history={k: [float(v) for v in vs] for k, vs in history.items()},
                iterations=int(model.optimizer.iterations.numpy()),
                micro_batch_size=getattr(model, "micro_batch_size", None),
            )
            np.savez(os.path.join(out_dir, f"{name}.npz"), *model.get_weights())
            if name in scenarios.predictions:
                np.save(
                    os.path.join(out_dir, f"{name}_predictions.npy"),
                    scenarios.predictions.pop(name),
                )
            del model  # its memory, before the next scenario's model
        except tf.errors.ResourceExhaustedError as error:
            info["error"] = type(error).__name__
            info["message"] = error.message
        info["stdout"] = stdout.getvalue()
        info["warnings"] = [str(w.message) for w in caught]
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    out_dir, pids = sys.argv[1], []
    for spec in sys.argv[2:]:
        group, limit_mb, names = spec.split(":")
        pids.append((group, fork_group(
            os.path.join(out_dir, group), limit_mb, names.split(",")
        )))
    codes = {group: forking.wait(pid) for group, pid in pids}
    for group, code in codes.items():
        with open(os.path.join(out_dir, group, "returncode"), "w") as f:
            f.write(str(code))
    sys.exit(1 if any(codes.values()) else 0)
