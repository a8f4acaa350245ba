"""Hide the notices TorchRec, FBGEMM and torch print about their own internals.

Imported first by ``dlrm_main.py`` (it installs its filters when imported: some
notices come while TorchRec itself is imported). Only these messages, from these
places: any other warning still shows.
"""

from __future__ import annotations

import logging
import warnings
from functools import partial


def quiet_library_notices() -> None:
    """Hide the warnings TorchRec, FBGEMM and torch print about their own internals, or
    about calls this example makes as TorchRec's DLRM example does, which a user of the
    example cannot act on. Only these messages, from these places: any other warning
    still shows. (Before the imports: some are raised while TorchRec is imported.)"""
    hide = partial(warnings.filterwarnings, "ignore")
    # Import-time notices for FBGEMM kernels (SSD, Adam variants) not built into this
    # FBGEMM package; the example uses only SGD and row-wise Adagrad.
    hide(r"(?s).*Failed to import: fbgemm_gpu\.", DeprecationWarning, r"fbgemm_gpu\.")
    # TorchRec itself imports this FBGEMM module; nothing here names it.
    hide(
        r"(?s).*The Python module fbgemm_gpu\.split_table_batched_embeddings_ops is now "
        "DEPRECATED",
        DeprecationWarning,
        r"fbgemm_gpu\.",
    )
    # Raised while TorchRec and FBGEMM define their modules at import; this file
    # scripts nothing with torch.jit.
    hide(r"`torch\.jit\.(script|interface)` is deprecated", DeprecationWarning, r"torch\.jit\.")
    # TorchRec's public apply_optimizer_in_backward (as in TorchRec's DLRM example) forwards
    # to torch's private _apply_optimizer_in_backward: the same call, without a stable name.
    hide(
        r"This API is deprecated\. Please use Pytorch Distributed's "
        "_apply_optimizer_in_backward",
        DeprecationWarning,
        r"torchrec\.optim\.apply_optimizer_in_backward",
    )
    # TorchRec's planner default; it warns of misestimated dense sizes in dry runs (no
    # tensors), but this example plans with its dense layers built and the plan is fixed
    # (table-wise, one kernel) for both models.
    hide(
        r"HeuristicalStorageReservation is known to cause issues",
        FutureWarning,
        r"torchrec\.distributed\.planner\.planners",
    )
    # torch's DDP on the argument TorchRec's DistributedModelParallel passes it internally.
    hide(
        r"`broadcast_buffers` is deprecated",
        FutureWarning,
        r"torchrec\.distributed\.model_parallel",
    )
    # DCP reads TorchRec's sharded tables (ShardedTensor, as TorchRec's state_dict gives
    # them) when a checkpoint loads; torch deprecates the type, which TorchRec still uses.
    hide(
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        FutureWarning,
        r"torch\.distributed\.checkpoint\.",
    )
    logged = {
        # The same dry-run notice as HeuristicalStorageReservation's above, once per plan.
        "torchrec.distributed.planner.storage_reservations": (
            "There is a known issue with TorchRec's dense tensor size calculation in dry run"
        ),
        # A Topology of world size and device type on TorchRec's default hardware figures,
        # as TorchRec's DLRM example builds it; this TorchRec only warns ("will fail" is
        # a future plan), and both models share the plan it gives.
        "torchrec.distributed.planner.types": (
            "The topology was constructed directly rather than via TopologyFactory"
        ),
        # Logged the first time anything asks whether fx is tracing: TorchRec's
        # KeyedJaggedTensor asks at every construction. A note to torch's callers.
        "torch.fx._symbolic_trace": "is_fx_tracing will return true for both fx.symbolic_trace",
    }
    for name, start in logged.items():
        logging.getLogger(name).addFilter(
            lambda record, s=start: not record.getMessage().startswith(s)
        )


quiet_library_notices()
