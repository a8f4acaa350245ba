"""What the library refuses, checked before any state changes: batches, settings, models.

A batch is refused with a ``ValueError`` naming the step and what is wrong,
or a :class:`BatchTypeError` (a ``TypeError`` that is also a ``ValueError``,
so a loop that drops refused batches with ``except ValueError`` drops these
too) when a tensor has the wrong type. :func:`check_structure` runs once per
batch, on the lookahead stage, before any module reads the batch: the
module's own passes (``KeyedJaggedTensor.permute``, the oracle's compiled
pass, FBGEMM) trust the structure and read past the end of a tensor, or
crash, where it is inconsistent.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "ID_DTYPES",
    "BatchTypeError",
    "check_batch",
    "check_feature_ids",
    "check_structure",
    "check_variable_batch",
    "feature_id_error",
    "no_fused_optimizer",
    "not_sharded",
]

ID_DTYPES = (torch.int64, torch.int32)  # the id types TorchRec's embedding modules take


class BatchTypeError(TypeError, ValueError):
    """A batch refused for a tensor of the wrong type."""


def check_batch(
    batch: Any, weighted: Mapping[str, bool], where: str, rows: Mapping[str, int] | None = None
) -> None:
    """Refuse ``batch`` unless its sparse features are well formed and known, and the ids
    of the features in ``rows`` lie in their tables.

    ``weighted`` maps every feature some embedding module of the model looks
    up to whether that module is weighted; ``rows``, a feature of a cached table
    to that table's rows (its ids are read on the host: check the batch there,
    before it moves to a device). A batch's other tensors
    (``dense_features``, ``labels``, as ``torchrec.datasets.utils.Batch``
    carries them) must hold as many samples as its sparse features.
    """
    features = getattr(batch, "sparse_features", None)
    if not isinstance(features, KeyedJaggedTensor):
        raise BatchTypeError(
            f"{where}: sparse_features must be a KeyedJaggedTensor, got {type(features).__name__}"
        )
    keys = features.keys()
    unknown = [k for k in keys if k not in weighted]
    if unknown:
        raise ValueError(
            f"{where}: the batch has features {unknown} that no embedding module knows"
        )
    check_structure(features, where, [k for k in keys if weighted[k]])
    samples = _samples(features)
    for name in ("dense_features", "labels"):
        tensor = getattr(batch, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.dim() and len(tensor) != samples:
            raise ValueError(
                f"{where}: {name} has {len(tensor)} samples but the sparse features have {samples}"
            )
    if rows:
        unchecked = np.iinfo(np.int64).max  # features of plain TorchRec modules
        check_feature_ids(
            features.values().numpy(force=True),
            features.length_per_key(),
            keys,
            [rows.get(k, unchecked) for k in keys],
            where,
        )


def check_structure(
    features: KeyedJaggedTensor, where: str, weighted_keys: Collection[str] = ()
) -> None:
    """Refuse ``features`` unless its tensors agree with each other and with its keys.

    Checks: distinct keys; 1-D values of an id type (``ID_DTYPES``); integer
    lengths and offsets, as many as the keys' strides say, lengths not
    negative, offsets from 0 not decreasing, both adding up to the values;
    the per-key lengths TorchRec may cache; weights (floating point, one per
    value) present if any of ``weighted_keys`` is a key; a deduplicated
    batch's strides and inverse indices (:func:`check_variable_batch`).
    """
    keys = features.keys()
    if len(set(keys)) != len(keys):
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"{where}: the batch repeats the features {repeated}")
    values = features.values()
    _check_tensor(values, "values", ID_DTYPES, where)
    lengths, offsets = features.lengths_or_none(), features.offsets_or_none()
    if lengths is not None:
        _check_tensor(lengths, "lengths", (torch.int64, torch.int32), where)
    if offsets is not None:
        _check_tensor(offsets, "offsets", (torch.int64, torch.int32), where)
    check_variable_batch(features, where)  # strides against the bags, inverse indices
    strides = _strides(features)
    bags = sum(strides)
    given = lengths.numel() if lengths is not None else offsets.numel() - 1
    if given != bags:
        what = "lengths" if lengths is not None else "offsets (less one)"
        shape = (
            f"strides {strides}"
            if features.variable_stride_per_key()
            else f"{len(keys)} features of {features.stride()} samples"
        )
        raise ValueError(f"{where}: {given} {what} where {shape} make {bags} bags")
    if offsets is not None:
        _check_offsets(offsets, lengths, values.numel(), where)
    if lengths is None:
        lengths = offsets.diff()
    if bags and bool((lengths < 0).any()):
        bag = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(
            f"{where}: feature {_key_of(bag, strides, keys)!r} has a bag of "
            f"negative length {int(lengths[bag])}"
        )
    total = int(lengths.sum())
    if total != values.numel():
        raise ValueError(
            f"{where}: the lengths add up to {total} ids but the batch has {values.numel()} values"
        )
    per_key = _per_key(lengths, strides)
    cached = features.length_per_key_or_none()
    if cached is not None and list(cached) != per_key:
        raise ValueError(
            f"{where}: length_per_key {list(cached)} does not match the lengths ({per_key})"
        )
    cached = features.offset_per_key_or_none()
    if cached is not None and list(cached) != [0, *np.cumsum(per_key).tolist()]:
        raise ValueError(f"{where}: offset_per_key {list(cached)} does not match the lengths")
    _check_weights(features, where, weighted_keys)


def check_feature_ids(
    values: np.ndarray,
    lengths_per_key: Sequence[int],
    keys: Sequence[str],
    rows_per_key: Sequence[int] | np.ndarray,
    where: str,
) -> None:
    """Raise ``ValueError`` naming ``where``, the feature and the id if any id of
    a feature is negative or not below its table's row count.

    ``values`` holds the features' ids one feature after another (a
    ``KeyedJaggedTensor``'s values), ``lengths_per_key`` how many each has.
    """
    limits = np.repeat(np.asarray(rows_per_key, dtype=np.int64), lengths_per_key)
    bad = (values < 0) | (values >= limits)
    if bad.any():
        raise feature_id_error(
            int(np.argmax(bad)), values, lengths_per_key, keys, rows_per_key, where
        )


def feature_id_error(
    position: int,
    values: np.ndarray,
    lengths_per_key: Sequence[int] | np.ndarray,
    keys: Sequence[str],
    rows_per_key: Sequence[int] | np.ndarray,
    where: str,
) -> ValueError:
    """The error :func:`check_feature_ids` raises for the bad id at ``position``."""
    key = int(np.searchsorted(np.cumsum(lengths_per_key), position, side="right"))
    value = int(values[position])
    if value < 0:
        return ValueError(f"{where}: feature {keys[key]!r}: negative id {value}")
    return ValueError(
        f"{where}: feature {keys[key]!r}: id {value} is out of range for a table of "
        f"{rows_per_key[key]} rows"
    )


def check_variable_batch(features: KeyedJaggedTensor, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` if a deduplicated batch does not add up.

    Checks, before anything reads the batch: one stride per key, strides that
    sum to the number of bags (lengths), inverse indices given for every key,
    one row of equal length per key, and each within its key's stride.
    Batches of one stride pass untouched.
    """
    if not features.variable_stride_per_key():
        return
    keys = features.keys()
    per_rank = features.stride_per_key_per_rank()
    if len(per_rank) != len(keys) or any(len(r) != 1 for r in per_rank):
        raise ValueError(
            f"{where}: a deduplicated batch needs one stride per key, got "
            f"{per_rank} for keys {keys}"
        )
    strides = [r[0] for r in per_rank]
    bags = features.lengths().numel()
    if sum(strides) != bags:
        raise ValueError(
            f"{where}: the strides {strides} add up to {sum(strides)} bags but the "
            f"batch has {bags} lengths"
        )
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        raise ValueError(
            f"{where}: a deduplicated batch (strides {strides}) needs "
            "inverse_indices, the bag of each sample"
        )
    names, indices = inverse
    missing = [k for k in keys if k not in names]
    if missing:
        raise ValueError(f"{where}: inverse_indices has no row for features {missing}")
    if indices.dim() != 2 or indices.shape[0] != len(names) or indices.is_floating_point():
        raise ValueError(
            f"{where}: inverse_indices must be an integer tensor [keys, batch] "
            f"= [{len(names)}, batch], got {tuple(indices.shape)} "
            f"{indices.dtype}"
        )
    rows = indices.cpu().numpy()
    for key, stride in zip(keys, strides):
        row = rows[names.index(key)]
        bad = (row < 0) | (row >= stride)
        if bad.any():
            raise ValueError(
                f"{where}: feature {key!r}: inverse index {int(row[bad][0])} is "
                f"out of range for its {stride} bags"
            )


def no_fused_optimizer(where: str) -> ValueError:
    """The error for lookahead tables given no fused optimizer (FBGEMM's TBE needs one)."""
    return ValueError(
        f"{where}: no fused optimizer: call apply_optimizer_in_backward on the module's "
        "parameters, or pass fused_params={'optimizer': EmbOptimType..., 'learning_rate': ...} "
        "to the collection or to its sharder"
    )


def not_sharded(kind: str, where: str) -> ValueError:
    """The error for a lookahead collection (class ``kind``) that reached training without
    its sharder: left unsharded under ``DistributedModelParallel`` it is wrapped as a dense
    module, and every rank would train its own copy of every table."""
    return ValueError(
        f"{where}: this {kind} was not sharded by a lookahead sharder, so it cannot train "
        f"as TorchRec's sharded tables do (under DistributedModelParallel each rank would keep "
        f"and train its own copy of every table); pass sharders=[{kind}Sharder()], or "
        f"lookahead_sharders() for a model that also holds plain TorchRec modules, to "
        f"DistributedModelParallel and to the planner"
    )


# ------------------------------------------------------------------ internals


def _check_tensor(tensor: Any, name: str, dtypes: tuple[torch.dtype, ...], where: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in dtypes:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise BatchTypeError(f"{where}: {name} must be {wanted}, got {got}")
    if tensor.dim() != 1:
        raise ValueError(f"{where}: {name} must be 1-D, got shape {tuple(tensor.shape)}")


def _check_offsets(
    offsets: torch.Tensor, lengths: torch.Tensor | None, num_values: int, where: str
) -> None:
    if offsets.numel() == 0 or int(offsets[0]) != 0:
        raise ValueError(f"{where}: offsets must start at 0")
    steps = offsets.diff()
    if bool((steps < 0).any()):
        bag = int(torch.nonzero(steps < 0)[0])
        raise ValueError(
            f"{where}: offsets decrease at bag {bag} ({int(offsets[bag])} to "
            f"{int(offsets[bag + 1])})"
        )
    if int(offsets[-1]) != num_values:
        raise ValueError(
            f"{where}: offsets end at {int(offsets[-1])} but the batch has {num_values} values"
        )
    if lengths is not None and not torch.equal(steps, lengths.to(steps.dtype)):
        raise ValueError(f"{where}: lengths and offsets disagree")


def _check_weights(features: KeyedJaggedTensor, where: str, weighted_keys: Collection[str]) -> None:
    weights = features.weights_or_none()
    if weights is None:
        needed = [k for k in features.keys() if k in weighted_keys]
        if needed:
            raise ValueError(
                f"{where}: features {needed} are looked up by a weighted "
                "module but the batch has no weights"
            )
        return
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        got = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise BatchTypeError(f"{where}: weights must be floating point, got {got}")
    if weights.shape != features.values().shape:
        raise ValueError(
            f"{where}: {tuple(weights.shape)} weights for {features.values().numel()} values"
        )


def _strides(features: KeyedJaggedTensor) -> list[int]:
    """Bags of each key (its stride; a deduplicated batch's distinct bags)."""
    if features.variable_stride_per_key():
        return [r[0] for r in features.stride_per_key_per_rank()]
    return [features.stride()] * len(features.keys())


def _samples(features: KeyedJaggedTensor) -> int:
    inverse = features.inverse_indices_or_none()
    if features.variable_stride_per_key() and inverse is not None:
        return inverse[1].shape[-1]
    return features.stride()


def _per_key(lengths: torch.Tensor, strides: list[int]) -> list[int]:
    ends = np.cumsum(strides)
    sums = np.concatenate([[0], np.cumsum(lengths.cpu().numpy(), dtype=np.int64)])
    return (sums[ends] - sums[ends - strides]).tolist()


def _key_of(bag: int, strides: list[int], keys: list[str]) -> str:
    return keys[int(np.searchsorted(np.cumsum(strides), bag, side="right"))]
