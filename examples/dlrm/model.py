"""The DLRM training model, its sharding plan and its optimizers; the rows to replicate."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from data import reader
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import SGD, RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_lookahead import (
    HotRowsEmbeddingBagCollection,
    LookaheadEmbeddingBagCollection,
    lookahead_sharders,
)
from torchrec_lookahead.traffic import count_data_parallel

__all__ = ["build", "cache_planner", "hot_rows", "tables"]


def tables(args: argparse.Namespace) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=args.embedding_dim,
            num_embeddings=rows,
            feature_names=[name],
        )
        for name, rows in zip(DEFAULT_CAT_NAMES, args.num_embeddings)
    ]


def sample_ids(args, days, world_size: int) -> dict[str, list[torch.Tensor]]:
    """Per table, the ids of the first --plan_sample_batches global steps (every rank's
    share of a step together, read locally): what the planners measure."""
    per_rank = []
    for r in range(world_size):
        train = reader(args, days, "train", r, world_size)
        per_rank.append([train[s] for s in range(min(args.plan_sample_batches, len(train)))])
    return {
        t.name: [
            torch.cat([b.sparse_features[t.feature_names[0]].values() for b in step])
            for step in zip(*per_rank)
        ]
        for t in tables(args)
    }


def embedding_optimizer(args: argparse.Namespace) -> EmbOptimType:
    """The fused optimizer --adagrad picks: row-wise Adagrad, else SGD."""
    return EmbOptimType.EXACT_ROWWISE_ADAGRAD if args.adagrad else EmbOptimType.EXACT_SGD


def cache_planner(args, days, world_size: int, device: torch.device):
    """``lookahead_planner`` sized from the first training batches of every rank (read locally)."""
    from planners import LookaheadCacheStatistics, lookahead_planner

    samples = sample_ids(args, days, world_size)
    stats = {
        t.name: LookaheadCacheStatistics(
            samples[t.name], t.num_embeddings, args.lookahead, args.prefetch_distance, t.name
        )
        for t in tables(args)
    }
    optimizer = embedding_optimizer(args)
    budget = None if args.cache_budget_mb is None else int(args.cache_budget_mb * 2**20)
    sharding = {
        t.name: ParameterConstraints(sharding_types=[args.sharding_type]) for t in tables(args)
    }
    return lookahead_planner(
        Topology(world_size=world_size, compute_device=device.type),
        args.batch_size,
        tables(args),
        stats,
        optimizer,
        args.step_compute_ms,
        budget,
        sharding,
    )


def hot_rows(args, days, world_size: int, device: torch.device):  # noqa: ANN201
    """The rows worth replicating on every rank (``planners.hot``) and what decided it, or
    ``(None, why)``: one rank, --no_hot_rows, --dedup (deduplicated batches are not
    split), or no row that pays. ``--hot_rows`` takes every row that saves bytes; by
    default ("auto") only rows whose bytes cost the link more time than their lookups
    cost the replicas (the link probed, or --link_gbps; the replicas' work timed here)."""
    from planners import optimizer_state_floats, propose_hot_rows
    from planners.link import measure_link_cost

    if world_size == 1:
        return None, "one rank: nothing to replicate"
    if args.hot_rows == "off" or args.dedup:
        return None, "off (--no_hot_rows)" if args.hot_rows == "off" else "off (--dedup)"
    samples = {
        name: [ids.numpy() for ids in steps]
        for name, steps in sample_ids(args, days, world_size).items()
    }
    budget = None if args.hot_budget_mb is None else int(args.hot_budget_mb * 2**20)
    optimizer = embedding_optimizer(args)
    state = optimizer_state_floats(optimizer, args.embedding_dim)
    link, why = None, "on (--hot_rows): every row that saves bytes"
    if args.hot_rows == "auto":
        link = measure_link_cost(
            samples,
            args.embedding_dim,
            optimizer,
            {"learning_rate": args.learning_rate},
            dist.GroupMember.WORLD,
            device,
            args.link_gbps,
        )
        how = "stated" if args.link_gbps else "measured"
        why = (
            f"auto: link {8 / link.per_byte / 1e9:.2f} Gbit/s ({how}), replicas "
            f"{link.per_lookup * 1e6:.2f} us per hot lookup + {link.per_step * 1e3:.2f} ms "
            "per step"
        )
    proposal = propose_hot_rows(samples, world_size, args.embedding_dim, state, budget, link=link)
    if not proposal.rows:
        return None, why + ": no row pays"
    return proposal, why


def build(
    args,
    lookahead: bool,
    world_size: int,
    device: torch.device,
    planner=None,
    hot: dict | None = None,
):
    """The DLRM training model under DMP, with the fused embedding optimizer configured
    (``hot``: the rows the lookahead model replicates on every rank)."""
    meta = torch.device("meta")
    if lookahead:
        # A table whose share is below what the window touches gets that at the first
        # batch (small tables are cached whole): no setting is too small for the window.
        settings = dict(
            device=meta, cache_load_factor=args.cache_load_factor, store_dir=args.store_dir
        )
        if hot:
            ebc = HotRowsEmbeddingBagCollection(tables(args), hot_rows=hot, **settings)
        else:
            ebc = LookaheadEmbeddingBagCollection(tables(args), **settings)
        sharders = lookahead_sharders()
    else:
        ebc = EmbeddingBagCollection(tables(args), device=meta)
        sharders = [EmbeddingBagCollectionSharder()]
    torch.manual_seed(args.seed)
    if args.interaction_type == "dcn":
        net = DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=args.dense_arch,
            over_arch_layer_sizes=args.over_arch,
            dcn_num_layers=args.dcn_num_layers,
            dcn_low_rank_dim=args.dcn_low_rank_dim,
            dense_device=device,
        )
    else:
        net = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=args.dense_arch,
            over_arch_layer_sizes=args.over_arch,
            dense_device=device,
        )
    model = DLRMTrain(net)
    embedding_optimizer = RowWiseAdagrad if args.adagrad else SGD
    apply_optimizer_in_backward(
        embedding_optimizer, model.model.sparse_arch.parameters(), {"lr": args.learning_rate}
    )
    # Both models get the same plan (--sharding_type, fused), so they can be compared.
    kernel = "fused_uvm_caching" if device.type == "cuda" else "fused"
    same_plan = {
        t.name: ParameterConstraints(sharding_types=[args.sharding_type], compute_kernels=[kernel])
        for t in tables(args)
    }
    free = not lookahead and args.torchrec_plan  # TorchRec's own choice of sharding
    planner = planner or EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device.type),
        batch_size=args.batch_size,
        constraints=None if free else same_plan,
    )
    try:
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    except PlannerError as error:  # one line: what TorchRec's planner could not fit
        why = str(error).strip().splitlines()[0].rstrip(". ")
        raise ValueError(
            f"TorchRec's planner found no plan for the {'lookahead' if lookahead else 'plain'} "
            f"model ({why}): smaller tables (--scale), more ranks, or, for the lookahead "
            "model, its tables on disk (--store_dir)"
        ) from None
    if args.print_sharding_plan and dist.get_rank() == 0:
        print(plan)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    count_data_parallel(dmp)  # data-parallel tables' all-reduces, in the bytes sent
    dense_class = torch.optim.Adagrad if args.adagrad else torch.optim.SGD
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda ps: dense_class(ps, lr=args.learning_rate),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])
