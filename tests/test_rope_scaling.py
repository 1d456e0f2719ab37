"""--rope_scaling (sft/model/rope_scaling.py): rows past a model's positions with its RoPE stretched, as
LLaMA-Factory's option does. The factor covers --max_length; a full fine-tune saves the scaled config; a LoRA
adapter's base loads scaled again (rope_scaling.json) in the save check, chat and merge; a resume keeps it."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import train_here
from sft.errors import ConfigError
from sft.model.rope_scaling import ROPE_RECORD, rope_line, rope_overrides, rope_record


def config(max_positions: int = 512, **rope):
    from transformers import LlamaConfig

    c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=max_positions)
    if rope:
        c.rope_parameters = {**c.rope_parameters, **rope}
    return c


def test_the_factor_is_the_smallest_whole_number_that_covers_max_length():
    linear = rope_overrides(config(), "linear", 1500)  # 1,500 / 512 = 2.9 -> 3
    assert linear == {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 3.0},
                      "max_position_embeddings": 1536}
    for kind in ("dynamic", "yarn"):
        scaled = rope_overrides(config(), kind, 2048)
        assert scaled["rope_parameters"]["original_max_position_embeddings"] == 512
        assert (scaled["rope_parameters"]["factor"], scaled["max_position_embeddings"]) == (4.0, 2048)
    assert rope_overrides(config(), None, 4096) == {}
    assert rope_overrides(config(), "yarn", 512) == {}  # within the model's positions: nothing to stretch
    assert "not scaled" in rope_line("yarn", {}, 512, 512)
    assert rope_line("yarn", rope_overrides(config(), "yarn", 600), 512, 600) == (
        "RoPE: yarn, factor 2: 512 -> 1,024 positions (--rope_scaling)")
    assert "suit fine-tuning better" in rope_line("dynamic", rope_overrides(config(), "dynamic", 600), 512, 600)


def test_a_model_already_scaled_is_refused():
    """DeepSeek-V2's configs already use yarn (factor 40), deepseek-coder's linear x4: stretching it again would be
    another model."""
    with pytest.raises(ConfigError, match="already scaled \\(yarn, factor 40"):
        rope_overrides(config(rope_type="yarn", factor=40), "linear", 4096)
    with pytest.raises(ConfigError, match="already scaled \\(linear, factor 4.0"):  # deepseek-coder's own
        rope_overrides(config(rope_type="linear", factor=4.0), "yarn", 32768)


def test_linear_scaling_gives_position_p_times_factor_the_angle_of_position_p():
    from transformers import LlamaForCausalLM

    from sft.model.rope_scaling import scaled

    base = config()
    stretched = scaled(config(), rope_overrides(config(), "linear", 2048))
    x = torch.zeros(1, 3, 32)
    cos, _ = LlamaForCausalLM(stretched).model.rotary_emb(x, torch.tensor([[0, 400, 2000]]))
    want, _ = LlamaForCausalLM(base).model.rotary_emb(x, torch.tensor([[0, 100, 500]]))
    torch.testing.assert_close(cos, want)


def test_a_wrong_kind_is_refused_with_the_close_one():
    from sft.options.arguments import parse_args

    with pytest.raises(ConfigError, match="--rope_scaling 'yarnn': did you mean yarn\\? Use linear, dynamic, yarn."):
        parse_args(["--rope_scaling", "yarnn"], data_only=True)


def long_data(tmp_path):
    """Conversations of 512 to 1,024 tokens: past the tiny llama's 512 positions."""
    words = " ".join(f"w{i}" for i in range(150))
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Repeat {n}: " + words},
                                                     {"role": "assistant", "content": words}]}) + "\n"
                            for n in range(4)))
    return data


def train(tmp_path, model, name: str, *extra: str):
    output = tmp_path / name
    result = train_here(["--model", str(model), "--dataset", str(long_data(tmp_path)), "--max_length", "1024",
                         "--max_steps", "2", "--save_steps", "1", "--eval_strategy", "no", "--report_to", "none",
                         "--output_dir", str(output), "--dataset_cache_dir", str(tmp_path / "cache"), *extra])
    return output, result


@pytest.mark.slow
def test_a_lora_adapters_base_loads_scaled_in_merge_and_with_plain_peft(tmp_path, tiny_llama):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    output, result = train(tmp_path, tiny_llama, "lora", "--lora", "--rope_scaling", "yarn")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "RoPE: yarn, factor 2: 512 -> 1,024 positions (--rope_scaling)" in result.stdout
    assert "warning: the longest conversation" not in result.stdout  # the scaled positions cover it
    overrides = json.loads((output / ROPE_RECORD).read_text())
    assert overrides["rope_parameters"]["rope_type"] == "yarn" and overrides["max_position_embeddings"] == 1024
    assert rope_record(output / "checkpoint-2") == overrides  # a checkpoint's adapter: its run's record
    # plain peft, as docs/speed.md shows: the base with the record's values gives the trained model's logits
    ids = torch.randint(0, 1000, (1, 700), generator=torch.Generator().manual_seed(0))
    scaled = AutoPeftModelForCausalLM.from_pretrained(output, **overrides).eval()
    unscaled = AutoPeftModelForCausalLM.from_pretrained(output).eval()
    with torch.no_grad():
        want, other = scaled(input_ids=ids).logits, unscaled(input_ids=ids).logits
    assert not torch.allclose(want, other, atol=1e-4)  # the RoPE matters: an unscaled base is another model
    merged = tmp_path / "merged"
    from sft.tools.merge import main as merge

    assert merge([str(output), str(merged), "--dtype", "float32"]) == 0
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert model.config.rope_parameters["rope_type"] == "yarn" and model.config.max_position_embeddings == 1024
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    # a resume without the option would train other positions: refused, naming it
    again, result = train(tmp_path, tiny_llama, "lora", "--lora", "--max_steps", "3", "--resume_from_checkpoint",
                          "true")
    assert result.returncode != 0 and "--rope_scaling yarn (this run: none)" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_a_full_fine_tune_saves_the_scaled_config(tmp_path, tiny_llama):
    from transformers import AutoConfig

    output, result = train(tmp_path, tiny_llama, "full", "--rope_scaling", "linear")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    saved = AutoConfig.from_pretrained(output)
    assert saved.rope_parameters["rope_type"] == "linear" and saved.rope_parameters["factor"] == 2.0
    assert saved.max_position_embeddings == 1024 and not (output / ROPE_RECORD).exists()
    # Without the option, conversations past the 512 positions are warned of, the warning naming the option: checked
    # in test_long_rows.py's test_conversations_past_the_models_positions_are_warned_of_before_loading, whose run
    # shows the same first screen (this test made a second run for it).
