"""BERT4Rec (masked item prediction over a transformer encoder), its plan and its optimizers.

The item embeddings are one sequence table (``EmbeddingConfig``, one row per item and
one for the mask token) looked up by an ``EmbeddingCollection``, or by a
``LookaheadEmbeddingCollection`` for the lookahead run; positions have embeddings of
their own, a ``nn.TransformerEncoder`` reads the sequence both ways, and a linear layer
scores every item at the positions to predict (the masked ones in training, the
held-out last one in evaluation). The model is called as TorchRec's pipelines call a
model: ``loss, (loss, scores, targets) = model(batch)``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from data import ITEM_FEATURE, NOT_A_TARGET, MaskedSequences
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim import SGD, RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import JaggedTensor

from torchrec_lookahead import LookaheadEmbeddingCollection, lookahead_sharders
from torchrec_lookahead.traffic import count_data_parallel

__all__ = ["BERT4Rec", "build", "item_table"]

TABLE = "item_embedding"


def item_table(args: argparse.Namespace) -> EmbeddingConfig:
    """The item table: a row per item and one for the mask token (id ``num_items``)."""
    return EmbeddingConfig(
        name=TABLE,
        embedding_dim=args.emb_dim,
        num_embeddings=args.num_items + 1,
        feature_names=[ITEM_FEATURE],
    )


def padded(items: JaggedTensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's rows, padded at the end to ``[batch, max_len, dim]``, and where the
    padding is (``[batch, max_len]``, True there). A leaf of TorchRec's pipeline's trace
    of the model (``torch.fx.wrap``): its shapes come from the data."""
    rows = items.to_padded_dense(desired_length=max_len)
    padding = torch.arange(max_len, device=rows.device)[None, :] >= items.lengths()[:, None]
    return rows, padding


torch.fx.wrap("padded")


class BERT4Rec(nn.Module):
    """Masked item prediction: the items' rows plus their positions' (normalised, dropped
    out), a bidirectional transformer encoder, and every item's score at the positions
    whose label is an item; the loss is the cross entropy of those scores."""

    def __init__(
        self,
        items: nn.Module,
        num_items: int,
        max_len: int,
        emb_dim: int,
        nhead: int,
        num_layers: int,
        dropout: float,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.items = items
        self.max_len = max_len
        self.positions = nn.Parameter(0.02 * torch.randn(max_len, emb_dim, device=device))
        self.norm = nn.LayerNorm(emb_dim, device=device)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            emb_dim,
            nhead,
            4 * emb_dim,
            dropout,
            activation="gelu",
            batch_first=True,
            device=device,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.out = nn.Linear(emb_dim, num_items, device=device)

    def forward(
        self, batch: MaskedSequences
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        rows, padding = padded(self.items(batch.sparse_features)[ITEM_FEATURE], self.max_len)
        hidden = self.encoder(
            self.dropout(self.norm(rows + self.positions)), src_key_padding_mask=padding
        )
        asked = batch.labels != NOT_A_TARGET
        scores = self.out(hidden[asked])
        targets = batch.labels[asked]
        loss = F.cross_entropy(scores, targets)
        return loss, (loss.detach(), scores.detach(), targets)


def build(
    args: argparse.Namespace, lookahead: bool, world_size: int, device: torch.device
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """BERT4Rec under DMP with the fused embedding optimizer configured: the item table
    in a ``LookaheadEmbeddingCollection`` (``lookahead``) or TorchRec's
    ``EmbeddingCollection``, table-wise with the fused kernel either way, so the two
    runs can be compared."""
    meta = torch.device("meta")
    items: nn.Module
    if lookahead:
        items = LookaheadEmbeddingCollection(
            [item_table(args)], device=meta, cache_load_factor=args.cache_load_factor
        )
        sharders = lookahead_sharders()
    else:
        items = EmbeddingCollection([item_table(args)], device=meta)
        sharders = [EmbeddingCollectionSharder()]
    torch.manual_seed(args.seed)
    model = BERT4Rec(
        items,
        args.num_items,
        args.max_len,
        args.emb_dim,
        args.nhead,
        args.num_layers,
        args.dropout,
        device,
    )
    embedding_optimizer = RowWiseAdagrad if args.adagrad else SGD
    apply_optimizer_in_backward(embedding_optimizer, items.parameters(), {"lr": args.lr})
    kernel = "fused_uvm_caching" if device.type == "cuda" else "fused"
    constraints = {
        TABLE: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[kernel])
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device.type),
        batch_size=args.train_batch_size,
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    if args.print_sharding_plan and dist.get_rank() == 0:
        print(plan)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    count_data_parallel(dmp)  # the dense layers' all-reduces, in the bytes sent
    dense_class = torch.optim.Adagrad if args.adagrad else torch.optim.SGD
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda ps: dense_class(ps, lr=args.lr),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])
