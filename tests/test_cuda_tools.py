"""The tools that check the CUDA path on the CPU catch what they are for (and nothing else).

``StreamChecker`` (``torchrec_lookahead.testing.stream_check``) must fail on a read or
write across streams with no event wait, and on a free while another stream may still
use the memory, and pass the same code once ordered; ``FakeCuda``
(``torchrec_lookahead.testing.fake_cuda``) must keep host tensors real, device tensors
fake with real values behind them, and refuse device mismatches as a GPU does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import torchrec_lookahead.streams as streams
from torchrec_lookahead._compat import is_fake, modes_entered
from torchrec_lookahead.testing.fake_cuda import FakeCuda
from torchrec_lookahead.testing.host_waits import HostCounter
from torchrec_lookahead.testing.stream_check import StreamChecker, StreamError
from torchrec_lookahead.testing.threads import in_new_threads

CUDA = torch.device("cuda", 0)


def test_a_read_on_another_stream_needs_an_event_wait() -> None:
    with pytest.raises(
        StreamError,
        match="read on the side stream by aten.sum.* written on "
        "the trainer's stream .* no event wait",
    ):
        with StreamChecker("cpu"):
            made = torch.zeros(4) + 1  # on the trainer's stream
            streams.side_stream("cpu").run(lambda: made.sum())
    with StreamChecker("cpu") as checker:
        made = torch.zeros(4) + 1
        side = streams.side_stream("cpu")
        side.wait_for(streams.mark("cpu"))
        side.run(lambda: made.sum())
    assert checker.errors == [] and checker.operators >= 2


def test_a_write_while_another_stream_may_still_read_is_reported() -> None:
    with pytest.raises(
        StreamError,
        match="written on the trainer's stream .* while the side stream may still read it",
    ):
        with StreamChecker("cpu"):
            side = streams.side_stream("cpu")
            made = torch.zeros(4) + 1
            side.wait_for(streams.mark("cpu"))
            side.run(lambda: made.sum())
            made.add_(1)  # the trainer's stream never waited for the side stream's read


def test_memory_used_on_another_stream_is_recorded_there_before_it_is_freed() -> None:
    def used_elsewhere(record: bool) -> None:
        side, held = streams.side_stream("cpu"), []
        side.run(lambda: held.append(torch.ones(4) * 2))  # made on the side stream
        side.current_waits(side.record())
        held[0].sum()  # used on the trainer's stream
        if record:
            streams.record_use(held, "cpu")
        held.clear()  # freed: its memory goes back to the side stream

    with pytest.raises(StreamError, match="freed while the trainer's stream .* may still use it"):
        with StreamChecker("cpu"):
            used_elsewhere(record=False)
    with StreamChecker("cpu") as checker:
        used_elsewhere(record=True)
    assert checker.errors == []


def test_a_thread_knows_what_its_starter_synchronised_with_before_starting_it() -> None:
    """A free in another thread (a garbage collection, say) is safe once the host waited for
    every use, if that thread was started after the wait; one started before knows nothing."""

    def made_and_used() -> list[torch.Tensor]:
        side, held = streams.side_stream("cpu"), []
        side.run(lambda: held.append(torch.ones(4) * 2))  # made on the side stream
        side.current_waits(side.record())
        held[0].sum()  # used on the trainer's stream
        return held

    def free_in(thread: threading.Thread) -> None:
        thread.start()
        thread.join()

    with StreamChecker("cpu") as checker:
        held = made_and_used()
        streams.side_stream("cpu").drain()
        streams.mark("cpu").synchronize()  # the host waited for both streams
        free_in(threading.Thread(target=held.clear))
    assert checker.errors == []
    with pytest.raises(StreamError, match="freed while the trainer's stream .* may still use it"):
        with StreamChecker("cpu"):
            go, held = threading.Event(), made_and_used()
            early = threading.Thread(target=lambda: (go.wait(), held.clear()))
            early.start()  # before the wait: it knows nothing of it
            streams.side_stream("cpu").drain()
            streams.mark("cpu").synchronize()
            go.set()
            early.join()


def test_threads_started_in_a_block_are_set_up_before_their_run_and_torn_down_after() -> None:
    """``in_new_threads``: each setup runs in the new thread before its run, in the order
    the blocks were entered, and its teardown there after the run, in reverse."""
    events: list[tuple[str, int]] = []

    def setup(name: str) -> Callable[[], Callable[[], None]]:
        def enter() -> Callable[[], None]:
            events.append((f"{name} set up", threading.get_ident()))
            return lambda: events.append((f"{name} torn down", threading.get_ident()))

        return enter

    with in_new_threads(setup("outer")), in_new_threads(setup("inner")):
        thread = threading.Thread(target=lambda: events.append(("run", threading.get_ident())))
        thread.start()
        thread.join()
    order = ["outer set up", "inner set up", "run", "inner torn down", "outer torn down"]
    assert [name for name, _ in events] == order
    assert {ident for _, ident in events} == {thread.ident}


def test_a_thread_started_in_the_doubles_leaves_their_modes_when_its_run_ends() -> None:
    """The doubles enter their modes (thread-local) in each thread started in their block,
    and exited them only on the thread that left the block: a pipeline's threads ended
    holding them, and torch released them as each thread went, taking the GIL, which at
    interpreter exit could abort the process ("terminate called without an active
    exception"). A block entered before theirs sees, after a thread's run, no mode left."""
    stacks: dict[str, tuple[int, int]] = {}

    def probe() -> Callable[[], None]:
        return lambda: stacks.update(after=modes_entered())

    with in_new_threads(probe), FakeCuda(CUDA) as fake:
        with StreamChecker(CUDA, values=fake.real), HostCounter(fake):
            thread = threading.Thread(target=lambda: stacks.update(during=modes_entered()))
            thread.start()
            thread.join()
    assert stacks["during"][0] >= 4 and stacks["during"][1] >= 2  # the doubles' modes
    assert stacks["after"] == (0, 0)


def test_rows_are_followed_one_by_one_for_index_operators() -> None:
    with StreamChecker("cpu") as checker:
        table = torch.zeros(8, 2) + 0  # on the trainer's stream
        side = streams.side_stream("cpu")
        side.wait_for(streams.mark("cpu"))
        side.run(lambda: table.index_copy_(0, torch.tensor([1, 2]), torch.ones(2, 2)))
        table.index_select(0, torch.tensor([5, 6]))  # other rows: nothing to wait for
        assert checker.errors == []
        table.index_select(0, torch.tensor([2]))  # a row the side stream wrote
        assert len(checker.errors) == 1 and "(row at 4)" in checker.errors[0]
        checker.errors.clear()


def test_an_access_to_the_whole_is_checked_against_every_row_another_stream_used() -> None:
    """A read of the whole table races with the row the side stream wrote, a write of it
    with the rows the side stream read too; once the trainer waits for the side stream,
    neither races, and a later row write there races again."""
    with StreamChecker("cpu") as checker:
        table = torch.zeros(8, 2) + 0
        side = streams.side_stream("cpu")
        side.wait_for(streams.mark("cpu"))
        side.run(lambda: table.index_select(0, torch.tensor([3])))
        side.run(lambda: table.index_copy_(0, torch.tensor([1]), torch.ones(1, 2)))
        table.sum()
        assert len(checker.errors) == 1 and "(row at 2) is read" in checker.errors[0]
        table.zero_()
        written = checker.errors[1:]
        assert len(written) == 2 and "(row at 6) is written" in written[0]  # read there
        assert "(row at 2) is written" in written[1]  # written there
        checker.errors.clear()
        side.current_waits(side.record())
        table.sum()
        side.wait_for(streams.mark("cpu"))
        side.run(lambda: table.index_select(0, torch.tensor([4])))
        side.current_waits(side.record())
        table.zero_()
        assert checker.errors == []
        side.wait_for(streams.mark("cpu"))
        side.run(lambda: table.index_copy_(0, torch.tensor([5]), torch.ones(1, 2)))
        table.sum()
        assert len(checker.errors) == 1 and "(row at 10) is read" in checker.errors[0]
        checker.errors.clear()


def test_host_memory_is_left_to_the_host() -> None:
    with StreamChecker("cpu") as checker:
        host = streams.host_side(torch.zeros(4) + 1)
        streams.side_stream("cpu").run(lambda: host.add_(1))
        host.sum()
    assert checker.errors == [] and checker.operators > 0


def test_fake_cuda_keeps_the_host_real_and_the_device_fake_with_real_values() -> None:
    with FakeCuda(CUDA) as fake:
        host = torch.arange(6.0)
        device = host.to("cuda")
        assert is_fake(device) and device.device == CUDA and not is_fake(host)
        assert torch.equal(device.cpu(), host) and not is_fake(device.cpu())
        assert device[2:4].tolist() == [2.0, 3.0] and device.sum().item() == 15.0
        assert torch.equal(fake.real(torch.nonzero(device > 3)), torch.tensor([[4], [5]]))
        # torch 2.13's words, then 2.11's
        with pytest.raises(RuntimeError, match="expected to be in the same device|Mismatching"):
            device.index_copy_(0, torch.tensor([0]), torch.ones(1))
        pinned = torch.ones(2).pin_memory()
        assert pinned.is_pinned() and not torch.ones(2).is_pinned()
        fake.transfers.clear()
        torch.ones(2).to("cuda", non_blocking=True)
        pinned.to("cuda", non_blocking=True)
        assert [t.blocking for t in fake.transfers] == [True, False]
        with pytest.raises(RuntimeError, match="torch.no_grad"):
            torch.ones(2, requires_grad=True).to("cuda")


def test_fake_cuda_draws_random_fills_and_makes_unified_memory_on_the_shadow() -> None:
    with FakeCuda(CUDA) as fake:
        filled = torch.empty(64, device="cuda").uniform_(2.0, 3.0)
        values = fake.real(filled)
        assert is_fake(filled) and bool(((values >= 2.0) & (values < 3.0)).all())
        like = torch.zeros(1, device="cuda")
        unified = torch.ops.fbgemm.new_unified_tensor(like, [5, 2], False)
        assert is_fake(unified) and unified.shape == (5, 2) and unified.device == CUDA


@pytest.mark.parametrize("optimizer", ["exact_adagrad", "exact_row_wise_adagrad"])
def test_fbgemm_kernels_are_followed_row_by_row_with_their_optimizer_state(optimizer) -> None:
    """The TBE backward updates the rows it looks up and their optimizer state, and
    nothing else: whatever FBGEMM release packs its arguments how (1.9 passes the weights
    as one list), a side-stream write of another row needs no wait, of the same row does."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    kind = {"exact_adagrad": EmbOptimType.EXACT_ADAGRAD}.get(
        optimizer, EmbOptimType.EXACT_ROWWISE_ADAGRAD
    )
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(8, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=kind, learning_rate=0.1
    )
    weights = tbe.split_embedding_weights()[0].data
    state = tbe.split_optimizer_states()[0][0].data

    def step(row: int, moved: int) -> list[str]:
        with StreamChecker("cpu") as checker:
            side = streams.side_stream("cpu")
            side.wait_for(streams.mark("cpu"))
            where = torch.tensor([moved])
            side.run(lambda: weights.index_copy_(0, where, torch.ones(1, 4)))
            side.run(lambda: state.index_copy_(0, where, torch.ones(1, *state.shape[1:])))
            out = tbe(torch.tensor([row]), torch.tensor([0, 1]))
            out.sum().backward()
            found = list(checker.errors)
            checker.errors.clear()
        return found

    assert step(row=2, moved=5) == []
    found = step(row=5, moved=5)
    assert found and all("split_embedding" in message for message in found)
    assert any("row at" in message for message in found)
