"""The CUDA path, checked on the CPU: one test per defect an audit of the never-run CUDA code
found (see docs/design.md, "Streams and devices"), each failing before its fix, and whole
steps through the path.

What a CPU can show (checked with torch 2.13 CPU): fake CUDA tensors
(``FakeTensorMode``) reject device mismatches; the ``cuda:fake`` process-group
backend takes CUDA tensors only, as NCCL does; FBGEMM's CUDA variable-batch
output is ``[1, N]``; a side stream that defers its work until waited for
(``torchrec_lookahead.testing.streams``) turns a missing wait into a wrong value.

The whole path runs under ``torchrec_lookahead.testing.fake_cuda.FakeCuda``
(``FakeTensorMode`` CUDA tensors with real CPU memory behind them, so that the
stage can read ids back and the store gets real rows) and
``torchrec_lookahead.testing.stream_check.StreamChecker`` (the rule CUDA's stream
sanitizer enforces, and ``record_stream`` before a free, over the package's own
streams: the trainer's, the side stream, the stage's).

FBGEMM operators stubbed under fake tensors (``fake_cuda.STUBBED``): a CPU build of
FBGEMM ships its TBE's CUDA forward kernels without a fake kernel, so
``fbgemm::split_embedding_codegen_forward_unweighted_pt2_wrapper`` and
``fbgemm::split_embedding_codegen_forward_weighted_pt2_wrapper`` get one (the pooled
output's shape, ``[batch, total_D]``); every other FBGEMM operator on the path runs its
own fake kernel (``bounds_check_indices``, the TBE lookup's) or, for the host side, its
CPU kernel. The TBE kernels' values are not computed (zero): the cache's moves, the
store and the planning are, on real data.

Not reachable on a CPU build: the backward. Autograd cannot record a fake CUDA tensor
there (the process aborts: it asks the CUDA device guard, which a CPU build lacks, for
the current stream), so the whole-path steps run forward only, under
``torch.no_grad()``; the fused optimizer's update and its ordering against the moves are
checked on the CPU device instead (``tests/test_exactness.py`` runs under the stream
checker, which follows FBGEMM's backward row by row).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_lookahead.streams as streams
from tests.models import (
    UNWEIGHTED,
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    train_reference,
)
from torchrec_lookahead import LookaheadEmbeddingBagCollection, LookaheadTrainPipeline
from torchrec_lookahead._compat import fake_cuda_tensors, fake_store
from torchrec_lookahead.cache.pools import slot_pools
from torchrec_lookahead.cache.slot_cache import SlotCache
from torchrec_lookahead.embedding.hot.sharded import HotRowsContext
from torchrec_lookahead.oracle.contract import CachePlan
from torchrec_lookahead.pipeline.batch_check import BatchCheck
from torchrec_lookahead.pipeline.executor import PlanExecutor
from torchrec_lookahead.pipeline.stage import LookaheadStage
from torchrec_lookahead.settings import PLANNERS
from torchrec_lookahead.steps import ModuleInput, StepContext, StepPlan
from torchrec_lookahead.store.stores import HostStore
from torchrec_lookahead.testing.fake_cuda import FakeCuda
from torchrec_lookahead.testing.host_waits import HostCounter
from torchrec_lookahead.testing.stream_check import TRAINER, StreamChecker
from torchrec_lookahead.testing.streams import use_deferred_side_streams

DATA = batches(16)
CUDA = torch.device("cuda", 0)


@contextmanager
def fake_cuda() -> Iterator[tuple[FakeCuda, StreamChecker]]:
    """Fake CUDA tensors with real values behind them, under the stream checker (leaving
    the block raises what it found)."""
    with FakeCuda(CUDA) as fake, StreamChecker(CUDA, values=fake.real) as checker:
        yield fake, checker


def test_a_state_dict_mid_window_waits_for_rows_still_landing() -> None:
    """Defect 5: a trainer-thread write-back (``state_dict``, checkpoints, eval) read the
    cache slots on its own stream while fetches queued on the side stream had not landed,
    and wrote the slots' old rows into the store."""
    with use_deferred_side_streams():
        model = lookahead_model("adagrad", cache_load_factor=0.05)
        twin = reference_twin(model, "adagrad")
        dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
        with LookaheadTrainPipeline(
            model, dense, torch.device("cpu"), lookahead=4, prefetch_distance=2
        ) as pipeline:
            it = iter(DATA)
            for _ in range(10):
                pipeline.progress(it)
            train_reference(twin, DATA[:10])
            assert_same_training_state(model, twin)  # state_dict: written back mid-window


def test_the_store_moves_rows_on_the_device_its_tensors_are_on() -> None:
    """Defect 1: under DMP on CUDA the store is FBGEMM's UVM TBE (weights and row-wise
    state are CUDA tensors); gathers and scatters used CPU ids and CPU buffers."""
    with FakeCuda(CUDA):
        weights = torch.empty(100, 8, device="cuda")
        state = torch.empty(100, device="cuda")
        store = HostStore([weights], states=[[state]])
        ids = torch.tensor([3, 1, 4])
        got, (got_state,) = store.gather(0, ids)
        assert got.device.type == "cuda" and got_state.device.type == "cuda"
        store.scatter(0, ids, got, [got_state])


def test_the_store_scatters_host_rows_into_a_device_table_without_blocking() -> None:
    """Audit item 13: the scatter into a store on the device (DMP's UVM table) copied the
    ids and the rows with blocking copies from pageable memory."""
    with FakeCuda(CUDA) as fake:
        values = torch.arange(40.0).view(10, 4)
        store = HostStore([values.to(CUDA)], states=[[torch.zeros(10).to(CUDA)]])
        rows = torch.full((2, 4), -1.0).pin_memory()  # host rows, as the cache stages them
        fake.transfers.clear()
        store.scatter(0, torch.tensor([7, 2]), rows, [torch.ones(2).pin_memory()])
        assert fake.blocking_transfers() == []
        assert fake.transfers and all(t.to_device for t in fake.transfers)
        expected = values.clone()
        expected[[7, 2]] = -1.0
        assert torch.equal(fake.real(store.weights[0]), expected)
        assert fake.real(store.states[0][0]).tolist() == [0, 0, 1, 0, 0, 0, 0, 1, 0, 0]


def test_a_vote_on_a_refused_batch_uses_tensors_of_the_collectives_device() -> None:
    """Defect 2: the vote all-reduced a CPU tensor on the stage's process group, which
    under NCCL takes CUDA tensors only (``cuda:fake`` stands in for NCCL). The reading
    vote's group takes gloo where the ranks run gloo or NCCL (a host tensor), else the
    ranks' own kind, with tensors of the device."""
    import torch.distributed as dist

    from torchrec_lookahead.votes import VoteGroup, refusals

    dist.init_process_group("cuda:fake", store=fake_store(), rank=0, world_size=2)
    try:
        group = dist.new_group(ranks=[0, 1])  # as the sharded module's stage group
        with fake_cuda_tensors():
            assert refusals(None, group, torch.device("cuda")).device.type == "cuda"
        with FakeCuda(CUDA):  # the vote reads its tensor back (a shadow's)
            reading = VoteGroup([0, 1], CUDA)
            assert reading.device.type == "cuda" and reading.agree(None) is None
            refused = ValueError("step \x00: bad")
            assert reading.agree(refused) is refused
    finally:
        dist.destroy_process_group()


def test_a_variable_batch_output_of_shape_1_by_n_expands() -> None:
    """Defect 3: FBGEMM's CUDA variable-batch forward returns ``[1, N]`` where the CPU's
    returns ``[N]``; the expansion split it along dim 0."""
    from tests.models import USER_KEYS, session_batches
    from torchrec_lookahead.variable_batch import expand_pooled

    features = session_batches(1, session=4, dedup=True)[0].sparse_features
    module = LookaheadEmbeddingBagCollection(UNWEIGHTED)
    selected = module.select(features)
    dims = [t.embedding_dim for t in UNWEIGHTED for _ in t.feature_names]
    strides = selected.stride_per_key()
    pooled = torch.randn(sum(s * d for s, d in zip(strides, dims)))
    flat = expand_pooled(pooled, selected, dims)
    assert torch.equal(expand_pooled(pooled.unsqueeze(0), selected, dims), flat)
    assert set(USER_KEYS) & set(selected.keys())


def test_an_unsharded_disk_store_on_cuda_is_refused(tmp_path) -> None:
    """Defect 4: the unsharded module pinned (copied into page-locked RAM) the mapped
    tables of a disk store on CUDA; the store is CPU-only for now, as under DMP."""
    with pytest.raises(ValueError, match="disk store .* CPU"):
        LookaheadEmbeddingBagCollection(UNWEIGHTED, device=torch.device("cuda"), store_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_says_it_needs_a_gpu_and_fails_without_one() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh"), sys.executable, "/tmp/unused"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert done.returncode == 1
    assert "no CUDA device here" in done.stderr and "needs a GPU" in done.stderr


# ------------------------------------------------------------ the cache's moves on CUDA


@dataclass
class PooledCache:
    """A cache of one pool of two tables (rows 0-5 and 6-10 of the pool) on fake CUDA, and
    its store, in host memory or on the device (DMP's UVM store)."""

    cache: SlotCache
    store: HostStore
    fake: FakeCuda
    executor: PlanExecutor
    steps: int = 0

    def apply(self, plan: CachePlan) -> None:
        """Apply ``plan`` as the pipeline does: through the executor (the side stream waits
        for the trainer's issue point), the trainer's stream then waiting for the moves."""
        self.executor.submit(self.steps, [partial(self.cache.apply, 0, plan)])
        self.executor.wait(self.steps)
        self.steps += 1

    def store_rows(self) -> list[torch.Tensor]:
        """Each table's weights and its row-wise state, as they are in the store now."""
        tensors = [
            t for table in range(2) for t in (self.store.weights[table], *self.store.states[table])
        ]
        return [self.fake.real(t).clone() if self.store.on_device else t.clone() for t in tensors]

    def bump_cached_rows(self) -> None:
        """Add 1 to every cache slot's weight, on the device (as an update would)."""
        with torch.no_grad():
            for weights in self.cache.tbe.split_embedding_weights():
                weights.add_(1.0)


@contextmanager
def pooled_cache(store_on_device: bool) -> Iterator[PooledCache]:
    with fake_cuda() as (fake, _):
        optimizer = EmbOptimType.EXACT_ROWWISE_ADAGRAD
        pools = slot_pools([6, 5], [4, 4], optimizer)
        assert len(pools) == 1 and pools[0].tables == (0, 1)
        weights = [torch.arange(24.0).view(6, 4), 100 + torch.arange(20.0).view(5, 4)]
        states = [[torch.arange(6.0)], [10 + torch.arange(5.0)]]
        if store_on_device:
            weights = [w.to(CUDA) for w in weights]
            states = [[s.to(CUDA) for s in table] for table in states]
        store = HostStore(weights, pin=True, states=states)
        params = {"learning_rate": 0.1}
        cache = SlotCache(pools, [4], [0, 1], optimizer, store, CUDA, fbgemm_params=params)
        executor = PlanExecutor(CUDA)
        try:
            yield PooledCache(cache, store, fake, executor)
        finally:
            executor.close()


def plan(
    step: int,
    fetch: list[int] = (),
    fetch_slots: list[int] = (),
    evict: list[int] = (),
    evict_slots: list[int] = (),
) -> CachePlan:
    return CachePlan(
        step,
        np.zeros(0, np.int64),
        np.asarray(evict, np.int64),
        np.asarray(evict_slots, np.int64),
        np.asarray(fetch, np.int64),
        np.asarray(fetch_slots, np.int64),
    )


@pytest.mark.parametrize("store_on_device", [False, True], ids=["host_store", "device_store"])
def test_a_pool_of_two_tables_moves_its_rows_through_a_cuda_cache(store_on_device) -> None:
    """Defect N1: a pool of two or more tables gathered its rows into a staging buffer on
    the cache's device with CPU rows and a CPU index (the step-0 fetch and ``refresh``
    raised). Rows of both tables go in, come back bumped, and reload after a store write;
    every device copy ordered on the side stream (defect N2; the checker raises)."""
    with pooled_cache(store_on_device) as pooled:
        before = pooled.store_rows()
        pooled.apply(plan(0, fetch=[1, 7, 10], fetch_slots=[2, 0, 3]))
        pooled.bump_cached_rows()
        pooled.apply(plan(1, evict=[1, 7, 10], evict_slots=[2, 0, 3]))
        after = pooled.store_rows()
        expected = [t.clone() for t in before]
        expected[0][1] += 1  # table 0, row 1
        expected[2][[1, 4]] += 1  # table 1, rows 1 and 4 (pool ids 7 and 10)
        for got, want in zip(after, expected):
            assert torch.equal(got, want)
        assert torch.equal(after[1], before[1]) and torch.equal(after[3], before[3])

        pooled.apply(plan(2, fetch=[0, 6], fetch_slots=[1, 2]))
        with torch.no_grad():  # the store is overwritten (a load), the cache reloaded
            for tensor in (pooled.store.weights[0], pooled.store.weights[1]):
                tensor.mul_(-1.0)
            reloaded = pooled.store_rows()
            pooled.cache.refresh(states=True)
            pooled.bump_cached_rows()
        pooled.cache.write_back_all()
        final = pooled.store_rows()
        reloaded[0][0] += 1  # the reloaded rows, bumped, written back
        reloaded[2][0] += 1
        for got, want in zip(final, reloaded):
            assert torch.equal(got, want)


@pytest.mark.parametrize("store_on_device", [False, True], ids=["host_store", "device_store"])
def test_moves_copy_between_host_and_device_without_blocking(store_on_device) -> None:
    """Audit items 12 and 13: the copies of slot indices to the device (``refresh``, the
    write-back's read) and the store's scatter into a device table were blocking copies
    from pageable memory on the current stream. A write-back into a store on the device
    (TorchRec's UVM tables under DMP) went through host memory and back (issue 40: three
    crossings of the host link); it now goes from the cache straight into the store."""
    with pooled_cache(store_on_device) as pooled:
        fake = pooled.fake
        fake.transfers.clear()
        pooled.apply(plan(0, fetch=[1, 7, 10], fetch_slots=[2, 0, 3]))
        pooled.apply(plan(1, fetch=[4], fetch_slots=[1], evict=[7], evict_slots=[0]))
        pooled.cache.refresh(states=True)
        pooled.cache.write_back_all()
        assert [t for t in fake.transfers if t.blocking] == []
        to_host = [t for t in fake.transfers if not t.to_device]
        if store_on_device:  # only slot indices go to the device; no row comes to the host
            assert fake.transfers and to_host == []
        else:
            assert to_host and len(to_host) < len(fake.transfers)  # both ways were seen


def test_a_write_back_into_host_memory_waits_on_the_host_after_the_fetches(monkeypatch) -> None:
    """A step that evicts into a store in host memory and fetches: the executor's host
    waited for the side stream (for the read rows, and with it for the trainer's issue
    point) before it issued the step's fetches. It now issues them first: every copy
    of the step to the device is queued when its host waits; the rows still land."""
    with pooled_cache(store_on_device=False) as pooled:
        pooled.apply(plan(0, fetch=[1, 7], fetch_slots=[0, 1]))
        pooled.bump_cached_rows()
        before = pooled.store_rows()

        def copies() -> int:
            return sum(t.to_device for t in pooled.fake.transfers)

        queued_at_waits = []
        side = type(streams.side_stream(CUDA))  # the stream checker's
        drain = side.drain

        def probed(stream: streams.SideStream) -> None:
            queued_at_waits.append(copies())
            drain(stream)

        monkeypatch.setattr(side, "drain", probed)
        pooled.apply(plan(1, fetch=[4, 10], fetch_slots=[0, 2], evict=[1], evict_slots=[0]))
        assert queued_at_waits == [copies()]
        after = pooled.store_rows()
        before[0][1] += 1  # table 0, row 1, bumped in the cache, written back
        for got, want in zip(after, before):
            assert torch.equal(got, want)
        monkeypatch.undo()
        pooled.cache.write_back_all()  # slot 0 holds row 4 (table 0), slot 2 row 10
        final = pooled.store_rows()
        assert torch.equal(final[0][4], after[0][4]) and torch.equal(final[2][4], after[2][4])


# ------------------------------------------------------------ streams


def test_cuda_and_cuda0_name_one_side_stream() -> None:
    """Defect N7: side streams were keyed by the device as given, so ``cuda`` and
    ``cuda:0`` had a side stream each, and moves on one were not ordered with the other."""
    with StreamChecker(CUDA):
        assert streams.side_stream(torch.device("cuda")) is streams.side_stream(CUDA)
        assert streams.side_stream("cuda:0") is streams.side_stream(CUDA)
    assert streams.side_stream("cpu") is streams.side_stream(torch.device("cpu"))


@dataclass(frozen=True)
class HotPart:
    """Stands in for the hot part of a batch (``HotInput``), which a sharded module's
    ``HotRowsContext`` records on a stream with TorchRec's context."""

    rows: torch.Tensor

    def record_stream(self, stream: torch.Stream) -> None:
        self.rows.record_stream(stream)


def test_the_hand_over_marks_every_tensor_of_the_step_for_the_trainer() -> None:
    """Defect N4: the hand-over marked the batch and the distributed input as used on the
    trainer's stream, not the step's slots (made on the stage's stream) nor anything else
    of the context; they could be handed out again while the trainer still read them."""
    with fake_cuda() as (_, checker):
        stage = LookaheadStage([], BatchCheck({}, {}), CUDA, threaded=False)
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])
        ).to(CUDA)
        batch = Batch(torch.zeros(2, 4).to(CUDA), features, torch.ones(2).to(CUDA))
        slots = torch.tensor([5, 6, 7]).to(CUDA)
        hot = HotPart(torch.tensor([0, 1]).to(CUDA))
        ctx = HotRowsContext(hot=hot)
        inputs = {"module": ModuleInput([], (ctx, []))}
        context = StepContext(0, batch, inputs, StepPlan(0, [], {"group": slots}))
        stage.hand_over(context)
        trainer = checker.stream_name(0)
        for name, tensor in [
            ("dense", batch.dense_features),
            ("ids", features.values()),
            ("labels", batch.labels),
            ("slots", slots),
            ("hot rows", hot.rows),
        ]:
            assert trainer in checker.recorded_streams(tensor), name


# ------------------------------------------------------------ the whole path


def _reads_back(fake: FakeCuda, thread: str) -> list[object]:
    """The copies from the device to the host made so far on the thread named ``thread``."""
    return [t for t in fake.transfers if not t.to_device and t.thread == thread]


@pytest.mark.parametrize("planner", PLANNERS)
def test_an_unsharded_window_runs_end_to_end_on_fake_cuda(planner: str) -> None:
    """A whole window on CUDA, unsharded, under the stream checker: the stage moves each
    batch to the device and plans it on its planning thread (``planner="host"``: reading
    its ids back there; ``"device"``: on the device, the executor reading each plan back;
    the trainer's thread reads nothing back either way), the executor fetches and evicts through
    pinned staging on the side stream (a pool of two tables among them), the
    steps look the rows up, ``state_dict`` writes the cache back and ``load_state_dict``
    reloads it. No step trains (fake CUDA has no backward here, see the module), so the
    store must come back as it was, except for what is changed on the device on purpose."""
    with fake_cuda() as (fake, checker):
        model = lookahead_model("rowwise_adagrad", cache_load_factor=0.05, device=CUDA)
        model.over.to(CUDA)
        model.eval()
        initial = [module.state_dict() for module in (model.unweighted, model.weighted)]
        initial = [{k: v.clone() for k, v in state.items()} for state in initial]
        dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
        with (
            torch.no_grad(),
            LookaheadTrainPipeline(
                model, dense, CUDA, lookahead=4, prefetch_distance=2, planner=planner
            ) as pipeline,
        ):
            it, trainer = iter(DATA), threading.current_thread().name
            for step in range(12):
                logits = pipeline.progress(it)
                assert logits.device == CUDA and logits.shape == (32,)
                if step == 0:  # FBGEMM's kernels read back twice at the first forward, once
                    before = len(_reads_back(fake, trainer))
            assert len(_reads_back(fake, trainer)) == before
            # the batch's ids, for the host's planner
            assert bool(_reads_back(fake, "lookahead-planner")) == (planner == "host")
            metrics = pipeline.cache_metrics()["total"]
            assert metrics.misses > 0 and metrics.rows_written_back > 0
            for module, state in zip((model.unweighted, model.weighted), initial):
                got = module.state_dict()
                assert all(torch.equal(got[k], v) for k, v in state.items())
            moves = [t for t in fake.transfers if t.thread == "lookahead-executor"]
            assert moves and not [t for t in moves if t.blocking]
            with pytest.raises(StopIteration):  # the last steps, planned at the end of the data
                while True:
                    pipeline.progress(it)

            # The moves are done (a load while moves are in flight races with them: see the
            # report of this change). Rows changed on the device reach the store, and a load
            # reloads them.
            group = model.weighted.cached_groups[0]  # w0 and w1: one pool of two tables
            assert len(group.pools) == 1 and len(group.pools[0].tables) == 2
            resident = [int((ids >= 0).sum()) for ids in group.cache.slot_ids]
            with torch.no_grad():
                for weights in group.cache.tbe.split_embedding_weights():
                    weights.add_(1.0)  # on the device, as an update would
            group.cache.write_back_all()  # the module writes back only after a lookup
            bumped = model.weighted.state_dict()
            changed = sum(int((bumped[k] != v).any(dim=1).sum()) for k, v in initial[1].items())
            assert changed == sum(resident) > 0
            model.weighted.load_state_dict(initial[1])  # reloads the cached rows
            group.cache.write_back_all()
            reloaded = model.weighted.state_dict()
            assert all(torch.equal(reloaded[k], v) for k, v in initial[1].items())
        assert checker.operators > 0


def _train_on_fake_cuda(
    planner: str, data: list[Batch], steps: int | None, cache_load_factor: float = 0.05, **window
) -> tuple[int, int]:
    """``steps`` steps (``None``: to the end of ``data``) of a window on fake CUDA, forward
    only (see the module), inside the caller's ``fake_cuda()`` block: the steps run and
    how often the caches grew."""
    model = lookahead_model("rowwise_adagrad", cache_load_factor=cache_load_factor, device=CUDA)
    model.over.to(CUDA)
    model.eval()
    dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
    with (
        torch.no_grad(),
        LookaheadTrainPipeline(model, dense, CUDA, planner=planner, **window) as pipeline,
    ):
        it, done = iter(data), 0
        try:
            while steps is None or done < steps:
                pipeline.progress(it)
                done += 1
        except StopIteration:
            assert steps is None, "the data ended early"
        return done, pipeline.cache_metrics()["total"].growths


def test_the_executor_reads_a_device_plan_back_without_waiting_for_the_trainer() -> None:
    """``planner="device"``: the executor reads each plan back on a stream of its own that
    waits for the stage's plan alone, so the read adds no wait for the trainer's stream.
    Read on the side stream, which first waits for the trainer to reach the step's issue
    point, the executor's host waited each step for the device to finish the step before
    (on a GPU, the moves of step ``s`` then start after step ``s - d - 1`` has run,
    though the plan was made ``L - d`` steps before). The host may already know that
    much of the trainer's stream from a wait of its own (a write-back into host memory
    waits for the step's updates), and then the read asks no more."""
    with fake_cuda() as (_, checker):
        _train_on_fake_cuda("device", DATA, 8, lookahead=4, prefetch_distance=1)
    known, reads, issues = 0, 0, set()  # the trainer's operators the executor's host waited for
    for wait in checker.waits:
        if wait.thread != "lookahead-executor":
            continue
        if wait.waiter is not None and wait.stream == TRAINER:  # the side stream: an issue point
            issues.add(wait.follows(TRAINER))
        elif wait.waiter is None:
            if "(to_host) <- cache/device_plans.py" in wait.site:  # a plan read back
                assert wait.follows(TRAINER) <= known, f"it waits for the trainer: {wait.site}"
                reads += 1
            known = max(known, wait.follows(TRAINER))
    assert reads >= 2 * 8 and len(issues) >= 8  # two reads a step and pool, steps issued


def test_the_stages_stream_has_the_priority_of_torchrecs_data_dist_stream() -> None:
    """TorchRec's ``TrainPipelineSparseDist`` copies each batch to the device and starts
    its input dist on streams of a higher priority than the model's, so their few kernels
    go before the model's queued ones; the stage does that work on its lane, and its
    planning (a device planner's plans, the steps' slots) on a stream of its own, both
    made at the same priority. The side stream's moves, issued ``d`` steps ahead, keep
    the default priority, as TorchRec's prefetch stream does."""
    with FakeCuda(CUDA) as fake, HostCounter(fake):  # torch.cuda's streams stood in for
        model = torch.nn.Linear(2, 1).to(CUDA)
        plain = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), CUDA)
        stage = LookaheadStage([], BatchCheck({}, {}), CUDA, threaded=False)
        made = {v.priority for v in vars(plain).values() if isinstance(v, torch.Stream)}
        assert len(made) == 1 and min(made) < 0  # its copy and data-dist streams
        assert stage._lane._stream.priority == min(made)
        assert stage._planning._stream.priority == min(made)
        assert streams.side_stream(CUDA)._stream.priority == 0
        # Device plans are read back on one stream per device, never the side stream (CUDA
        # draws each new stream from a small pool per priority, in turn).
        readback = streams.readback_stream(CUDA)
        assert readback is streams.readback_stream("cuda") and readback._stream.priority < 0


@pytest.mark.parametrize("planner", PLANNERS)
def test_planning_runs_on_a_stream_of_its_own_beside_the_input_dist(planner: str) -> None:
    """Inline, the trainer's thread runs each batch's input dist on the stage's lane, and
    TorchRec's input dist waits on the host for its own copies there (split sizes read
    back, a blocking copy of a permutation): it waits for whatever the lane has queued.
    Planning (a host planner's ids read back and slots copied over, a device planner's
    ~200 kernels a batch) runs on a stream of its own that waits for the lane's event
    after the input dist, and the lane never waits for it, so those host waits wait for
    distributing only, as plain TorchRec's wait on its data-dist stream."""
    with fake_cuda() as (_, checker):
        streams_of: dict[str, set[int]] = {}
        operator = checker.operator

        def attributed(func, args, kwargs):  # noqa: ANN001, ANN202
            thread = threading.current_thread().name
            streams_of.setdefault(thread, set()).add(checker.current())
            return operator(func, args, kwargs)

        checker.operator = attributed  # type: ignore[method-assign]
        _train_on_fake_cuda(planner, DATA, 6, lookahead=4)
        (lane,) = checker.streams_named("stage")
    planning = streams_of["lookahead-planner"]
    assert planning and lane not in planning and TRAINER not in planning
    assert lane in streams_of["lookahead-reader"]  # the batches' copies to the device
    lane_waits = [w for w in checker.waits if w.waiter == lane]
    assert not [w for w in lane_waits if w.stream in planning]


def test_no_view_of_a_read_back_buffer_is_copied_to_the_device(monkeypatch) -> None:
    """``streams.to_host`` reads into a page-locked buffer that goes back to the caching
    host allocator when freed, which knows of no use of it but that copy. On a GPU a view
    of it handed to ``streams.to_device`` counts as page-locked and is copied from in
    place, on the side stream, possibly after the buffer went to another read. So what a
    move copies to the device (a device plan's slots and ids) is copied out of it first."""
    buffers: list[torch.Tensor] = []  # kept alive, so that no address is reused meanwhile
    inside: list[str] = []
    to_host, to_device = streams.to_host, streams.to_device

    def reading(tensor: torch.Tensor) -> torch.Tensor:
        buffers.append(to_host(tensor))
        return buffers[-1]

    def copying(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        if tensor.device.type == "cpu" and tensor.numel():
            at = tensor.data_ptr()
            for b in buffers:
                if b.data_ptr() <= at < b.data_ptr() + b.numel() * b.element_size():
                    inside.append(threading.current_thread().name)
        return to_device(tensor, device)

    monkeypatch.setattr(streams, "to_host", reading)
    monkeypatch.setattr(streams, "to_device", copying)
    with fake_cuda():
        _train_on_fake_cuda("device", DATA, 8, lookahead=4)
    assert len(buffers) >= 2 * 8 and inside == []


@pytest.mark.parametrize("planner", PLANNERS)
def test_a_cache_grows_through_the_cuda_path(planner: str) -> None:
    """A window wider than the cache grows it between steps, on the trainer's thread: the
    rows and their optimizer state are copied into the new TBE on the trainer's stream,
    which the next moves wait for, and the old TBE's memory (made by the stage) is
    marked used there. Unreachable under fake CUDA until ``Tensor.copy_`` of a fake
    tensor went through the operator (its binding asks for the CUDA device guard)."""
    widening = batches(1, batch_size=2) + batches(8, batch_size=256, seed=3)
    with fake_cuda():
        steps, growths = _train_on_fake_cuda(
            planner, widening, None, cache_load_factor=0.01, lookahead=3
        )
    assert steps == len(widening) and growths > 0
