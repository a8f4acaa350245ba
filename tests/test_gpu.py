"""The CUDA path on a GPU (``make gpu-check``; not collected by ``make test``).

Marked ``cuda``: they need a GPU (run on a lent H200, see ``docs/results.md``). They
compare against all-resident training bitwise, with deterministic algorithms on
(``testing.determinism``): FBGEMM's CUDA backward sums long segments in a
nondeterministic order otherwise. Deduplicated batches are the exception: FBGEMM's
CUDA variable-batch backward (1.6) is not deterministic even so. Three all-resident
runs of the same 40 batches differed from each other at 3-5 steps (SGD) and 39 steps
(row-wise Adagrad), by at most 1.2e-7, so those runs are compared within float32
rounding.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models import (
    DENSE_LR,
    LR,
    OPTIMIZERS,
    TwoModuleModel,
    assert_same_training_state,
    batches,
    lookahead_model,
    session_batches,
)
from torchrec_lookahead import LookaheadTrainPipeline
from torchrec_lookahead.settings import PLANNERS
from torchrec_lookahead.testing.resident import FullyResidentEmbeddingBagCollection

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda", 0)
ROOT = Path(__file__).resolve().parents[1]


def on_cuda(batch):
    return batch.to(CUDA)


def cuda_model_and_twin(optimizer: str):
    """The lookahead model with its cache on the GPU, and its all-resident twin there."""
    cpu = lookahead_model(optimizer, cache_load_factor=0.05)
    fused = {"optimizer": OPTIMIZERS[optimizer][1], "learning_rate": LR}
    twin = TwoModuleModel(
        FullyResidentEmbeddingBagCollection(cpu.unweighted, fused, CUDA),
        FullyResidentEmbeddingBagCollection(cpu.weighted, fused, CUDA),
    ).to(CUDA)
    twin.over.load_state_dict(copy.deepcopy(cpu.over.state_dict()))
    model = lookahead_model(optimizer, cache_load_factor=0.05, device=CUDA)
    model.unweighted.load_state_dict(cpu.unweighted.state_dict())
    model.weighted.load_state_dict(cpu.weighted.state_dict())
    model.over.load_state_dict(copy.deepcopy(cpu.over.state_dict()))
    model.over.to(CUDA)
    return model, twin


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_unsharded_cuda_cache_matches_all_resident_training(
    dedup: bool, optimizer: str, planner: str
) -> None:
    data = session_batches(40, session=4, dedup=True) if dedup else batches(40)
    model, twin = cuda_model_and_twin(optimizer)
    dense = torch.optim.SGD(twin.over.parameters(), lr=DENSE_LR)
    expected = []
    for batch in data:
        dense.zero_grad()
        loss, logits = twin(on_cuda(batch))
        loss.backward()
        dense.step()
        expected.append(logits)
    dense = torch.optim.SGD(model.over.parameters(), lr=DENSE_LR)
    pipeline = LookaheadTrainPipeline(model, dense, CUDA, lookahead=8, planner=planner)
    got, it = [], iter(data)
    while True:
        try:
            got.append(pipeline.progress(it))
        except StopIteration:
            break
    assert len(got) == len(expected)
    if dedup:  # FBGEMM's variable-batch backward on CUDA: see the module's docstring
        torch.testing.assert_close([g.detach() for g in got], [e.detach() for e in expected])
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert_same_training_state(model, twin, exact=not dedup)


def test_dlrm_example_on_one_gpu_matches_plain_torchrec_through_a_checkpoint(tmp_path) -> None:
    """DMP at world size 1 over NCCL (table-wise, the store a UVM TBE), a checkpoint
    mid-run, resumed: the weights equal plain TorchRec's (``fused``) bitwise, with plans
    made on the host and on the device."""
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        str(ROOT / "examples" / "dlrm" / "dlrm_main.py"),
        "--scale",
        "0.001",
        "--synthetic_samples_per_day",
        "8192",
        "--batch_size",
        "256",
        "--limit_val_batches",
        "2",
        "--limit_test_batches",
        "2",
        "--data_cache",
        str(tmp_path / "data"),
        "--deterministic",
    ]
    first = subprocess.run(
        common
        + [
            "--out",
            str(tmp_path / "a"),
            "--limit_train_batches",
            "12",
            "--save_dir",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = subprocess.run(
        common
        + [
            "--out",
            str(tmp_path / "b"),
            "--limit_train_batches",
            "24",
            "--save_dir",
            str(tmp_path / "ckpt"),
            "--resume",
        ],
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for planner in PLANNERS:  # the whole run against plain TorchRec, plans made either way
        whole = subprocess.run(
            common
            + ["--out", str(tmp_path / planner), "--limit_train_batches", "24", "--baseline"]
            + ["--planner", planner],
            capture_output=True,
            text=True,
        )
        assert whole.returncode == 0, whole.stderr[-3000:]
        summary = json.loads((tmp_path / planner / "summary.json").read_text())
        assert summary["weights_match"] is True, planner
    resumed_digest = json.loads((tmp_path / "b" / "summary.json").read_text())["weights_digest"]
    assert resumed_digest == summary["weights_digest"]
