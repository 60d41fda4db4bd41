"""keras_accum: exact, fast gradient accumulation for Keras 3 on TensorFlow."""

__version__ = "0.1.0"

from keras_accum import callbacks  # noqa: E402
from keras_accum.accumulator import GradientAccumulator  # noqa: E402
from keras_accum.model import GradientAccumulationModel  # noqa: E402

__all__ = [
    "GradientAccumulationModel",
    "GradientAccumulator",
    "callbacks",
    "__version__",
]
