"""Child processes of tests/test_remat.py: cases that need a process of
their own (logical devices, a memory limit set before TensorFlow starts).

    python tests/remat_child.py mirrored
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_accum  # noqa: E402
import test_remat  # noqa: E402


def mirrored():
    """Two replicas: with and without `remat`, the same weights."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    data = test_remat._data((6, 6, 4), (2,))
    models = []
    for remat in (False, True):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = keras_accum.GradientAccumulationModel.from_model(
                test_remat.residual_net(), gradient_accumulation_steps=3,
                remat=remat,
            )
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        keras.utils.set_random_seed(7)
        model.fit(*data, batch_size=4, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    difference = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(models[0].weights, models[1].weights)
    )
    moved = test_remat._moved(test_remat.residual_net(), models[1])
    print(f"moved {moved:.3e} difference {difference:.3e}")


if __name__ == "__main__":
    {"mirrored": mirrored}[sys.argv[1]]()
