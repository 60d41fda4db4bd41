"""The normaliser `D` of each compiled loss term, recorded beside the loss.

Wraps the loss objects of the model's `CompileLoss`; see docs/design.md,
"Exact normalisation".
"""

import collections
import contextlib
import functools
import threading
import warnings

import tensorflow as tf
from keras import ops
from keras import tree

from keras_accum import _keras_compat as compat
from keras_accum._keras_compat import loss_module as keras_loss_module

_state = threading.local()

# Reductions whose value is a mean, i.e. `sum / normaliser`.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


# `normalizer`: the `D` the term's sum was divided by (`None` for a sum);
# `data_dependent`: whether `D` depends on a mask or sample weights;
# `value`: the term's loss.
LossTerm = collections.namedtuple(
    "LossTerm", ["normalizer", "data_dependent", "value"]
)


class _LossRecording:
    def __init__(self):
        self.terms = []
        self.unknown_terms = 0

    def known_terms(self):
        """The `LossTerm`s, in the compiled losses' order; `None` if a term's
        normaliser is unknown (a custom loss object)."""
        return None if self.unknown_terms else list(self.terms)

    def normalizer(self, batch_size):
        """`D` (`None` for a sum); for mixed terms `batch_size`, warned."""
        terms = self.terms
        if len(terms) == 1 and self.unknown_terms == 0:
            return terms[0].normalizer
        if self.unknown_terms or any(
            t.data_dependent or t.normalizer is None for t in terms
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


def _normalizer(values, sample_weight, mask, reduction):
    """The divisor Keras' `reduce_weighted_values` uses for `values`."""
    dtype = values.dtype
    if reduction == "mean_with_sample_weight" and (
        sample_weight is not None or mask is not None
    ):
        weights = keras_loss_module.apply_mask(
            sample_weight, mask, dtype=dtype, reduction=reduction
        )
        weights = ops.cast(weights, dtype)
        _, weights = keras_loss_module.squeeze_or_expand_to_same_rank(
            values, weights
        )
        return ops.sum(weights), True
    if mask is not None:
        # Keras weights valid entries by `total / valid` (0 if none).
        return ops.sum(ops.cast(mask, dtype)), True
    size = ops.prod(ops.convert_to_tensor(ops.shape(values), dtype="int32"))
    return ops.cast(size, dtype), False


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
        reduction = keras_loss_module.standardize_reduction(loss.reduction)
        if type(loss).__call__ is not keras_loss_module.Loss.__call__ or (
            reduction not in _MEAN_REDUCTIONS + ("sum",)
        ):
            recording.unknown_terms += 1
            return loss(y_true, y_pred, sample_weight)

        # The same steps as `keras.losses.Loss.__call__`.
        in_mask = compat.get_keras_mask(y_pred)
        with compat.name_scope(loss.name):
            y_pred = tree.map_structure(
                lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_pred
            )
            y_true = tree.map_structure(
                lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_true
            )
            values = loss.call(y_true, y_pred)
            out_mask = compat.get_keras_mask(values)
            mask = in_mask if out_mask is None else out_mask
            if in_mask is not None and out_mask is not None:
                mask = in_mask & out_mask
            value = keras_loss_module.reduce_weighted_values(
                values,
                sample_weight=sample_weight,
                mask=mask,
                reduction=reduction,
                dtype=loss.dtype,
            )
            if reduction == "sum":
                recording.terms.append(LossTerm(None, False, value))
            else:
                values = ops.convert_to_tensor(values, dtype=loss.dtype)
                if sample_weight is not None:
                    sample_weight = ops.convert_to_tensor(
                        sample_weight, dtype=loss.dtype
                    )
                normalizer, data_dependent = _normalizer(
                    values, sample_weight, mask, reduction
                )
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
            flat[i] = entry._replace(loss=RecordingLoss(entry.loss))
