"""What an operator reads and writes of its arguments' memory, for the stream checker.

:class:`~torchrec_lookahead.testing.stream_check.StreamChecker` checks every
operator's accesses to device memory against the other streams'. An
operator's schema says which arguments it writes (an alias annotation that
writes), which it reads, and which it does not touch at all (a view, or a
query of metadata, reads no data). Two kinds are followed row by row rather
than whole, because the side stream moves rows into the cache while the
trainer's step reads other rows of the same tables, ordered by the plan, not
by events:

* ``index_copy_`` and ``index_select`` along the first dimension: the rows
  their index names;
* FBGEMM's TBE kernels (``split_embedding_*``): each feature's ids, at its
  table's offset in the weights, its row width apart; the backward also
  updates the optimizer's state (``momentum1``, ``momentum2``) of those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from torchrec_lookahead._compat import op_schema

__all__ = ["OperatorAccesses", "RowAccess", "WholeAccess", "tensors_in"]

aten = torch.ops.aten

WholeAccess = tuple[torch.Tensor, bool]  # a tensor, and whether it is written
RowAccess = tuple[torch.Tensor, np.ndarray, bool]  # a tensor, where its rows start, written


class OperatorAccesses:
    """The accesses of operators, their schemas read once per operator.

    Args:
        values: the values of an index tensor (for fake CUDA tensors: their shadows).
    """

    def __init__(self, values: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._values = values
        self._schemas: dict[Any, list[tuple[str, bool | None]]] = {}
        self._names: dict[Any, str] = {}
        self._returns: dict[Any, bool] = {}

    def of(self, func: Any, args: tuple, kwargs: dict) -> tuple[list[WholeAccess], list[RowAccess]]:
        """What ``func`` reads and writes: whole tensors, and rows of some."""
        bound = self._bind(func, args, kwargs)
        rows: list[RowAccess] = []
        by_row: set[str] = set()
        if func in (aten.index_copy_.default, aten.index_select.default, aten.index_select.out):
            if bound["dim"] == 0 and bound["self"].dim() > 0:
                target = bound["self"]
                keys = self._keys(target, bound["index"])
                rows.append((target, keys, func is aten.index_copy_.default))
                by_row.add("self")
        elif func.namespace == "fbgemm" and "split_embedding" in func.name():
            bound = _named_weights(bound)
            rows, by_row = self._tbe_rows(func, bound)
        whole: list[WholeAccess] = []
        for name, write in self._schema(func):
            if name in by_row or write is None:
                continue
            if name == "weights" and by_row.intersection(("host_weights", "dev_weights")):
                # packed and followed by row: its placements and offsets are only read
                whole.extend((bound[n], False) for n in _PACKED_METADATA if n in bound)
                continue
            for tensor in tensors_in(bound.get(name)):
                whole.append((tensor, write))
        return whole, rows

    def name(self, func: Any) -> str:
        """How messages name operator ``func``."""
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func).replace(".default", "")
        return name

    def aliased_returns(self, func: Any) -> bool:
        """Whether ``func`` returns memory of its inputs (a view, or in place)."""
        aliased = self._returns.get(func)
        if aliased is None:
            aliased = any(r.alias_info is not None for r in op_schema(func).returns)
            self._returns[func] = aliased
        return aliased

    def _schema(self, func: Any) -> list[tuple[str, bool | None]]:
        """Per argument: written (True), read (False), or neither (``None``: a view or a
        metadata query reads no data)."""
        cached = self._schemas.get(func)
        if cached is not None:
            return cached
        metadata = func.namespace == "prim" or func in _METADATA
        known: list[tuple[str, bool | None]] = []
        for a in op_schema(func).arguments:
            aliased = a.alias_info is not None
            write = aliased and bool(a.alias_info.is_write)
            known.append((a.name, None if metadata or (aliased and not write) else write))
        self._schemas[func] = known
        return known

    def _bind(self, func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = [name for name, _ in self._schema(func)]
        return {**dict(zip(names, args)), **kwargs}

    def _keys(self, tensor: torch.Tensor, index: torch.Tensor) -> np.ndarray:
        """Where rows ``index`` of ``tensor`` start in its storage (in elements)."""
        ids = self._values(index).detach().numpy().astype(np.int64, copy=False)
        return int(tensor.storage_offset()) + ids * int(tensor.stride(0))

    def _tbe_rows(self, func: Any, bound: dict[str, Any]) -> tuple[list[RowAccess], set[str]]:
        """The rows an FBGEMM TBE kernel reads (forward) or updates (backward, with the
        optimizer's state): each feature's ids, at its table's offset, its row width apart."""
        needed = ("D_offsets", "offsets", "indices", "weights_offsets")
        if any(not isinstance(bound.get(name), torch.Tensor) for name in needed):
            return [], set()
        values = {n: self._values(bound[n]).detach().numpy().astype(np.int64) for n in needed}
        d_offsets, offsets = values["D_offsets"], values["offsets"]
        features = len(d_offsets) - 1
        if features < 1 or (len(offsets) - 1) % features:
            return [], set()  # a variable batch: followed whole
        batch = (len(offsets) - 1) // features
        per_feature = [
            (
                values["indices"][offsets[f * batch] : offsets[(f + 1) * batch]],
                int(d_offsets[f + 1] - d_offsets[f]),
            )
            for f in range(features)
        ]
        write = "backward" in func.name()
        rowwise = "rowwise" in func.name()
        rows: list[RowAccess] = []
        by_row: set[str] = set()
        groups = [("weights", values["weights_offsets"], False)]
        for prefix in ("momentum1", "momentum2"):
            if write and isinstance(bound.get(f"{prefix}_offsets"), torch.Tensor):
                offsets_of = self._values(bound[f"{prefix}_offsets"]).detach().numpy()
                groups.append((prefix, offsets_of.astype(np.int64), rowwise))
        for prefix, starts, one_wide in groups:
            keys = np.concatenate(
                [
                    starts[f] + ids * (1 if one_wide else width)
                    for f, (ids, width) in enumerate(per_feature)
                ]
                or [np.zeros(0, np.int64)]
            )
            for place in ("host", "dev", "uvm"):
                name = f"{place}_{prefix}" if prefix == "weights" else f"{prefix}_{place}"
                tensor = bound.get(name)
                if isinstance(tensor, torch.Tensor):
                    by_row.add(name)
                    if tensor.numel():
                        rows.append((tensor, keys + tensor.storage_offset(), write))
        return rows, by_row


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of an argument or a result: itself, or those of a (nested) list."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


# FBGEMM >= 1.9's backward kernels take a table's weights packed in one list argument
# (``Tensor[] weights``): on the CPU [host, placements, offsets], on CUDA [dev, uvm,
# placements, offsets, lxu_cache]. Older releases pass each by name.
_PACKED_WEIGHTS = {
    3: ("host_weights", "weights_placements", "weights_offsets"),
    5: ("dev_weights", "uvm_weights", "weights_placements", "weights_offsets", "lxu_cache_weights"),
}
_PACKED_METADATA = ("weights_placements", "weights_offsets")


def _named_weights(bound: dict[str, Any]) -> dict[str, Any]:
    """``bound`` with a packed ``weights`` list also bound by the older names."""
    packed = bound.get("weights")
    if not isinstance(packed, (list, tuple)) or len(packed) not in _PACKED_WEIGHTS:
        return bound
    return {**bound, **dict(zip(_PACKED_WEIGHTS[len(packed)], packed)), "weights": list(packed)}


# Operators that read metadata only (views are told apart by their schemas).
_METADATA = {
    aten.is_pinned.default,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.record_stream.default,
}
