"""LoRA on the DeepSeek MoE families (deepseek_v2, deepseek_v3): which weights the default adapter adapts (MLA
projections, the dense layers' MLP, the shared experts; the routed experts only with --lora_experts; never the
router), checked on the live model, in the saved file, after a plain-peft reload, and after sft.tools.merge."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DEEPSEEK_TOKENIZER, needs_shared, save_tiny_model
from sft.options.arguments import LoraArguments, ModelArguments
from sft.model.families import FAMILIES
from sft.model.loading import load_model, load_tokenizer

TEXTS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
         "Write a function that reverses a string in Python."]


def lora_args(experts: bool, **kwargs) -> LoraArguments:
    args = LoraArguments(lora=True, lora_r=4, **kwargs)
    args.lora_experts = experts  # set as an attribute: works before and after LoraArguments has the field
    return args


def adapted(model) -> set[str]:
    """The adapted weights, by path from `layers.`: `layers.0.mlp.gate_proj` for a layer's weight,
    `layers.1.mlp.experts.gate_up_proj` for a fused expert parameter."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    paths = set()
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and module.lora_A:
            path = name[name.index("layers."):].replace(".base_layer", "")
            if isinstance(module, ParamWrapper) and module.parameter_name != "weight":
                path += f".{module.parameter_name}"
            paths.add(path)
    return paths


def expected(config, experts: bool) -> set[str]:
    """What the README promises for this config."""
    attention = ["q_proj"] if config.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    attention += ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    paths = set()
    for i in range(config.num_hidden_layers):
        paths |= {f"layers.{i}.self_attn.{p}" for p in attention}
        mlp = "mlp" if i < config.first_k_dense_replace else "mlp.shared_experts"
        paths |= {f"layers.{i}.{mlp}.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
        if experts and i >= config.first_k_dense_replace:
            paths |= {f"layers.{i}.mlp.experts.gate_up_proj", f"layers.{i}.mlp.experts.down_proj"}
    return paths


def saved_modules(adapter_dir) -> set[str]:
    """Module paths (from `layers.`) of the weights in the saved adapter file."""
    from safetensors import safe_open

    with safe_open(adapter_dir / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    return {k[k.index("layers."):].rsplit(".lora_", 1)[0].replace(".base_layer", "") for k in keys}


def logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


@needs_shared
@pytest.mark.parametrize("experts", [False, True], ids=["default", "lora_experts"])
@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_moe_lora_targets_save_reload_merge(tmp_path, model_type, experts):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sft.tools.merge import main as merge

    base_dir = save_tiny_model(tmp_path / "base", model_type, tokenizer_dir=DEEPSEEK_TOKENIZER)
    model = load_model(ModelArguments(model=str(base_dir), dtype="float32"), lora_args(experts))
    config = model.config
    assert (config.first_k_dense_replace, config.q_lora_rank is None) == (1, model_type == "deepseek_v2")
    want = expected(config, experts)
    assert adapted(model) == want
    assert not any(p.endswith("mlp.gate") for p in adapted(model)), "the router must never be adapted"

    # one optimizer step on a real tokenized batch: every adapter gets a nonzero lora_B
    tokenizer = load_tokenizer(ModelArguments(model=str(base_dir)))
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.train()
    loss = model(**batch, labels=labels, use_cache=False).loss
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    torch.optim.AdamW(trainable, lr=1e-2).step()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            assert p.abs().sum() > 0, f"{name} did not train"
    expected_logits = logits(model, batch)
    with model.disable_adapter():
        assert not torch.allclose(logits(model, batch), expected_logits, atol=1e-3), "the adapter changes nothing"

    model.save_pretrained(tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir)
    assert saved_modules(tmp_path / "adapter") == {p.split(".experts.")[0] + ".experts" if ".experts." in p else p
                                                   for p in want}

    # plain peft on the plain transformers model: the same adapted weights, the same logits
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    assert adapted(reloaded) == want
    torch.testing.assert_close(logits(reloaded, batch), expected_logits)

    assert merge([str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged, batch), expected_logits, rtol=1e-4, atol=1e-4)


def test_user_mlp_names_and_all_linear_keep_the_dense_and_shared_mlp():
    """peft turns a module target named gate_proj/up_proj/down_proj into the routed experts on these models; a
    user's names still mean the layers so named, and all-linear means every linear layer but the router."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config
    from sft.model.loading import attach_lora

    config = tiny_config("deepseek_v2")
    user = lora_args(False, lora_target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"])
    model = attach_lora(AutoModelForCausalLM.from_config(config), user, False)
    assert adapted(model) == {p for p in expected(config, False) if "self_attn" not in p or p.endswith("o_proj")}
    everything = attach_lora(AutoModelForCausalLM.from_config(config),
                             lora_args(False, lora_target_modules=["all-linear"]), False)
    assert adapted(everything) == expected(config, True)
    llama = attach_lora(AutoModelForCausalLM.from_config(tiny_config("llama")),
                        lora_args(False, lora_target_modules=["all-linear"]), False)  # the CLI's list of one
    assert {p.rsplit(".", 1)[-1] for p in adapted(llama)} == set(FAMILIES["llama"].lora_modules)


def test_lora_experts_needs_routed_experts(tmp_path):
    from sft.errors import ConfigError

    base_dir = save_tiny_model(tmp_path / "base", "llama")
    with pytest.raises(ConfigError, match="--lora_experts"):
        load_model(ModelArguments(model=str(base_dir)), lora_args(True))
