"""LoRA as Axolotl and LLaMA-Factory users set it up: rsLoRA (--use_rslora: alpha / sqrt(r)), DoRA (--use_dora)
and LoRA+ (--loraplus_lr_ratio: the B matrices at R times the learning rate, sft/model/lora_plus.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import tensorboard_scalars, train_here
from sft.errors import ConfigError
from test_long_rows import tiny_lora_llama


def trainer(tmp_path, ratio: float, **args):
    from sft.options.arguments import SFTTrainingArguments
    from sft.trainer import SFTTrainer

    training = SFTTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", learning_rate=1e-3,
                                    weight_decay=0.1, max_steps=10, warmup_steps=2, **args)
    return SFTTrainer(model=tiny_lora_llama(False), args=training, loraplus_lr_ratio=ratio)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adamw_bf16_sr"])
def test_loraplus_puts_the_b_matrices_at_ratio_times_the_rate_of_their_group(tmp_path, optim):
    plain = trainer(tmp_path, 0.0, optim=optim)
    plain.create_optimizer_and_scheduler(10)
    plus = trainer(tmp_path, 16.0, optim=optim)
    plus.create_optimizer_and_scheduler(10)
    names = {id(p): n for n, p in plus.model.named_parameters() if p.requires_grad}
    kinds = [{"lora_B" if ".lora_B." in names[id(p)] else "other" for p in g["params"]}
             for g in plus.optimizer.param_groups]
    assert sorted(map(sorted, kinds)) == [["lora_B"], ["other"]]  # each B matrix moved, nothing else
    rates = {kind.pop(): g["initial_lr"] for kind, g in zip(kinds, plus.optimizer.param_groups)}
    assert rates == {"other": 1e-3, "lora_B": pytest.approx(16e-3)}  # --learning_rate, and 16x it
    assert all(g["weight_decay"] == 0.1 for g in plus.optimizer.param_groups)  # the rest as in their group
    assert sum(len(g["params"]) for g in plus.optimizer.param_groups) == \
        sum(len(g["params"]) for g in plain.optimizer.param_groups)
    for _ in range(3):  # warmup, then decay: every group follows the schedule from its own rate
        plus.lr_scheduler.step()
        plain.lr_scheduler.step()
    lr = plain.optimizer.param_groups[0]["lr"]
    assert lr > 0 and sorted(g["lr"] for g in plus.optimizer.param_groups) == [lr, pytest.approx(16 * lr)]


def test_a_deepspeed_optimizer_of_its_own_is_refused_with_loraplus():
    from types import SimpleNamespace as NS

    from sft.options.checks import loraplus_needs_the_trainers_optimizer

    o = NS(lora=NS(loraplus_lr_ratio=16.0), deepspeed={"optimizer": {"type": "AdamW"}},
           training=NS(deepspeed="ds_configs/zero3_offload.json"))
    with pytest.raises(ConfigError, match="builds its own optimizer"):
        loraplus_needs_the_trainers_optimizer(o, None)
    loraplus_needs_the_trainers_optimizer(NS(**{**vars(o), "deepspeed": {"zero_optimization": {}}}), None)


@pytest.mark.slow
def test_the_demo_trains_with_rslora_dora_and_loraplus_and_the_adapter_loads_with_plain_peft(tmp_path):
    from peft import PeftConfig

    output = tmp_path / "run"
    result = train_here(["--lora", "--use_rslora", "--use_dora", "--loraplus_lr_ratio", "16", "--max_steps", "3",
                         "--logging_steps", "1", "--lora_r", "16", "--lora_alpha", "16", "--learning_rate", "1e-4",
                         "--output_dir", str(output), "--dataset_cache_dir", str(tmp_path / "cache")])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "LoRA+: 28 B matrices learn at 16x the learning rate (--loraplus_lr_ratio)" in result.stdout  # not DoRA's
    # magnitude vectors, which peft names lora_magnitude_vector
    assert "LoRA r=16 (rsLoRA: alpha / sqrt(r))" in result.stdout
    saved = PeftConfig.from_pretrained(output)  # the save check reloaded it beside the trained one
    assert saved.use_rslora and saved.use_dora  # the saved adapter scales and normalizes as it trained
    rates = tensorboard_scalars(output / "runs", "train/learning_rate")
    assert rates and max(rates) <= 1e-4  # the logged rate is the A matrices' (--learning_rate), not 16x


def test_rslora_scales_by_the_square_root_of_the_rank():
    from sft.model.loading import attach_lora
    from sft.options.arguments import LoraArguments
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    lora = attach_lora(model, LoraArguments(lora=True, lora_r=16, lora_alpha=32, use_rslora=True), False)
    scalings = {m.scaling["default"] for m in lora.modules() if isinstance(getattr(m, "scaling", None), dict)}
    assert scalings == {32 / 16 ** 0.5}


@pytest.mark.slow
def test_a_loraplus_checkpoint_resumes_only_with_loraplus(tmp_path, monkeypatch, capsys):
    """Its optimizer state holds the B matrices' own groups: a resume without the option is refused by name, before
    any model loads (else torch's optimizer would stop on a group that does not match). The three runs are
    sft.train.main in this process (a new Python with torch and transformers for each cost ~5 s apiece)."""
    from sft.train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    output = tmp_path / "run"
    common = ["--lora", "--output_dir", str(output), "--dataset_cache_dir", str(tmp_path / "cache"), "--report_to",
              "none", "--eval_strategy", "no"]
    code = main([*common, "--loraplus_lr_ratio", "16", "--max_steps", "2", "--save_steps", "1"])
    first = capsys.readouterr()
    assert code == 0, first.err[-2000:]
    code = main([*common, "--max_steps", "3", "--resume_from_checkpoint", "true"])
    again = capsys.readouterr()
    assert code == 2 and "trained with --loraplus_lr_ratio 16.0 (this run: none)" in again.err
    assert "Loading model" not in again.out
    code = main([*common, "--loraplus_lr_ratio", "16", "--max_steps", "3", "--resume_from_checkpoint", "true"])
    resumed = capsys.readouterr()
    assert code == 0 and "resuming after step 2" in resumed.out, resumed.err[-2000:]


def test_dora_on_moe_mlp_weights_is_refused_before_loading(tmp_path):
    """peft has no DoRA for LoRA on parameters (DeepSeek MoE's MLP weights): said from a weightless copy, with the
    attention projections that it can adapt."""
    from conftest import save_tiny_model
    from sft.model.loading import check_lora_targets
    from sft.options.arguments import LoraArguments, ModelArguments

    model = ModelArguments(model=str(save_tiny_model(tmp_path / "v2", "deepseek_v2")))
    with pytest.raises(ConfigError, match="--use_dora: peft has no DoRA for weights adapted as parameters"):
        check_lora_targets(model, LoraArguments(lora=True, use_dora=True))
    check_lora_targets(model, LoraArguments(lora=True, use_dora=True, lora_target_modules=["q_proj", "o_proj"]))


def test_dora_is_refused_beside_fp8_and_compiled_layers():
    """DoRA reads the bf16 base weight (--fp8 holds e4m3 copies), and its forward breaks dynamo's graph; under
    `auto` both fast paths then stay off with these reasons (sft/options/resolve.py)."""
    from types import SimpleNamespace as NS

    from sft.options.checks import compiled_layers_combinations, fp8_combinations

    o = NS(lora=NS(lora=True, qlora=False, use_dora=True), model=NS(fp8_on=True, compile_layers_on=True, tp_size=1),
           training=NS(torch_compile=False), zero_stage=lambda m: None)
    with pytest.raises(ConfigError, match="--fp8 with --use_dora"):
        fp8_combinations(o, None)
    with pytest.raises(ConfigError, match="--compile_layers with --use_dora"):
        compiled_layers_combinations(o, None)


def test_dora_on_the_nf4_base_of_fsdp_is_refused():
    """peft's DoRA reads the base weight for its norms; torchao's NF4 tensors (FSDP's 4-bit base) stop it."""
    from types import SimpleNamespace as NS

    from conftest import tiny_config
    from sft.model.loading import attach_lora
    from sft.model.nf4_base import quantize_base_nf4
    from sft.options.arguments import LoraArguments
    from sft.options.checks import dora_reads_its_base
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama")).to(torch.bfloat16)
    quantize_base_nf4(model, 1)
    with pytest.raises(TypeError):  # what the check spares a user, after minutes of loading
        attach_lora(model, LoraArguments(lora=True, qlora=True, use_dora=True), False)
    o = NS(lora=NS(lora=True, qlora=True, use_dora=True), fsdp=lambda m: True)
    with pytest.raises(ConfigError, match="--use_dora with --qlora under FSDP"):
        dora_reads_its_base(o, None)
    dora_reads_its_base(NS(**{**vars(o), "fsdp": lambda m: False}), None)
