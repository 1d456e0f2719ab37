"""--sequence_parallel N: DeepSpeed's Ulysses through accelerate and the Trainer (sft/parallel/sequence_parallel.py).
What it needs is refused before any model loads; on 2 CPU gloo ranks it trains the rows of one process exactly:
the same losses and gradient norms step by step, and the same adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, run_train, save_tiny_model, train_here
from test_config import box, parse
from test_distributed import EXTENSIONS, launch_with
from sft.data.packing import Collator
from sft.errors import ConfigError
from sft.model.loading import load_config
from sft.options.arguments import ModelArguments, validate_setup
from sft.parallel.sequence_parallel import check_model

ZERO2 = {"zero_stage": "2", "world_size": 2, "launched": True}


def settled(machine, size: int, *extra: str):
    """The options with --sequence_parallel `size`, resolved and checked on `machine` (parsed on this one without
    it: a launch of several processes is described, not made)."""
    model_args, data_args, lora_args, training_args = parse(*extra)
    training_args.sequence_parallel = size
    validate_setup(model_args, data_args, lora_args, training_args, machine=machine)
    return model_args, data_args, lora_args, training_args


def refused_on(machine, size: int, *extra: str) -> str:
    with pytest.raises(ConfigError) as e:
        settled(machine, size, *extra)
    return str(e.value)


def test_it_needs_a_deepspeed_launch_of_a_multiple_of_its_size():
    assert "accelerate_configs/zero2.yaml" in refused_on(box(2, world_size=2, launched=True), 2)
    assert "launch a multiple of 2" in refused_on(box(3, zero_stage="2", world_size=3, launched=True), 2)
    assert "number of GPUs" in refused_on(box(2, **ZERO2), 0)
    settled(box(2, **ZERO2), 2)


def test_packed_rows_need_an_attention_that_reads_documents_from_positions():
    """DeepSpeed's wrapper drops the mask: under sdpa packed conversations would attend to each other."""
    message = refused_on(box(2, **ZERO2), 2, "--packing", "true")
    assert "Drop --packing" in message and "flash_attention_2" in message
    assert "Use sdpa" in refused_on(box(2, **ZERO2), 2, "--attn_implementation", "eager")


def test_a_full_fine_tune_under_zero3_keeps_whole_logits():
    """The loss in chunks gathers a frozen ZeRO-3 lm_head once; a trained one cannot be."""
    zero3 = box(2, zero_stage="3", world_size=2, launched=True)
    assert "ZeRO-2" in refused_on(zero3, 2)
    settled(zero3, 2, "--lora")
    settled(box(2, **ZERO2), 2)


def test_the_zero_stage_is_read_from_the_deepspeed_json_an_accelerate_config_names(tmp_path):
    """accelerate exports no ZeRO stage for a config that names a JSON file (all of ours)."""
    from sft.machine import read_launch

    assert read_launch({"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(REPO / "ds_configs" / "zero3.json")}).zero_stage == "3"
    assert read_launch({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}).zero_stage == "2"
    assert read_launch({"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "missing.json")}).zero_stage is None


def test_rows_are_padded_to_one_length_that_the_ranks_share():
    """Each rank takes an equal slice, and gloo's all_gather of the ranks' rows needs one length."""
    model_args, data_args, lora_args, training_args = settled(box(2, **ZERO2), 2, "--max_length", "129")
    assert data_args.pad_to_multiple_of == 258
    config = training_args.parallelism_config
    assert (config.sp_size, config.sp_backend, config.sp_handler.sp_attn_implementation) == (2, "deepspeed", "sdpa")
    assert parse("--max_length", "128")[3].parallelism_config is None  # off: the Trainer builds its own


def test_the_model_must_split_into_whole_heads_and_not_be_mla(tmp_path):
    llama = save_tiny_model(tmp_path / "llama", "llama")  # 4 attention heads, 2 key/value heads
    check_model(load_config(ModelArguments(model=str(llama))), 2)
    with pytest.raises(ConfigError, match="4 attention heads must divide"):
        check_model(load_config(ModelArguments(model=str(llama))), 3)
    check_model(load_config(ModelArguments(model=str(llama))), 4)  # 2 key/value heads, each on 2 ranks: DeepSpeed replicates them
    v2 = save_tiny_model(tmp_path / "v2", "deepseek_v2")
    with pytest.raises(ConfigError, match="MLA"):
        check_model(load_config(ModelArguments(model=str(v2))), 2)


def test_rows_of_one_conversation_get_positions_for_the_slices():
    batch = Collator(pad_token_id=0, pad_to_multiple_of=4, positions=True)(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]  # the padding continues the conversation
    assert "attention_mask" not in batch
    assert "position_ids" not in Collator(pad_token_id=0)([{"input_ids": [5], "labels": [5]}])


def logged(output: Path) -> list[tuple[float, float, int]]:
    rows = [json.loads(line) for line in (output / "trainer_log.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"], r["num_input_tokens_seen"]) for r in rows if "loss" in r and "grad_norm" in r]


@pytest.mark.slow
def test_two_ranks_train_the_rows_of_one_process(tmp_path):
    """One conversation per row, each split over 2 gloo ranks under ZeRO-2 and under ZeRO-3 (with the long-row
    levers): the losses, gradient norms and token counts of one process training the same rows, step by step
    (DeepSpeed's reduction differs by stage: sft/speed/sequence_parallel_loss.py), and the same adapter, which
    plain peft loads."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = save_tiny_model(tmp_path / "qwen2", "qwen2")
    common = ["--model", str(model), "--dataset", str(REPO / "data" / "alpaca_demo.json"), "--max_samples", "32",
              "--max_length", "128", "--per_device_train_batch_size", "1", "--max_steps", "4", "--logging_steps", "1",
              "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--report_to", "none", "--seed", "0",
              "--save_strategy", "no", "--lora", "--lora_dropout", "0"]  # dropout: each rank draws its own masks
    one = train_here([*common, "--output_dir", str(tmp_path / "one")])  # the one process: this one
    assert one.returncode == 0, one.stderr[-3000:]
    expected = logged(tmp_path / "one")
    adapter = load_file(tmp_path / "one" / "adapter_model.safetensors")
    levers = ("--activation_checkpointing", "--offload_activations", "--mlp_tile_tokens", "32")
    for stage, port, extra in (("zero2", 29641, ()), ("zero3", 29643, levers)):
        output = tmp_path / stage
        two = run_train([*common, "--sequence_parallel", "2", "--ddp_backend", "gloo", "--output_dir", str(output),
                         *extra], launcher=launch_with(f"{stage}.yaml", port),
                        env={"TORCH_EXTENSIONS_DIR": EXTENSIONS}, timeout=900)
        assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
        assert "Training on 2 process(es)" in two.stdout, two.stdout[-2000:]
        got = logged(output)
        assert len(got) == len(expected) == 4
        for (loss, norm, tokens), (loss_sp, norm_sp, tokens_sp) in zip(expected, got):
            assert loss_sp == pytest.approx(loss, rel=1e-4) and norm_sp == pytest.approx(norm, rel=1e-4), stage
            assert tokens_sp == tokens, stage  # each token counted once (tok/s, MFU), not once per slice holder
        adapter_sp = load_file(output / "adapter_model.safetensors")
        assert adapter.keys() == adapter_sp.keys()
        for key, value in adapter.items():
            torch.testing.assert_close(adapter_sp[key], value, rtol=1e-3, atol=1e-5)  # weights ~1e-2: float noise
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), output)
