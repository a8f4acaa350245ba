"""What a bitwise comparison needs on CUDA: deterministic algorithms and cuBLAS's workspace.

FBGEMM's CUDA backward sums long segments of a table's gradient in a
nondeterministic order, and cuBLAS picks reduction orders by workspace,
unless deterministic algorithms are on; on the CPU every result compared here
is deterministic already. Call before the first CUDA work of the process.
"""

from __future__ import annotations

import os

import torch

__all__ = ["deterministic_cuda"]


def deterministic_cuda() -> bool:
    """Turn on what makes CUDA results repeatable, if there is CUDA; returns whether."""
    if not torch.cuda.is_available():
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    return True
