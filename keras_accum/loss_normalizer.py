"""The normaliser `D` of each compiled loss term, recorded beside the loss
(docs/design.md, "Exact normalisation")."""

import collections
import contextlib
import functools
import threading
import warnings

import keras
import tensorflow as tf
from keras import ops
from keras import tree

from keras_accum import _keras_compat as compat
from keras_accum._keras_compat import loss_module as keras_loss

_state = threading.local()

# Reductions whose value is a mean, i.e. `sum / normaliser`.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")

# `normalizer`: the `D` the term's sum was divided by (`None` for a sum);
# `data_dependent`: whether `D` depends on a mask or sample weights.
LossTerm = collections.namedtuple(
    "LossTerm", ["normalizer", "data_dependent", "value"]
)


class _LossRecording:
    def __init__(self):
        self.terms = []
        self.unknown_terms = 0

    def known_terms(self):
        """The `LossTerm`s in the compiled losses' order; `None` if unknown."""
        return None if self.unknown_terms else list(self.terms)

    def normalizer(self, batch_size):
        """`D` (`None` for a sum); for mixed terms `batch_size`, warned."""
        if len(self.terms) == 1 and self.unknown_terms == 0:
            return self.terms[0].normalizer
        if self.unknown_terms or any(
            t.data_dependent or t.normalizer is None for t in self.terms
        ):
            warnings.warn(
                "GradientAccumulationModel: the model's loss has several "
                "terms whose normalisers differ (masked or weighted outputs, "
                "`reduction='sum'`, or a custom loss object). Micro-batches "
                "are weighted by their number of samples, which equals the "
                "big batch only when every term is a per-sample mean. See "
                "docs/semantics.md, 'What equals the big batch'.",
                stacklevel=2,
            )
        return batch_size


@contextlib.contextmanager
def record_loss_terms():
    """Records the `LossTerm`s of the compiled losses computed in the block."""
    recording = _LossRecording()
    previous = getattr(_state, "recording", None)
    _state.recording = recording
    try:
        yield recording
    finally:
        _state.recording = previous


class RecordingLoss:
    """A `keras.losses.Loss` recording its normaliser in `record_loss_terms`."""

    def __init__(self, loss):
        self.loss = loss

    @property
    def name(self):
        return self.loss.name

    def __call__(self, y_true, y_pred, sample_weight=None):
        recording = getattr(_state, "recording", None)
        loss = self.loss
        if recording is None:
            return loss(y_true, y_pred, sample_weight)
        reduction = keras_loss.standardize_reduction(loss.reduction)
        if type(loss).__call__ is not keras_loss.Loss.__call__ or (
            reduction not in _MEAN_REDUCTIONS + ("sum",)
        ):
            recording.unknown_terms += 1
            return loss(y_true, y_pred, sample_weight)

        # The same steps as `keras.losses.Loss.__call__`.
        in_mask = compat.get_keras_mask(y_pred)
        with keras.name_scope(loss.name):
            convert = functools.partial(ops.convert_to_tensor, dtype=loss.dtype)
            y_pred = tree.map_structure(convert, y_pred)
            y_true = tree.map_structure(convert, y_true)
            values = loss.call(y_true, y_pred)
            out_mask = compat.get_keras_mask(values)
            mask = in_mask if out_mask is None else out_mask
            if in_mask is not None and out_mask is not None:
                mask = in_mask & out_mask
            value = keras_loss.reduce_weighted_values(
                values,
                sample_weight=sample_weight,
                mask=mask,
                reduction=reduction,
                dtype=loss.dtype,
            )
            if reduction == "sum":
                recording.terms.append(LossTerm(None, False, value))
                return value
            # `D`: the divisor Keras' `reduce_weighted_values` used.
            values = ops.convert_to_tensor(values, dtype=loss.dtype)
            dtype = values.dtype
            data_dependent = sample_weight is not None or mask is not None
            if reduction == "mean_with_sample_weight" and data_dependent:
                weights = keras_loss.apply_mask(
                    sample_weight, mask, dtype=dtype, reduction=reduction
                )
                _, weights = keras_loss.squeeze_or_expand_to_same_rank(
                    values, ops.cast(weights, dtype)
                )
                normalizer = ops.sum(weights)
            elif mask is not None:
                # Keras weights valid entries by `total / valid` (0 if none).
                normalizer = ops.sum(ops.cast(mask, dtype))
            else:
                data_dependent = False
                size = ops.convert_to_tensor(ops.shape(values), dtype="int32")
                normalizer = ops.cast(ops.prod(size), dtype)
            recording.terms.append(
                LossTerm(tf.stop_gradient(normalizer), data_dependent, value)
            )
        return value


def install(model, x, y, y_pred, sample_weight):
    """Wraps the model's compiled losses (built symbolically if need be)."""
    compile_loss = compat.compile_loss(model)
    if compile_loss is None:
        return
    if not compile_loss.built:
        compat.compute_output_spec(
            functools.partial(compat.compute_loss, model),
            compat.symbolic(x),
            compat.symbolic(y),
            compat.symbolic(y_pred),
            sample_weight=compat.symbolic(sample_weight),
            training=False,
        )
    flat = compat.flat_losses(compile_loss)
    for i, entry in enumerate(flat):
        if not isinstance(entry.loss, RecordingLoss):
            flat[i] = compat.with_loss(entry, RecordingLoss(entry.loss))
