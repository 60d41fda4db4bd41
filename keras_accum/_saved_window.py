"""The pending window in Keras' weights files (`save_own_variables`)."""

import functools
import warnings

import numpy as np

from keras_accum._tf_utils import per_replica_values
from keras_accum._workers import gather
from keras_accum._workers import workers
from keras_accum.batch_norm import combine_moments

# Keys: `keras_accum:<part>:<name>:<replica>`, beside Keras' numbered ones.
_PREFIX = "keras_accum:"


def save(parts, store, strategy=None):
    """Writes each part's `state()`, one value per replica of the job, to
    `store`. With several workers (`strategy`), each holds its own
    replicas' values: they are gathered from all workers (one all-gather,
    which every worker must join)."""
    names, values = [], []
    for part, obj in parts.items():
        for name, variable in obj.state().items():
            names.append(f"{_PREFIX}{part}:{name}")
            values.append(per_replica_values(variable))
    if strategy is not None and workers(strategy)[1] > 1 and values:
        values = _gathered(strategy, values)
    for key, per_replica in zip(names, values):
        for r, value in enumerate(per_replica):
            store[f"{key}:{r}"] = value


def _gathered(strategy, values):
    """`values` (per variable, this worker's per-replica arrays) for all
    replicas of the job: packed into one float64 row per replica, which
    holds the counters, flags and float32 buffers exactly."""
    local = [
        np.concatenate([np.ravel(v[r]).astype(np.float64) for v in values])
        for r in range(len(values[0]))
    ]
    rows = gather(strategy, local)
    result, start = [], 0
    for per_replica in values:
        like = per_replica[0]
        end = start + like.size
        result.append([
            row[start:end].reshape(like.shape).astype(like.dtype)
            for row in rows
        ])
        start = end
    return result


def load(parts, store, replicas):
    """Restores each part (`restore(values)`) from `store`, on `replicas`
    replicas; returns the store's entries that are Keras' own."""
    own = {k: store[k] for k in store.keys() if not k.startswith(_PREFIX)}
    saved = [k.split(":") + [k] for k in store.keys() if k.startswith(_PREFIX)]
    values = {}
    for _, part, name, _, key in sorted(saved, key=lambda k: int(k[3])):
        per_replica = values.setdefault(part, {}).setdefault(name, [])
        per_replica.append(np.asarray(store[key]))
    values = _to_replicas(values, replicas)
    for part, obj in parts.items():
        obj.restore(values.get(part, {}))
    return own if saved else store


def _to_replicas(values, replicas):
    """Saved per-replica state for `replicas` replicas: as saved, or merged
    exactly into the first (docs/design.md, "The window's state")."""
    accumulator = values.get("accumulator", {})
    saved = len(accumulator.get("micro_step", [None]))
    if saved == replicas:
        return values
    merged = {name: [v[0]] * replicas for name, v in accumulator.items()}
    pending = int(accumulator.get("micro_step", [0])[0])
    if not pending:
        return {"accumulator": merged}
    if any(int(a) != pending for a in accumulator["added_micro_batches"]):
        warnings.warn(
            "The saved window was accumulated on "
            f"{saved} replicas and dropped non-finite micro-batches; it "
            f"cannot be split over {replicas} replicas and is discarded.",
            stacklevel=3,
        )
        for name in ("micro_step", "added_micro_batches", "steps_in_window"):
            merged[name] = [np.zeros((), np.int64)] * replicas
        return {"accumulator": merged}
    for name, per_replica in accumulator.items():
        if name == "normalizer_sum" or name.startswith("buffer_"):
            merged[name] = _on_first(np.sum(per_replica, axis=0), replicas)
    statistics, batch_norm = values.get("batch_norm", {}), {}
    for name in statistics:
        if name.endswith("_count"):
            group = name.removesuffix("count")
            fields = [group + field for field in ("count", "mean", "m2")]
            parts = zip(*(statistics[field] for field in fields))
            combined = functools.reduce(combine_moments, parts)
            for field, value in zip(fields, combined):
                batch_norm[field] = _on_first(np.asarray(value), replicas)
    return {"accumulator": merged, "batch_norm": batch_norm}


def _on_first(value, replicas):
    """`value` on the first replica, zeros on the others."""
    return [value] + [np.zeros_like(value)] * (replicas - 1)
