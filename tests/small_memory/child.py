"""Training runs on a small device, for `tests/test_small_memory.py`.

Usage: python child.py LIMIT_MB OUT_DIR SCENARIO [SCENARIO ...]

Sets TensorFlow's CPU allocator limit to LIMIT_MB before TensorFlow starts
(oneDNN off: its kernels crash at the limit instead of raising), then runs
each scenario (see `SCENARIOS` in the test) and writes, per scenario,
`OUT_DIR/<scenario>.npz` (final weights) and `OUT_DIR/<scenario>.json`
(history, updates, the chosen micro-batch, or the error raised).
"""

import json
import os
import sys

os.environ.update(
    TF_CPU_ALLOCATOR_USE_BFC="true",
    TF_CPU_BFC_MEM_LIMIT_IN_MB=sys.argv[1],
    TF_ENABLE_ONEDNN_OPTS="0",
    TF_CPP_MIN_LOG_LEVEL="3",
    KERAS_BACKEND="tensorflow",
)
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import contextlib  # noqa: E402
import io  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from small_memory import scenarios  # noqa: E402


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
        except tf.errors.ResourceExhaustedError as error:
            info["error"] = type(error).__name__
            info["message"] = error.message
        info["stdout"] = stdout.getvalue()
        info["warnings"] = [str(w.message) for w in caught]
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    main(sys.argv[2], sys.argv[3:])
