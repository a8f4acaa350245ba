"""Sharding the lookahead collections with ``DistributedModelParallel``.

``LookaheadEmbeddingBagCollectionSharder`` is the ``ModuleSharder`` passed to
DMP and to the planner; it builds a
:class:`~torchrec_lookahead.embedding.sharded.ShardedLookaheadEmbeddingBagCollection`,
whose kernels (:mod:`~torchrec_lookahead.embedding.kernel`) cache the shards
each rank owns. ``LookaheadEmbeddingCollectionSharder`` does the same for
sequence tables
(:class:`~torchrec_lookahead.embedding.sequence_sharded.ShardedLookaheadEmbeddingCollection`).
``HotRowsEmbeddingBagCollectionSharder`` does the same for
:class:`~torchrec_lookahead.embedding.hot.collection.HotRowsEmbeddingBagCollection`,
whose sharded module also replicates the hot rows
(:mod:`~torchrec_lookahead.embedding.hot.sharded`). The module layout follows
TorchRec's: kernel (``batched_embedding_kernel.py``), lookup
(``embedding_lookup.py``), sharded collection and sharder (``embeddingbag.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import (
    ModuleSharder,
    ParameterSharding,
    ShardingEnv,
    ShardingEnv2D,
    ShardingType,
)

from torchrec_lookahead.embedding.cached import CachedCollection
from torchrec_lookahead.embedding.collection import LookaheadEmbeddingBagCollection
from torchrec_lookahead.embedding.hot.collection import HotRowsEmbeddingBagCollection
from torchrec_lookahead.embedding.hot.sharded import ShardedHotRowsEmbeddingBagCollection
from torchrec_lookahead.embedding.kernel import LookaheadFusedEmbeddingBag
from torchrec_lookahead.embedding.sequence import LookaheadEmbeddingCollection
from torchrec_lookahead.embedding.sequence_sharded import ShardedLookaheadEmbeddingCollection
from torchrec_lookahead.embedding.sharded import ShardedLookaheadEmbeddingBagCollection
from torchrec_lookahead.tbe import check_trained

__all__ = [
    "HotRowsEmbeddingBagCollectionSharder",
    "LookaheadEmbeddingBagCollectionSharder",
    "LookaheadEmbeddingCollectionSharder",
    "LookaheadFusedEmbeddingBag",
    "ShardedLookaheadEmbeddingBagCollection",
    "ShardedLookaheadEmbeddingCollection",
    "lookahead_sharders",
]


if TYPE_CHECKING:
    # TorchRec's sharders are untyped here (Any to mypy): the mixin reads their settings.
    SharderBase = Any
else:
    SharderBase = object


def check_plan(module: CachedCollection, params: dict[str, ParameterSharding]) -> None:
    """Refuse, before TorchRec's sharding builds any TBE, a plan a lookahead cache cannot
    serve: a table of a type FBGEMM does not train (its type may have changed since the
    module was built), or a shard with no rows."""
    check_trained(module.table_configs())
    for name, sharding in params.items():
        shards = sharding.sharding_spec.shards if sharding.sharding_spec else []
        empty = [
            rank for rank, shard in zip(sharding.ranks or [], shards) if shard.shard_sizes[0] == 0
        ]
        if empty:
            raise ValueError(
                f"table {name}: the plan gives ranks {empty} no rows of it "
                f"({sharding.sharding_type}, {sum(s.shard_sizes[0] for s in shards)} rows); "
                "a lookahead cache needs rows on every shard: shard it table-wise, or over "
                "fewer ranks than it has rows"
            )


def lookahead_kernels(compute_device_type: str) -> list[str]:
    """The compute kernel a lookahead table is planned as: ``fused`` on the CPU (the store
    is in host memory anyway), ``fused_uvm_caching`` on CUDA (the planner then counts the
    cache in device memory and the rows in host memory, this kernel's layout)."""
    if compute_device_type == "cuda":
        return [EmbeddingComputeKernel.FUSED_UVM_CACHING.value]
    return [EmbeddingComputeKernel.FUSED.value]


class LookaheadSharding(SharderBase):
    """What the lookahead sharders share (a mixin listed before TorchRec's sharder): the
    plan checked (:func:`check_plan`), the sharded module built with the module's fused
    params under the sharder's, and the compute kernel (:func:`lookahead_kernels`)."""

    def shard(
        self,
        module: CachedCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> Any:
        check_plan(module, params)
        return self.sharded_module_type(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params={**module.fused_params, **(self.fused_params or {})},
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return lookahead_kernels(compute_device_type)


class LookaheadEmbeddingBagCollectionSharder(LookaheadSharding, EmbeddingBagCollectionSharder):
    """Shards ``LookaheadEmbeddingBagCollection`` with lookahead-cached fused kernels.

    Offers the sharding types TorchRec's sharder offers on the device except
    data-parallel (a replicated table has no single owner to cache it; keep
    small replicated tables in a plain ``EmbeddingBagCollection``), so a planner
    gives a lookahead model the plan it gives plain TorchRec, and the same
    results. TorchRec shards row-wise only on CUDA (from when gloo had no
    reduce-scatter); ``cpu_row_wise=True`` offers row-wise and table-row-wise on
    the CPU too, exact against TorchRec's own row-wise path. Over gloo at two
    ranks or more a deduplicated batch cannot reach row-wise shards (their
    outputs would need a reduce-scatter of uneven parts, which gloo lacks): it
    is refused.
    """

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        cpu_row_wise: bool = False,
    ) -> None:
        super().__init__(fused_params, qcomm_codecs_registry)
        self.cpu_row_wise = cpu_row_wise

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = [ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE]
        if compute_device_type == "cuda" or self.cpu_row_wise:
            types += [ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE]
        return [t.value for t in types]

    @property
    def module_type(self) -> type[LookaheadEmbeddingBagCollection]:
        return LookaheadEmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[ShardedLookaheadEmbeddingBagCollection]:
        return ShardedLookaheadEmbeddingBagCollection


class LookaheadEmbeddingCollectionSharder(LookaheadSharding, EmbeddingCollectionSharder):
    """Shards ``LookaheadEmbeddingCollection`` (sequence tables) with lookahead-cached fused
    kernels.

    Offers what TorchRec's ``EmbeddingCollectionSharder`` offers on the CPU and on CUDA
    except data-parallel (a replicated table has no single owner to cache it):
    table-wise, column-wise and row-wise. The output dist is TorchRec's own. Deduplicated
    (variable-stride) batches are refused, as the unsharded collection refuses them.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = [ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE]
        return [t.value for t in types]

    @property
    def module_type(self) -> type[LookaheadEmbeddingCollection]:
        return LookaheadEmbeddingCollection

    @property
    def sharded_module_type(self) -> type[ShardedLookaheadEmbeddingCollection]:
        return ShardedLookaheadEmbeddingCollection


class HotRowsEmbeddingBagCollectionSharder(LookaheadEmbeddingBagCollectionSharder):
    """Shards ``HotRowsEmbeddingBagCollection`` as the lookahead sharder does, and
    replicates its hot rows on every rank. A hot table must keep its rows whole
    (table- or row-wise), and 2D parallelism is refused (the replicas' update
    would run over the sharding group only)."""

    def shard(
        self,
        module: HotRowsEmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedHotRowsEmbeddingBagCollection:
        if isinstance(env, ShardingEnv2D):
            raise ValueError(
                "hot rows are not replicated under 2D parallelism (DMPCollection): their "
                "gradients are summed over the sharding group only, and the replica groups "
                "would part; build a LookaheadEmbeddingBagCollection, or shard it with "
                "DistributedModelParallel"
            )
        whole_rows = {
            ShardingType.TABLE_WISE.value,
            ShardingType.ROW_WISE.value,
            ShardingType.TABLE_ROW_WISE.value,
        }
        for name in module.hot_rows:
            if params[name].sharding_type not in whole_rows:
                raise ValueError(
                    f"table {name}: hot rows are replicated whole, and the plan "
                    f"splits its columns ({params[name].sharding_type}); shard it "
                    "table- or row-wise, or give it no hot rows"
                )
        sharded = super().shard(module, params, env, device, module_fqn)
        assert isinstance(sharded, ShardedHotRowsEmbeddingBagCollection)
        return sharded

    @property
    def module_type(self) -> type[HotRowsEmbeddingBagCollection]:
        return HotRowsEmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[ShardedHotRowsEmbeddingBagCollection]:
        return ShardedHotRowsEmbeddingBagCollection


def lookahead_sharders(
    fused_params: dict[str, Any] | None = None, cpu_row_wise: bool = False
) -> list[ModuleSharder]:
    """The sharders for a model mixing lookahead and plain TorchRec modules.

    The lookahead collections' (pooled, sequence and hot-rows) first, then TorchRec's
    default sharders for every other module type (``EmbeddingBagCollection``,
    ``EmbeddingCollection``, ...).
    """
    return [
        LookaheadEmbeddingBagCollectionSharder(fused_params, cpu_row_wise=cpu_row_wise),
        LookaheadEmbeddingCollectionSharder(fused_params),
        HotRowsEmbeddingBagCollectionSharder(fused_params, cpu_row_wise=cpu_row_wise),
        *get_default_sharders(),
    ]
