"""FBGEMM's operators under fake CUDA: what stands in where a CPU build of FBGEMM falls short.

:class:`~torchrec_lookahead.testing.fake_cuda.FakeCuda` runs every operator
on a CUDA tensor twice, fake and on the shadows (real CPU memory). A CPU
build of FBGEMM does not serve every operator the training path calls on
CUDA tensors, so:

* its TBE's pooled forward has no fake kernel (a CPU kernel only): one is
  registered here (:data:`STUBBED`, :func:`register_stubs`);
* its training kernels (``split_embedding_*``) do not run on the shadows, since
  their CPU kernels read a CPU table's layout and a CUDA table is laid out
  for the GPU (:func:`is_training_kernel`): their outputs' shadows are zero;
* its unified-memory tensors (UVM) are device memory of the size asked for
  (:data:`UNIFIED_MEMORY`; their meta kernel makes an empty one);
* ``keyed_jagged_index_select_dim1``, which has a CUDA kernel only, runs on the
  shadows through FBGEMM's CPU ``permute_1D_sparse_data`` (:data:`HOST_TWINS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchrec_lookahead._compat import has_fake_kernel, op_schema

__all__ = ["HOST_TWINS", "STUBBED", "UNIFIED_MEMORY", "is_training_kernel", "register_stubs"]

# FBGEMM operators without a fake kernel in a CPU build of FBGEMM (they have CPU
# kernels only), given one here where missing: the TBE's pooled forward, unweighted and
# weighted.
STUBBED = (
    "fbgemm::split_embedding_codegen_forward_unweighted_pt2_wrapper",
    "fbgemm::split_embedding_codegen_forward_weighted_pt2_wrapper",
)
_STUBS_REGISTERED: list[Any] = []  # the torch.library fragment holding them (once per process)

# FBGEMM's unified (UVM) tensors: device memory of the size asked for.
UNIFIED_MEMORY = {
    torch.ops.fbgemm.new_unified_tensor.default,
    torch.ops.fbgemm.new_managed_tensor.default,
}


def register_stubs() -> None:
    """Fake kernels for :data:`STUBBED` (the pooled output ``[batch, total_D]``) where
    FBGEMM has none, once per process: they only ever run on fake tensors."""
    if _STUBS_REGISTERED:
        return
    library = torch.library.Library("fbgemm", "FRAGMENT")
    for name in STUBBED:
        if has_fake_kernel(name):  # a CUDA build of FBGEMM has its own
            continue
        schema = op_schema(getattr(torch.ops.fbgemm, name.split("::")[1]).default)
        torch.library.register_fake(name, _pooled_forward(schema), lib=library)
    _STUBS_REGISTERED.append(library)


def _pooled_forward(schema: Any) -> Callable[..., torch.Tensor]:
    names = [argument.name for argument in schema.arguments]

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = {**dict(zip(names, args)), **kwargs}
        features = bound["D_offsets"].numel() - 1
        batch = (bound["offsets"].numel() - 1) // max(features, 1)
        return bound["dev_weights"].new_empty((batch, bound["total_D"]))

    return forward


def is_training_kernel(func: Any) -> bool:
    """FBGEMM's training kernels: a CUDA table's layout is not what their CPU kernels read."""
    return func.namespace == "fbgemm" and "split_embedding" in func.name()


def _keyed_jagged_index_select_dim1(
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    weights: torch.Tensor | None = None,
    selected_lengths_sum: int | None = None,
) -> list[torch.Tensor]:
    """FBGEMM's ``keyed_jagged_index_select_dim1`` (a CUDA kernel only) on the CPU: the bags
    ``indices`` of every key's ``batch_size`` bags, through FBGEMM's CPU permute."""
    keys = lengths.numel() // batch_size
    starts = torch.arange(keys, dtype=indices.dtype) * batch_size
    picked = (starts.view(-1, 1) + indices.view(1, -1)).reshape(-1)
    picked_lengths, picked_values, picked_weights = torch.ops.fbgemm.permute_1D_sparse_data(
        picked, lengths, values, weights, selected_lengths_sum
    )
    return [picked_values, picked_lengths] + ([] if weights is None else [picked_weights])


# FBGEMM operators with a CUDA kernel only: what runs on the shadows instead.
HOST_TWINS = {
    torch.ops.fbgemm.keyed_jagged_index_select_dim1.default: _keyed_jagged_index_select_dim1,
}
