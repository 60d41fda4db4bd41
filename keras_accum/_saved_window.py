"""The pending window in Keras' weights files (`save_own_variables`)."""

import functools
import warnings

import numpy as np

from keras_accum._tf_utils import per_replica_values
from keras_accum.batch_norm import combine_moments

# Keys: `keras_accum:<part>:<name>:<replica>`, beside Keras' numbered ones.
_PREFIX = "keras_accum:"


def save(parts, store):
    """Writes each part's `state()`, one value per replica, to `store`."""
    for part, obj in parts.items():
        for name, variable in obj.state().items():
            for r, value in enumerate(per_replica_values(variable)):
                store[f"{_PREFIX}{part}:{name}:{r}"] = value


def load(parts, store, replicas):
    """Restores each part (`restore(values)`) from `store`, on `replicas`
    replicas; returns the store's entries that are Keras' own."""
    own, saved = {}, {}
    for key in store.keys():
        if key.startswith(_PREFIX):
            part, name, replica = key[len(_PREFIX) :].split(":")
            saved.setdefault(part, {}).setdefault(name, {})[int(replica)] = (
                np.asarray(store[key])
            )
        else:
            own[key] = store[key]
    values = {
        part: {
            name: [per_replica[r] for r in sorted(per_replica)]
            for name, per_replica in names.items()
        }
        for part, names in saved.items()
    }
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
    merged = {"accumulator": {}, "batch_norm": {}}
    for name, per_replica in accumulator.items():
        merged["accumulator"][name] = [per_replica[0]] * replicas
    pending = int(accumulator.get("micro_step", [0])[0])
    if not pending:
        return merged
    accumulated = [int(a) for a in accumulator["added_micro_batches"]]
    if any(a != pending for a in accumulated):
        warnings.warn(
            "The saved window was accumulated on "
            f"{saved} replicas and dropped non-finite micro-batches; it "
            f"cannot be split over {replicas} replicas and is discarded.",
            stacklevel=3,
        )
        for name in ("micro_step", "added_micro_batches", "steps_in_window"):
            merged["accumulator"][name] = [np.zeros((), np.int64)] * replicas
        return merged
    for name, per_replica in accumulator.items():
        if name == "normalizer_sum" or name.startswith("buffer_"):
            total = np.sum(per_replica, axis=0)
            merged["accumulator"][name] = _on_first(total, replicas)
    statistics = values.get("batch_norm", {})
    for name in statistics:
        if not name.endswith("_count"):
            continue
        group = name[: -len("_count")]
        parts = zip(
            *(statistics[group + field] for field in ("_count", "_mean", "_m2"))
        )
        combined = functools.reduce(combine_moments, parts)
        for field, value in zip(("count", "mean", "m2"), combined):
            merged["batch_norm"][f"{group}_{field}"] = _on_first(
                np.asarray(value), replicas
            )
    return merged


def _on_first(value, replicas):
    """`value` on the first replica, zeros on the others."""
    return [value] + [np.zeros_like(value)] * (replicas - 1)
