"""--attn_implementation varlen (sft/speed/varlen_attention.py): packed rows' attention per document through torch's
varlen FlashAttention. On CPU the attention runs through sdpa with the documents' mask, so these tests check all but
the kernel: the collator's offsets, the kwargs that reach the attention, MLA's value padding, grouped heads, and the
kernel call for both spellings of torch's API (a stand-in kernel); bench/varlen_check.py checks the kernel on a GPU."""

from __future__ import annotations

import inspect

import pytest
import torch

from conftest import lora_demo_run, tiny_config
from sft.data.packing import CU_SEQ_LENS, Collator, pack_rows
from sft.speed import varlen_attention
from test_packing import assert_same_loss_and_gradients, documents, per_document_loss


def test_the_collator_gives_each_documents_start_over_the_batchs_tokens():
    rows = [{"input_ids": [1] * 7, "labels": [1] * 7, "seq_lengths": [3, 4]},
            {"input_ids": [1] * 5, "labels": [1] * 5, "seq_lengths": [5]}]
    batch = Collator(pad_token_id=0, document_starts=True)(rows)
    # row 0: documents of 3 and 4; row 1: one of 5 and its 2 tokens of padding (7 wide)
    assert batch[CU_SEQ_LENS].tolist() == [0, 3, 7, 14] and batch[CU_SEQ_LENS].dtype == torch.int32
    assert CU_SEQ_LENS not in Collator(pad_token_id=0)(rows)
    one_each = [{**row, "seq_lengths": [len(row["input_ids"])]} for row in rows]
    assert CU_SEQ_LENS not in Collator(pad_token_id=0, document_starts=True)(one_each)  # the causal order is enough


@pytest.fixture(scope="module")
def varlen_models(tmp_path_factory):
    """Tiny models loaded with `varlen` through from_pretrained: llama with grouped key/value heads, and
    deepseek_v2 (MLA) whose value heads (12) are smaller than its query/key heads (16)."""
    from transformers import AutoModelForCausalLM

    varlen_attention.register()
    models = {}
    for name, config in (("llama", tiny_config("llama")), ("deepseek_v2", tiny_config("deepseek_v2", v_head_dim=12))):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        models[name] = path
    return models


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v2"])
def test_packed_loss_and_gradients_equal_per_document(varlen_models, model_type, tmp_path):
    from transformers import AutoModelForCausalLM, TrainingArguments

    from sft.trainer import SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(varlen_models[model_type], dtype=torch.float32,
                                                 attn_implementation="varlen")
    assert model.config._attn_implementation == "varlen"
    model.train()
    docs = documents(model.config.vocab_size)
    rows = pack_rows([d[0] for d in docs], [d[1] for d in docs], 40).to_pylist()
    batch = Collator(pad_token_id=0, document_starts=True)(rows)
    trainer = SFTTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                                            disable_tqdm=True))
    seen = []
    with spy_on_attention(seen):
        packed = trainer.compute_loss(model, batch)
    assert seen and all(cu is batch[CU_SEQ_LENS] or torch.equal(cu, batch[CU_SEQ_LENS]) for cu in seen)
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert_same_loss_and_gradients(model, packed, packed_grads, per_document_loss(model, docs))


class spy_on_attention:
    """Records the cu_seq_lens each attention call receives (None: the call got none)."""

    def __init__(self, seen: list):
        self.seen, self.original = seen, varlen_attention.masked_documents_attention

    def __enter__(self):
        def spy(q, k, v, cu, longest, scale):
            self.seen.append(cu)
            return self.original(q, k, v, cu, longest, scale)
        varlen_attention.masked_documents_attention = spy

    def __exit__(self, *exc):
        varlen_attention.masked_documents_attention = self.original


def old_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9-2.11's spelling: causal by flag, the default scale, one head count for all."""
    assert is_causal and key.shape[1] == query.shape[1] and value.shape[-1] == query.shape[-1]
    return varlen_attention.masked_documents_attention(query, key, value, cu_seq_q, max_q, query.shape[-1] ** -0.5)


def new_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """Later releases: causal as a window, its own scale, shared key heads."""
    assert window_size == (-1, 0) and enable_gqa == (key.shape[1] != query.shape[1])
    return varlen_attention.masked_documents_attention(query, key, value, cu_seq_q, max_q, scale)


@pytest.mark.parametrize("stand_in", [old_kernel, new_kernel], ids=["is_causal", "window_size"])
def test_the_kernel_call_gives_the_masked_attention_in_either_spelling(monkeypatch, stand_in):
    """documents_attention adapts to the installed torch's varlen_attn: the scale folded into the query where the
    kernel takes none, key heads repeated where it cannot share them."""
    monkeypatch.setattr(varlen_attention, "kernel", lambda: stand_in)
    monkeypatch.setattr(varlen_attention, "kernel_parameters", lambda: frozenset(inspect.signature(stand_in).parameters))
    torch.manual_seed(0)
    q, k, v = torch.randn(23, 4, 16), torch.randn(23, 2, 16), torch.randn(23, 2, 16)
    cu = torch.tensor([0, 5, 17, 23], dtype=torch.int32)
    scale = 0.37  # not 1/sqrt(16): MLA's scale has yarn's factor in it
    expected = varlen_attention.masked_documents_attention(q, k, v, cu, 12, scale)
    got = varlen_attention.documents_attention(q, k, v, cu, 12, scale)
    assert torch.allclose(got, expected, atol=1e-5)
    # the check can fail: another scale, or documents run together, give other outputs
    assert not torch.allclose(varlen_attention.documents_attention(q, k, v, cu, 12, 0.25), expected, atol=1e-3)
    together = torch.tensor([0, 23], dtype=torch.int32)
    assert not torch.allclose(varlen_attention.documents_attention(q, k, v, together, 23, scale), expected, atol=1e-3)


@pytest.mark.slow
def test_the_demo_trains_the_same_under_varlen(tmp_path, plain_lora_demo_losses):
    """The demo's packed rows (sdpa with the documents' mask, the plain run) and the same under varlen: the same
    losses, through the real command (registration, collator, the Trainer's kwargs, MLA's value padding where the
    tiny model has it)."""
    losses, _ = lora_demo_run(tmp_path, "varlen", "--attn_implementation", "varlen")
    assert losses == pytest.approx(plain_lora_demo_losses, rel=1e-5)


def test_varlen_is_refused_before_loading_where_its_kernel_cannot_run():
    from sft.errors import ConfigError
    from sft.machine import Launch, Machine
    from sft.options.arguments import read_options, settle

    def settled(capability: tuple[int, int], *extra: str):
        gpu = Machine(gpu_names=("NVIDIA GPU",), gpu_memory_gib=(23.5,), bf16=capability >= (8, 0),
                      gpu_capabilities=(capability,), host_ram_gib=64, host_ram_available_gib=60,
                      launch=Launch(world_size=1), packages=frozenset())
        return settle(read_options(["--model", "m", "--dataset", "data/sample_sft.jsonl", "--output_dir",
                                    "/nonexistent/out", "--attn_implementation", "varlen", *extra]), gpu)

    with pytest.raises(ConfigError, match="compute capability 8.0 or later .FlashAttention-2; this one is 7.5"):
        settled((7, 5), "--lora")
    with pytest.raises(ConfigError, match="computes in bf16 or fp16 .FlashAttention-2., and this run computes in fp32"):
        settled((8, 9), "--fp8", "false", "--compile_layers", "false")  # a full fine-tune without --bf16
    assert settled((8, 9), "--lora").model.attn_implementation == "varlen"  # the bf16 base: its activations too
    # bf16 weights with a bf16 optimizer (--bf16's autocast cannot be asked for on this CPU machine)
    assert settled((8, 9), "--dtype", "bfloat16", "--optim", "adamw_bf16_sr", "--fp8", "false").model.attn_implementation \
        == "varlen"


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v2"])
def test_packed_rows_of_one_document_each_run_sdpas_causal_kernel(varlen_models, model_type, monkeypatch):
    """A batch whose packed rows hold one document each (long conversations) comes without offsets: the attention
    runs transformers' sdpa with the causal order alone (cuDNN's fused kernel on a GPU, faster than FlashAttention-2
    on long rows), never the documents' kernel, and gives sdpa's loss (MLA's smaller value heads included)."""
    from transformers import AutoModelForCausalLM

    def no_kernel(*args, **kwargs):
        raise AssertionError("the documents' kernel ran")

    rows = [{"input_ids": ids, "labels": labels, "seq_lengths": [len(ids)]} for ids, labels in documents(1024)[:3]]
    batch = Collator(pad_token_id=0, document_starts=True)(rows)
    assert CU_SEQ_LENS not in batch and "position_ids" in batch
    monkeypatch.setattr(varlen_attention, "documents_attention", no_kernel)
    monkeypatch.setattr(varlen_attention, "masked_documents_attention", no_kernel)
    losses = {}
    for attention in ("varlen", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(varlen_models[model_type], dtype=torch.float32,
                                                     attn_implementation=attention)
        with torch.no_grad():
            losses[attention] = model(**batch).loss.item()
    assert losses["varlen"] == pytest.approx(losses["sdpa"], rel=1e-5)


def test_unpacked_rows_with_padding_give_sdpas_loss(varlen_models):
    """Without packing each row is one sequence and its padding follows it: the attention needs no offsets (the
    padding's own outputs train nothing), and the loss is sdpa's with its padding mask."""
    from transformers import AutoModelForCausalLM

    docs = documents(1024)
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in docs]
    batch = Collator(pad_token_id=0, document_starts=True)(rows)
    assert CU_SEQ_LENS not in batch and "attention_mask" in batch
    losses = {}
    for attention in ("varlen", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(varlen_models["llama"], dtype=torch.float32,
                                                     attn_implementation=attention)
        with torch.no_grad():
            losses[attention] = model(**batch).loss.item()
    assert losses["varlen"] == pytest.approx(losses["sdpa"], rel=1e-5)


# ---- the attention left at its default on packed rows on a GPU: varlen (sft/options/resolve.py)

H200 = dict(gpu_names=("NVIDIA H200",), gpu_capabilities=((9, 0),), gpu_memory_gib=(139.0,), bf16=True)


def settled_attention(tmp_path, model_type: str, *extra: str, gpu: bool = True):
    from sft.machine import Machine
    from sft.options.arguments import read_options, settle

    path = tmp_path / model_type
    tiny_config(model_type).save_pretrained(path)
    options = read_options(["--model", str(path), "--dataset", "data/alpaca_demo.json", "--output_dir",
                            "/nonexistent/out", "--lora", *extra])
    return settle(options, Machine(**H200) if gpu else Machine()).model


@pytest.mark.parametrize("model_type, extra, gpu, want", [
    ("deepseek_v2", ("--packing",), True, "varlen"),
    ("deepseek_v3", ("--packing",), True, "varlen"),
    ("deepseek_v2", ("--packing", "--attn_implementation", "sdpa"), True, "sdpa"),  # given: kept
    ("deepseek_v2", (), True, "sdpa"),  # unpacked rows: varlen not measured there
    ("deepseek_v2", ("--packing",), False, "sdpa"),  # no GPU: no kernel
    ("llama", ("--packing",), True, "varlen"),  # dense models' too (deepseek-llm-7b LoRA 1.24x, run 1436Z)
    ("qwen2", ("--packing",), True, "varlen"),
    ("deepseek_v2", ("--packing", "--activation_checkpointing", "true", "--activation_checkpointing_keep_attention",
                     "true"), True, "sdpa"),  # the kept attention needs sdpa's kernels
])
def test_packed_rows_attend_per_document_unless_told_otherwise(tmp_path, model_type, extra, gpu, want):
    model = settled_attention(tmp_path, model_type, *extra, gpu=gpu)
    assert model.attn_implementation == want
    said = any(note.startswith("attention per packed document (varlen") for note in model.speed_choices)
    assert said is (want == "varlen")
