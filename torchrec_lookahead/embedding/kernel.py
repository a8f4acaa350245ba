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

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import (
    ShardingEnv,
    ShardingType,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._compat import (
    FusedKernelBase,
    FusedOptimizerBase,
    FusedSequenceKernelBase,
)
from torchrec_lookahead.checks import no_fused_optimizer
from torchrec_lookahead.embedding.cache_group import GroupTable, build_cache_group
from torchrec_lookahead.settings import CacheSizing
from torchrec_lookahead.store.files import StoreFiles
from torchrec_lookahead.store.stores import ORACLE_ROW_BYTES
from torchrec_lookahead.tbe import set_learning_rate
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
        if store_files is not None:
            # The store TBE's host buffers are store files (the sharded module checked that
            # a disk store can serve here: check_disk_store).
            buffers = _store_buffers(config, *store_files)
            fused = {**(config.fused_params or {}), "preallocated_host_buffers": buffers}
            config = dataclasses.replace(config, fused_params=fused)
        if "optimizer" not in (config.fused_params or {}):
            raise no_fused_optimizer(f"tables {[t.name for t in config.embedding_tables]}")
        super().__init__(config, pg, device, sharding_type, env)  # type: ignore[call-arg]
        # Who makes the store current before its optimizer state is read, and who hears
        # that its state was loaded (see route_store_events).
        self._before_store_read: Callable[[], None] = self.write_back
        self._after_store_load: Callable[[], None] = _nothing
        states = self.store_tbe.split_optimizer_states()
        self.cached = build_cache_group(
            [
                # A plan's per-table cache_params.load_factor stays in each table's fused
                # params (TorchRec groups tables without it): each table sized from its own.
                GroupTable(
                    t.name,
                    t.num_embeddings,
                    t.local_rows,
                    t.local_cols,
                    t.num_features(),
                    (t.fused_params or {}).get("cache_load_factor"),
                )
                for t in config.embedding_tables
            ],
            self.store_tbe.split_embedding_weights(),
            sizing=sizing,
            fused_params=config.fused_params or {},
            device=device,
            pooling=self.pooling,
            data_type=config.data_type,
            files=None if store_files is None else store_files[0],
            states=states or [[] for _ in config.embedding_tables],
        )
        self.store = self.cached.cache.store
        self.use_fused_optimizer(CacheAwareFusedOptimizer(config, self.store_tbe, pg, self))

    def route_store_events(
        self, before_read: Callable[[], None], after_load: Callable[[], None]
    ) -> None:
        """Let the module composing this kernel make the store current before its
        optimizer state is read (``before_read``, by default this kernel's
        :meth:`write_back`) and hear that the state was loaded (``after_load``): a module
        whose rows also live elsewhere (replicated hot rows) brings them in there."""
        self._before_store_read = before_read
        self._after_store_load = after_load

    def before_store_read(self) -> None:
        self._before_store_read()

    def after_store_load(self) -> None:
        self._after_store_load()

    def write_back(self) -> None:
        """Make the store current: write the cache's updated rows back."""
        self.cached.write_back()

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
        self.before_store_read()
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


def _nothing() -> None:
    """No one to tell."""


def _store_buffers(config: GroupedEmbeddingConfig, files: StoreFiles, prefix: str) -> dict:
    """Store files for the host buffers FBGEMM's TBE would allocate for ``config``:
    the tables' weights, one after another, and the optimizer's per-row state."""
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
    ``CombinedOptimizer`` and ``state_dict()`` go through) makes the store current
    first (the kernel's ``before_store_read``), and loading them reloads the cached
    rows' weights and state, then tells the kernel's ``after_store_load``.
    """

    def __init__(self, config, emb_module, pg, kernel: LookaheadKernel) -> None:  # noqa: ANN001
        self._kernel = kernel
        super().__init__(config, emb_module, pg)

    def before_state_read(self) -> None:
        self._kernel.before_store_read()

    def post_load_state_dict(self) -> None:
        super().post_load_state_dict()
        self._kernel.cached.cache.refresh(states=True)
        self._kernel.after_store_load()
