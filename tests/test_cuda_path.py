"""The CUDA path, checked on the CPU: one test per defect an audit of the never-run CUDA code
found (see docs/design.md, "Streams and devices"), each failing before its fix.

What a CPU can show (checked with torch 2.13 CPU): fake CUDA tensors
(``FakeTensorMode``) reject device mismatches; the ``cuda:fake`` process-group
backend takes CUDA tensors only, as NCCL does; FBGEMM's CUDA variable-batch
output is ``[1, N]``; a side stream that defers its work until waited for
(``torchrec_lookahead.testing.streams``) turns a missing wait into a wrong value.
"""

from __future__ import annotations

import pytest
import torch

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
from torchrec_lookahead.testing.streams import use_deferred_side_streams

DATA = batches(16)


def test_a_state_dict_mid_window_waits_for_rows_still_landing() -> None:
    """Defect 5: a trainer-thread write-back (``state_dict``, checkpoints, eval) read the
    cache slots on its own stream while fetches queued on the side stream had not landed,
    and wrote the slots' old rows into the store."""
    with use_deferred_side_streams():
        model = lookahead_model("adagrad", cache_load_factor=0.05)
        twin = reference_twin(model, "adagrad")
        dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
        with LookaheadTrainPipeline(model, dense, torch.device("cpu"), lookahead=4,
                                    prefetch_distance=2) as pipeline:  # fmt: skip
            it = iter(DATA)
            for _ in range(10):
                pipeline.progress(it)
            train_reference(twin, DATA[:10])
            assert_same_training_state(model, twin)  # state_dict: written back mid-window


def test_the_store_moves_rows_on_the_device_its_tensors_are_on() -> None:
    """Defect 1: under DMP on CUDA the store is FBGEMM's UVM TBE (weights and row-wise
    state are CUDA tensors); gathers and scatters used CPU ids and CPU buffers."""
    from torchrec_lookahead.store import HostStore

    with fake_cuda_tensors():
        weights = torch.empty(100, 8, device="cuda")
        state = torch.empty(100, device="cuda")
        store = HostStore([weights], states=[[state]])
        ids = torch.tensor([3, 1, 4])
        got, (got_state,) = store.gather(0, ids)
        assert got.device.type == "cuda" and got_state.device.type == "cuda"
        store.scatter(0, ids, got, [got_state])


def test_a_vote_on_a_refused_batch_uses_tensors_of_the_collectives_device() -> None:
    """Defect 2: the vote all-reduced a CPU tensor on the stage's process group, which
    under NCCL takes CUDA tensors only (``cuda:fake`` stands in for NCCL)."""
    import torch.distributed as dist

    from torchrec_lookahead.embedding.sharded import refusals

    dist.init_process_group("cuda:fake", store=fake_store(), rank=0, world_size=2)
    try:
        group = dist.new_group(ranks=[0, 1])  # as the sharded module's stage group
        with fake_cuda_tensors():
            assert refusals(None, group, torch.device("cuda")).device.type == "cuda"
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
        LookaheadEmbeddingBagCollection(UNWEIGHTED, device=torch.device("cuda"),
                                        store_dir=tmp_path)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_says_it_needs_a_gpu_and_fails_without_one() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), sys.executable,
                           "/tmp/unused"], capture_output=True, text=True, cwd=root)  # fmt: skip
    assert done.returncode == 1
    assert "no CUDA device here" in done.stderr and "needs a GPU" in done.stderr
