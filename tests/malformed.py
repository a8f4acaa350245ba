"""Malformed copies of a good batch, one kind each, and what the refusal says.

Each ``MALFORMED`` entry takes a ``Batch`` (any number of features, with or
without weights) and returns a copy that plain ``EmbeddingBagCollection``
raises on or that would crash or mislead a module that trusts it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def _rebuilt(batch: Batch, **changes: object) -> Batch:
    kjt = batch.sparse_features
    parts = {
        "keys": kjt.keys(),
        "values": kjt.values(),
        "weights": kjt.weights_or_none(),
        "lengths": kjt.lengths(),
    }
    parts.update(changes)
    return Batch(batch.dense_features, KeyedJaggedTensor(**parts), batch.labels)


def _weights(batch: Batch) -> torch.Tensor:
    kjt = batch.sparse_features
    weights = kjt.weights_or_none()
    return torch.ones(kjt.values().numel()) if weights is None else weights


def _with_values(batch: Batch, more: int) -> Batch:
    """``more`` values (and weights) more, or fewer, than the lengths say."""
    values, weights = batch.sparse_features.values(), _weights(batch)
    if more < 0:
        return _rebuilt(batch, values=values[:more], weights=weights[:more])
    return _rebuilt(
        batch,
        values=torch.cat([values, values[:more]]),
        weights=torch.cat([weights, weights[:more]]),
    )


def _negative_length(batch: Batch) -> Batch:
    lengths = batch.sparse_features.lengths().clone()
    lengths[1] += lengths[0] + 1  # the sum stays, so only the sign tells
    lengths[0] = -1
    return _rebuilt(batch, lengths=lengths)


def _decreasing_offsets(batch: Batch) -> Batch:
    kjt = batch.sparse_features
    offsets = kjt.offsets().clone()
    offsets[2] = offsets[-1]  # from 0 to the end, but not monotone
    return Batch(
        batch.dense_features,
        KeyedJaggedTensor(
            keys=kjt.keys(), values=kjt.values(), offsets=offsets, weights=kjt.weights_or_none()
        ),
        batch.labels,
    )


def _wrong_lengths_size(batch: Batch) -> Batch:
    lengths = batch.sparse_features.lengths()[:-2]
    return _rebuilt(
        batch,
        lengths=lengths,
        values=batch.sparse_features.values()[: int(lengths.sum())],
        weights=_weights(batch)[: int(lengths.sum())],
    )


def _repeated_key(batch: Batch) -> Batch:
    keys = list(batch.sparse_features.keys())
    keys[1] = keys[0]
    return _rebuilt(batch, keys=keys)


def _unknown_key(batch: Batch) -> Batch:
    keys = list(batch.sparse_features.keys())
    keys[-1] = "no_such_feature"
    return _rebuilt(batch, keys=keys)


def _wrong_length_per_key(batch: Batch) -> Batch:
    kjt = batch.sparse_features
    per_key = kjt.length_per_key()
    per_key = [per_key[0] + 1, per_key[1] - 1, *per_key[2:]]
    return _rebuilt(batch, length_per_key=per_key)


def _fewer_dense_samples(batch: Batch) -> Batch:
    return Batch(batch.dense_features[:-1], batch.sparse_features, batch.labels)


def _missing_key(batch: Batch) -> Batch:
    kjt = batch.sparse_features
    kept = kjt.keys()[:-1]
    return Batch(batch.dense_features, kjt.permute(list(range(len(kept)))), batch.labels)


def _permuted_keys(batch: Batch) -> Batch:
    kjt = batch.sparse_features
    order = list(reversed(range(len(kjt.keys()))))
    return Batch(batch.dense_features, kjt.permute(order), batch.labels)


# kind -> (make it, a phrase of the refusal, the exception type)
MALFORMED: dict[str, tuple[Callable[[Batch], Batch], str, type[Exception]]] = {
    "short_weights": (lambda b: _rebuilt(b, weights=_weights(b)[:-3]), "weights for", ValueError),
    "long_values": (lambda b: _with_values(b, 5), "lengths add up to", ValueError),
    "short_values": (lambda b: _with_values(b, -5), "lengths add up to", ValueError),
    "negative_length": (_negative_length, "negative length", ValueError),
    "decreasing_offsets": (_decreasing_offsets, "offsets decrease", ValueError),
    "wrong_lengths_size": (_wrong_lengths_size, "bags", ValueError),
    "float_ids": (
        lambda b: _rebuilt(b, values=b.sparse_features.values().float()),
        "values must be int64 or int32",
        TypeError,
    ),
    "int16_ids": (
        lambda b: _rebuilt(b, values=b.sparse_features.values().short()),
        "values must be int64 or int32",
        TypeError,
    ),
    "integer_weights": (
        lambda b: _rebuilt(b, weights=_weights(b).long()),
        "weights must be floating point",
        TypeError,
    ),
    "repeated_key": (_repeated_key, "repeats the features", ValueError),
    "unknown_key": (_unknown_key, "no embedding module knows", ValueError),
    "wrong_length_per_key": (_wrong_length_per_key, "length_per_key", ValueError),
    "fewer_dense_samples": (_fewer_dense_samples, "dense_features has", ValueError),
    "missing_key": (_missing_key, "missing from the batch", ValueError),
}

# Malformed only under DMP, whose input dist routes every batch as the window's first (an
# unsharded module selects its features by name, in any order).
MALFORMED_SHARDED: dict[str, tuple[Callable[[Batch], Batch], str, type[Exception]]] = {
    "permuted_keys": (_permuted_keys, "the window's first batch in the order", ValueError),
}


def malformed(kind: str, batch: Batch) -> Batch:
    return (MALFORMED | MALFORMED_SHARDED)[kind][0](batch)
