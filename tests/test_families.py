"""LoRA targets per DeepSeek family: which modules receive adapters, checked after save and reload."""

from __future__ import annotations

import pytest
import torch

from conftest import save_tiny_model
from test_moe_lora import expected as moe_expected
from sft.config import LoraArguments, ModelArguments
from sft.families import FAMILIES
from sft.model import load_model


def adapted(model) -> set[str]:
    """Names of the modules carrying LoRA weights, with the layer index and peft's prefixes removed."""
    names = set()
    for name, _ in model.named_parameters():
        if "lora_A" in name:
            module = name.split(".lora_A")[0].replace("base_model.model.model.", "")
            names.add(module.replace(".base_layer", ""))
    return names


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_lora_targets_survive_save_and_reload(tmp_path, model_type):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = save_tiny_model(tmp_path / "base", model_type)
    model = load_model(ModelArguments(model=str(base_dir)), LoraArguments(lora=True, lora_r=4))
    targets = adapted(model)
    layers = model.config.num_hidden_layers
    if model_type in ("llama", "qwen2"):
        expected = {f"layers.{i}.{kind}.{p}" for i in range(layers)
                    for kind, p in [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                                    ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
                                    ("mlp", "down_proj")]}
        assert targets == expected
    else:  # DeepSeek MoE: MLA, dense layers' MLP, shared experts; no routed experts, no router (test_moe_lora.py)
        assert targets == moe_expected(model.config, experts=False)

    with torch.no_grad():  # make the adapter non-trivial, then check the reload carries exactly these weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    assert adapted(reloaded) == targets
    saved = {n: p for n, p in model.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert saved.keys() == loaded.keys()
    for name in saved:
        torch.testing.assert_close(saved[name], loaded[name], rtol=0, atol=0)
