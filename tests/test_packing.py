"""Packing: best-fit decreasing, position_ids restarting per document, and no attention or label across documents:
the loss and every gradient of a packed batch equal the per-document computation (fp32) for each model family, both
where transformers finds the documents from position_ids and where SFTTrainer builds the mask from the collator's
documents and picks the labelled tokens at the collator's positions (no host wait: tests/test_host_syncs.py)."""

from __future__ import annotations

import random

import pytest

from conftest import save_tiny_model
from sft.data.packing import DOCUMENT_IDS, LABELLED_POSITIONS, Collator, best_fit_decreasing, pack_rows
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


def test_long_packed_rows_under_sdpa_get_a_note_on_their_dense_mask(tmp_path):
    """A packed row of two documents or more takes a dense [tokens x tokens] mask under sdpa (and loses its fused
    causal kernel): from 8,192-token rows the first screen says so, with the count and the mask's size; flex_attention,
    short rows and rows of one document each get no note."""
    from datasets import Dataset

    from conftest import train_here
    from sft.data.packing import rows_with_several_documents
    from sft.speed.packed_mask import dense_mask_note

    table = pack_rows([[7] * 5000, [8] * 4000, [9] * 3000, [6] * 8000], [[IGNORE] * 5000, [IGNORE] * 4000,
                                                                        [IGNORE] * 3000, [IGNORE] * 8000], 8192)
    rows = Dataset(table)  # rows of 8000; 5000 + 3000; 4000: one of three holds two documents
    assert sorted(map(len, rows["seq_lengths"])) == [1, 1, 2] and rows_with_several_documents(rows) == 1
    assert rows_with_several_documents({"seq_lengths": [[5, 0], [4, 4], [8]]}) == 1  # an empty document is none
    note = dense_mask_note("sdpa", 32768, rows)
    assert note.startswith("note: 1 of 3 packed rows hold two documents or more") and "(1 GiB a row at 32,768" in note
    assert "(64 MiB a row at 8,192 tokens)" in dense_mask_note("sdpa", 8192, rows)
    assert dense_mask_note("flex_attention", 32768, rows) is None and dense_mask_note("sdpa", 4096, rows) is None
    assert dense_mask_note("sdpa", 32768, Dataset.from_dict({"seq_lengths": [[8000], [5000]]})) is None

    # the demo's short conversations packed into rows of 8,192 tokens: every row holds several, said once (the note
    # counts the rows before training; a step of one of the two rows trains through the dense mask as well)
    result = train_here(["--max_length", "8192", "--packing", "true", "--max_steps", "1", "--eval_strategy", "no",
                         "--per_device_train_batch_size", "1", "--report_to", "none", "--output_dir",
                         str(tmp_path / "out"), "--dataset_cache_dir", str(tmp_path / "cache")])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = [line for line in result.stdout.splitlines() if "packed rows hold two documents or more" in line]
    assert len(lines) == 1 and "(64 MiB a row at 8,192 tokens)" in lines[0], result.stdout[-2000:]


def test_collator_restarts_positions_per_document_and_its_padding_continues_the_last_one():
    batch = Collator(pad_token_id=0)([
        {"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, 2, 3, IGNORE, 5], "seq_lengths": [3, 2]},
        {"input_ids": [6, 7], "labels": [IGNORE, 7], "seq_lengths": [2]},
    ])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3, IGNORE, 5], [IGNORE, 7, IGNORE, IGNORE, IGNORE]]
    assert "attention_mask" not in batch
    assert batch["use_cache"] is False  # a cache would break the packed mask (test below)
    plain = Collator(pad_token_id=0)([{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]},
                                      {"input_ids": [4], "labels": [IGNORE]}])
    assert plain["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    fixed = Collator(pad_token_id=0, pad_to_multiple_of=4)([{"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, 2, 3, 4, 5],
                                                             "seq_lengths": [5]}])
    assert fixed["position_ids"].tolist() == [list(range(8))]  # one document and its padding: no restart
    assert fixed["labels"].tolist() == [[IGNORE, 2, 3, 4, 5, IGNORE, IGNORE, IGNORE]]


def test_collator_numbers_documents_and_labelled_positions_on_the_host():
    rows = [{"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE, 2, 3, IGNORE, 5], "seq_lengths": [3, 2]},
            {"input_ids": [6, 7], "labels": [IGNORE, 7], "seq_lengths": [2]}]
    batch = Collator(pad_token_id=0, labelled_positions=True, document_ids=True)(rows)
    assert batch[DOCUMENT_IDS].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]  # the padding: the last document's
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    # flat places t (row x 5 + t) whose next token has a label: row 0's targets 2, 3, 5; row 1's 7
    assert batch[LABELLED_POSITIONS].tolist() == [0, 1, 3, 5]
    # every row one document filling it: nothing to mask but the causal order, and the positions are 0..n-1
    whole = Collator(pad_token_id=0, document_ids=True)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3],
                                                          "seq_lengths": [3]}])
    assert DOCUMENT_IDS not in whole and "position_ids" not in whole
    # ... and one document with padding: the padding follows every real token, which causal attention never reads
    padded = Collator(pad_token_id=0, document_ids=True, pad_to_multiple_of=8)(rows[1:])
    assert DOCUMENT_IDS not in padded and "position_ids" not in padded and "attention_mask" not in padded
    assert DOCUMENT_IDS not in Collator(pad_token_id=0)(rows)  # asked for only


@pytest.mark.parametrize("attn", ["sdpa", "eager", pytest.param("flex_attention", marks=pytest.mark.slow)])
def test_the_mask_from_the_documents_is_the_one_transformers_finds(attn):
    """sft/speed/packed_mask.py builds, from the collator's documents, the mask transformers builds when it finds
    the documents from position_ids (flex attention: the same BlockMask blocks and mask function)."""
    import torch
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    from sft.speed.packed_mask import builds_packed_mask, packed_causal_mask

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = attn
    assert builds_packed_mask(config)
    rows = [{"input_ids": list(range(1, 100)), "labels": list(range(1, 100)), "seq_lengths": [40, 1, 58]},
            {"input_ids": list(range(1, 60)), "labels": list(range(1, 60)), "seq_lengths": [59]}]
    batch = Collator(0, pad_to_multiple_of=128, document_ids=True)(rows)
    embeddings = torch.zeros(2, 128, 16)
    theirs = create_causal_mask(config, embeddings, None, None, position_ids=batch["position_ids"])
    ours = packed_causal_mask(config, batch[DOCUMENT_IDS], embeddings.dtype)
    if attn == "flex_attention":
        from torch.nn.attention.flex_attention import create_mask

        assert torch.equal(ours.to_dense(), theirs.to_dense())
        theirs, ours = (create_mask(m.mask_mod, 2, 1, 128, 128, device="cpu") for m in (theirs, ours))
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    allowed = ours if ours.dtype == torch.bool else ours == 0  # eager: 0 where attended, the dtype's min elsewhere
    # row 0: documents 0-39, 40, 41-98 and its padding; row 1: 0-58 and its padding
    assert allowed[0, 0, 45, 41] and not allowed[0, 0, 45, 40] and not allowed[0, 0, 45, 10]
    assert allowed[1, 0, 58, 0] and not allowed[1, 0, 58, 60] and not allowed[0, 0, 40, 39]
    assert allowed[0, 0, 110, 41] and not allowed[0, 0, 98, 110]  # no real token reads the padding


def test_models_with_sliding_windows_or_flash_attention_keep_transformers_own_mask():
    from transformers import LlamaConfig, Qwen2Config

    from sft.speed.packed_mask import builds_packed_mask

    flash = LlamaConfig()
    flash._attn_implementation = "flash_attention_2"
    sliding = Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0, num_hidden_layers=2)
    sliding._attn_implementation = "sdpa"
    assert not builds_packed_mask(flash) and not builds_packed_mask(sliding)


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


@pytest.mark.parametrize("path", ["position_ids", "collator's documents"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "deepseek_v2", "deepseek_v3"])
def test_packed_loss_and_gradients_equal_per_document(tiny_models, model_type, attn, path, tmp_path):
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
    if path == "position_ids":
        batch = Collator(pad_token_id=0)(rows)  # two or more packed rows, padded: a real training batch
        packed = model(**batch).loss  # as the Trainer calls it: the batch itself turns the cache off
    else:
        batch = Collator(pad_token_id=0, labelled_positions=True, document_ids=True)(rows)
        packed = sft_trainer(model, tmp_path).compute_loss(model, batch)  # its mask, its labelled-token loss
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    assert_same_loss_and_gradients(model, packed, packed_grads, per_document_loss(model, docs))


def per_document_loss(model, docs):
    """The loss of each document run alone, weighted by its labelled tokens: what a packed batch must give."""
    import torch

    total, count = 0.0, 0
    for ids, labels in docs:
        out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), use_cache=False)
        n = sum(label != IGNORE for label in labels[1:])
        total = total + out.loss * n
        count += n
    return total / count


def sft_trainer(model, tmp_path):
    """SFTTrainer with the labelled-token loss (--chunked_loss's) on CPU: the path that builds the packed mask from
    the collator's documents and picks the labelled tokens at the collator's positions."""
    from transformers import TrainingArguments

    from sft.speed.chunked_loss import chunked_causal_lm_loss
    from sft.speed.packed_mask import builds_packed_mask
    from sft.trainer import SFTTrainer

    assert builds_packed_mask(model.config)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True)
    return SFTTrainer(model=model, args=args, labelled_token_loss=chunked_causal_lm_loss)


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
