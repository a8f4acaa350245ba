"""Deduplicated (variable-batch) ``KeyedJaggedTensor`` batches: looking them up, expanding them.

In TorchRec's deduplicated form (RecD) a key's stride is its number of
distinct bags, which may be smaller than the batch, and ``inverse_indices``
(keys, ``[num_keys, batch]``) names the bag of every sample. The values hold
each distinct bag once, so the oracle plans distinct bags only, and FBGEMM's
TBE pools them with ``batch_size_per_feature_per_rank`` (its output is one
flat tensor: each feature's ``stride x dim`` block in turn). The unsharded
collections expand that output to the batch exactly as
``EmbeddingBagCollection`` does (the same TorchRec functions, so the backward
sums the duplicates' gradients the same way); under DMP TorchRec's own
sharded collection does it after the output all-to-all.

On the CPU, where every feature has the same width, both expand with :func:`gather_bags`
instead of FBGEMM's per-feature select ops: one ``index_select`` whose
backward sums each bag's duplicates in sample order, as FBGEMM's CPU ops do
(bitwise the same, tested), in a fraction of their time (``benchmarks/dedup.py``;
figures in ``docs/guides/dedup.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_modules import process_pooled_embeddings, reorder_inverse_indices
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "VARIABLE_BATCH_OPTIMIZERS",
    "check_variable_batch_optimizer",
    "expand_pooled",
    "gather_bags",
    "keep_inverse_indices",
    "padded_lookup",
    "tbe_batch_sizes",
]

# The fused optimizers FBGEMM's TBE (1.8) trains variable batches with; it asserts on others
# (EXACT_ADAGRAD among them), so TorchRec's fused kernel refuses them too.
VARIABLE_BATCH_OPTIMIZERS = frozenset(
    {
        EmbOptimType.EXACT_SGD,
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        EmbOptimType.ADAM,
        EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD,
        EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD,
        EmbOptimType.NONE,
    }
)


def check_variable_batch_optimizer(
    features: KeyedJaggedTensor, optimizer: EmbOptimType, where: str
) -> None:
    """Raise ``ValueError`` if ``features`` is deduplicated and FBGEMM cannot train
    variable batches with ``optimizer``."""
    if features.variable_stride_per_key() and optimizer not in VARIABLE_BATCH_OPTIMIZERS:
        names = sorted(o.name for o in VARIABLE_BATCH_OPTIMIZERS)
        raise ValueError(
            f"{where}: deduplicated batches train with the fused optimizers "
            f"{names} (FBGEMM's variable-batch TBE), "
            f"not {optimizer.name}"
        )


def tbe_batch_sizes(features: KeyedJaggedTensor) -> dict[str, Any]:
    """FBGEMM TBE arguments for ``features``: its bags per feature and rank when the
    batch is deduplicated, else nothing."""
    if not features.variable_stride_per_key():
        return {}
    return {"batch_size_per_feature_per_rank": features.stride_per_key_per_rank()}


def keep_inverse_indices(
    permuted: KeyedJaggedTensor, original: KeyedJaggedTensor
) -> KeyedJaggedTensor:
    """``permuted`` (from ``original.permute``, which drops them) with ``original``'s
    inverse indices; they name their keys, so their order need not change."""
    inverse = original.inverse_indices_or_none()
    if inverse is None or permuted.inverse_indices_or_none() is not None:
        return permuted
    return KeyedJaggedTensor(
        keys=permuted.keys(),
        values=permuted.values(),
        weights=permuted.weights_or_none(),
        lengths=permuted.lengths(),
        stride_per_key_per_rank=permuted.stride_per_key_per_rank(),
        inverse_indices=inverse,
    )


def padded_lookup(
    tbe: torch.nn.Module,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size_per_feature_per_rank: list[list[int]],
    dims: list[int],
) -> torch.Tensor:
    """A variable batch pooled by a CPU ``tbe``, in FBGEMM's variable-batch output layout.

    FBGEMM 1.8's CPU TBE pools a variable batch by padding every feature to
    the largest feature's bags with empty bags, running the fixed-batch
    kernel, and copying each (rank, feature) block out with per-element
    tensor indexing, tens of times slower than the fixed-batch kernel. This
    does the same padding and runs the same kernel, so the sums and the
    backward (the padded gradient, zeros on the empty bags) are the same, with
    a few whole-tensor ops (figures in ``docs/guides/dedup.md``).
    ``dims``: each feature's width.
    """
    bags = torch.tensor([sum(ranks) for ranks in batch_size_per_feature_per_rank])
    features, max_b = len(bags), int(bags.max())
    lengths = offsets[1:] - offsets[:-1]
    first = torch.arange(features) * max_b - (torch.cumsum(bags, 0) - bags)
    where = torch.repeat_interleave(first, bags) + torch.arange(len(lengths))
    padded = torch.zeros(features * max_b + 1, dtype=offsets.dtype)
    padded[1:][where] = lengths
    pooled = tbe(indices, torch.cumsum(padded, 0), per_sample_weights=per_sample_weights)
    # Each feature's columns split once, so the backward builds each feature's gradient once.
    per_feature = pooled.split(dims, dim=1)
    blocks = []
    for rank in range(len(batch_size_per_feature_per_rank[0])):
        for block, ranks in zip(per_feature, batch_size_per_feature_per_rank):
            start = sum(ranks[:rank])
            blocks.append(block[start : start + ranks[rank]].reshape(-1))
    return torch.cat(blocks)


def expand_pooled(
    pooled: torch.Tensor, features: KeyedJaggedTensor, dims: list[int]
) -> torch.Tensor:
    """The TBE output of ``features`` as ``[batch, sum(dims)]``, each sample given its bag.

    ``dims`` are the features' widths in ``features``' key order. A batch of
    one stride is already in that shape. FBGEMM's variable-batch output is
    flat: ``[N]`` on the CPU, ``[1, N]`` on CUDA; both are taken.
    """
    if not features.variable_stride_per_key():
        return pooled
    pooled = pooled.reshape(-1)
    strides = features.stride_per_key()
    inverse = reorder_inverse_indices(features.inverse_indices_or_none(), features.keys())
    if len(set(dims)) == 1 and pooled.device.type == "cpu":  # CUDA: FBGEMM's kernel
        return gather_bags(pooled, inverse, strides, dims[0])
    blocks = pooled.split([s * d for s, d in zip(strides, dims)])
    per_feature = [block.view(s, d) for block, s, d in zip(blocks, strides, dims)]
    return process_pooled_embeddings(per_feature, inverse)


def gather_bags(
    pooled: torch.Tensor, inverse: torch.Tensor, bags: list[int], dim: int
) -> torch.Tensor:
    """Pooled bags expanded to the batch: ``[batch, features * dim]``.

    ``pooled`` holds each feature's ``bags[f] x dim`` block in turn (flat or
    not); ``inverse[f, b]`` is sample ``b``'s bag of feature ``f``. Sample
    ``b``'s columns of feature ``f`` are that bag's row.
    """
    counts = torch.tensor(bags, device=inverse.device)
    first = counts.cumsum(0) - counts  # each feature's first row in ``pooled``
    rows = (inverse + first[:, None]).t().reshape(-1)
    return pooled.reshape(-1, dim).index_select(0, rows).view(inverse.shape[1], -1)
