"""--lora_experts computes the routed experts' LoRA low-rank beside their grouped matmul (sft/speed/expert_lora.py):
peft's loss and gradients without peft's expert-sized parametrized weight, peft's own forward wherever the split
does not apply, one compiled graph for every MoE layer, and an adapter that loads and merges as peft's."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from sft.options.arguments import LoraArguments, ModelArguments

FAMILIES = ["deepseek_v2", "deepseek_v3"]


def packed_batch(vocab: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 32), generator=generator)
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "labels": labels}


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def adapted_models(tmp_path, model_type: str, layers: int = 3):
    """(ours, peft's own): the same tiny MoE model and adapter (lora_B random, so that the experts' LoRA adds
    something), ours through sft's loading with --lora_experts, peft's through get_peft_model with the same
    config and no custom module."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from sft.model.loading import load_model

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=300, num_hidden_layers=layers)).save_pretrained(
        tmp_path / model_type)
    lora = LoraArguments(lora=True, lora_r=8, lora_dropout=0.0)
    lora.lora_experts = True
    ours = load_model(ModelArguments(model=str(tmp_path / model_type), dtype="float32"), lora).train()
    for name, p in ours.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    config = ours.peft_config["default"]
    config._custom_modules = None  # peft's own ParamWrapper
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / model_type, dtype=torch.float32)
    theirs = get_peft_model(plain, config).train()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def split_wrappers(model) -> list:
    from sft.speed.expert_lora import SplitExpertLora

    return [m for m in model.modules() if isinstance(m, SplitExpertLora)]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_experts_lora_gives_peft_s_loss_and_gradients_without_its_parametrized_weight(tmp_path, model_type,
                                                                                          monkeypatch):
    from peft.tuners.lora.layer import ParamWrapper

    ours, theirs = adapted_models(tmp_path, model_type)
    wrappers = split_wrappers(ours)
    assert len(wrappers) == 2 * 2 and not split_wrappers(theirs)  # gate_up_proj and down_proj of 2 MoE layers
    assert all(type(m).__name__ == "ParamWrapper" for m in wrappers)  # peft finds nested wrappers by this name
    batch = packed_batch(300)
    expected, expected_grads = loss_and_grads(theirs, batch)

    used = []
    activate = ParamWrapper._activate_lora
    monkeypatch.setattr(ParamWrapper, "_activate_lora",
                        lambda self, adapters: used.append(self.parameter_name) or activate(self, adapters))
    got, grads = loss_and_grads(ours, batch)
    # peft's parametrization never runs: not for the experts, nor for the shared experts' and dense MLP's 2-D weights
    # (sft/speed/traced_param_lora.py)
    assert used == []
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys() and any(".experts." in n and "lora_A" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_peft_s_own_forward_runs_where_the_split_does_not_apply(tmp_path):
    """Adapters disabled (peft's disable_adapter, as a reference model would use it), two adapters at once, or
    merged: peft's forward, peft's numbers."""
    ours, theirs = adapted_models(tmp_path, "deepseek_v2", layers=2)
    batch = packed_batch(300)
    with torch.no_grad():
        with ours.disable_adapter(), theirs.disable_adapter():
            torch.testing.assert_close(ours(**batch).logits, theirs(**batch).logits)
        assert all(w._split_factors() is not None for w in split_wrappers(ours))
        ours.base_model.merge_adapter()
        theirs.base_model.merge_adapter()
        assert all(w._split_factors() is None for w in split_wrappers(ours))
        torch.testing.assert_close(ours(**batch).logits, theirs(**batch).logits, rtol=1e-5, atol=1e-5)


def test_a_rank_the_grouped_matmul_cannot_align_goes_through_peft(tmp_path):
    """torch's grouped matmul wants 16-byte rows: rank-4 activations in bf16 are 8 bytes, so peft's forward."""
    from transformers import AutoModelForCausalLM

    from sft.model.loading import load_model

    AutoModelForCausalLM.from_config(tiny_config("deepseek_v2", vocab_size=300)).save_pretrained(tmp_path / "v2")
    for rank, dtype, split in ((4, "bfloat16", False), (8, "bfloat16", True), (4, "float32", True)):
        lora = LoraArguments(lora=True, lora_r=rank, lora_dropout=0.0)
        lora.lora_experts = True
        model = load_model(ModelArguments(model=str(tmp_path / "v2"), dtype=dtype), lora)
        assert all((w._split_factors() is not None) == split for w in split_wrappers(model)), (rank, dtype)


@pytest.mark.slow
def test_compiled_moe_layers_with_the_experts_lora_are_one_graph_without_breaks(tmp_path):
    """--compile_layers with --lora_experts: peft's parametrization (a Tensor.set_ dynamo cannot trace) broke every
    MoE layer's graph and its per-module class recompiled each layer. Now one graph per layer kind (the dense
    first layer, the MoE layers) and the eager loss and gradients."""
    from torch._dynamo.utils import counters

    from sft.speed.regional_compile import compile_decoder_layers

    ours, theirs = adapted_models(tmp_path, "deepseek_v2", layers=4)
    batch = packed_batch(300)
    expected, expected_grads = loss_and_grads(theirs, batch)
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(ours) == 4
    got, grads = loss_and_grads(ours, batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # the dense first layer's graph, the MoE layers', the final norm's
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


@pytest.mark.slow
def test_compiled_bf16_layers_hand_the_grouped_matmul_dense_factors(tmp_path):
    """In bf16 a compiled layer runs torch's grouped matmul itself (fp32 goes through transformers' fallback op), and
    inductor hands it the adapter's factors as laid out: peft's lora_B interleaves the experts, which the kernel
    refuses ("Invalid strides/sizes"; the first GPU run of --lora_experts stopped so) unless copied row-major."""
    from torch._inductor.utils import run_and_get_code
    from transformers import AutoModelForCausalLM

    from sft.model.loading import load_model
    from sft.speed.regional_compile import compile_decoder_layers

    torch.manual_seed(0)
    config = tiny_config("deepseek_v2", vocab_size=300, num_hidden_layers=3, hidden_size=128,
                         intermediate_size=256, moe_intermediate_size=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "v2")
    lora = LoraArguments(lora=True, lora_r=16, lora_dropout=0.0)
    lora.lora_experts = True
    model = load_model(ModelArguments(model=str(tmp_path / "v2"), dtype="bfloat16"), lora).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    batch = packed_batch(300)
    expected, _ = loss_and_grads(model, batch)
    compile_decoder_layers(model)
    (got, grads), code = run_and_get_code(loss_and_grads, model, batch)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    assert any(".experts." in n and "lora_B" in n for n in grads)
    # the copy stays an op of its own in inductor's code: on CUDA inductor laid a copy it could see through out as
    # its source (run 20261207T0228Z), which the CPU's kernel choice does not show
    assert any("sft.row_major_copy" in c for c in code)
