"""TorchRec's sharded output awaitables: the deduplicated output's expansion, a completed output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchrec.distributed.embeddingbag import (
    VariableBatchEmbeddingBagCollectionAwaitable,
    construct_output_kt,
)
from torchrec.distributed.types import LazyAwaitable

__all__ = [
    "CompletedOutput",
    "GatheredOutput",
]


class GatheredOutput(VariableBatchEmbeddingBagCollectionAwaitable):
    """TorchRec's deduplicated output, expanded to the batch by ``gather`` where every
    feature has the same width and the output is on the CPU; otherwise as TorchRec
    expands it. TorchRec's expansion is the private ``_wait_impl`` of its awaitable,
    over the awaitable's private fields; :meth:`adopt` takes over TorchRec's object."""

    gather: Callable[[torch.Tensor, torch.Tensor, Any, int], torch.Tensor]

    @classmethod
    def adopt(cls, output: Any, gather: Callable[..., torch.Tensor]) -> Any:
        """``output`` expanded by ``gather`` if it is TorchRec's deduplicated output
        (the same object, its class swapped: no state is copied)."""
        if type(output) is VariableBatchEmbeddingBagCollectionAwaitable:
            output.__class__ = cls
            output.gather = gather
        return output

    def _wait_impl(self) -> Any:
        dims = self._uncombined_embedding_dims
        if len(set(dims)) != 1 or self._inverse_indices[1].device.type != "cpu":
            return super()._wait_impl()
        embeddings = [awaitable.wait() for awaitable in self._awaitables]
        _, inverse = self._inverse_indices
        if self._inverse_indices_permute_indices is not None:
            inverse = inverse.index_select(0, self._inverse_indices_permute_indices)
        pooled = embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings)
        expanded = self.gather(pooled, inverse, self._batch_size_per_feature_pre_a2a, dims[0])
        for awaitable in self._resize_awaitables or []:
            awaitable.wait()
        return construct_output_kt(
            embeddings=[self._permute_op(expanded)],
            embedding_names=self._embedding_names,
            embedding_dims=self._embedding_dims,
        )


class CompletedOutput(LazyAwaitable[Any]):
    """A sharded module's output awaitable, completed by ``complete`` when waited for: a
    module that adds to TorchRec's output (the hot rows' part) still returns one
    awaitable, as TorchRec's sharded modules do. Waiting is TorchRec's private
    ``_wait_impl``, hence here."""

    def __init__(self, output: Any, complete: Callable[[Any], Any]) -> None:
        super().__init__()
        self._output = output
        self._complete = complete

    def _wait_impl(self) -> Any:
        return self._complete(self._output.wait())
