"""The sharded kernels: TorchRec's fused kernels, their full-shard TBE the store, a cache in front.

:class:`LookaheadFusedEmbeddingBag` serves pooled tables (a sharded
``EmbeddingBagCollection``), :class:`LookaheadFusedEmbedding` sequence tables (a
sharded ``EmbeddingCollection``: one row per id, FBGEMM's pooling ``NONE``); both
are :class:`LookaheadKernel` over TorchRec's kernel of their kind.

On CPU the kernel is planned as ``fused`` (the store TBE is in host memory
anyway). On CUDA it is planned as ``fused_uvm_caching``: the planner's
estimators then count the cache in device memory (its load factor) and the
rows in host memory, which is this kernel's layout; the store TBE is built
as plain UVM (``fused_uvm``), without FBGEMM's own cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import (
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import DataType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._compat import (
    FusedKernelBase,
    FusedOptimizerBase,
    FusedSequenceKernelBase,
)
from torchrec_lookahead.cache.tables import CachedTables
from torchrec_lookahead.checks import no_fused_optimizer
from torchrec_lookahead.embedding.hot import (
    HotRowTier,
)
from torchrec_lookahead.store.files import StoreFiles
from torchrec_lookahead.store.stores import ORACLE_ROW_BYTES, HostStore, MmapStore
from torchrec_lookahead.tbe import set_learning_rate
from torchrec_lookahead.types import CacheSizing
from torchrec_lookahead.variable_batch import (
    tbe_batch_sizes,
)

__all__ = [
    "CacheAwareFusedOptimizer",
    "LookaheadFusedEmbedding",
    "LookaheadFusedEmbeddingBag",
    "LookaheadKernel",
]


class LookaheadKernel:
    """A TorchRec fused kernel (a base listed after this mixin), its full-shard TBE the
    store, a lookahead cache in front. A subclass says how a step's features reach the
    cache's lookup (:meth:`step_lookup`)."""

    store_tbe: Any
    local_rows: list[int]
    local_cols: list[int]
    feature_table_map: list[int]
    pooling: Any
    training: bool
    use_fused_optimizer: Callable[[CacheAwareFusedOptimizer], None]

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        sizing: CacheSizing,
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sharding_type: ShardingType | None = None,
        env: ShardingEnv | None = None,
        store_files: tuple[StoreFiles, str] | None = None,
    ) -> None:
        device = device or torch.device("cpu")
        on_cuda = device.type == "cuda"
        if on_cuda:  # the store stays in host memory, without FBGEMM's own cache
            tables = [
                dataclasses.replace(t, compute_kernel=EmbeddingComputeKernel.FUSED_UVM)
                for t in config.embedding_tables
            ]
            config = dataclasses.replace(config, embedding_tables=tables)
        if store_files is not None:  # the store TBE's host buffers are store files
            if on_cuda:
                raise ValueError(
                    "a disk store under DMP runs on the CPU for now: FBGEMM's "
                    "UVM buffers of a CUDA TBE cannot be mapped files"
                )
            buffers = _store_buffers(config, *store_files)
            fused = {**(config.fused_params or {}), "preallocated_host_buffers": buffers}
            config = dataclasses.replace(config, fused_params=fused)
        if "optimizer" not in (config.fused_params or {}):
            raise no_fused_optimizer(f"tables {[t.name for t in config.embedding_tables]}")
        super().__init__(config, pg, device, sharding_type, env)  # type: ignore[call-arg]
        params = dict(config.fused_params or {})
        params.pop("preallocated_host_buffers", None)
        optimizer = params.pop("optimizer")
        store_states = self.store_tbe.split_optimizer_states()
        weights = self.store_tbe.split_embedding_weights()
        states = store_states or [[] for _ in config.embedding_tables]
        store: HostStore
        if store_files is not None:
            names = [t.name for t in config.embedding_tables]
            store = MmapStore(store_files[0], names, weights, states)
        else:
            store = HostStore(weights, states=states)
        # A plan's per-table cache_params.load_factor stays in each table's fused params
        # (TorchRec groups tables without it), so size each table's cache from its own.
        table_slots = [
            sizing.rows(
                t.name,
                t.num_embeddings,
                t.local_rows,
                (t.fused_params or {}).get("cache_load_factor"),
            )
            for t in config.embedding_tables
        ]
        self.store = store
        self.table_names = [t.name for t in config.embedding_tables]
        self.row_starts = [_row_offset(t) for t in config.embedding_tables]
        self._hot: HotRowTier | None = None  # replicas of some rows, see fold_replicas_from
        self.cached = CachedTables(
            [t.name for t in config.embedding_tables],
            self.local_rows,
            self.local_cols,
            self.feature_table_map,
            table_slots,
            store,
            optimizer,
            device,
            self.pooling,
            params,
            config.data_type,
            [sizing.cap(t.name, t.num_embeddings, t.local_rows) for t in config.embedding_tables],
        )
        self.use_fused_optimizer(CacheAwareFusedOptimizer(config, self.store_tbe, pg, self))

    def fold_replicas_from(self, hot: HotRowTier) -> None:
        """Some rows of this kernel's shards are replicated by ``hot``: their newest
        values are there, and are folded into the store whenever it is written back."""
        self._hot = hot

    def owner_rows_loaded(self) -> None:
        """The store was loaded (a checkpoint): its hot rows are newer than the replicas."""
        if self._hot is not None:
            self._hot.invalidate()

    def write_back(self) -> None:
        """Make the store current: the cache's updated rows, then the replicas of the
        shards' hot rows (which the owner's cache never sees)."""
        self.cached.write_back()
        if self._hot is None:
            return
        for table, (name, start, rows) in enumerate(
            zip(self.table_names, self.row_starts, self.local_rows)
        ):
            folded = self._hot.fold(name, start, start + rows)
            if folded is not None:
                ids, weights, states = folded
                self.store.scatter(table, torch.from_numpy(ids), weights, states)

    def read_rows(self, table: int, ids: np.ndarray) -> list[torch.Tensor]:
        """Local rows ``ids`` of table ``table`` from the store: weights, then optimizer state."""
        weights, states = self.store.gather(table, torch.from_numpy(ids))
        return [weights, *states]

    def forward(self, features: KeyedJaggedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.cached.context is not None:  # a step runs: its slots are in its context
            # The fused optimizer's learning rate lives on the store TBE; keep the cache's in step.
            set_learning_rate(self.cached.cache.tbe, self.store_tbe.get_learning_rate())
            return self.step_lookup(features, **kwargs)
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                "a lookahead-cached table trains through LookaheadTrainPipeline; call the "
                "model directly only in eval mode or under torch.no_grad()"
            )
        self.write_back()
        return super().forward(features, *args, **kwargs)  # type: ignore[misc]

    def step_lookup(self, features: KeyedJaggedTensor, **kwargs: Any) -> torch.Tensor:
        """The running step's lookup of ``features`` through the cache."""
        raise NotImplementedError


class LookaheadFusedEmbeddingBag(LookaheadKernel, FusedKernelBase):
    """TorchRec's fused kernel of pooled tables, its full-shard TBE the store, a lookahead
    cache in front."""

    def step_lookup(self, features: KeyedJaggedTensor, **kwargs: Any) -> torch.Tensor:
        # A deduplicated batch: its bags per feature and rank, and TorchRec's preallocated
        # output when several kernels of a lookup merge theirs (as its fused kernel gets them).
        variable_batch = tbe_batch_sizes(features)
        if variable_batch:
            variable_batch.update(kwargs)
        return self.cached.lookup(
            features.offsets(),
            features.values().numel(),
            features.weights_or_none(),
            **variable_batch,
        )


class LookaheadFusedEmbedding(LookaheadKernel, FusedSequenceKernelBase):
    """TorchRec's fused kernel of sequence tables (one row per id), its full-shard TBE the
    store, a lookahead cache in front."""

    def step_lookup(self, features: KeyedJaggedTensor, **kwargs: Any) -> torch.Tensor:
        return self.cached.lookup(features.offsets(), features.values().numel(), None)


def _row_offset(table: Any) -> int:
    """The first row of a table's shard (0 for a whole table)."""
    metadata = getattr(table, "local_metadata", None)
    return int(metadata.shard_offsets[0]) if metadata is not None else 0


def _store_buffers(config: GroupedEmbeddingConfig, files: StoreFiles, prefix: str) -> dict:
    """Store files for the host buffers FBGEMM's TBE would allocate for ``config``:
    the tables' weights, one after another, and the optimizer's per-row state."""
    if config.data_type != DataType.FP32:
        raise ValueError(f"a disk store holds FP32 tables, not {config.data_type}")
    optimizer = (config.fused_params or {}).get("optimizer")
    elements = sum(t.local_rows * t.local_cols for t in config.embedding_tables)
    rows = sum(t.local_rows for t in config.embedding_tables)
    state = {
        EmbOptimType.EXACT_SGD: None,
        EmbOptimType.EXACT_ADAGRAD: elements,
        EmbOptimType.EXACT_ROWWISE_ADAGRAD: rows,
    }
    if optimizer not in state:
        raise ValueError(
            f"a disk store supports the optimizers {sorted(map(str, state))}, not {optimizer}"
        )
    state_elements = state[optimizer] or 0
    files.check_space(
        4 * (elements + state_elements) + ORACLE_ROW_BYTES * rows,
        "the tables, their optimizer state and the oracles' row tables",
    )
    buffers = {"weights": files.tensor(f"{prefix}.weights", (elements,))}
    if state[optimizer] is not None:
        buffers["momentum1"] = files.tensor(f"{prefix}.momentum1", (state[optimizer],))
    return buffers


class CacheAwareFusedOptimizer(FusedOptimizerBase):
    """TorchRec's fused optimizer over the store TBE, kept in step with the cache.

    Its state tensors are the store's: reading them (``state``, which
    ``CombinedOptimizer`` and ``state_dict()`` go through) writes the cache
    (and the replicas of hot rows) back first, and loading them reloads the
    cached rows' weights and state (hot rows' replicas reload before they are next read).
    """

    def __init__(self, config, emb_module, pg, kernel: LookaheadKernel) -> None:  # noqa: ANN001
        self._kernel = kernel
        super().__init__(config, emb_module, pg)

    def before_state_read(self) -> None:
        self._kernel.write_back()

    def post_load_state_dict(self) -> None:
        super().post_load_state_dict()
        self._kernel.cached.cache.refresh(states=True)
        self._kernel.owner_rows_loaded()
