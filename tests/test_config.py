"""Config validation before any model loads: each bad combination is one line (exit code 2) that says what to
do instead. GPU-dependent checks run against a faked torch.cuda, since this box has no GPU."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO
from sft.config import ConfigError, parse_args, validate, validate_setup

DATA = str(REPO / "data" / "alpaca_demo.json")


def parse(*extra: str):
    return parse_args(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", *extra])


def refused(*extra: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse(*extra)
    return str(e.value)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` GPUs (bf16 capable unless said otherwise)."""
    def fake(n: int, bf16: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    return fake


def test_precision_the_hardware_lacks():
    assert "Drop --bf16" in refused("--bf16", "true")
    assert "drop --fp16" in refused("--fp16", "true")


def test_bf16_weights_on_a_gpu_without_bf16(gpus):
    args = parse("--lora", "--dtype", "bfloat16")
    gpus(1, bf16=False)
    with pytest.raises(ConfigError, match="no bf16"):
        validate_setup(*args[:3], args[3])


def test_fsdp_and_offload_on_cpu(monkeypatch):
    assert "FSDP needs GPUs" in refused("--fsdp", "full_shard")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert "FSDP needs GPUs" in refused()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    assert "offload" in refused()


def test_deepspeed_offload_json_on_cpu():
    message = refused("--deepspeed", str(REPO / "ds_configs" / "zero3_offload.json"))
    assert "offload" in message and "no GPU" in message


def test_attention_that_cannot_train_here():
    assert "use sdpa" in refused("--attn_implementation", "flex_attention", "--packing", "true")
    assert "Use sdpa" in refused("--attn_implementation", "flash_attention_2")
    assert "separates packed documents" in refused("--attn_implementation", "paged|sdpa", "--packing", "true")


def test_more_processes_than_gpus(gpus, monkeypatch):
    args = parse()
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="3 processes on this machine but 2 GPU.*--num_processes 2"):
        validate_setup(*args[:3], args[3])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    validate_setup(*args[:3], args[3])


def test_deepspeed_json_fixed_values_must_match_the_trainer(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto",
                                  "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}))
    message = refused("--deepspeed", str(config), "--per_device_train_batch_size", "2")
    assert "train_micro_batch_size_per_gpu=8" in message and "per_device_train_batch_size=2" in message
    assert '"auto"' in message
    parse("--deepspeed", str(config), "--per_device_train_batch_size", "8")  # agreeing values pass


def test_launcher_settings_must_match_the_trainer(gpus, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    assert "gradient_accumulation_steps: 4" in refused("--gradient_accumulation_steps", "2")
    parse("--gradient_accumulation_steps", "4")
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(a))
    assert "two DeepSpeed configs" in refused("--deepspeed", str(b))
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE")

    args = parse()
    args[3].bf16 = True  # as parsed on a bf16 GPU
    gpus(1)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ConfigError, match="mixed_precision: fp16 but the command line says --bf16"):
        validate_setup(*args[:3], args[3])


def test_quantized_base_with_zero3(monkeypatch):
    """No QLoRA option exists yet; the check fires for any of the usual names as soon as one is added."""
    model_args, data_args, lora_args, training_args = parse("--lora")
    model_args.load_in_4bit = True
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ConfigError, match="ZeRO-3.*ZeRO-2"):
        validate_setup(model_args, data_args, lora_args, training_args)


def test_our_options():
    assert "use auto, all, final or no" in refused("--verify_saves", "sometimes")
    assert "use stop or skip" in refused("--nan_policy", "ignore")
    assert "above 1" in refused("--loss_spike_factor", "0.5")
    parse("--loss_spike_factor", "0")


def test_train_prints_one_line_and_exits_2(capsys, tmp_path):
    from sft.train import main

    assert main(["--model", "m", "--dataset", DATA, "--output_dir", str(tmp_path), "--fp16", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --fp16") and "\n" not in err and "Traceback" not in err


def test_flex_attention_pads_packed_rows_to_one_shape(gpus):
    """flex_attention compiles its kernels per shape: packed rows are padded to --max_length unless told."""
    model_args, data_args, lora_args, training_args = parse("--packing", "true", "--max_length", "512")
    assert data_args.pad_to_multiple_of is None  # sdpa: the batch's longest row
    gpus(1)
    model_args.attn_implementation = "flex_attention"
    validate(model_args, data_args, lora_args, training_args)
    assert data_args.pad_to_multiple_of == 512
    gpus(0)
    assert parse("--pad_to_multiple_of", "64")[1].pad_to_multiple_of == 64
    assert "positive" in refused("--pad_to_multiple_of", "0")


def test_tensor_parallel_needs_gpus():
    assert "needs GPUs" in refused("--tp_size", "2")  # accelerate's ParallelismConfig refuses MULTI_CPU


def test_tensor_parallel_checkpoints_skip_the_trainers_optimizer_saving(gpus):
    """transformers' Trainer refuses checkpoints with its own optimizer state for a model sharded at load time
    (seen on GPUs): a TP run sets save_only_model, and sft/tensor_parallel.py saves the optimizer state itself."""
    def tp_validated(*extra: str):
        model_args, data_args, lora_args, training_args = parse(*extra)  # parsed without GPUs, then "on 2 GPUs"
        gpus(2)
        model_args.tp_size = 2
        try:
            validate(model_args, data_args, lora_args, training_args)
        finally:
            gpus(0)
        return training_args

    assert tp_validated("--save_strategy", "steps").save_only_model
    assert not tp_validated("--save_strategy", "no").save_only_model
    assert not parse("--save_strategy", "steps")[3].save_only_model
    assert tp_validated("--resume_from_checkpoint", "true").save_only_model  # resuming is no longer refused
    with pytest.raises(ConfigError, match="--use_liger_kernel with --tp_size 2"):
        tp_validated("--use_liger_kernel", "true")  # seen on 2 H200s: mixed torch.Tensor and DTensor
    with pytest.raises(ConfigError, match="--lora with --tp_size 2.*ddp.yaml"):
        tp_validated("--lora")  # peft on the TP shards: a shape error at the first step (seen on CPU over gloo)
