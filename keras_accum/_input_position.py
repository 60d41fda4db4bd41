"""Where `fit()` is in its input, for `callbacks.BackupAndRestore`: the
fingerprint of the last batch trained on, and a resume at a backed-up
position (docs/design.md, "Exact resume")."""

import warnings

import numpy as np
import tensorflow as tf

from keras_accum import _keras_compat as compat
from keras_accum._tf_utils import components
from keras_accum._tf_utils import state_variable

# A fingerprint matches its backup's within this relative tolerance (the
# same sums, reduced in another order).
_RTOL = 1e-6


def fingerprint(data):
    """`[sum, sum of squares, sum of magnitudes]` of the numbers in `data`,
    in float64: batches that differ in their samples differ in it."""
    total = tf.zeros([3], tf.float64)
    for value in tf.nest.flatten(data):
        if isinstance(value, tf.RaggedTensor):
            value = value.flat_values
        elif isinstance(value, tf.SparseTensor):
            value = value.values
        if value is None or not (
            value.dtype.is_floating or value.dtype.is_integer
            or value.dtype.is_bool
        ):
            continue
        value = tf.cast(value, tf.float64)
        total += tf.stack([
            tf.reduce_sum(value),
            tf.reduce_sum(value * value),
            tf.reduce_sum(tf.abs(value)),
        ])
    return total


def _local_fingerprint(batch):
    """The fingerprint of a batch as this worker's replicas hold it."""
    parts = [p for v in tf.nest.flatten(batch) for p in components(v)]
    return fingerprint(parts).numpy()


class InputPosition:
    """The input's position: recorded while training, resumed at restart.

    `start_fit()` and `capture()` tell it `fit()`'s input; `record()` (in the train step) keeps
    the fingerprint of the batch trained on last; `resume()` makes the next
    epoch start where a backup was made: it draws the orders of the epochs
    before it (a reshuffling `tf.data` pipeline then gives the order it
    gave the backed-up run), and `take()` has the train calls consume the
    backed-up epoch's batches without training, restore the metrics' state
    and check the last batch's fingerprint.
    """

    def __init__(self):
        self.records = False  # whether the train step records fingerprints
        self.variable = None
        self.epoch_iterator = None  # `fit()`'s, once it has started
        self._capturing = False
        self.remaining = 0
        self._metrics = self._expected = None
        self._where, self._strict = "", True

    # While training.

    def start_fit(self, records):
        """A `fit()` starts; returns whether the train step must be traced
        again (`records`: whether it records fingerprints)."""
        self.epoch_iterator, self._capturing = None, True
        changed = records != self.records
        self.records = records
        return changed

    def capture(self, epoch_iterator):
        """Keeps the epoch iterator of the `fit()` that started."""
        if self._capturing:
            self.epoch_iterator, self._capturing = epoch_iterator, False

    def build(self):
        """Creates the fingerprint's variable (in the strategy's scope)."""
        if self.records and self.variable is None:
            self.variable = state_variable(
                tf.zeros([3], tf.float64), "input_fingerprint",
                aggregation=tf.VariableAggregation.SUM,
            )

    def record(self, data):
        """Keeps the fingerprint of `data`, the batch being trained on."""
        if self.records and self.variable is not None:
            self.variable.assign(fingerprint(data))

    def recorded(self):
        """The fingerprint of the last batch trained on by this worker's
        replicas, or `None` if the train step records none."""
        if not self.records or self.variable is None:
            return None
        values = [np.asarray(c.numpy()) for c in components(self.variable)]
        return np.sum(values, axis=0).tolist()

    # At a restart.

    def resume(self, epoch, batches, metrics=None, expected=None,
               where="", strict=True):
        """Has the next epoch, `epoch`, start after its batch `batches`,
        with `metrics` (the values of `model.metrics_variables`) and the
        last skipped batch's fingerprint checked against `expected`."""
        self._capturing = False
        given = 0
        if self.epoch_iterator is not None:
            given = compat.replay_epochs(self.epoch_iterator, epoch)
        skip = given + batches
        self.remaining = int(skip)
        self._metrics = metrics if skip else None
        self._expected = expected if skip else None
        self._where, self._strict = where, strict

    def reset(self):
        self.remaining = 0
        self._metrics = self._expected = None
        self.epoch_iterator, self._capturing = None, False

    def take(self, model, iterator, steps_per_execution):
        """Consumes one train call's batches if any are to be skipped;
        returns whether it did."""
        if not self.remaining:
            return False
        count = min(steps_per_execution, self.remaining)
        get_next = getattr(iterator, "get_next", lambda: next(iterator))
        for taken in range(count):
            try:
                batch = get_next()
            except (StopIteration, tf.errors.OutOfRangeError):
                if not taken:
                    raise  # The epoch ended with the call before.
                # The input ended inside this call (a backup counts an
                # epoch of unknown length's last call as ending at its
                # nominal step): a short call, which returns as Keras'
                # own does; the next one ends the epoch.
                self.remaining = 1
            if self._metrics is not None or not compat.metrics_built(model):
                # Resumed mid-epoch: the epoch's metrics as backed up.
                compat.build_metrics(model, batch)
                _restore_metrics(model, self._metrics)
                self._metrics = None
            self.remaining -= 1
            if not self.remaining:
                self._check(batch)
                break
        return True

    def _check(self, batch):
        """Compares the last skipped batch with the backed-up one."""
        expected, self._expected = self._expected, None
        if expected is None or not np.any(expected):
            return  # No fingerprint recorded (a train step of its own).
        found = _local_fingerprint(batch)
        scale = np.array([expected[2], expected[1], expected[2]])
        if np.all(np.abs(found - expected) <= _RTOL * scale):
            return
        message = (
            f"The input of this `fit()` is not the one that was backed up: "
            f"{self._where} holds other samples than the backed-up run "
            "trained on there, so resuming would train on other samples "
            "than it would have. Give the input the same order in every run "
            "(a `seed` for `tf.data.Dataset.shuffle`, or "
            "`keras.utils.set_random_seed()` before the pipeline is built; "
            "`shuffle=False` or `True` for arrays), or delete the backup "
            "folder to start over; `strict=False` resumes anyway, with a "
            f"warning. (Fingerprints: backed up {list(expected)}, found "
            f"{found.tolist()}.)"
        )
        if self._strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=2)


def _restore_metrics(model, values):
    """Assigns `values` (`None`: none) to `model.metrics_variables`."""
    if values is None:
        return
    variables = model.metrics_variables
    if len(values) != len(variables):
        raise ValueError(
            f"The backup holds the state of {len(values)} metric variables, "
            f"but the model's compiled loss and metrics have "
            f"{len(variables)}: `compile()` was called with other metrics "
            "than in the run that was backed up. Compile the same metrics, "
            "or delete the backup folder to start training over."
        )
    for value, variable in zip(values, variables):
        variable.assign(
            np.reshape(np.asarray(value, variable.dtype), variable.shape)
        )
