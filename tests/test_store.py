"""The in-memory store joins the tables of one FBGEMM TBE, which lie back to back."""

from __future__ import annotations

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from torchrec_lookahead.store.stores import HostStore


def tbe_store(rows: list[int], dims: list[int]) -> HostStore:
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(rows, dims)],
        optimizer=EmbOptimType.EXACT_ADAGRAD,
        device="cpu",
    )
    return HostStore(tbe.split_embedding_weights(), states=tbe.split_optimizer_states())


def test_tables_of_one_tbe_are_joined_and_moves_through_the_join_reach_each_table() -> None:
    store = tbe_store([5, 7, 3], [4, 4, 4])
    joined = store.joined([0, 1, 2])
    assert joined is not None and joined.weights[0].shape == (15, 4)
    assert len(joined.states[0]) == 1 and joined.states[0][0].shape == (15, 4)
    rows = torch.tensor([1, 6, 13])  # table 0 row 1, table 1 row 1, table 2 row 1
    joined.scatter(0, rows, torch.full((3, 4), 2.0), [torch.full((3, 4), 3.0)])
    for table in range(3):
        assert torch.equal(store.weights[table][1], torch.full((4,), 2.0))
        assert torch.equal(store.states[table][0][1], torch.full((4,), 3.0))
    weights, states = joined.gather(0, rows)
    assert torch.equal(weights, torch.full((3, 4), 2.0)) and torch.equal(
        states[0][2], 3.0 * torch.ones(4)
    )


def test_tables_not_back_to_back_are_not_joined() -> None:
    store = tbe_store([5, 7, 3], [4, 4, 4])
    assert store.joined([0, 2]) is None  # table 1 lies between them
    assert store.joined([1, 0]) is None  # not in memory order
    base = torch.zeros(13, 4)
    gap = HostStore([base[:5], base[6:]])  # one row between them
    assert gap.joined([0, 1]) is None
    mixed = tbe_store([5, 7], [4, 8])
    assert mixed.joined([0, 1]) is None  # rows of different widths


def test_a_join_is_found_once_and_again_after_the_state_is_reallocated() -> None:
    """Every move asks for its pool's join; it is found once, and found again when
    ``allocate_states`` replaces the optimizer state it would otherwise still view."""
    weights = torch.zeros(12, 4)
    store = HostStore([weights[:5], weights[5:]])
    joined = store.joined([0, 1])
    assert joined is not None and store.joined([0, 1]) is joined
    assert joined.states == [[]]
    store.allocate_states([[torch.Size([4])], [torch.Size([4])]])
    rejoined = store.joined([0, 1])
    assert rejoined is not joined
    if rejoined is not None:  # the new state tensors happened to lie back to back
        assert rejoined.states[0][0].data_ptr() == store.states[0][0].data_ptr()
