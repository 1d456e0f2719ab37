"""sft/speed/shared_input_adapters.py: under --compile_layers, the LoRA down-projections that read one input (q/k/v,
gate/up) run as one matmul, with the loss and gradients of the eager model; adapters with their own dropout, other
linears, a user's own inductor pass and SFT_SHARED_INPUT_ADAPTERS=0 keep one matmul per adapter."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor

from conftest import tiny_config
from sft.machine import read_launch
from sft.options.arguments import LoraArguments, ModelArguments
from sft.speed import shared_input_adapters
from test_regional_compile import loss_and_grads, packed_batch


@pytest.fixture
def fused(monkeypatch) -> list[int]:
    """The matmuls each compiled graph lost to the pass; inductor's caches off, which would skip the pass on a hit."""
    removed: list[int] = []
    real = shared_input_adapters.share_inputs
    monkeypatch.setattr(shared_input_adapters, "share_inputs", lambda graph: removed.append(real(graph)) or removed[-1])
    with inductor.patch({"force_disable_caches": True, "pre_grad_custom_pass": None}):
        torch._dynamo.reset()
        yield removed
    torch._dynamo.reset()


@pytest.mark.slow
def test_deepseek_adapters_reading_one_input_share_a_matmul_with_the_eager_models_numbers(fused, tmp_path):
    """DeepSeek-V2 (MLA, a dense first layer, then routed and shared experts). Llama's compiled layers, the pass on,
    are checked against the eager model in tests/test_regional_compile.py."""
    from transformers import AutoModelForCausalLM

    from sft.model.loading import load_model

    torch.manual_seed(0)
    config = tiny_config("deepseek_v2", vocab_size=300, num_hidden_layers=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)

    def lora_model(compile_layers: bool):
        torch.manual_seed(0)  # the same LoRA init
        model = load_model(ModelArguments(model=str(tmp_path), compile_layers=str(compile_layers).lower()),
                           LoraArguments(lora=True, lora_dropout=0.0))
        for name, p in model.named_parameters():  # lora_B starts at 0: give the adapters a delta to add
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        return model.train()

    eager, compiled = lora_model(False), lora_model(True)
    batch = packed_batch(300)
    expected, expected_grads = loss_and_grads(eager, batch)
    got, grads = loss_and_grads(compiled, batch)
    # each layer's graph (the dense layer's, the MoE layer's): MLA's q_proj and kv_a_proj adapters (1 fewer), the
    # MLP's gate/up, whose adapters (sft/speed/traced_param_lora.py) cast their input each (1 fewer); the final
    # norm's graph has none
    assert fused == [2, 2, 0]
    assert got == pytest.approx(expected, rel=1e-5)
    assert grads.keys() == expected_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_only_adapters_are_fused_not_narrow_or_frozen_or_biased_linears_nor_behind_dropout(fused):
    """Two adapters (A then B) on one input share a matmul; a narrow projection with no up-projection after it (a
    model's own k/v under grouped-query attention), a frozen A and a biased one are left as they are, and so are
    adapters with a dropout of their own (each draws its own mask: their inputs differ)."""
    F = torch.nn.functional

    def weight(*shape, grad=True):
        return torch.randn(*shape, requires_grad=grad)

    a1, b1, a2, b2 = weight(4, 32), weight(16, 4), weight(4, 32), weight(16, 4)
    narrow, frozen, b3, biased, b4, bias = weight(8, 32), weight(4, 32, grad=False), weight(16, 4), weight(4, 32), \
        weight(16, 4), weight(4)

    def f(x, a1, b1, a2, b2, narrow, frozen, b3, biased, b4):
        dropped = F.linear(F.linear(F.dropout(x, 0.1), a1), b1) + F.linear(F.linear(F.dropout(x, 0.1), a2), b2)
        return (F.linear(F.linear(x, a1), b1) * 2 + F.linear(F.linear(x, a2), b2) + F.linear(F.linear(x, frozen), b3)
                + F.linear(F.linear(x, biased, bias), b4), F.linear(x, narrow), dropped.detach() * 0)

    x = torch.randn(3, 5, 32)
    args = (a1, b1, a2, b2, narrow, frozen, b3, biased, b4)
    expected = f(x, *args)
    shared_input_adapters.install()
    got = torch.compile(f, fullgraph=True)(x, *args)
    assert fused == [1]  # a1 and a2 only
    for want, mine in zip(expected, got):
        torch.testing.assert_close(mine, want)
    sum(t.sum() for t in got).backward()
    assert all(w.grad is not None for w in args if w.requires_grad)


def test_installed_by_compiled_layers_unless_turned_off_or_a_pass_of_the_users_is_set(monkeypatch):
    from sft.speed.regional_compile import compile_decoder_layers

    def installed(env: dict, users=None):
        monkeypatch.setattr("sft.machine.launch", lambda: read_launch(env))
        with inductor.patch({"pre_grad_custom_pass": users}):  # restored after
            compile_decoder_layers(torch.nn.Linear(2, 2))  # no decoder layer: nothing compiled, the settings made
            return inductor.pre_grad_custom_pass

    assert isinstance(installed({}), shared_input_adapters.SharedInputAdapters)
    assert installed({"SFT_SHARED_INPUT_ADAPTERS": "0"}) is None
    def users(graph):
        pass

    assert installed({}, users) is users
