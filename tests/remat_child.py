"""Child processes of tests/test_remat.py: cases that need a process of
their own (logical devices, a memory limit set before TensorFlow starts).

    python tests/remat_child.py mirrored
    python tests/remat_child.py limit VARIANT WEIGHTS.npy

`limit` trains `deep_net()` on 4 samples, 2 per update, and saves the
final weights, or prints `out of memory`. VARIANT: `plain` (`keras.Model`,
one sample per step), `ours` (`GradientAccumulationModel`, N=2 of one
sample), `remat` (the same with `remat=True`), `in_step` (batches of 2,
`micro_batch_size=1`), `auto` (batches of 2, `micro_batch_size="auto"`,
`remat="auto"`). The memory
limit comes from the environment (`TF_CPU_BFC_MEM_LIMIT_IN_MB`).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import test_remat  # noqa: E402

import keras_accum  # noqa: E402

# The models `mirrored()` trains: residual blocks, a block that writes
# state in its forward pass, and a subclassed model built by `fit()`.
MIRRORED_MODELS = {
    "residual": (test_remat.residual_net, (6, 6, 4)),
    "spectral_normalization": (
        lambda: test_remat._writers_net(
            test_remat.WRITERS["spectral_normalization"]
        ),
        (5,),
    ),
    "subclassed_unbuilt": (
        lambda: test_remat.styled_net("subclassed",
                                      gradient_accumulation_steps=1),
        (6, 6, 4),
    ),
}


def mirrored():
    """Two replicas: with and without `remat`, the same weights; a line
    `NAME moved M difference D` per model of `MIRRORED_MODELS`."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    # One strategy for all: a new one's collectives can take the instance
    # keys of an earlier one's, of other shapes.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for name, (make, shape) in MIRRORED_MODELS.items():
        data = test_remat._data(shape, (2,))
        models = []
        for remat in (False, True):
            with strategy.scope():
                model = make()
                if not isinstance(model, keras_accum.GradientAccumulationModel):
                    model = keras_accum.GradientAccumulationModel.from_model(
                        model, gradient_accumulation_steps=3
                    )
                model.gradient_accumulation_steps = 3
                model.remat = remat
                model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            keras.utils.set_random_seed(7)
            model.fit(*data, batch_size=4, epochs=2, shuffle=False, verbose=0)
            models.append(model)
        difference = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(models[0].weights, models[1].weights)
        )
        initial = make()
        initial(np.zeros((1,) + shape))
        moved = test_remat._moved(initial, models[1])
        print(f"{name} moved {moved:.3e} difference {difference:.3e}")


class SequenceBlock(keras.layers.Layer):
    """Per position: Dense, BatchNormalization, ReLU, Dropout, Dense, and
    the residual add. (No convolution: some of TensorFlow's CPU
    convolution kernels ask for a workspace, wait for the allocator when it
    is refused, then go on without it, which makes a run under a limit
    slow.)"""

    def __init__(self, channels, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(channels)
        self.norm = keras.layers.BatchNormalization()
        self.dropout = keras.layers.Dropout(0.3)
        self.outer = keras.layers.Dense(channels)

    def call(self, x, training=None):
        h = keras.activations.relu(self.norm(self.inner(x), training=training))
        return x + self.outer(self.dropout(h, training=training))


SHAPE = (4096, 8)


def deep_net():
    """24 blocks on 4096 positions: activations far larger than weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(SHAPE)
    x = inputs
    for _ in range(24):
        x = SequenceBlock(SHAPE[-1])(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(x))


def limit(variant, path):
    # One operation at a time: a failed allocation then waits for TF's
    # allocator (10 s) once, not once per operation running beside it.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    x, y = test_remat._data(SHAPE, (2,), n=4)
    options = dict(gradient_accumulation_steps=2, remat=variant == "remat")
    batch_size = 1
    if variant in ("auto", "in_step"):
        # The micro-batches inside the step; "auto" ends at one row.
        options = dict(gradient_accumulation_steps=1, micro_batch_size=1)
        if variant == "auto":
            options.update(micro_batch_size="auto", remat="auto")
        batch_size = 2
    model = deep_net()
    if variant != "plain":
        model = keras_accum.GradientAccumulationModel.from_model(
            model, **options
        )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    keras.utils.set_random_seed(7)
    try:
        history = model.fit(x, y, batch_size=batch_size, epochs=1,
                            shuffle=False, verbose=0)
    except tf.errors.ResourceExhaustedError as error:
        print("out of memory:", error.message.splitlines()[0][:200])
        return
    np.save(path, np.concatenate([np.ravel(w) for w in model.get_weights()]))
    print("trained; remat active:",
          getattr(model, "remat_active", False),
          "logs:", sorted(history.history))


if __name__ == "__main__":
    {"mirrored": mirrored, "limit": limit}[sys.argv[1]](*sys.argv[2:])
