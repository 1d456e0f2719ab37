"""Long rows on one card: --mlp_tile_tokens (sft/speed/tiled_mlp.py) and --offload_activations (SFTTrainer) give
the plain path's loss and gradients. Their memory and speed at 16k-32k tokens are bench/RESULTS.md's."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import lora_demo_run, train_here


def tiny_lora_llama(checkpointing: bool, checkpoint_kwargs: dict | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs or {"use_reentrant": False})
        model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))


def tiny_lora_model(model_type: str, checkpointing: bool, checkpoint_kwargs: dict | None = None):
    """A 3-layer model of a family we train, with LoRA on the family's default targets as training attaches it
    (sft/model/loading.py attach_lora: DeepSeek MoE's MLP weights as target_parameters), its B matrices random so
    that every LoRA weight has a gradient to compare; llama: tiny_lora_llama. `checkpoint_kwargs`: what
    transformers' checkpoint of each layer gets (default: the non-reentrant checkpoint alone)."""
    if model_type == "llama":
        return tiny_lora_llama(checkpointing, checkpoint_kwargs)
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config
    from sft.model.loading import attach_lora
    from sft.options.arguments import LoraArguments

    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=256, num_hidden_layers=3, intermediate_size=160)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs or {"use_reentrant": False})
    model = attach_lora(model, LoraArguments(lora=True, lora_r=4, lora_dropout=0.0), checkpointing)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return model


def loss_and_grads(model, ids):
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_tiled_mlp_gives_the_whole_mlps_loss_and_gradients_and_keeps_its_names(checkpointing, model_type):
    """Every family we train: the dense MLPs tiled (DeepSeek MoE: its first, dense layer; the MoE blocks whole)."""
    from sft.speed.tiled_mlp import tile_mlps

    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))  # 100 = 6 x 16 + 4
    plain = tiny_lora_model(model_type, checkpointing)
    tiled = tiny_lora_model(model_type, checkpointing)
    keys = tiled.state_dict().keys()
    dense = getattr(tiled.config, "first_k_dense_replace", None) or 3
    mlp = tiled.base_model.model.model.layers[0].mlp
    whole = type(mlp).__name__
    assert tile_mlps(tiled, 16) == (dense, 3 - dense)
    assert type(mlp).__name__ == f"Tiled{whole}" and whole.endswith("MLP")
    assert tiled.state_dict().keys() == keys
    want_loss, want = loss_and_grads(plain, ids)
    got_loss, got = loss_and_grads(tiled, ids)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def gate_runs(model) -> list[int]:
    """A step's forwards of each dense MLP's gate projection (its frozen base layer under LoRA), layer by layer."""
    runs = []
    for layer in model.base_model.model.model.layers:
        gate = getattr(layer.mlp, "gate_proj", None)
        if gate is None:  # an MoE block
            continue
        runs.append(0)
        gate.base_layer.register_forward_hook(lambda *_, i=len(runs) - 1: runs.__setitem__(i, runs[i] + 1))
    return runs


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("keep_attention", [False, True])
def test_in_a_checkpointed_layer_each_tile_runs_twice_a_step_and_gives_the_whole_mlps_gradients(model_type,
                                                                                              keep_attention):
    """Eager layers as --mlp_tile_tokens gets them (sft/speed/layer_checkpoint.py): each tile runs in the forward and
    in its own recompute, not once more in the layer's (which torch runs first and stops at the last tile's input),
    with or without the kept attention. The layer's recompute unmarked, as before: 7 + 6 + 7 of 7 tiles."""
    from sft.speed.layer_checkpoint import checkpoint_kwargs
    from sft.speed.tiled_mlp import tile_mlps

    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))  # 7 tiles of up to 16
    want_loss, want = loss_and_grads(tiny_lora_model(model_type, True), ids)
    for marked, runs_per_layer in ((True, 2 * 7), (False, 7 + 6 + 7)):
        model = tiny_lora_model(model_type, True, checkpoint_kwargs(keep_attention, tiled_mlps=marked))
        tile_mlps(model, 16)
        runs = gate_runs(model)
        got_loss, got = loss_and_grads(model, ids)
        assert runs == [runs_per_layer] * len(runs) and runs
        assert got_loss == pytest.approx(want_loss, rel=1e-6)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_layer_that_saves_its_mlps_output_gets_it_in_the_recompute():
    """OLMo-2 normalizes the MLP's output before the residual add: the layer's recompute does not stop at the last
    tile's input, and the norm must see the real output. It is computed there (saving nothing): the gradients are
    the whole MLP's, at one more forward per tile."""
    from peft import LoraConfig, get_peft_model
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from sft.speed.layer_checkpoint import checkpoint_kwargs
    from sft.speed.tiled_mlp import tile_mlps

    def olmo2(tiled: bool):
        torch.manual_seed(0)
        model = Olmo2ForCausalLM(Olmo2Config(vocab_size=256, hidden_size=64, intermediate_size=160,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(tiled_mlps=tiled))
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "down_proj"]))
        if tiled:
            assert tile_mlps(model, 16) == (2, 0)
        return model

    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))
    want_loss, want = loss_and_grads(olmo2(False), ids)
    model = olmo2(True)
    runs = gate_runs(model)
    got_loss, got = loss_and_grads(model, ids)
    assert runs == [3 * 7, 3 * 7]
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_eager_tiled_layers_get_the_marked_recompute_and_compiled_ones_do_not(tmp_path):
    """The options as the run resolves them: --mlp_tile_tokens under transformers' checkpoint marks the eager
    layers' recompute (with the kept attention, one context function for both); compiled layers, a reentrant
    checkpoint of yours and SFT_TILED_MLP_LAYER_RECOMPUTE=1 leave the checkpoint as it was."""
    from sft.machine import Launch, Machine
    from sft.options.arguments import read_options
    from sft.options.resolve import resolve_defaults
    from sft.speed import layer_checkpoint as lc

    def context_fn(*argv: str, launch: Launch = Launch()):
        options = read_options(["--lora", "true", "--activation_checkpointing", "true", "--mlp_tile_tokens", "4096",
                                "--output_dir", str(tmp_path / "run"), *argv])
        options = resolve_defaults(options, Machine(launch=launch))
        return (options.training.activation_checkpointing_kwargs or {}).get("context_fn")

    assert context_fn() is lc.tiled_mlp_contexts
    assert context_fn("--activation_checkpointing_keep_attention", "true", "--attn_implementation",
                      "sdpa") is lc.keep_attention_and_tiled_mlp_contexts
    assert context_fn("--compile_layers", "true") is None
    assert context_fn("--activation_checkpointing_kwargs", '{"use_reentrant": true}') is None
    assert context_fn(launch=Launch(tiled_mlp_layer_recompute=True)) is None


def test_a_forward_bound_to_the_mlp_after_tiling_runs_per_tile():
    """Liger binds its SwiGLU forward into each MLP's __dict__ after the model loads (the Trainer applies it, after
    we tile): the tiled MLP runs that forward, a tile at a time, instead of being shadowed by it."""
    import types

    from sft.speed.tiled_mlp import tile_mlps

    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(2))
    plain, tiled = tiny_lora_llama(False), tiny_lora_llama(False)
    tile_mlps(tiled, 16)
    seen: list[int] = []
    for layer in tiled.base_model.model.model.layers:
        whole = type(layer.mlp).__mro__[1].forward  # LlamaMLP's

        def bound(self, x, whole=whole):
            seen.append(x.shape[-2])
            return whole(self, x)
        layer.mlp.__dict__["forward"] = types.MethodType(bound, layer.mlp)  # liger's _bind_method_to_module
    want_loss, want = loss_and_grads(plain, ids)
    got_loss, got = loss_and_grads(tiled, ids)
    # every layer's 100 tokens, 16 at a time, in the forward and again in the backward (each tile is checkpointed)
    assert seen and max(seen) == 16 and sum(seen) == 2 * 3 * 100
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_moe_blocks_stay_whole():
    from sft.speed.tiled_mlp import is_dense_mlp
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP, DeepseekV2Moe

    assert is_dense_mlp(DeepseekV2MLP.__new__(DeepseekV2MLP))  # V2's first (dense) layers
    assert not is_dense_mlp(DeepseekV2Moe.__new__(DeepseekV2Moe))  # routes each token: left whole


@pytest.mark.slow
def test_the_demo_trains_the_same_with_offloaded_checkpoints_and_tiled_mlps(tmp_path, plain_lora_demo_losses):
    levers, stdout = lora_demo_run(tmp_path, "levers", "--offload_activations", "true", "--mlp_tile_tokens", "32")
    assert "Tiled MLP: 4 decoder MLPs run 32 tokens at a time" in stdout
    assert levers == pytest.approx(plain_lora_demo_losses, rel=1e-5)


def test_offloading_needs_the_checkpoints_and_a_tile_is_a_count():
    from sft.errors import ConfigError
    from sft.options.arguments import parse_args

    with pytest.raises(ConfigError, match="--offload_activations keeps the activation checkpoints in host RAM"):
        parse_args(["--offload_activations", "true"], data_only=True)
    with pytest.raises(ConfigError, match="--mlp_tile_tokens -1: give a number of tokens"):
        parse_args(["--mlp_tile_tokens", "-1"], data_only=True)


def test_conversations_past_the_models_positions_are_warned_of_before_loading(tmp_path, tiny_llama):
    """RoPE encodes positions past max_position_embeddings without complaint (deepseek-llm-7b has 4,096, the long
    rows here 32,768): the first screen warns where the longest conversation runs past them. Packed rows restart
    their positions at each document, so it is the longest document that counts, not --max_length."""
    from datasets import Dataset
    from transformers import AutoConfig

    from sft.data.packing import longest_document, pack_rows
    from sft.model.families import positions_warning

    packed = Dataset(pack_rows([[5] * 300, [6] * 200, [7] * 700], [[-100] * 300, [-100] * 200, [-100] * 700], 1024))
    assert longest_document(packed) == 700  # rows of 1,000 and 200 tokens: the longest document, not row
    assert longest_document(Dataset.from_dict({"input_ids": [[1] * 9, [2] * 40]})) == 40
    config = AutoConfig.from_pretrained(tiny_llama)  # max_position_embeddings 512
    assert positions_warning(config, 512, "m") is None
    warning = positions_warning(config, 700, "m")
    assert "the longest conversation is 700 tokens, past the 512 positions m was trained on" in warning
    assert "--max_length 512" in warning

    words = " ".join(f"word{i}" for i in range(700))  # one conversation of more than 512 tokens
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Repeat: " + words},
                                             {"role": "assistant", "content": words}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello."}]}) + "\n")
    result = train_here(["--model", str(tiny_llama), "--dataset", str(data), "--max_length", "4096", "--max_steps",
                         "1", "--eval_strategy", "no", "--report_to", "none", "--output_dir", str(tmp_path / "out"),
                         "--dataset_cache_dir", str(tmp_path / "cache")])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    warned = [line for line in result.stdout.splitlines() if line.startswith("warning: the longest conversation")]
    assert len(warned) == 1 and "past the 512 positions" in warned[0], result.stdout[-2000:]
    assert "Stretch its RoPE over them (--rope_scaling yarn or linear)" in warned[0]  # the option that covers them


def test_the_long_attention_check_runs_its_plumbing_on_cpu(capsys):
    """bench/long_attention_check.py --tiny: sdpa's own choice, shared and repeated key/value heads, against fp32."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from long_attention_check import main

    assert main(["--tiny"]) == 0
    assert "PASS long-attention-check: r1-distill-qwen-7b" in capsys.readouterr().out
