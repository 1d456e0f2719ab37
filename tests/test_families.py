"""LoRA targets per DeepSeek family: which modules receive adapters, checked after save and reload."""

from __future__ import annotations

import pytest
import torch

from conftest import save_tiny_model
from test_moe_lora import expected as moe_expected
from sft.options.arguments import LoraArguments, ModelArguments
from sft.model.families import FAMILIES
from sft.model.loading import load_model


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
    if model_type in ("llama", "qwen2", "qwen3"):
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


# ---- presets per released model: identify, check_family, strategy, R1 without reasoning --------------------------

from conftest import DEEPSEEK_TOKENIZER, needs_shared, run_train, tiny_config  # noqa: E402
from sft.model.families import (VARIANTS, R1DistillWithoutReasoning, check_family, identify,  # noqa: E402
                          parameter_count, strip_reasoning)
from sft.plan.box import strategy  # noqa: E402


def tiny_tokenizer():
    from transformers import AutoTokenizer

    from sft.model.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


@pytest.mark.parametrize("model_type,vocab,name,template", [
    ("llama", 102400, "deepseek-llm", "deepseek"),
    ("llama", 32256, "deepseek-coder", "deepseek_coder"),
    ("llama", 128256, "R1-Distill-Llama", "r1_distill"),
    ("qwen2", 151936, "R1-Distill-Qwen", "r1_distill"),
    ("qwen2", 152064, "R1-Distill-Qwen", "r1_distill"),
    ("deepseek_v2", 102400, "DeepSeek-V2", "deepseek"),
    ("deepseek_v3", 129280, "DeepSeek-V3", "deepseek_v3"),
])
def test_each_family_is_told_apart_by_its_config(model_type, vocab, name, template):
    config = tiny_config(model_type, vocab_size=vocab)
    variant = identify(config)
    assert variant.name == name and variant.template == template
    assert FAMILIES[model_type].lora_modules  # the LoRA targets come from the same table


def test_every_covered_model_is_in_the_table():
    models = {m.split("/")[1] for v in VARIANTS for m in v.models}
    for wanted in ("deepseek-llm-7b-base", "deepseek-llm-67b-chat", "deepseek-coder-6.7b-instruct",
                   "deepseek-coder-33b-instruct", "DeepSeek-R1-Distill-Qwen-1.5B", "DeepSeek-R1-Distill-Qwen-7B",
                   "DeepSeek-R1-Distill-Qwen-14B", "DeepSeek-R1-Distill-Qwen-32B", "DeepSeek-R1-Distill-Llama-8B",
                   "DeepSeek-R1-Distill-Llama-70B", "DeepSeek-V2", "DeepSeek-V2-Lite", "DeepSeek-V3"):
        assert wanted in models


@needs_shared
def test_the_real_coder_tokenizer_and_config():
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(DEEPSEEK_TOKENIZER)
    tokenizer = AutoTokenizer.from_pretrained(DEEPSEEK_TOKENIZER)
    assert identify(config, tokenizer).name == "deepseek-coder"
    # Detected by the tokenizer alone too (its <|EOT|> and FIM tokens), whatever the vocabulary size says.
    assert identify(tiny_config("llama", vocab_size=len(tokenizer)), tokenizer).name == "deepseek-coder"
    assert check_family(config, tokenizer, "auto") == []  # auto resolves to deepseek_coder: all as expected
    assert check_family(config, tokenizer, "deepseek_coder") == []
    wrong = check_family(config, tokenizer, "deepseek_v3")
    assert any("--template deepseek_v3 on deepseek-coder" in w and "use --template deepseek_coder" in w
               for w in wrong)
    assert any("generate() will not stop" in w for w in wrong)  # V3's EOS is not this model's eos (<|EOT|>)
    # Without its linear RoPE scaling x4 (a config edited, or converted without it):
    config.rope_parameters = {"rope_type": "default", "rope_theta": 100000.0}
    assert any("RoPE scaling" in w and "linear" in w for w in check_family(config, tokenizer, "deepseek_coder"))
    # The base model's eos (<｜end▁of▁sentence｜>, id 32014) with the instruct template, which ends with <|EOT|>:
    base = AutoConfig.from_pretrained(DEEPSEEK_TOKENIZER, eos_token_id=32014)
    assert any("<|EOT|> (id 32021)" in w and "will not stop" in w for w in check_family(base, tokenizer, "auto"))
    # A tokenizer without a chat template (a base model's): `auto` falls back to deepseek, and the run says that
    # this family's chat models use deepseek_coder (docs/data.md, the `auto` row).
    tokenizer.chat_template = None
    assert any(w.startswith("--template auto (resolved to deepseek) on deepseek-coder (the tokenizer has no chat "
                            "template): this family's chat models use --template deepseek_coder")
               for w in check_family(config, tokenizer, "auto"))


def test_wrong_template_warns_with_the_familys_own():
    tokenizer = tiny_tokenizer()  # deepseek-llm's special tokens and chat template (the embedded tiny model)
    config = tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    assert identify(config, tokenizer).name == "deepseek-llm"
    assert check_family(config, tokenizer, "auto") == []
    assert check_family(config, tokenizer, "deepseek") == []
    warnings = check_family(config, tokenizer, "deepseek_v3")
    assert len(warnings) == 1 and warnings[0].startswith("--template deepseek_v3 on deepseek-llm") and \
        "use --template deepseek," in warnings[0]
    # V2 chat models use deepseek (V2.5 and 0628 deepseek_v3): both are fine there; deepseek_coder is not.
    v2 = tiny_config("deepseek_v2", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    assert check_family(v2, tokenizer, "deepseek_v3") == [] and check_family(v2, tokenizer, "deepseek") == []
    assert "use --template deepseek," in check_family(v2, tokenizer, "deepseek_coder")[0]
    qwen = tiny_config("qwen2", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    assert "use --template r1_distill" in check_family(qwen, tokenizer, "deepseek")[0]


def test_other_warnings():
    tokenizer = tiny_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    assert any("not needed" in w for w in check_family(config, tokenizer, "auto", trust_remote_code=True))
    small = tiny_config("llama", vocab_size=len(tokenizer) - 10, eos_token_id=tokenizer.eos_token_id)
    assert any("embedding only" in w for w in check_family(small, tokenizer, "auto"))
    assert check_family(_config("mistral"), tokenizer, "auto")[0].startswith("model_type 'mistral' is none")
    # A Llama 3 tokenizer (not DeepSeek's BOS) on a 128256 vocabulary: not R1-Distill-Llama.
    llama3 = types_namespace(bos_token="<|begin_of_text|>", vocab=["<|begin_of_text|>"])
    assert identify(tiny_config("llama", vocab_size=128256), llama3) is None


def _config(model_type):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def types_namespace(bos_token, vocab):
    from types import SimpleNamespace

    return SimpleNamespace(bos_token=bos_token, get_vocab=lambda: dict.fromkeys(vocab, 0))


@pytest.mark.parametrize("model,lora,config", [
    ("deepseek-r1-distill-qwen-1.5b", True, "ddp.yaml"), ("deepseek-llm-7b", True, "ddp.yaml"),
    # R1-Distill-Qwen-14B LoRA: FSDP's plans counted from accelerate's units (the embedding gathered for the forward
    # only, the tail to the loss's backward: planner.fsdp_adapter_buffers) leave the card its margin (21.1 GiB by
    # nvidia-smi at micro-batch 4), at ZeRO-3's speed class, and come first in the strategy table
    ("deepseek-r1-distill-llama-8b", True, "ddp.yaml"), ("deepseek-r1-distill-qwen-14b", True, "fsdp.yaml"),
    # V2-Lite: its ZeRO-3 row measured 24.6 GiB by nvidia-smi on 2 GPUs (over a real card) and 1.1% MFU, which
    # bounds its offload plans too; with equal estimates the plan with room (offload, micro-batch 4) is chosen
    ("deepseek-v2-lite", True, "zero3_offload.yaml"), ("deepseek-llm-67b", True, "zero3_offload.yaml"),
    # R1-Distill-Llama-8B full: its FSDP plans come within 1 GiB of the card (23.9 GiB by nvidia-smi at best)
    ("deepseek-llm-7b", False, "fsdp.yaml"), ("deepseek-r1-distill-llama-8b", False, "zero3_offload.yaml"),
    ("deepseek-r1-distill-qwen-14b", False, "zero3_offload.yaml"), ("deepseek-llm-67b", False, None),
])
def test_strategy_on_three_24gb_cards(model, lora, config):
    chosen = strategy(model, lora)
    assert (chosen.config and chosen.config.split("/")[-1]) == config, chosen.why
    if chosen.config:
        assert (REPO / chosen.config).is_file()


def test_strategy_is_the_planners_choice():
    """One memory model: the box's strategy (sft/plan/box.py) is the planner's best plan for it (sft/plan/planner.py),
    host RAM included; a config that the planner has no built-in shape for is read through its config (no weights)."""
    from transformers import AutoConfig

    from sft.plan.plans import Box, best_plan, enumerate_plans
    from sft.plan.shapes import SHAPES
    from sft.plan.box import recommended_strategy
    from sft.parallel.strategies import STRATEGIES

    for name in ("deepseek-llm-7b", "deepseek-v2-lite"):  # the resident plan is opt-in (--quantize_experts)
        plans = enumerate_plans(SHAPES[name], Box(3, 24, 512.0), "lora")
        best = best_plan([p for p in plans if not p.w.resident])
        assert strategy(SHAPES[name], True).config == STRATEGIES[best.w.strategy].accelerate_config
    small_host = strategy("deepseek-llm-67b", True, host_ram_gib=128)
    assert small_host.config is None and "host RAM > 128" in small_host.why
    v3 = recommended_strategy(AutoConfig.for_model("deepseek_v3"), lora=True)  # 671B
    assert v3.config is None and "671.0B parameters" in v3.why


def test_parameter_count_from_a_config_reads_no_weights():
    from transformers import AutoConfig

    assert round(parameter_count(AutoConfig.for_model("deepseek_v3")) / 1e9) == 671  # a meta copy: instant


def test_r1_without_reasoning_renders_answers_only_and_saves_matching_jinja():
    from sft.data.templates import R1Distill

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]
    assert strip_reasoning("<think>\nx\n</think>\n\nanswer") == "answer" and strip_reasoning("plain") == "plain"
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    keep, drop = R1Distill(bos, eos), R1DistillWithoutReasoning(bos, eos)
    # the reasoning is trained (its opening `<think>\n` is the generation prompt's, so prompt: sft/data/templates.py)
    assert "add them\n</think>" in "".join(t for ex in keep.examples(messages) for t, trained in ex if trained)
    trained = [t for t, is_trained in drop.render(messages) if is_trained]
    assert trained == ["4" + eos, "6" + eos]
    assert drop.text(messages[:2], add_generation_prompt=True).endswith("<｜Assistant｜>")
    assert keep.text(messages[:2], add_generation_prompt=True).endswith("<｜Assistant｜><think>\n")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = drop.chat_template  # what training would save: renders exactly as training did
    for prefix, prompt in ((messages, False), (messages[:4], True)):
        assert tokenizer.apply_chat_template(prefix, tokenize=False, add_generation_prompt=prompt) == \
            R1DistillWithoutReasoning(tokenizer.bos_token, tokenizer.eos_token).text(prefix, prompt)


def test_remote_code_only_with_the_flag(tmp_path):
    """A hub config that points at remote code (auto_map) still loads transformers' own class without the flag."""
    import json

    from transformers import AutoConfig

    config = tiny_config("deepseek_v2")
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    loaded = AutoConfig.from_pretrained(tmp_path, trust_remote_code=False)
    assert type(loaded).__module__.startswith("transformers.models.deepseek_v2")


REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_r1_0528_qwen3_preset_and_v32_refused():
    """R1-0528-Qwen3-8B (model_type qwen3): its family, LoRA targets (test_lora_targets_survive_save_and_reload runs
    qwen3 too) and template; DeepSeek-V3.2 loads in transformers but is refused with one error."""
    from sft.errors import ConfigError
    from sft.model.families import refuse_unsupported

    config = tiny_config("qwen3", vocab_size=151936)
    assert identify(config).name == "R1-0528-Qwen3" and identify(config).template == "r1_0528"
    assert FAMILIES["qwen3"].lora_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"]
    refuse_unsupported(config)  # nothing to refuse
    with pytest.raises(ConfigError, match="^DeepSeek-V3.2 \\(model_type deepseek_v32\\) is not supported"):
        refuse_unsupported(tiny_config("deepseek_v32"))


def test_v32_is_refused_by_the_data_tool_and_the_planner_with_trainings_error(tmp_path, capsys):
    """`deepseek-sft data` and `deepseek-sft plan --model <dir>` on a DeepSeek-V3.2 directory (a config and a
    tokenizer: neither loads weights) stop with training's one error line, not data in another family's layout or a
    plan that training then refuses."""
    import json

    from sft.data.dataset import main as data_main
    from sft.errors import ConfigError
    from sft.model.families import refuse_unsupported
    from sft.plan.planner import main as plan_main

    v32 = tmp_path / "v32"
    tiny_config("deepseek_v32").save_pretrained(v32)
    tiny_tokenizer().save_pretrained(v32)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(ConfigError) as refused:
        refuse_unsupported(tiny_config("deepseek_v32"))
    expected = f"error: {refused.value}\n"
    capsys.readouterr()
    assert data_main(["--model", str(v32), "--dataset", str(data), "--dataset_cache_dir", str(tmp_path / "cache")]) == 2
    assert capsys.readouterr().err == expected
    assert plan_main(["--model", str(v32)]) == 2
    assert capsys.readouterr().err == expected
    # training: the same line, before the data is read or the run's record is written into --output_dir (a weights
    # file as a real checkpoint has one: a directory without weights is told so first)
    from safetensors.torch import save_file

    save_file({}, str(v32 / "model.safetensors"))
    out = tmp_path / "out"
    trained = run_train(["--model", str(v32), "--dataset", str(data), "--output_dir", str(out)])
    assert trained.returncode == 2 and trained.stderr == expected, trained.stderr
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
