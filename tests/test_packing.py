"""Packing: best-fit decreasing, position_ids restarting per document, and no attention or label across documents:
the loss and every gradient of a packed batch equal the per-document computation (fp32) for each model family."""

from __future__ import annotations

import random

import pytest

from conftest import save_tiny_model
from sft.data.packing import Collator, best_fit_decreasing, pack_rows
from sft.data.tokenization import IGNORE


def reference_bfd(lengths: list[int], capacity: int) -> list[list[int]]:
    """Textbook best-fit decreasing: longest first, each into the bin it leaves the least room in."""
    bins, space = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if space[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (space[b], b))
        else:
            b = len(bins)
            bins.append([])
            space.append(capacity)
        bins[b].append(i)
        space[b] -= lengths[i]
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_decreasing_matches_the_textbook_algorithm(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 300))]
    bins = best_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert [sorted(lengths[i] for i in b) for b in bins] == [sorted(lengths[i] for i in b)
                                                             for b in reference_bfd(lengths, 100)]


def test_pack_rows_keeps_documents_whole_and_aligned():
    import pyarrow as pa

    rng = random.Random(0)
    docs = [[rng.randint(5, 999) for _ in range(rng.randint(1, 60))] for _ in range(200)]
    labels = [[IGNORE] + [t if rng.random() < 0.5 else IGNORE for t in d[1:]] for d in docs]
    table = pack_rows(docs, labels, 128)
    rows = table.to_pylist()
    seen = []
    for row in rows:
        assert len(row["input_ids"]) == len(row["labels"]) == sum(row["seq_lengths"]) <= 128
        start = 0
        for n in row["seq_lengths"]:
            seen.append((row["input_ids"][start:start + n], row["labels"][start:start + n]))
            start += n
    assert sorted(seen) == sorted(zip(docs, labels))
    # Sliced Arrow columns (what datasets hands over after a filter) pack the same.
    sliced = pa.array([[0]] + docs, type=pa.list_(pa.int32())).slice(1)
    sliced_labels = pa.array([[0]] + labels, type=pa.list_(pa.int32())).slice(1)
    assert pack_rows(sliced, sliced_labels, 128).to_pylist() == rows
    # Empty documents (records tokenization dropped) are left out, not packed as documents of length 0.
    with_empty = pack_rows([[]] + docs[:100] + [[]] * 3 + docs[100:], [[]] + labels[:100] + [[]] * 3 + labels[100:],
                           128).to_pylist()
    assert all(n > 0 for row in with_empty for n in row["seq_lengths"])
    assert sorted(map(str, with_empty)) == sorted(map(str, rows))


def test_collator_restarts_positions_per_document_and_pads_as_its_own_document():
    batch = Collator(pad_token_id=0)([
        {"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, 2, 3, IGNORE, 5], "seq_lengths": [3, 2]},
        {"input_ids": [6, 7], "labels": [IGNORE, 7], "seq_lengths": [2]},
    ])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3, IGNORE, 5], [IGNORE, 7, IGNORE, IGNORE, IGNORE]]
    assert "attention_mask" not in batch
    assert batch["use_cache"] is False  # a cache would break the packed mask (test below)
    plain = Collator(pad_token_id=0)([{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]},
                                      {"input_ids": [4], "labels": [IGNORE]}])
    assert plain["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    fixed = Collator(pad_token_id=0, pad_to_multiple_of=4)([{"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, 2, 3, 4, 5],
                                                             "seq_lengths": [5]}])
    assert fixed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert fixed["labels"].tolist() == [[IGNORE, 2, 3, 4, 5, IGNORE, IGNORE, IGNORE]]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return {t: save_tiny_model(tmp_path_factory.mktemp(t), t) for t in
            ("llama", "qwen2", "deepseek_v2", "deepseek_v3")}


def documents(vocab: int, seed: int = 0):
    """Documents as the data layer makes them: first label ignored, a prompt part ignored, replies trained."""
    rng = random.Random(seed)
    docs = []
    for n in (13, 7, 21, 5, 17, 9):
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        prompt = rng.randint(1, n - 2)
        docs.append((ids, [IGNORE] * prompt + ids[prompt:]))
    return docs


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "deepseek_v2", "deepseek_v3"])
def test_packed_loss_and_gradients_equal_per_document(tiny_models, model_type, attn):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_models[model_type], dtype=torch.float32,
                                                 attn_implementation=attn)
    model.train()  # dropout is 0 in these configs; train mode is what the Trainer runs
    docs = documents(model.config.vocab_size)
    table = pack_rows([d[0] for d in docs], [d[1] for d in docs], 40)
    rows = table.to_pylist()
    assert len(rows) >= 2 and any(len(r["seq_lengths"]) > 1 for r in rows)
    batch = Collator(pad_token_id=0)(rows)  # two or more packed rows, padded: a real training batch

    packed = model(**batch).loss  # as the Trainer calls it: the batch itself turns the cache off
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    total, count = 0.0, 0
    for ids, labels in docs:
        out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), use_cache=False)
        n = sum(label != IGNORE for label in labels[1:])
        total = total + out.loss * n
        count += n
    per_document = total / count
    assert_same_loss_and_gradients(model, packed, packed_grads, per_document)


def assert_same_loss_and_gradients(model, packed, packed_grads: dict, per_document) -> None:
    """The packed batch's loss and gradients (taken before) equal the per-document loss's (backward run here)."""
    per_document.backward()
    assert abs(packed.item() - per_document.item()) < 1e-5
    assert packed_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    worst = max((packed_grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters()
                if p.grad is not None)
    assert worst < 1e-5, f"largest gradient difference {worst:.2e}"


def test_without_position_ids_or_with_a_cache_documents_would_leak(tiny_models):
    """The check above can fail: the same packed row with positions running on (no document boundaries), or with
    a KV cache (the model's default use_cache=True, which the Collator's batch overrides), gives a different loss."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    assert model.config.use_cache  # the default the saved model keeps
    docs = documents(model.config.vocab_size)
    batch = Collator(pad_token_id=0)(pack_rows([d[0] for d in docs], [d[1] for d in docs], 40).to_pylist())
    with torch.no_grad():
        separated = model(**batch).loss
        leaking = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        cached = model(**{**batch, "use_cache": True}).loss
    assert abs(separated.item() - leaking.item()) > 1e-3
    assert abs(separated.item() - cached.item()) > 1e-3
