"""Deduplicated (RecD) batches: each repeated bag planned, looked up and sent once, exactly.

The lookahead model fed deduplicated batches equals the all-resident model
fed the same batches, bitwise (both pool the distinct bags with the same TBE
kernels and expand them as ``EmbeddingBagCollection`` does); against training
on the plain batches it differs only in how the duplicates' gradients are
summed (once per distinct bag before the TBE, instead of per sample inside it).
"""

from __future__ import annotations

import re

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_modules import process_pooled_embeddings
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.models import (
    KEYS,
    USER_KEYS,
    assert_same_training_state,
    lookahead_model,
    reference_twin,
    session_batches,
    train_dropping_refused,
    train_lookahead,
    train_reference,
)
from torchrec_lookahead.data.dedup import DedupCounts, deduplicate
from torchrec_lookahead.variable_batch import check_variable_batch_optimizer, gather_bags

STEPS = 60
SESSION = 4
DEDUPED = session_batches(STEPS, SESSION, dedup=True)
PLAIN = session_batches(STEPS, SESSION, dedup=False)


def test_gather_bags_expands_bitwise_as_fbgemm_does() -> None:
    """One gather stands in for FBGEMM's per-feature selects (TorchRec's sharded and
    unsharded expansions): the same output, and the same gradient sums over every
    bag's duplicates, in any order of the inverse indices."""
    torch.manual_seed(0)
    batch, dim = 96, 8
    bags = [batch, 5, 1, 17, batch, 3]  # features kept whole and deduplicated ones
    inverse = torch.stack(
        [torch.randperm(batch) if n == batch else torch.randint(0, n, (batch,)) for n in bags]
    )
    gradient = torch.randn(batch, len(bags) * dim)
    flat = torch.randn(sum(bags) * dim, requires_grad=True)
    expanded = {
        "gather_bags": lambda x: gather_bags(x, inverse, bags, dim),
        "batch_index_select_dim0": lambda x: torch.ops.fbgemm.batch_index_select_dim0(
            inputs=x,
            indices=inverse.reshape(-1),
            input_num_indices=[batch] * len(bags),
            input_rows=bags,
            input_columns=[dim] * len(bags),
            permute_output_dim_0_1=True,
        ).view(batch, -1),
        "group_index_select_dim0": lambda x: process_pooled_embeddings(
            [block.view(n, dim) for block, n in zip(x.split([n * dim for n in bags]), bags)],
            inverse,
        ),
    }
    results = {}
    for name, expand in expanded.items():
        flat.grad = None
        output = expand(flat)
        output.backward(gradient)
        results[name] = (output.detach(), flat.grad.clone())
    ours = results.pop("gather_bags")
    for name, (output, grad) in results.items():
        assert torch.equal(ours[0], output), name
        assert torch.equal(ours[1], grad), name


def test_deduplicate_keeps_each_shared_bag_once_and_expands_back() -> None:
    features = deduplicate(PLAIN[0].sparse_features, USER_KEYS)
    counts = DedupCounts()
    counts.add(features)
    strides = dict(zip(features.keys(), features.stride_per_key()))
    assert [strides[k] for k in KEYS] == [8, 32, 8, 32, 8, 32]  # 32 samples, sessions of 4
    assert counts.ids_after == features.values().numel() < PLAIN[0].sparse_features.values().numel()
    assert counts.ids_before == PLAIN[0].sparse_features.values().numel()
    assert counts.bags_after == 3 * 8 + 3 * 32 and counts.bags_before == 6 * 32
    names, inverse = features.inverse_indices()
    assert names == KEYS and inverse.shape == (6, 32)
    assert torch.equal(inverse[0], torch.arange(32) // SESSION)  # first-seen order
    for key in KEYS:  # expanding each key's bags by its inverse indices gives the plain batch
        plain = PLAIN[0].sparse_features[key].to_dense()
        bags = features[key].to_dense()
        assert all(torch.equal(plain[i], bags[inverse[KEYS.index(key), i]]) for i in range(32))


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_deduplicated_batches_match_all_resident_training(optimizer) -> None:
    model = lookahead_model(optimizer, cache_load_factor=0.1)
    twin = reference_twin(model, optimizer)
    expected = train_reference(twin, DEDUPED)
    outputs, pipeline = train_lookahead(model, DEDUPED, lookahead=8, prefetch_distance=1)
    assert len(outputs) == STEPS
    for step, (got, want) in enumerate(zip(outputs, expected)):
        assert torch.equal(got, want), f"step {step} output differs"
    assert_same_training_state(model, twin)
    total = pipeline.cache_metrics()["total"]
    # The oracle planned the distinct bags only.
    assert total.lookups == sum(b.sparse_features.values().numel() for b in DEDUPED)
    assert total.rows_written_back > 0


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_deduplicated_training_equals_plain_training_to_float_tolerance(optimizer) -> None:
    """Measured after 60 steps: weights within 4e-9 (SGD), 4.5e-8 (Adagrad) and 1.7e-7
    (row-wise Adagrad), logits within 6e-8, 2.4e-7 and 2.4e-7; asserted with a margin
    (1e-6 and 1e-5). Adagrad, which FBGEMM's variable-batch kernels lack, trains here
    because the CPU pools variable batches padded (``padded_lookup``)."""
    torch.manual_seed(1)
    dedup_model = lookahead_model(optimizer, cache_load_factor=0.1)
    torch.manual_seed(1)
    plain_model = lookahead_model(optimizer, cache_load_factor=0.1)
    dedup_out, _ = train_lookahead(dedup_model, DEDUPED, 8, 1)
    plain_out, _ = train_lookahead(plain_model, PLAIN, 8, 1)
    assert torch.equal(dedup_out[0], plain_out[0])  # same forward before any update
    for a, b in zip(dedup_out, plain_out):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for module in ("unweighted", "weighted"):
        got = getattr(dedup_model, module).state_dict()
        want = getattr(plain_model, module).state_dict()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)


def test_fbgemm_variable_batch_optimizers_are_checked() -> None:
    """On CUDA FBGEMM's own variable-batch kernels run, which lack EXACT_ADAGRAD (the CPU
    pools variable batches padded, with any optimizer: see the tolerance test)."""
    features = DEDUPED[0].sparse_features
    check_variable_batch_optimizer(features, EmbOptimType.EXACT_ROWWISE_ADAGRAD, "step 0")
    check_variable_batch_optimizer(PLAIN[0].sparse_features, EmbOptimType.EXACT_ADAGRAD, "x")
    message = r"step 0: deduplicated .* optimizers \[.*'EXACT_SGD'.*\] .*, not EXACT_ADAGRAD"
    with pytest.raises(ValueError, match=message):
        check_variable_batch_optimizer(features, EmbOptimType.EXACT_ADAGRAD, "step 0")


def test_eval_mode_expands_deduplicated_batches() -> None:
    model = lookahead_model("sgd", cache_load_factor=0.1)
    model.eval()
    with torch.no_grad():
        got = model.unweighted(DEDUPED[3].sparse_features).values()
        want = model.unweighted(PLAIN[3].sparse_features).values()
    assert torch.equal(got, want)


def _with(features: KeyedJaggedTensor, **changes) -> KeyedJaggedTensor:
    parts = dict(
        keys=features.keys(),
        values=features.values(),
        weights=features.weights(),
        lengths=features.lengths(),
        stride_per_key_per_rank=features.stride_per_key_per_rank(),
        inverse_indices=features.inverse_indices(),
    )
    parts.update(changes)
    return KeyedJaggedTensor(**parts)


def _bad_inverse(value: int):
    names, inverse = DEDUPED[5].sparse_features.inverse_indices()
    inverse = inverse.clone()
    inverse[0, 7] = value
    return {"inverse_indices": (names, inverse)}


def _strides():
    strides = DEDUPED[5].sparse_features.stride_per_key_per_rank()
    return {"stride_per_key_per_rank": [[strides[0][0] + 1]] + strides[1:]}


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            lambda: _bad_inverse(8),
            r"step 5: feature 'f0': inverse index 8 is out of range for "
            r"its 8 bags",
        ),
        (lambda: _bad_inverse(-1), "inverse index -1 is out of range"),
        (
            lambda: {"inverse_indices": (KEYS, torch.zeros(5, 32, dtype=torch.int64))},
            r"inverse_indices must be an integer tensor \[keys, batch\] = \[6, batch\]",
        ),
        (
            lambda: {"inverse_indices": (KEYS[1:], torch.zeros(5, 32, dtype=torch.int64))},
            r"inverse_indices has no row for features \['f0'\]",
        ),
        (_strides, r"the strides \[9, 32, .*\] add up to 121 bags but the batch has 120 lengths"),
        (lambda: {"inverse_indices": None}, "needs inverse_indices"),
    ],
)
def test_bad_deduplicated_batches_are_refused_and_training_goes_on(changes, message) -> None:
    model = lookahead_model("rowwise_adagrad", cache_load_factor=0.1)
    twin = reference_twin(model, "rowwise_adagrad")
    source = DEDUPED[5]
    bad = Batch(source.dense_features, _with(source.sparse_features, **changes()), source.labels)
    outputs, errors = train_dropping_refused(model, DEDUPED[:5] + [bad] + DEDUPED[5:])
    assert len(errors) == 1, errors
    assert re.search(message, errors[0]), errors[0]
    expected = train_reference(twin, DEDUPED)
    assert len(outputs) == STEPS and all(torch.equal(a, b) for a, b in zip(outputs, expected))
    assert_same_training_state(model, twin)


def test_a_batch_without_shared_bags_is_deduplicated_too() -> None:
    """Under DMP each rank deduplicates its own part: one rank's plain batch beside another's
    deduplicated one broke TorchRec's input dist (a collective), at two ranks of the DLRM
    example with shuffled sessions. Every batch takes the deduplicated form."""
    counts = DedupCounts()
    features = session_batches(1, 1, dedup=False)[0].sparse_features
    deduplicated = deduplicate(features, USER_KEYS)
    assert deduplicated.variable_stride_per_key()
    assert deduplicated.stride_per_key() == [features.stride()] * len(features.keys())
    assert torch.equal(deduplicated.values(), features.values())
    _, inverse = deduplicated.inverse_indices()
    assert torch.equal(inverse, torch.arange(features.stride()).expand_as(inverse))
    counts.add(deduplicated)
    assert counts.ids_before == counts.ids_after == features.values().numel()


def test_deduplicate_refuses_unknown_keys_and_deduplicated_batches() -> None:
    with pytest.raises(ValueError, match=r"cannot deduplicate features \['zz'\]"):
        deduplicate(PLAIN[0].sparse_features, ["f0", "zz"])
    with pytest.raises(ValueError, match="deduplicated already"):
        deduplicate(DEDUPED[0].sparse_features, USER_KEYS)
