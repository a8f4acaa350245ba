"""DeviceOracleCacher: the oracle's contract, the numba oracle's choices, and no host sync."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.functional import pad

import torchrec_lookahead.oracle.device as device_oracle
from benchmarks.common import pinned_rows_needed
from tests.contract import replay
from tests.test_oracle import BAD_ORACLE_SETTINGS, tie_breaks, traces
from torchrec_lookahead import CachePlan, DeviceOracleCacher, OracleCacher
from torchrec_lookahead.oracle.cacher import TIE_BREAKS
from torchrec_lookahead.oracle.device import DevicePlan
from torchrec_lookahead.testing.fake_cuda import FakeCuda
from torchrec_lookahead.testing.host_waits import VALUE_READ_OPS, HostCounter, Tally


def assert_same_choices(batches, capacity, lookahead, d, num_rows=None, tie_break="frequency"):
    """Both oracles refuse alike, or plan the same misses and evictions at every step, and
    the device oracle's plans meet the contract."""
    numba = OracleCacher(capacity, lookahead, d, num_rows, tie_break=tie_break)
    device = DeviceOracleCacher(capacity, lookahead, d, num_rows, "cpu", tie_break=tie_break)
    tensors = [torch.as_tensor(b, dtype=torch.int64) for b in batches]
    try:
        want = list(numba.plan(batches))
    except ValueError as refusal:
        with pytest.raises(ValueError) as caught:
            list(device.plan(tensors))
        assert str(caught.value) == str(refusal)
        return
    got = list(device.plan(tensors))
    replay(batches, got, device.flush(), capacity, d)
    assert [p.step for p in got] == [p.step for p in want]
    for a, b in zip(want, got):
        assert sorted(a.fetch_ids.tolist()) == sorted(b.fetch_ids.tolist()), a.step
        assert sorted(a.evict_ids.tolist()) == sorted(b.evict_ids.tolist()), a.step
    assert sorted(numba.flush().evict_ids.tolist()) == sorted(device.flush().evict_ids.tolist())


@settings(max_examples=60)
@given(traces(), tie_breaks)
def test_plans_meet_the_contract_and_match_the_numba_oracle(trace, tie_break) -> None:
    batches, num_rows, capacity, lookahead, d = trace
    assert_same_choices(batches, capacity, lookahead, d, num_rows, tie_break)


def streams() -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(11)
    return {
        "zipf": [np.minimum(rng.zipf(1.3, size=50), 400) - 1 for _ in range(50)],
        "uniform": [rng.integers(0, 250, size=int(rng.integers(0, 41))) for _ in range(50)],
    }


@pytest.mark.parametrize("tie_break", TIE_BREAKS)
@pytest.mark.parametrize("lookahead, d", [(0, 0), (0, 2), (1, 1), (4, 2), (16, 0), (60, 1)])
@pytest.mark.parametrize("stream", ["zipf", "uniform"])
def test_matches_the_numba_oracle_on_larger_traces(stream, lookahead, d, tie_break) -> None:
    batches = streams()[stream]
    floor = pinned_rows_needed(batches, d)
    for capacity in (floor, floor + 40, 2 * floor):  # from exactly the pinned minimum up
        assert_same_choices(batches, capacity, lookahead, d, 400, tie_break)
    with pytest.raises(ValueError, match=f"a capacity of at least {floor} is needed"):
        list(
            DeviceOracleCacher(floor - 1, lookahead, d, 400, "cpu").plan(map(torch.tensor, batches))
        )


@pytest.mark.parametrize("tie_break", TIE_BREAKS)
@pytest.mark.parametrize("limit", ["_ROW_LIMIT", "_STEP_LIMIT", "_USES_LIMIT", "_RANK_LIMIT"])
def test_victims_are_ordered_alike_where_the_sort_keys_do_not_pack(
    limit, tie_break, monkeypatch
) -> None:
    """Past a bound of the packed keys (a table of 2**32 rows, 2**31 steps, 2**40 ids),
    the victim order is one stable sort per key, and the same."""
    monkeypatch.setattr(device_oracle, limit, 0)
    batches = streams()["zipf"]
    floor = pinned_rows_needed(batches, 1)
    for capacity in (floor, 2 * floor):
        assert_same_choices(batches, capacity, 4, 1, 400, tie_break)


def test_the_table_grows_to_the_ids_when_num_rows_is_unknown() -> None:
    batches = [np.array([1, 2]), np.array([10_000, 2]), np.array([123_456, 1, 3]), np.array([0])]
    assert_same_choices(batches, 4, 1, 1)


def test_flush_keeps_rows_resident_and_the_stream_goes_on_after_finish() -> None:
    batches = [np.array([i % 7, (3 * i) % 11]) for i in range(30)]
    oracle = DeviceOracleCacher(6, 3, 1, 11, "cpu")
    numba = OracleCacher(6, 3, 1, 11)
    plans = list(oracle.plan(map(torch.tensor, batches[:15])))
    want = list(numba.plan(batches[:15]))
    mid = oracle.flush()
    assert len(mid.evict_ids) == oracle.num_resident == numba.num_resident
    assert mid.step == 15 and oracle.finish() == []
    plans += list(oracle.plan(map(torch.tensor, batches[15:])))
    want += list(numba.plan(batches[15:]))
    replay(batches, plans, oracle.flush(), 6, 1)
    assert [p.num_misses for p in plans] == [p.num_misses for p in want]


@pytest.mark.parametrize("lookahead", [8, 12])
@pytest.mark.parametrize("tie_break", TIE_BREAKS)
def test_a_stream_ended_early_goes_on_with_a_wider_window(lookahead, tie_break) -> None:
    """Three batches, ``finish``, nine more, ``finish``: the window's rings grow after rows
    became resident. The numba oracle once looped forever here (a new step's bucket began
    with the list of the step a ring's length before it); both oracles fetch alike."""
    before = [[3, 10, 15, 6, 10], [7, 2, 9, 5, 15, 6, 12, 6, 1, 2, 13], [9, 4, 10, 6, 11, 12]]
    after = [
        [13, 12, 3, 8, 5, 2, 7, 6],
        [6, 5],
        [0],
        [0, 9, 8, 13, 15, 13, 7, 2, 12, 12, 3, 7],
        [10, 13, 8, 3, 1, 15, 11, 6, 14, 15, 1, 5, 2, 9, 15, 2, 11, 11],
        [11, 3],
        [11, 10, 8, 13, 13, 15, 7, 15, 5],
        [2, 0, 1, 4, 13, 15, 12],
        [2, 1],
    ]
    plans: dict[str, list[CachePlan]] = {}
    for name, oracle in [
        ("numba", OracleCacher(15, lookahead, 1, 16, tie_break=tie_break)),
        ("device", DeviceOracleCacher(15, lookahead, 1, 16, "cpu", tie_break=tie_break)),
    ]:
        plans[name] = list(oracle.plan(np.array(b) for b in before))
        plans[name] += list(oracle.plan(np.array(b) for b in after))
    assert len(plans["numba"]) == len(before) + len(after)
    for a, b in zip(plans["numba"], plans["device"], strict=True):
        assert sorted(a.fetch_ids.tolist()) == sorted(b.fetch_ids.tolist()), a.step


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.tensor([1, -3, 2]), "step 1: negative id -3"),
        (torch.tensor([1, 7]), "step 1: id 7 is out of range for a table of 5 rows"),
        (torch.tensor([[1, 2]]), "1-D array"),
        (torch.tensor([0.5, 1.0]), "integers"),
        (np.array([0, 1, 2, 3, 4]), "a capacity of at least 5 is needed"),
    ],
)
def test_bad_batch_is_refused_and_changes_nothing(bad, message) -> None:
    good = [torch.tensor(b) for b in ([0, 1], [2, 3], [1, 4], [0, 3])]
    oracle = DeviceOracleCacher(capacity=4, lookahead=2, prefetch_distance=0, num_rows=5)
    plans = [p for p in [oracle.push(good[0])] if p is not None]
    with pytest.raises(ValueError, match=message):
        oracle.push(bad)
    for batch in good[1:]:
        plans += [p for p in [oracle.push(batch)] if p is not None]
    plans += oracle.finish()
    replay([b.numpy() for b in good], plans, oracle.flush(), 4, 0)
    clean = DeviceOracleCacher(capacity=4, lookahead=2, prefetch_distance=0, num_rows=5)
    for got, want in zip(plans, clean.plan(good)):
        assert np.array_equal(got.slots, want.slots)
        assert np.array_equal(got.fetch_ids, want.fetch_ids)
        assert np.array_equal(got.evict_ids, want.evict_ids)


def test_prepare_checks_without_changing_anything_and_absent_matches() -> None:
    batches = [np.array([1, 2]), np.array([3, 3, 4]), np.array([2, 5])]
    oracle = DeviceOracleCacher(capacity=4, lookahead=1, prefetch_distance=1, num_rows=10)
    numba = OracleCacher(capacity=4, lookahead=1, prefetch_distance=1, num_rows=10)
    plans = [p for p in [oracle.push(batches[0])] if p]
    numba.push(batches[0])
    prepared = oracle.prepare(batches[1])
    assert sorted(prepared.unique.tolist()) == [3, 4]
    assert sorted(oracle.absent(prepared).tolist()) == sorted(
        numba.absent(numba.prepare(batches[1])).tolist()
    )
    with pytest.raises(ValueError, match="a capacity of at least 5"):
        oracle.prepare(np.array([5, 6, 7]))
    oracle.prepare(np.array([9]))  # checked, never pushed: no trace
    plans += [p for p in [oracle.push(prepared)] if p]
    with pytest.raises(ValueError, match="prepared for step 1 cannot enter at step 2"):
        oracle.push(prepared)
    plans += [p for p in [oracle.push(batches[2])] if p] + oracle.finish()
    clean = list(DeviceOracleCacher(4, 1, 1, 10).plan(batches))
    assert [p.fetch_ids.tolist() for p in plans] == [p.fetch_ids.tolist() for p in clean]
    assert [p.slots.tolist() for p in plans] == [p.slots.tolist() for p in clean]


@pytest.mark.parametrize("name, value", BAD_ORACLE_SETTINGS)
def test_bad_settings_are_refused_naming_them(name: str, value: object) -> None:
    settings_: dict[str, object] = {
        "capacity": 4,
        "lookahead": 2,
        "prefetch_distance": 1,
        "num_rows": 10,
        name: value,
    }
    with pytest.raises(ValueError, match=name):
        DeviceOracleCacher(**settings_)


# ------------------------------------------------------------------ the sync-free path


def plan_device(oracle: DeviceOracleCacher, batches: list[torch.Tensor]) -> list[DevicePlan]:
    return [p for b in batches for p in [oracle.push_device(b)] if p] + oracle.finish_device()


def zipf_batches(size: int, steps: int, device: str = "cpu") -> list[torch.Tensor]:
    rng = np.random.default_rng(size)
    ids = [np.minimum(rng.zipf(1.2, size=size), 5000) - 1 for _ in range(steps)]
    return [torch.from_numpy(b).to(device) for b in ids]


@pytest.mark.parametrize("tie_break", TIE_BREAKS)
def test_the_sync_free_path_plans_as_the_contract_path(tie_break) -> None:
    batches = zipf_batches(64, 40)
    args = (300, 4, 1, 5000, "cpu")
    device = plan_device(DeviceOracleCacher(*args, tie_break=tie_break), batches)
    contract = list(DeviceOracleCacher(*args, tie_break=tie_break).plan(batches))
    for plan, want in zip(device, contract, strict=True):
        got = plan.to_cache_plan()
        for field in ("slots", "evict_ids", "evict_slots", "fetch_ids", "fetch_slots"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
        assert plan.fetch_ids.shape == plan.evict_slots.shape == (64,)  # padded, static
        assert not plan.overflow and not plan.bad_ids


def step_tally(size: int, lookahead: int, d: int) -> Tally:
    """What one ``push_device`` once the window is full costs the host on (fake) CUDA."""
    with FakeCuda() as fake, HostCounter(fake) as counter:
        oracle = DeviceOracleCacher(4 * size, lookahead, d, 5000, "cuda:0")
        batches = zipf_batches(size, lookahead + 4, "cuda:0")
        for batch in batches[:-1]:
            oracle.push_device(batch)
        before = counter.tally().copy()
        oracle.push_device(batches[-1])
        return counter.tally().minus(before)


def test_a_step_waits_for_nothing_and_issues_a_fixed_number_of_device_ops() -> None:
    small = step_tally(8, 1, 1)
    assert small.host_waits == 0 and small.device_ops > 0
    for size, lookahead, d in [(512, 1, 1), (8, 32, 1), (512, 32, 2), (64, 0, 1)]:
        tally = step_tally(size, lookahead, d)
        assert (tally.host_waits, tally.device_ops) == (0, small.device_ops), (size, lookahead)


def test_on_fake_cuda_a_stream_is_planned_alike_with_no_host_wait() -> None:
    """On the project's fake CUDA (real values behind fake device tensors): device checks
    as on a GPU, and every host wait counted, from the first batch to ``finish_device``."""
    on_cpu = plan_device(DeviceOracleCacher(300, 4, 1, 5000, "cpu"), zipf_batches(64, 12))
    want = [p.to_cache_plan() for p in on_cpu]
    with FakeCuda() as fake, HostCounter(fake) as counter:
        oracle = DeviceOracleCacher(300, 4, 1, 5000, "cuda:0")
        batches = zipf_batches(64, 12, "cuda:0")
        before = counter.tally().copy()
        plans = plan_device(oracle, batches)
        assert counter.tally().minus(before).host_waits == 0
        got = [p.to_cache_plan() for p in plans]
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(a.slots, b.slots) and np.array_equal(a.fetch_ids, b.fetch_ids)


def test_an_oracle_on_cuda_takes_batches_made_on_cuda() -> None:
    """``device="cuda"`` names the current device: batches made with ``.to("cuda")`` (on
    ``cuda:0``) enter, and the oracle says where it plans as they say where they are."""
    with FakeCuda():
        oracle = DeviceOracleCacher(8, 1, 1, 100, "cuda")
        assert oracle.device == torch.device("cuda:0")
        for batch in ([1, 2], [2, 3], [4, 5]):
            oracle.push_device(torch.tensor(batch).to("cuda"))
        assert len(oracle.finish_device()) == 1


def test_the_sync_free_path_flags_bad_ids_and_a_broken_capacity() -> None:
    oracle = DeviceOracleCacher(capacity=3, lookahead=1, prefetch_distance=0, num_rows=10)
    oracle.push_device(torch.tensor([1, 2]))
    plan = oracle.push_device(torch.tensor([3, 12, -2]))
    # plan(0): flagged already, as the bad batch entered the window
    assert plan is not None and plan.step == 0 and plan.bad_ids and not plan.overflow
    (plan,) = oracle.finish_device()
    assert plan.slots.tolist() == [2, -1, -1]  # bad ids have no slot
    oracle.push_device(torch.tensor([4, 5, 6, 7]))
    (plan,) = oracle.finish_device()
    assert plan.overflow
    with pytest.raises(ValueError, match="1-D int64 tensor"):
        oracle.push_device(torch.tensor([1, 2], dtype=torch.int32))


def test_a_batch_prepared_sized_enters_the_contract_path_only_once_grown() -> None:
    """``push`` of what ``prepare_sized`` made, with the cache not grown for it: the numba
    oracle refuses it; the device oracle let it in, and its plan evicted a row a step of
    the window still used (its sticky flag set, and not read on the contract path)."""
    oracle = DeviceOracleCacher(capacity=4, lookahead=1, prefetch_distance=1, num_rows=10)
    oracle.push(torch.tensor([0, 1]))
    oracle.push(torch.tensor([2, 3]))
    prepared, needed = oracle.prepare_sized(torch.tensor([4, 5, 6]))
    assert needed == 5
    with pytest.raises(ValueError, match="a capacity of at least 5 is needed"):
        oracle.push(prepared)
    oracle.grow(5)
    plans = [oracle.push(prepared), *oracle.finish()]
    want = OracleCacher(5, 1, 1, 10)
    want.push(np.array([0, 1]))
    wanted = [want.push(np.array([2, 3])), want.push(np.array([4, 5, 6])), *want.finish()]
    assert [sorted(p.evict_ids.tolist()) for p in plans] == [
        sorted(p.evict_ids.tolist()) for p in wanted[1:]
    ]


def test_a_void_plan_is_refused_on_the_contract_path() -> None:
    """A plan whose sticky flags a sync-free batch set cannot be read as a plan."""
    oracle = DeviceOracleCacher(capacity=3, lookahead=0, prefetch_distance=0, num_rows=10)
    assert oracle.push_device(torch.tensor([1, 2])).to_cache_plan().step == 0
    with pytest.raises(ValueError, match="plan of step 1 is void: .* outside the table"):
        oracle.push_device(torch.tensor([3, 12])).to_cache_plan()
    oracle = DeviceOracleCacher(capacity=3, lookahead=0, prefetch_distance=0, num_rows=10)
    with pytest.raises(ValueError, match="plan of step 0 is void: .* broke the capacity rule"):
        oracle.push_device(torch.tensor([4, 5, 6, 7])).to_cache_plan()


# The kernels that read a value back to the host (make_fx records ``.item()`` as the first).
_HOST_READS = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "unique_consecutive"}


@pytest.mark.parametrize("tie_break", TIE_BREAKS)
def test_a_full_windows_step_is_one_graph_that_a_cuda_graph_could_replay(tie_break) -> None:
    """Once the window is full, the steps of batches padded to the ring's width (``-1``)
    trace (``make_fx``) to one graph: the same kernels with the same arguments, over the
    same memory, none reading a value back. A CUDA graph captured from one step replays
    the next; a step number or ring row baked into an argument would tell them apart. The
    padded batches plan as the unpadded ones do."""
    rng = np.random.default_rng(3)
    lengths = [int(n) for n in rng.integers(20, 33, size=12)]
    batches = [torch.from_numpy(np.minimum(rng.zipf(1.2, n), 1000) - 1) for n in lengths]
    padded = [pad(batch, (0, 32 - len(batch)), value=-1) for batch in batches]
    want = plan_device(DeviceOracleCacher(64, 4, 1, 1000, "cpu", tie_break=tie_break), batches)

    oracle = DeviceOracleCacher(64, 4, 1, 1000, "cpu", tie_break=tie_break)
    plans = [oracle.push_device(batch) for batch in padded[:6]]

    def step(ids: torch.Tensor) -> list[torch.Tensor]:  # the plan's tensors (not its label)
        plans.append(plan := oracle.push_device(ids))
        assert plan is not None
        return [getattr(plan, f.name) for f in fields(plan) if f.name != "step"]

    graphs = [make_fx(step)(batch) for batch in padded[6:9]]
    plans += [oracle.push_device(batch) for batch in padded[9:]]
    plans += oracle.finish_device()

    first = graphs[0]
    assert len(dict(first.named_buffers())) > 5  # the oracle's state, held as buffers
    for graph in graphs[1:]:
        assert graph.code == first.code
        for name, tensor in graph.named_buffers():  # the oracle's state, read and written
            assert tensor.data_ptr() == first.get_buffer(name).data_ptr(), name
    calls = [node.target for node in first.graph.nodes if node.op == "call_function"]
    ops = {call.__name__.split(".")[0] for call in calls}
    assert "index_copy_" in ops and not ops & _HOST_READS
    assert not set(calls) & VALUE_READ_OPS  # kernels that read a value argument back
    for a, b, n in zip(want, [p for p in plans if p is not None], lengths, strict=True):
        got, expected = b.to_cache_plan(), a.to_cache_plan()
        assert np.array_equal(got.slots[:n], expected.slots) and (got.slots[n:] == -1).all()
        for field in ("evict_ids", "evict_slots", "fetch_ids", "fetch_slots"):
            assert np.array_equal(getattr(got, field), getattr(expected, field)), field


def test_the_contract_path_waits_only_for_its_checks_and_the_plan() -> None:
    """Per ``push``: the id range and the pinned-row count are read back together, then the
    plan's counts, its moves in one piece and its slots (what ``docs/design.md`` says the
    contract path syncs)."""
    with FakeCuda() as fake, HostCounter(fake) as counter:
        oracle = DeviceOracleCacher(256, 2, 1, 5000, "cuda:0")
        batches = zipf_batches(64, 6, "cuda:0")
        for batch in batches[:-1]:
            oracle.push(batch)
        before = counter.tally().copy()
        oracle.push(batches[-1])
        waits = counter.tally().minus(before).waits
    assert waits == {"tolist": 2, "D2H copy": 2}


@pytest.mark.parametrize("lookahead, d", [(1, 1), (8, 2), (16, 0)])
def test_growing_as_a_cache_group_does_plans_as_the_numba_oracle_grown_alike(lookahead, d) -> None:
    """``prepare_sized`` then ``grow`` to what the window needs (1.5x), then ``push`` (the
    sync-free ``push_device``): the same slots needed, and the same misses and evictions."""
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 300, size=int(rng.integers(5, 12 + 4 * s))) for s in range(40)]
    numba, device = (
        OracleCacher(4, lookahead, d, 300),
        DeviceOracleCacher(4, lookahead, d, 300, "cpu"),
    )
    plans: list[tuple[object, object]] = []
    for batch in batches:
        want, needed = numba.prepare_sized(batch)
        got, device_needed = device.prepare_sized(torch.as_tensor(batch))
        assert device_needed == needed
        if needed > numba.capacity:
            numba.grow(needed * 3 // 2)
            device.grow(needed * 3 // 2)
        pair = (numba.push(want), device.push_device(got))
        if pair[0] is not None:
            plans.append(pair)
    plans += zip(numba.finish(), device.finish_device())
    assert device.capacity > 4 and len(plans) == len(batches)
    for want, got in plans:
        trimmed = got.to_cache_plan()
        assert sorted(want.fetch_ids.tolist()) == sorted(trimmed.fetch_ids.tolist()), want.step
        assert sorted(want.evict_ids.tolist()) == sorted(trimmed.evict_ids.tolist()), want.step
        assert not bool(got.overflow) and not bool(got.bad_ids)
