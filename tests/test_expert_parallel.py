"""DeepSpeed AutoEP (accelerate_configs/autoep.yaml, sft/parallel/expert_parallel.py): a DeepSeek-V2 LoRA with the
routed experts shared out among the ranks. On 2 gloo ranks of a CPU it trains the same losses as plain DDP on the
same data and seed, its MoE balance loss included, and its adapter loads with plain peft on the plain model. What
it cannot do is refused with one error line before any model loads. Its speed on GPUs: bench/throughput.py's
moe-lora-autoep-ddp row (group issue30)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_train, save_tiny_model, tiny_config
from test_config import parse, refused
from test_distributed import EXTENSIONS, launch_with, short_run, tensors
from test_moe_lora import adapted, expected

AUTOEP_JSON = REPO / "ds_configs" / "autoep.json"


def logged(output: Path) -> list[dict]:
    return [row for row in map(json.loads, (output / "trainer_log.jsonl").read_text().splitlines()) if "loss" in row]


@pytest.mark.slow
def test_autoep_trains_like_ddp_and_its_adapter_loads_with_plain_peft(tmp_path):
    """Issue 26 item 2: the tiny V2 (4 routed experts, 2 per rank under AutoEP) with the V2-Lite recipe's LoRA and
    activation checkpointing (whose recomputation runs the all-to-alls again in backward), 4 steps under AutoEP and
    under DDP from the same seed: the same first loss (nothing trained yet: the same model and data), the same later
    losses (the gradients through the all-to-alls are DDP's) and the same balance loss (its hooks follow the replaced
    routers). The run's own verified save passed (all ranks' forward); the adapter holds the promised modules,
    equals DDP's, and loads with plain peft on the plain model. Resumed from the run's checkpoint after 2 steps (its
    DeepSpeed checkpoint holds each rank's experts) in a new run, AutoEP trains steps 3-4 to the uninterrupted run's
    losses."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = save_tiny_model(tmp_path / "v2", "deepseek_v2")
    lora = ("--lora", "--lora_dropout", "0", "--activation_checkpointing", "true", "--dataset_cache_dir",
            str(tmp_path / "cache"))
    # saves every 2 steps (short_run): the uninterrupted run also writes the checkpoint-2 that a new run resumes from
    autoep = run_train(short_run(base, tmp_path / "autoep", *lora, "--max_steps", "4"),
                       launcher=launch_with("autoep.yaml", 29667),
                       env={"TORCH_EXTENSIONS_DIR": EXTENSIONS, "OMP_NUM_THREADS": "1"})
    assert autoep.returncode == 0, (autoep.stdout + autoep.stderr)[-4000:]
    assert "Training on 2 process(es) (DeepSpeed ZeRO-0" in autoep.stdout, autoep.stdout[-2000:]
    assert "DeepSpeed AutoEP: 1 MoE layers, each GPU holds 2 of their 4 routed experts" in autoep.stdout
    accelerate = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
                  "--main_process_port", "29669"]
    ddp_args = [a for a in short_run(base, tmp_path / "ddp", *lora, "--max_steps", "4", "--save_strategy", "no")
                if a not in ("--ddp_backend", "gloo")]
    ddp = run_train([*ddp_args, "--use_cpu", "--ddp_find_unused_parameters", "false"], launcher=accelerate,
                    env={"OMP_NUM_THREADS": "1"})
    assert ddp.returncode == 0, (ddp.stdout + ddp.stderr)[-4000:]

    ours, theirs = logged(tmp_path / "autoep"), logged(tmp_path / "ddp")
    assert len(ours) == len(theirs) == 4
    assert ours[0]["loss"] == pytest.approx(theirs[0]["loss"], rel=1e-6)
    for mine, reference in zip(ours, theirs):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-4)
        assert mine["moe/aux_loss"] == pytest.approx(reference["moe/aux_loss"], rel=1e-3) and mine["moe/aux_loss"] > 0

    config = AutoModelForCausalLM.from_pretrained(base).config
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "autoep")
    assert adapted(reloaded) == expected(config, False)  # MLA, the dense MLP, the shared experts
    trained, reference = tensors(tmp_path / "autoep" / "adapter_model.safetensors"), \
        tensors(tmp_path / "ddp" / "adapter_model.safetensors")
    assert trained.keys() == reference.keys()
    for key, value in trained.items():
        # Adam moves a weight by about the learning rate (1e-2) per step whatever its gradient's size: a gradient
        # summed in another order can move a near-zero one by ~1e-5 in a few steps (seen: one of 1536 after 3)
        torch.testing.assert_close(value, reference[key], rtol=1e-3, atol=1e-4)

    # A new run resumes from the checkpoint the run above wrote after step 2 (a separate 2-step run wrote the same
    # checkpoint for one 2-rank launch more).
    checkpoint = tmp_path / "autoep" / "checkpoint-2"
    done = run_train(short_run(base, tmp_path / "resumed", *lora, "--max_steps", "4", "--resume_from_checkpoint",
                               str(checkpoint)), launcher=launch_with("autoep.yaml", 29671),
                     env={"TORCH_EXTENSIONS_DIR": EXTENSIONS, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "Resuming from" in done.stdout and "checkpoint-2" in done.stdout, done.stdout[-2000:]
    resumed = logged(tmp_path / "resumed")
    assert [row["step"] for row in resumed] == [3, 4]
    assert [row["loss"] for row in resumed] == pytest.approx([row["loss"] for row in ours[2:]], rel=1e-6)


def test_what_autoep_cannot_do_is_refused_before_loading(tmp_path):
    zero2 = tmp_path / "zero2_autoep.json"
    zero2.write_text(json.dumps({**json.loads(AUTOEP_JSON.read_text()), "zero_optimization": {"stage": 2}}))
    autoep = ("--deepspeed", str(AUTOEP_JSON))
    assert "ZeRO stage 0 only" in refused("--deepspeed", str(zero2), "--lora")
    assert "add --lora" in refused(*autoep)
    assert "--quantize_experts fp8 with DeepSpeed AutoEP" in refused(*autoep, "--lora", "--quantize_experts", "fp8",
                                                                     "--activation_checkpointing", "true")
    assert "drop --lora_experts" in refused(*autoep, "--lora", "--lora_experts", "true")
    parse(*autoep, "--lora")


def test_the_model_and_the_launch_must_fit_autoep():
    from sft.errors import ConfigError
    from sft.parallel.expert_parallel import check_expert_parallel

    config = json.loads(AUTOEP_JSON.read_text())
    v2 = tiny_config("deepseek_v2")  # 4 routed experts
    check_expert_parallel(v2, config, 2)
    check_expert_parallel(v2, config, 4)  # ep 2 within 4 processes: two replicas of each expert share
    check_expert_parallel(tiny_config("llama"), {}, 2)  # no AutoEP: nothing to check
    with pytest.raises(ConfigError, match="DeepSeek-V2 models .V2-Lite. only, not llama"):
        check_expert_parallel(tiny_config("llama"), config, 2)
    with pytest.raises(ConfigError, match="must be 2 or more and divide the model's 4 routed experts"):
        check_expert_parallel(v2, {**config, "expert_parallel": {**config["expert_parallel"], "autoep_size": 3}}, 3)
    with pytest.raises(ConfigError, match="on 3 processes: the processes must be a multiple of it"):
        check_expert_parallel(v2, config, 3)


def test_the_shipped_json_turns_autoep_on_for_the_peft_model():
    """DeepSpeed matches the preset's layer pattern whole against the module names: the peft model's carry
    `base_model.model.` in front, which the shipped pattern allows (and the plain model's names still match)."""
    import re

    block = json.loads(AUTOEP_JSON.read_text())["expert_parallel"]
    assert block["enabled"] and block["preset_model"] == "deepseek_v2" and block["autoep_size"] == 2
    pattern = re.compile(block["moe_layer_pattern"])
    assert pattern.fullmatch("base_model.model.model.layers.7.mlp") and pattern.fullmatch("model.layers.7.mlp")
    assert not pattern.fullmatch("base_model.model.model.layers.7.mlp.experts")
    from sft.parallel.expert_parallel import autoep_block

    assert autoep_block({"expert_parallel": block}) == block and autoep_block({}) is None
    assert autoep_block({"expert_parallel": {**block, "enabled": False}}) is None
