"""LoRA under autocast: the adapted layers' inputs go to the LoRA matmuls without peft's fp32 round trip, and the
loss and every gradient stay bit-identical to peft's own path (correctness before speed)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sft.options.arguments import LoraArguments


class CountFp32Copies(TorchDispatchMode):
    """Counts dtype conversions to float32 of activation-sized tensors (more than `min_numel` values)."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.count = min_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float32 \
                and args[0].dtype != torch.float32 and args[0].numel() >= self.min_numel:
            self.count += 1
        return func(*args, **kwargs)


def lora_model(path, peft_casts: bool, monkeypatch):
    from transformers import AutoModelForCausalLM

    from sft.machine import Launch
    from sft.model.loading import attach_lora

    # SFT_PEFT_INPUT_CAST=1 or unset, as the launch read once says it (attach_lora asks it)
    monkeypatch.setattr("sft.model.loading.launch", lambda: Launch(peft_input_cast=peft_casts))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)  # bf16 frozen base, as on GPUs
    model = attach_lora(model, LoraArguments(lora=True, lora_dropout=0.0), False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter, so that the LoRA path changes the loss
    return model


def loss_and_grads(model, input_ids: torch.Tensor, autocast: bool, counter: CountFp32Copies | None = None):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if counter is not None:
            with counter:
                loss = model(input_ids=input_ids, labels=input_ids).loss
        else:
            loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_autocast_lora_skips_the_fp32_round_trip_with_identical_loss_and_gradients(tiny_llama, monkeypatch):
    input_ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    peft = lora_model(tiny_llama, peft_casts=True, monkeypatch=monkeypatch)
    ours = lora_model(tiny_llama, peft_casts=False, monkeypatch=monkeypatch)
    activation = input_ids.numel() * peft.config.hidden_size
    peft_count, our_count = CountFp32Copies(activation), CountFp32Copies(activation)
    expected_loss, expected_grads = loss_and_grads(peft, input_ids, True, peft_count)
    loss, grads = loss_and_grads(ours, input_ids, True, our_count)
    assert peft_count.count > 0 and our_count.count < peft_count.count, (peft_count.count, our_count.count)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    for name in grads:
        assert torch.equal(grads[name], expected_grads[name]), name


def test_without_autocast_peft_still_casts(tiny_llama, monkeypatch):
    """A bf16 base with fp32 adapter weights outside autocast (e.g. a check's plain forward) needs the cast."""
    model = lora_model(tiny_llama, peft_casts=False, monkeypatch=monkeypatch)
    input_ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("peft_casts", [True, False])
def test_the_adapter_stays_fp32(tiny_llama, monkeypatch, peft_casts):
    model = lora_model(tiny_llama, peft_casts, monkeypatch)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
