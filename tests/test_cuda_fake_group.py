"""The lookahead stage with replicated hot rows, sharded over two ranks, on fake CUDA.

Each simulated rank (one per test, the other ranks standing in through torch's
``cuda:fake`` process-group backend and its ``FakeStore``, which take CUDA tensors only,
as NCCL does) shards a collection with hot rows in two tables, one table-wise on rank 0
and one row-wise over both, with the project's sharder and TorchRec's sharded module,
then runs a batch through the stage (``LookaheadStage``, inline): the batch goes to the
device, the hot-row tier splits it (``split_batch``), the union's exchange starts, the
cold batch goes through TorchRec's input dist (a variable batch: the splits', lengths'
and ids' all-to-alls) and every shard's cache prepares and plans its ids. Under
``FakeCuda`` (fake CUDA tensors with real values behind them: a collective there acts
as if every rank sent this rank's tensors) and the stream checker.

Defect N3: the cold batch was a CPU ``KeyedJaggedTensor`` handed to the NCCL input dist
("No backend type associated with device type cpu"); this test fails so without the
cold batch's move to the batch's device in ``embedding/hot/split.py``.

Stubbed or stood in for (a CPU build of torch has no CUDA runtime):

* FBGEMM operators: none on this path. ``fake_cuda.STUBBED`` (the TBE's pooled forward)
  is registered by ``FakeCuda`` but not reached (no forward here). FBGEMM's
  ``keyed_jagged_index_select_dim1`` has a fake kernel but a CUDA kernel only: its
  values on the shadows come from FBGEMM's CPU ``permute_1D_sparse_data``
  (``FakeCuda``).
* ``torch.cuda.get_device_capability`` (asked by ``dist.broadcast`` of a CUDA tensor):
  an sm90 device; ``torch.cuda.current_stream`` (TorchRec synchronises it before reading
  lengths back): a stream whose ``synchronize`` returns at once.
* TorchRec's ``TableBatchedEmbeddingSlice`` (a table's view of a TBE's weights, a tensor
  subclass torch cannot make of a fake tensor): the view, as a plain parameter.

Not reached: ``DistributedModelParallel`` (its collective validation's
``broadcast_object_list`` fails under the fake tensor mode, which makes the pickled
object's byte storage ``meta``), the step's forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fbgemm_gpu
import pytest
import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.composable.table_batched_embedding_slice import (
    TableBatchedEmbeddingSlice,
)
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead import HotRowsEmbeddingBagCollection, HotRowsEmbeddingBagCollectionSharder
from torchrec_lookahead._compat import fake_store, is_fake
from torchrec_lookahead.embedding.hot.sharded import HotRowsContext
from torchrec_lookahead.oracle.device import DevicePreparedBatch
from torchrec_lookahead.pipeline.batch_check import BatchCheck
from torchrec_lookahead.pipeline.stage import LookaheadStage
from torchrec_lookahead.settings import PLANNERS, WindowSettings
from torchrec_lookahead.testing.fake_cuda import FakeCuda
from torchrec_lookahead.testing.stream_check import StreamChecker

WORLD = 2
TABLES = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"])
    for i in range(2)
]
HOT = {"t0": [1, 2, 3], "t1": [5, 60]}
# Four samples. f0: [1, 7] [2] [8] []; f1: [5] [9, 60] [70] [60]. Hot: 1, 2; 5, 60, 60.
KEYS, LENGTHS = ["f0", "f1"], [2, 1, 1, 0, 1, 2, 1, 1]
VALUES = [1, 7, 2, 8, 5, 9, 60, 70, 60]
# The cold ids each rank's shards get when every rank sends this batch: t0 (table-wise)
# on rank 0, t1's rows 0-49 on rank 0 and 50-99 on rank 1 (ids within the shard).
OWNED = {0: [7, 7, 8, 8, 9, 9], 1: [20, 20]}


class _HostWait:
    """``torch.cuda.current_stream``'s stand-in: the host waits for nothing here."""

    def synchronize(self) -> None:
        return None


@pytest.fixture
def cuda_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA runtime queries on the path, stood in for (see the module)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _HostWait())
    original = TableBatchedEmbeddingSlice.__new__

    def new(cls: type, data: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not is_fake(data):
            return original(cls, data, *args, **kwargs)
        start, end, rows, dim = (*args, *kwargs.values())
        view = data[start:end].view(rows, dim)
        return torch.nn.Parameter(view, requires_grad=data.requires_grad)

    monkeypatch.setattr(TableBatchedEmbeddingSlice, "__new__", new)


@pytest.fixture(params=range(WORLD), ids=lambda rank: f"rank{rank}")
def rank(request: pytest.FixtureRequest) -> Iterator[int]:
    """A simulated rank of ``WORLD``, its default process group ``cuda:fake``."""
    dist.init_process_group("cuda:fake", store=fake_store(), rank=request.param, world_size=WORLD)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    fbgemm_gpu.__variant__ == "cuda",
    reason="FakeCuda runs FBGEMM's CPU kernels on its shadows; a CUDA build of FBGEMM "
    "(1.6) puts a C++ autograd kernel in front of keyed_jagged_index_select_dim1, which "
    "crashes on fake CUDA tensors. make gpu-check's two-rank runs reach this path on two GPUs.",
)
@pytest.mark.parametrize("planner", PLANNERS)
def test_a_batch_with_hot_rows_reaches_the_input_dist_on_cuda(
    rank: int, cuda_runtime: None, planner: str
) -> None:
    """One rank's stage splits a batch, sends its cold part through TorchRec's input dist on
    the device and plans the ids its shards own (defect N3: the cold part stayed on the
    CPU, which NCCL refuses), on the host or on the device."""
    module = HotRowsEmbeddingBagCollection(
        TABLES, device=torch.device("meta"), cache_load_factor=0.2, hot_rows=HOT
    )
    apply_optimizer_in_backward(RowWiseAdagrad, module.parameters(), {"lr": 0.05})
    features = KeyedJaggedTensor(
        keys=KEYS, values=torch.tensor(VALUES), lengths=torch.tensor(LENGTHS)
    )
    batch = Batch(torch.zeros(4, 1), features, torch.zeros(4))
    device = torch.device("cuda", rank)  # each rank's own, as the plan places its shards
    with (
        FakeCuda(device) as fake,
        StreamChecker(device, values=fake.real) as checker,
        torch.no_grad(),  # autograd cannot record fake CUDA tensors on a CPU build
    ):
        sharder = HotRowsEmbeddingBagCollectionSharder()
        plan = construct_module_sharding_plan(
            module,
            {"t0": table_wise(rank=0), "t1": row_wise()},
            sharder=sharder,
            local_size=WORLD,
            world_size=WORLD,
            device_type="cuda",
        )
        env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
        sharded = sharder.shard(module, plan, env, device)
        sharded.open_window(WindowSettings(lookahead=2, prefetch_distance=1, planner=planner))
        check = BatchCheck(dict.fromkeys(KEYS, False), {})
        stage = LookaheadStage([sharded], check, device, threaded=False)
        stage.start(iter([batch]))
        item = stage.get()
        if item.error is not None:
            raise item.error
        assert item.context is not None
        prepared = item.context.inputs[sharded]
        ctx, distributed = prepared.distributed
        assert distributed and all(kjt.values().device == device for kjt in distributed)
        batches = [b for step in prepared.groups for b in step.batches]
        if planner == "device":  # the ids stay on the device
            assert all(isinstance(b, DevicePreparedBatch) for b in batches)
            assert all(b.ids.device == device for b in batches)
            seen = [i for b in batches for i in fake.real(b.ids).tolist()]
        else:  # the host's planner read them back
            seen = [int(i) for b in batches for i in b.ids]
        assert sorted(seen) == OWNED[rank]
        assert isinstance(ctx, HotRowsContext) and ctx.hot is not None
        assert ctx.hot.split.rows.device == device
        metrics = sharded.replica_metrics
        assert (metrics.lookups, metrics.hot_lookups) == (len(VALUES), 5)
        ids = item.context.batch.sparse_features.values()  # the batch, moved by the stage
        assert ids.device == device and fake.real(ids).tolist() == VALUES
        stage.close()
    assert checker.operators > 0
