"""A small two-module recommendation model, its all-resident twin, and data for it."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.optim import SGD, Adagrad, RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead import LookaheadEmbeddingBagCollection
from torchrec_lookahead._compat import TBE_TAKES_HOST_BUFFERS
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.dedup import deduplicate
from torchrec_lookahead.testing.resident import FullyResidentEmbeddingBagCollection

# A disk store under DMP hands FBGEMM's TBE its files (FBGEMM 1.8 and later; the lent GPU
# machine's 1.6 refuses it, see _compat.TBE_TAKES_HOST_BUFFERS).
needs_store_buffers = pytest.mark.skipif(
    not TBE_TAKES_HOST_BUFFERS,
    reason="a disk store under DMP needs fbgemm_gpu 1.8 or newer (preallocated_host_buffers)",
)

# Tables of different sizes and dims; t0 serves two features; w0 and w1 are weighted and
# share a slot pool (equal dims).
UNWEIGHTED = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=4000, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=1500, feature_names=["f2"]),
    EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=10000, feature_names=["f3"]),
]
WEIGHTED = [
    EmbeddingBagConfig(name="w0", embedding_dim=8, num_embeddings=3000, feature_names=["g0"]),
    EmbeddingBagConfig(name="w1", embedding_dim=8, num_embeddings=2500, feature_names=["g1"]),
]
KEYS = ["f0", "f1", "f2", "f3", "g0", "g1"]
ROWS = [4000, 4000, 1500, 10000, 3000, 2500]
DENSE = 4

OPTIMIZERS = {
    "sgd": (SGD, EmbOptimType.EXACT_SGD),
    "adagrad": (Adagrad, EmbOptimType.EXACT_ADAGRAD),
    "rowwise_adagrad": (RowWiseAdagrad, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
}
LR = 0.05


def batches(num: int, batch_size: int = 32, seed: int = 0) -> list[Batch]:
    """Skewed ids, Poisson bag sizes (empty bags, repeated ids in a bag), weighted g0, g1."""
    data = SyntheticCriteo(table_sizes=ROWS, zipf_exponent=1.05, pooling_factor=2.0, seed=seed)
    out = []
    for step in range(num):
        sparse = data.batch(step, batch_size)
        rng = np.random.default_rng([seed, step, 1])
        values = np.concatenate(sparse.values)
        weights = np.ones(len(values), dtype=np.float32)
        weighted = int(sparse.lengths[-2:].sum())
        if weighted:
            weights[-weighted:] = rng.uniform(0.5, 1.5, weighted)
        dense = rng.standard_normal((batch_size, DENSE)).astype(np.float32)
        labels = (rng.random(batch_size) < 0.3).astype(np.int64)
        out.append(
            Batch(
                dense_features=torch.from_numpy(dense),
                sparse_features=KeyedJaggedTensor.from_lengths_sync(
                    keys=KEYS,
                    values=torch.from_numpy(values),
                    lengths=torch.from_numpy(sparse.lengths.reshape(-1)),
                    weights=torch.from_numpy(weights),
                ),
                labels=torch.from_numpy(labels),
            )
        )
    return out


USER_KEYS = ["f0", "f2", "g0"]  # the user-side features of session_batches (g0 weighted)


def session_batches(
    num: int, session: int, dedup: bool, batch_size: int = 32, seed: int = 0
) -> list[Batch]:
    """``batches`` where ``session`` consecutive samples share their ``USER_KEYS`` bags (and
    weights); deduplicated (TorchRec's variable-stride form) or plain."""
    first = np.arange(batch_size) // session * session
    out = []
    for batch in batches(num, batch_size, seed):
        bags = batch.sparse_features.to_dict()
        parts = []
        for key in KEYS:
            jagged = bags[key]
            samples = first if key in USER_KEYS else np.arange(batch_size)
            values, weights = jagged.to_dense(), jagged.to_dense_weights()
            parts.append(([values[i] for i in samples], [weights[i] for i in samples]))
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=KEYS,
            values=torch.cat([v for values, _ in parts for v in values]),
            weights=torch.cat([w for _, weights in parts for w in weights]),
            lengths=torch.tensor([len(v) for values, _ in parts for v in values]),
        )
        if dedup:
            features = deduplicate(features, USER_KEYS)
        out.append(Batch(batch.dense_features, features, batch.labels))
    return out


class TwoModuleModel(nn.Module):
    """Pooled embeddings of both modules and the dense features into a logistic layer."""

    def __init__(self, unweighted: nn.Module, weighted: nn.Module) -> None:
        super().__init__()
        self.unweighted = unweighted
        self.weighted = weighted
        width = sum(len(t.feature_names) * t.embedding_dim for t in UNWEIGHTED + WEIGHTED)
        torch.manual_seed(0)
        self.over = nn.Linear(width + DENSE, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = [
            self.unweighted(batch.sparse_features).values(),
            self.weighted(batch.sparse_features).values(),
            batch.dense_features,
        ]
        logits = self.over(torch.cat(pooled, dim=1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.float())
        return loss, logits.detach()


def lookahead_model(
    optimizer: str, data_type: DataType = DataType.FP32, **cache: object
) -> TwoModuleModel:
    """The model with lookahead-cached modules of ``data_type`` tables; ``cache_rows`` and
    ``max_cache_rows`` may name tables of both; with ``store_dir`` each module keeps a disk
    store in a directory of its own below it."""

    def settings(tables: list[EmbeddingBagConfig]) -> dict[str, object]:
        names = {t.name for t in tables}
        out = dict(cache)
        for per_table in ("cache_rows", "max_cache_rows"):  # settings that name tables
            if isinstance(cache.get(per_table), dict):
                out[per_table] = {k: v for k, v in cache[per_table].items() if k in names}
        if "store_dir" in cache:  # a directory of its own for each module
            out["store_dir"] = Path(cache["store_dir"]) / tables[0].name
            out["store_dir"].mkdir()
        return out

    unweighted, weighted = (
        [dataclasses.replace(t, data_type=data_type) for t in tables]
        for tables in (UNWEIGHTED, WEIGHTED)
    )
    model = TwoModuleModel(
        LookaheadEmbeddingBagCollection(unweighted, **settings(unweighted)),
        LookaheadEmbeddingBagCollection(weighted, is_weighted=True, **settings(weighted)),
    )
    for module in (model.unweighted, model.weighted):
        apply_optimizer_in_backward(OPTIMIZERS[optimizer][0], module.parameters(), {"lr": LR})
    return model


def reference_twin(model: TwoModuleModel, optimizer: str) -> TwoModuleModel:
    """The same model (same initial weights) with all-resident fused TBE tables."""
    fused = {"optimizer": OPTIMIZERS[optimizer][1], "learning_rate": LR}
    twin = TwoModuleModel(
        FullyResidentEmbeddingBagCollection(model.unweighted, fused),
        FullyResidentEmbeddingBagCollection(model.weighted, fused),
    )
    twin.over.load_state_dict(copy.deepcopy(model.over.state_dict()))
    return twin


DENSE_LR = 0.1


def train_reference(twin: TwoModuleModel, data: list[Batch]) -> list[torch.Tensor]:
    """Plain training loop; returns each step's logits."""
    dense = torch.optim.SGD(twin.over.parameters(), lr=DENSE_LR)
    outputs = []
    for batch in data:
        dense.zero_grad()
        loss, logits = twin(batch)
        loss.backward()
        dense.step()
        outputs.append(logits)
    return outputs


def train_lookahead(
    model: TwoModuleModel,
    data,
    lookahead: int,
    prefetch_distance: int,
    planning_workers: int = 1,
    stage_thread: bool = True,
    planner: str = "host",
):
    """Train through LookaheadTrainPipeline (by default with the stage on its own thread,
    whatever the machine); returns (each step's logits, pipeline)."""
    from torchrec_lookahead import LookaheadTrainPipeline

    dense = torch.optim.SGD(model.over.parameters(), lr=DENSE_LR)
    pipeline = LookaheadTrainPipeline(
        model,
        dense,
        torch.device("cpu"),
        lookahead=lookahead,
        prefetch_distance=prefetch_distance,
        planning_workers=planning_workers,
        stage_thread=stage_thread,
        planner=planner,
    )
    outputs, it = [], iter(data)
    while True:
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            return outputs, pipeline


def train_dropping_refused(model: TwoModuleModel, stream, lookahead: int = 3):
    """Train through the pipeline as a user does who drops the batches it refuses
    (``ValueError``) and goes on; returns (each step's logits, the refusals' messages)."""
    from torchrec_lookahead import LookaheadTrainPipeline

    dense = torch.optim.SGD(model.over.parameters(), lr=DENSE_LR)
    pipeline = LookaheadTrainPipeline(model, dense, torch.device("cpu"), lookahead=lookahead)
    it, outputs, errors = iter(stream), [], []
    while True:
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            return outputs, errors
        except ValueError as error:
            errors.append(str(error))


def assert_same_training_state(
    model: TwoModuleModel, twin: TwoModuleModel, exact: bool = True
) -> None:
    """Every table, optimizer-state tensor and dense parameter equal, bitwise (``exact``)
    or within float32 rounding (``torch.testing.assert_close``'s defaults)."""

    def same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        expected = expected.to(got.device)  # a store's tables are in host memory
        if exact:
            assert torch.equal(got, expected), what
        else:
            torch.testing.assert_close(got, expected, msg=what)

    for source, target in ((model.unweighted, twin.unweighted), (model.weighted, twin.weighted)):
        state = source.state_dict()
        reference = target.tbe.split_embedding_weights()
        for config, weight in zip(source.embedding_bag_configs(), reference):
            same(state[f"embedding_bags.{config.name}.weight"], weight, config.name)
        expected_states = target.tbe.split_optimizer_states()
        got_states = source.optimizer_states()
        assert len(got_states) == (len(expected_states) or len(got_states))
        for got, expected in zip(got_states, expected_states):
            assert len(got) == len(expected)
            for a, b in zip(got, expected):
                same(a, b, "optimizer state")
    for name, param in twin.over.named_parameters():
        same(dict(model.over.named_parameters())[name], param, name)


DATA_KEYS_UNKNOWN_TO_MODEL = ["f0", "f1", "f2", "zz", "g0", "g1"]
