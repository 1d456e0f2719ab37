"""--chunked_loss: the training loss without whole logits (SFTTrainer.compute_loss with a labelled-token loss) gives
the model's own loss and gradients (dense and MoE models, packed rows, LoRA, the Trainer's num_items_in_batch), leaves
evaluation and generation alone, trains through the real entry point, and is refused where another path owns the
loss."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO, tiny_config
from sft.speed.chunked_loss import chunked_causal_lm_loss, liger_causal_lm_loss
from sft.options.arguments import ConfigError, parse_args, validate_setup
from sft.machine import Launch, Machine

DATA = str(REPO / "data" / "alpaca_demo.json")


def tiny(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=300), dtype=torch.float32).train()


def packed_batch(vocab: int) -> dict:
    """Two rows, each two packed documents (position_ids restart), prompts and padding labelled -100."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 24), generator=generator)
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt
    labels[:, 10:13] = -100  # the second document's prompt
    labels[1, 20:] = -100  # padding
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def loss_and_grads(model, batch: dict, **extra) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch, use_cache=False, **extra).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def sft_trainer(model, output_dir, loss_fn=chunked_causal_lm_loss):
    from sft.options.arguments import SFTTrainingArguments
    from sft.trainer import SFTTrainer

    args = SFTTrainingArguments(output_dir=str(output_dir), use_cpu=True, report_to="none")
    return SFTTrainer(model=model, args=args, labelled_token_loss=loss_fn)


def trainer_loss_and_grads(model, batch: dict, output_dir, loss_fn=chunked_causal_lm_loss, num_items_in_batch=None):
    """What a training step computes: SFTTrainer.compute_loss on the batch (as the Collator gives it: no cache)."""
    trainer = sft_trainer(model, output_dir, loss_fn)
    model.train()
    model.zero_grad()
    loss = trainer.compute_loss(model, {**batch, "use_cache": False}, num_items_in_batch=num_items_in_batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def with_positions(batch: dict) -> dict:
    """The batch with the collator's labelled positions (sft/data/packing.py LABELLED_POSITIONS)."""
    from sft.data.packing import LABELLED_POSITIONS, labelled_positions

    return {**batch, LABELLED_POSITIONS: labelled_positions(batch["labels"])}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("num_items", [None, 40])
@pytest.mark.parametrize("positions", [False, True], ids=["mask", "positions"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_same_loss_and_gradients_as_the_models_own(model_type, num_items, positions, lora, monkeypatch, tmp_path):
    """The labelled tokens picked by their mask, or at the collator's positions (index_select: no host wait). A
    full fine-tune trains the lm_head (its chunks recomputed in the backward); LoRA freezes it, and each chunk's
    hidden-state gradient is computed in the forward (FrozenHeadCrossEntropy)."""
    from peft import LoraConfig, get_peft_model

    import sft.speed.chunked_loss

    monkeypatch.setattr(sft.speed.chunked_loss, "CHUNK_TOKENS", 7)  # several chunks, the last one short
    model = tiny(model_type)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    assert (sft.speed.chunked_loss.frozen_head(model.get_output_embeddings()) is not None) is lora
    batch = packed_batch(model.config.vocab_size)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    expected, expected_grads = loss_and_grads(model, batch, **extra)
    got, grads = trainer_loss_and_grads(model, with_positions(batch) if positions else batch, tmp_path,
                                        num_items_in_batch=extra.get("num_items_in_batch"))
    assert got == pytest.approx(expected.item(), rel=1e-5)
    assert grads.keys() == expected_grads.keys() and grads
    assert all("lora_" in n for n in grads) if lora else "lm_head.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_under_mixed_precision_the_loss_runs_in_the_models_autocast(tmp_path):
    """bf16 autocast, a bf16 lm_head beside an fp32 final norm (whose output is fp32): inside the model autocast
    casts both; the labelled-token loss, computed after the forward, must run under the same autocast (on a GPU,
    Liger's kernel failed on 'float != BFloat16' without it). Same loss as the model's own under autocast."""
    from sft.options.arguments import SFTTrainingArguments
    from sft.trainer import SFTTrainer

    model = tiny("llama")
    model.lm_head.to(torch.bfloat16)
    batch = packed_batch(model.config.vocab_size)
    args = SFTTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=True)
    trainer = SFTTrainer(model=model, args=args, labelled_token_loss=chunked_causal_lm_loss)
    wrapped = trainer.accelerator.prepare_model(trainer.model)  # as training wraps it: forward under autocast
    got = trainer.compute_loss(wrapped, {**batch, "use_cache": False})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**batch, use_cache=False).loss
    assert got.item() == pytest.approx(expected.item(), rel=2e-2)


def test_the_loss_asks_the_forward_for_no_hidden_states_and_gets_no_fp32_copies(tmp_path):
    """The last hidden state comes from a hook on the decoder: `output_hidden_states=True` would return every
    layer's, and under bf16 the mixed-precision forward wrapper converts each to fp32 (at 16k tokens of a 7B model,
    7 GiB: the out-of-memory of the first 24 GiB long-row run). Same loss as the model's own under autocast."""
    from sft.options.arguments import SFTTrainingArguments
    from sft.trainer import SFTTrainer

    model = tiny("llama")
    batch = packed_batch(model.config.vocab_size)
    args = SFTTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=True)
    trainer = SFTTrainer(model=model, args=args, labelled_token_loss=chunked_causal_lm_loss)
    wrapped = trainer.accelerator.prepare_model(trainer.model)
    returned = []
    wrapped.register_forward_hook(lambda m, a, kw, out: returned.append((kw, out)), with_kwargs=True)
    got = trainer.compute_loss(wrapped, {**batch, "use_cache": False})
    (kwargs, outputs), = returned
    assert not kwargs.get("output_hidden_states") and outputs.hidden_states is None
    assert outputs.logits.shape[1] == 1  # one position's logits: the loss projected the labelled tokens itself
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**batch, use_cache=False).loss
    assert got.item() == pytest.approx(expected.item(), rel=2e-2)


def test_chunks_are_at_most_chunk_tokens_and_only_labelled_tokens():
    seen = []
    head = torch.nn.Linear(8, 11, bias=False)
    head.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[0]))
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    labels = torch.randint(0, 11, (2, 9))
    labels[0, :5] = -100
    loss = chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=4)
    loss.backward()
    labelled = int((torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:] != -100).sum())
    forward = seen[: len(seen) // 2]  # then the backward's recomputation, chunk by chunk
    assert sum(forward) == labelled == 12 and max(forward) <= 4 and len(seen) == 2 * len(forward)


@pytest.fixture
def liger_reference(monkeypatch):
    """Liger's fused linear cross-entropy is Triton (GPU only): here a reference with its signature and reduction
    stands in, recording how many rows it was given, so the test sees what our code hands it."""
    import sys
    import types

    rows = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, reduction="mean", **_):
        rows.append(input.shape[0])
        logits = input.float() @ weight.float().t() + (0 if bias is None else bias.float())
        return torch.nn.functional.cross_entropy(logits, target, reduction=reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    return rows


@pytest.mark.parametrize("num_items", [None, 40])
@pytest.mark.parametrize("positions", [False, True], ids=["mask", "positions"])
def test_liger_loss_on_the_labelled_tokens_is_the_models_own(num_items, positions, liger_reference, tmp_path):
    model = tiny("llama")
    batch = packed_batch(model.config.vocab_size)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    expected, expected_grads = loss_and_grads(model, batch, **extra)
    got, grads = trainer_loss_and_grads(model, with_positions(batch) if positions else batch, tmp_path,
                                        liger_causal_lm_loss, extra.get("num_items_in_batch"))
    labelled = int((torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:] != -100).sum())
    assert liger_reference == [labelled] and labelled < batch["labels"].numel()  # prompts and padding left out
    assert got == pytest.approx(expected.item(), rel=1e-5)
    assert grads.keys() == expected_grads.keys() and "lm_head.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for loss_fn in (liger_causal_lm_loss, chunked_causal_lm_loss):  # a batch without labels: a zero gradient
        hidden = torch.randn(1, 4, model.config.hidden_size, requires_grad=True)
        none = loss_fn(hidden, model.lm_head, torch.full((1, 4), -100))
        none.backward()
        assert none.item() == 0.0 and bool((hidden.grad == 0).all())
    assert liger_reference == [labelled]  # Liger's kernel is not called without labels


def test_liger_chunks_are_the_fewest_of_at_most_chunk_tokens_rows():
    """Our chunk_mem_const under Liger's chunk rule (its default of 1 gave 256 rows for 4,000 tokens at the 7B
    shape): at most CHUNK_TOKENS rows a chunk where a constant allows it, and one constant more would exceed it; one
    chunk for few tokens."""
    from sft.speed.chunked_loss import CHUNK_TOKENS, liger_chunk_mem_const, liger_chunk_rows

    assert liger_chunk_rows(4000, 4096, 102400, 1) == 256 and liger_chunk_rows(700, 4096, 102400, 25) == 700
    for hidden, vocab in ((4096, 102400), (3584, 152064), (2048, 102400), (7168, 129280), (64, 300)):
        for tokens in (700, 1500, 4000, 8086, 16000):
            constant = liger_chunk_mem_const(tokens, hidden, vocab)
            rows = liger_chunk_rows(tokens, hidden, vocab, constant)
            bigger = liger_chunk_rows(tokens, hidden, vocab, constant + 1)
            assert rows <= CHUNK_TOKENS or constant == 1, (hidden, vocab, tokens, constant)  # 1: Liger's default
            assert bigger > CHUNK_TOKENS or constant >= vocab / hidden, (hidden, vocab, tokens, constant)
            assert rows >= min(tokens, CHUNK_TOKENS // 4), (hidden, vocab, tokens, rows)
    assert liger_chunk_rows(4000, 4096, 102400, liger_chunk_mem_const(4000, 4096, 102400)) == 1024


def test_with_lora_evaluation_and_generation_keep_the_models_path(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    batch = packed_batch(model.config.vocab_size)
    expected, expected_grads = loss_and_grads(model, batch)
    got, grads = trainer_loss_and_grads(model, batch, tmp_path)
    assert got == pytest.approx(expected.item(), rel=1e-5) and all("lora_" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    trainer = sft_trainer(model, tmp_path)
    _, outputs = trainer.compute_loss(model, {**batch, "use_cache": False}, return_outputs=True)
    assert outputs.logits.shape == (2, 1, model.config.vocab_size)  # training: one position's logits, not all
    model.eval()
    with torch.no_grad():
        out = model(**batch, use_cache=False)
        eval_loss = trainer.compute_loss(model, {**batch, "use_cache": False})  # evaluation: the model's own loss
    assert out.logits.shape == (2, 24, model.config.vocab_size) and out.loss is not None
    assert eval_loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert model.generate(input_ids=batch["input_ids"][:1, :5], max_new_tokens=2, do_sample=False).shape == (1, 7)


def logits_matmuls(vocab: int):
    """A dispatch mode counting the matmuls whose output is logits (last dimension `vocab`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == vocab:
                Count.calls += 1
            return out

    return Count()


@pytest.mark.parametrize("bias", [False, True])
def test_a_frozen_head_projects_each_chunk_once_and_scales_its_gradient_in_the_backward(bias):
    """Two lm_head matmuls a chunk, both in the forward (a trained head's chunks are projected again in the
    backward); the loss and the hidden states' gradient are F.cross_entropy's, whatever the backward's scale."""
    from sft.speed.chunked_loss import FrozenHeadCrossEntropy, frozen_head

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias).requires_grad_(False)
    states = torch.randn(11, 16, requires_grad=True)
    targets = torch.randint(0, 50, (11,))
    forward, backward = logits_matmuls(50), logits_matmuls(50)
    with forward:
        loss = FrozenHeadCrossEntropy.apply(states, *frozen_head(head), targets, 4)
    with backward:
        (loss * 0.37).backward()
    assert forward.calls == 3 and backward.calls == 0  # chunks of 4, 4 and 3 rows
    reference = states.detach().clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(head(reference).float(), targets, reduction="sum")
    (expected * 0.37).backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(states.grad, reference.grad, rtol=1e-5, atol=1e-7)
    assert frozen_head(torch.nn.Linear(16, 50)) is None  # a trained head keeps the recomputed chunks


def lm_head_matmul_rows(vocab: int, hidden: int):
    """A dispatch mode keeping the rows of every lm_head matmul: the logits' (last dimension `vocab`) and their
    gradient's times the weight (last dimension `hidden`, inner dimension `vocab`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Rows(TorchDispatchMode):
        seen: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.matmul.default):
                inner = args[-2].shape[-1] if func is not torch.ops.aten.addmm.default else args[1].shape[-1]
                if out.shape[-1] == vocab or (out.shape[-1] == hidden and inner == vocab):
                    Rows.seen.append(out.shape[0])
            return out

    return Rows()


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-head", "trained-head"])
def test_the_last_chunk_is_padded_to_a_quarter_of_a_chunk_and_changes_nothing(frozen):
    """37 labelled tokens in chunks of 16: 16, 16 and 5 rows, the 5 padded to 8 (a quarter of 16 is 4), so that the
    lm_head's matmuls see four shapes at most, whatever the batch; the padding (IGNORE) adds no loss and no
    gradient: the loss and gradients are F.cross_entropy's on the 37 rows."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(not frozen)
    hidden = torch.randn(1, 38, 16, requires_grad=True)
    labels = torch.randint(0, 50, (1, 38))  # shifted by one: 37 targets
    rows = lm_head_matmul_rows(50, 16)
    with rows:
        loss = chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=16)
    loss.backward()
    assert set(rows.seen) == {16, 8}
    reference = hidden.detach().clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(head(reference[0, :-1]).float(), labels[0, 1:])
    grads = [p.grad.clone() for p in head.parameters() if p.requires_grad]
    head.zero_grad()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(hidden.grad, reference.grad, rtol=1e-5, atol=1e-7)
    for got, want in zip(grads, [p.grad for p in head.parameters() if p.requires_grad]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_rows_without_a_label_add_no_loss_and_get_no_gradient():
    """cross_entropy_and_grad_eager (the kernel compiled for the GPU) on IGNORE rows: what F.cross_entropy's
    ignore_index gives, and a zero gradient row."""
    from sft.speed.chunked_loss import cross_entropy_and_grad_eager

    torch.manual_seed(0)
    logits = torch.randn(6, 30, requires_grad=True)
    targets = torch.tensor([3, -100, 7, 29, -100, 0])
    loss, grad = cross_entropy_and_grad_eager(logits.detach(), targets)
    expected = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-7)
    assert bool(grad[[1, 4]].eq(0).all())


def test_a_zero3_frozen_head_is_gathered_for_the_forward_only():
    """LoRA under ZeRO-3: the gathered weight serves the forward's two matmuls a chunk; nothing of it is kept for
    the backward (deepspeed's GatheredParameters on a parameter ZeRO does not partition gathers nothing: here the
    same path on one process)."""
    pytest.importorskip("deepspeed")
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = -100
    grads = []
    for zero3 in (False, True):
        hidden.grad = None
        chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=4, zero3_frozen_head=zero3).backward()
        grads.append(hidden.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert bool(grads[1][0, :2].eq(0).all()) and bool(grads[1][0, 2:].ne(0).any())  # unlabelled positions: none


def test_a_frozen_head_under_autocast_matches_autograd_in_bf16():
    """A bf16 autocast forward (the models' mixed precision): the logits in bf16, their gradient cast to bf16 before
    its matmul with the weight, as autograd does; the fp32 states get an fp32 gradient."""
    from sft.speed.chunked_loss import FrozenHeadCrossEntropy, frozen_head

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300, bias=False).requires_grad_(False)
    states = torch.randn(37, 64, requires_grad=True)
    targets = torch.randint(0, 300, (37,))
    reference = states.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = FrozenHeadCrossEntropy.apply(states, *frozen_head(head), targets, 16)
        expected = torch.nn.functional.cross_entropy(head(reference).float(), targets, reduction="sum")
    loss.backward()
    expected.backward()
    assert states.grad.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(states.grad, reference.grad, rtol=1e-5, atol=1e-6)


def machine() -> Machine:
    return Machine(gpu_names=("NVIDIA GeForce RTX 4090",), gpu_memory_gib=(23.5,), bf16=True, host_ram_gib=64,
                   host_ram_available_gib=60, launch=Launch(), packages=frozenset({"liger_kernel"}))


def test_refused_beside_liger_and_tensor_parallel():
    args = parse_args(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", "--chunked_loss",
                       "true"])
    validate_setup(*args, machine=machine())
    args[3].use_liger_kernel = True
    with pytest.raises(ConfigError, match="--chunked_loss with --use_liger_kernel"):
        validate_setup(*args, machine=machine())


def test_liger_runs_its_fused_loss_on_the_labelled_tokens_where_its_own_would_run():
    from dataclasses import replace

    def liger_setup(*extra: str, launch: Launch = Launch()) -> tuple[dict | None, bool]:
        args = parse_args(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", *extra])
        args[3].use_liger_kernel = True  # parse_args checks against this CPU machine, which has no Liger
        args[0].chunked_loss = "auto"  # as typed: parse_args settled it for a run without Liger
        validate_setup(*args, machine=replace(machine(), launch=launch))
        return args[3].liger_kernel_config, args[3].liger_loss_on_labels

    assert liger_setup() == ({"fused_linear_cross_entropy": False}, True)  # Liger's other kernels as it sets them
    assert liger_setup("--liger_kernel_config", '{"rms_norm": false}') == (
        {"rms_norm": False, "fused_linear_cross_entropy": False}, True)
    off = '{"fused_linear_cross_entropy": false}'
    assert liger_setup("--liger_kernel_config", off) == ({"fused_linear_cross_entropy": False}, False)  # yours
    assert liger_setup("--label_smoothing_factor", "0.1") == (None, False)  # the Trainer's smoothing needs logits
    assert liger_setup(launch=Launch(zero_stage="3", world_size=2)) == (None, False)  # Liger's own under ZeRO-3


def test_trains_through_the_entry_point(tmp_path, tiny_llama, capsys):
    import sft.train

    code = sft.train.main(["--model", str(tiny_llama), "--dataset", DATA, "--output_dir", str(tmp_path / "out"),
                           "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_length", "128",
                           "--packing", "true", "--report_to", "none", "--save_strategy", "no", "--lora", "true",
                           "--chunked_loss", "true", "--dataset_cache_dir", str(tmp_path / "cache")], save=False)
    assert code == 0, capsys.readouterr().err[-2000:]


# ---- --chunked_loss auto (the default): on wherever Liger's fused loss is not

def config_dir(tmp_path, model_type: str) -> str:
    """A model directory holding only a tiny config of `model_type`: all the rule reads before weights load."""
    path = tmp_path / model_type
    tiny_config(model_type).save_pretrained(path)
    return str(path)


def options_for(model: str, *extra: str):
    from sft.options.arguments import read_options

    return read_options(["--model", model, "--dataset", DATA, "--output_dir", "/nonexistent/out", *extra])


def settled(model: str, *extra: str, launch: Launch = Launch()):
    from sft.options.arguments import settle

    return settle(options_for(model, *extra), Machine(launch=launch)).model


NOTE = "loss in chunks on (no [tokens x vocabulary] logits held whole; --chunked_loss false turns it off)"  # CPU


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "llama", "qwen2"])
def test_auto_takes_the_loss_in_chunks_without_liger_and_the_first_screen_says_so(tmp_path, model_type):
    from sft.report.console import run_overview

    m = settled(config_dir(tmp_path, model_type), "--lora")
    assert m.chunked_loss_on
    assert m.speed_choices == (NOTE,)
    text = run_overview(model="m", architecture="DeepseekV2ForCausalLM", total_params=10, trainable_params=1,
                        dtype="float32", adapter_dtype=None, mixed_precision=None, lora_rank=8, processes=1,
                        strategy="no parallelism", devices="CPU", per_device_batch=1, grad_accum=1, data_parallel=1,
                        mean_row_tokens=None, max_steps=1, epochs=None, resume_step=0, output_dir="out", saves="none",
                        tensorboard=None, speed=m.speed_choices)
    assert f"  speed        {NOTE}" in text.splitlines()


def test_auto_reads_no_weights_nor_config(monkeypatch):
    """The rule needs nothing of the model: the embedded tiny model is not built for it, and a model that is not
    there is on too (its own error is said when the run loads it)."""
    import huggingface_hub.constants

    import sft.model.tiny

    monkeypatch.setattr(sft.model.tiny, "ensure_tiny_model", lambda *a, **k: pytest.fail("the tiny model was built"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert settled("tiny-deepseek").chunked_loss_on
    assert settled("/nonexistent/model").chunked_loss_on


def test_auto_is_off_where_the_checks_refuse_it(tmp_path):
    """Beside Liger's fused loss, under --tp_size, and for a trained lm_head under ZeRO-3 on several processes: the
    checks a `true` would meet. A LoRA's frozen lm_head there is gathered once: on."""
    from sft.options.resolve import chunked_loss_allowed

    v2 = config_dir(tmp_path, "deepseek_v2")
    for change in ("use_liger_kernel", "tp_size"):
        o = options_for(v2, "--lora")
        setattr(o.training if change == "use_liger_kernel" else o.model, change, True if change[0] == "u" else 2)
        assert not chunked_loss_allowed(o, Machine())
    zero3 = Launch(zero_stage="3", world_size=2, launched=True)
    assert not chunked_loss_allowed(options_for(v2), Machine(launch=zero3))
    assert chunked_loss_allowed(options_for(v2, "--lora"), Machine(launch=zero3))
    assert chunked_loss_allowed(options_for(v2, "--lora"), Machine())


def test_the_users_word_wins_and_a_bare_flag_means_true(tmp_path):
    v2, llama = config_dir(tmp_path, "deepseek_v2"), config_dir(tmp_path, "llama")
    off = settled(v2, "--chunked_loss", "false")
    assert not off.chunked_loss_on and off.speed_choices == ()  # the whole logits, and nothing said
    assert settled(llama, "--chunked_loss").chunked_loss_on and settled(llama, "--chunked_loss", "true").chunked_loss_on
    assert settled(llama, "--chunked_loss", "true").speed_choices == ()  # asked for: nothing to say
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("chunked_loss: true\n")
    assert settled(llama, "--config", str(recipe)).chunked_loss_on
    with pytest.raises(ConfigError, match=r"--chunked_loss.*: invalid choice: 'maybe' \(choose from 'auto', 'true', 'false'\)"):
        parse_args(["--chunked_loss", "maybe"], data_only=True)


@pytest.mark.parametrize("asked, chunks", [((), True), (("--chunked_loss", "false"), False)])
def test_an_mla_run_trains_with_the_loss_in_chunks_unless_told(tmp_path, asked, chunks, capsys):
    import sft.train
    from conftest import save_tiny_model

    model = save_tiny_model(tmp_path / "v2", "deepseek_v2")
    seen = {}
    code = sft.train.main(["--model", str(model), "--dataset", DATA, "--output_dir", str(tmp_path / "out"),
                           "--max_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "128",
                           "--report_to", "none", "--save_strategy", "no", "--lora", "true",
                           "--dataset_cache_dir", str(tmp_path / "cache"), *asked], save=False,
                          on_trainer=lambda trainer: seen.update(loss=trainer.labelled_token_loss))
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert (getattr(seen["loss"], "func", None) is chunked_causal_lm_loss) is chunks
    assert ("loss in chunks on (no [tokens x vocabulary]" in out.out) is chunks
