"""TorchRec's, FBGEMM's and torch's internals, behind one door.

Every private name, override and patch the project needs is in this package,
each with why no public API serves, one module per thing it adapts: FBGEMM's TBE
(``fbgemm``), TorchRec's embedding modules (``modules``), its fused kernels and
lookups (``kernels``), its sharded collections (``sharded``) and their output
awaitables (``outputs``), ``torch.distributed`` (``distributed``), torch's fake
tensors for checking CUDA code on the CPU (``fake``), and torch.profiler's settings
for a benchmark's traces (``profiler``). The rest of the project uses
public API only, and imports these names from the package itself. Checked on
torch 2.13 / FBGEMM 1.8 / TorchRec 1.8 (``requirements/cpu.txt``) and on
torch 2.14.1 / FBGEMM 1.9.0 / TorchRec 1.9.2 (``requirements/compat.txt``,
``make test-compat``): every name below is in both, with the same meaning. On the
lent GPU machine's train, torch 2.11 / FBGEMM 1.6 (CUDA build) / TorchRec 1.6.1, one
differs, and :data:`TBE_TAKES_HOST_BUFFERS` says so. A release that moves one of them
breaks this package alone.
"""

from torchrec_lookahead._compat.distributed import (
    Shard,
    ShardedTensor,
    data_parallel_parts,
    destroy_group,
    in_backward,
    live_groups,
    observe_collectives,
    sharded_tensor_from_shards,
)
from torchrec_lookahead._compat.fake import (
    DATA_DEPENDENT,
    ITEM,
    PIN_MEMORY,
    TO_COPY,
    UNIQUE,
    DispatchMode,
    FakeTensor,
    fake_cuda_tensors,
    fake_store,
    has_fake_kernel,
    is_fake,
    modes_entered,
    op_schema,
    outside_dispatch_mode,
    real_tensors,
)
from torchrec_lookahead._compat.fbgemm import (
    TBE_TAKES_HOST_BUFFERS,
    split_pooled_tables,
)
from torchrec_lookahead._compat.kernels import (
    FusedKernelBase,
    FusedOptimizerBase,
    FusedSequenceKernelBase,
    LookupBase,
    SequenceLookupBase,
)
from torchrec_lookahead._compat.modules import (
    embedding_features,
    feature_rows,
    in_backward_optimizers,
)
from torchrec_lookahead._compat.outputs import (
    CompletedOutput,
    GatheredOutput,
)
from torchrec_lookahead._compat.profiler import every_thread_and_wait
from torchrec_lookahead._compat.sharded import (
    ShardedCollectionBase,
    ShardedSequenceCollectionBase,
)

__all__ = [
    "CompletedOutput",
    "DATA_DEPENDENT",
    "DispatchMode",
    "FakeTensor",
    "FusedKernelBase",
    "FusedOptimizerBase",
    "FusedSequenceKernelBase",
    "GatheredOutput",
    "ITEM",
    "LookupBase",
    "PIN_MEMORY",
    "SequenceLookupBase",
    "Shard",
    "ShardedCollectionBase",
    "ShardedSequenceCollectionBase",
    "ShardedTensor",
    "TBE_TAKES_HOST_BUFFERS",
    "TO_COPY",
    "UNIQUE",
    "data_parallel_parts",
    "destroy_group",
    "live_groups",
    "embedding_features",
    "every_thread_and_wait",
    "fake_cuda_tensors",
    "fake_store",
    "feature_rows",
    "has_fake_kernel",
    "in_backward",
    "in_backward_optimizers",
    "is_fake",
    "modes_entered",
    "observe_collectives",
    "op_schema",
    "outside_dispatch_mode",
    "real_tensors",
    "sharded_tensor_from_shards",
    "split_pooled_tables",
]
