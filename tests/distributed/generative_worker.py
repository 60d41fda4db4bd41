"""Runs drawn configurations (`tests/generative.py`) under `MirroredStrategy`.

Started once by tests/test_generative.py, so that the two logical CPUs do
not leak into other tests and TensorFlow starts once for all the cases:
reads one case per line on stdin, as JSON, trains it (ours on 2 replicas,
the reference on one device) and answers one line per case,
`RESULT <json>` (`generative.run_case()`'s dict), until stdin ends.

Usage:
    echo '{"strategy": "mirrored", ...}' | python generative_worker.py
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402


def main():
    # Only the answers on stdout: anything else printed goes to stderr, so
    # that the test reads exactly one line per case.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    import generative

    print("READY", file=answers, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        case = json.loads(line)
        result = generative.run_case(case, strategy)
        result["replicas"] = strategy.num_replicas_in_sync
        print("RESULT " + json.dumps(result), file=answers, flush=True)


if __name__ == "__main__":
    main()
