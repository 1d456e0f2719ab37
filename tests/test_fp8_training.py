"""sft/speed/fp8_training.py: a full fine-tune in FP8 through torchao's float8 training. torch 2.13's CPU build
runs torchao's FP8 matmuls, so the real conversion trains here: through sft/train.py (SFT_FP8_ON_CPU=1 lets --fp8
run on CPU), and under FSDP2 on 2 CPU ranks. Speed and the 7B loss check are bench/RESULTS.md's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, train_here

pytest.importorskip("torchao")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_the_decoder_linear_layers_convert_and_the_embeddings_and_lm_head_stay():
    from sft.speed.fp8_training import use_fp8_training

    model = tiny_llama()
    keys = model.state_dict().keys()
    assert use_fp8_training(model, "tensorwise") == 2 * 7  # q, k, v, o, gate, up, down per layer
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert len(converted) == 14 and all(".layers." in n for n in converted)
    assert type(model.lm_head) is torch.nn.Linear
    assert model.state_dict().keys() == keys  # saves and checkpoints see the names they know


def test_a_saved_fp8_model_is_verified_by_its_weights_bit_for_bit(tmp_path):
    """The verified save of a full fine-tune in FP8 compares weights, not logits (compiled FP8 and an eager reload
    round differently: up to 1.15 apart on an H200): the save passes as written, a changed weight is found by name,
    and the names of the checkpoint wrapper and torch.compile are those of a plain reload."""
    from sft.errors import SaveMismatchError
    from sft.safety.verify import SaveVerifier, plain_name
    from sft.speed.fp8_training import use_fp8_training

    model = tiny_llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    use_fp8_training(model, "tensorwise")
    verifier = SaveVerifier(base_model=str(tmp_path), lora=False, fp8_recipe="tensorwise")
    verifier.check(model, tmp_path)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1
    with pytest.raises(SaveMismatchError, match=r"1 saved tensors differ .*layers\.1\.mlp\.down_proj\.weight"):
        verifier.check(model, tmp_path)
    assert plain_name("model.layers.0._checkpoint_wrapped_module._orig_mod.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"


def test_fp8_training_gives_about_the_bf16_loss_and_gradients():
    from sft.speed.fp8_training import use_fp8_training

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    runs = []
    for fp8 in (False, True):
        model = tiny_llama()
        if fp8:
            use_fp8_training(model, "rowwise")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.item(), model.model.layers[0].mlp.down_proj.weight.grad.clone()))
    (plain, plain_grad), (fp8, fp8_grad) = runs
    assert abs(fp8 - plain) < 0.01 * plain
    assert (fp8_grad - plain_grad).norm() / plain_grad.norm() < 0.1  # FP8's rounding of three matmuls' inputs


def short_full_run(tmp_path, name: str, *extra: str):
    # Rows of 64 tokens, not the demo's 256 (its conversations are at most 57): torch's CPU FP8 matmul is slow (~11 s
    # a step at 256), and the losses compared, the layers converted and the saved model do not depend on the length.
    output = tmp_path / name
    result = train_here(["--max_steps", "3", "--logging_steps", "1", "--dtype", "bfloat16", "--optim", "adamw_bf16_sr",
                         "--max_length", "64", "--report_to", "none", "--eval_strategy", "no", "--seed", "0",
                         "--output_dir", str(output), "--dataset_cache_dir", str(tmp_path / "cache"), *extra],
                        env={"SFT_FP8_ON_CPU": "1"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    losses = [json.loads(line)["loss"] for line in (output / "trainer_log.jsonl").read_text().splitlines()
              if '"loss"' in line and '"step"' in line]
    return result, output, losses


@pytest.mark.slow
def test_a_full_fine_tune_in_fp8_trains_verifies_and_saves_a_plain_model(tmp_path):
    from transformers import AutoModelForCausalLM

    result, output, losses = short_full_run(tmp_path, "fp8", "--fp8", "true")
    assert "FP8: 16 linear layers of the decoder train in e4m3 (tensorwise scales, torchao)" in result.stdout
    _, _, plain = short_full_run(tmp_path, "bf16", "--fp8", "false")
    assert len(losses) == len(plain) == 3
    assert all(abs(a - b) < 0.02 * b for a, b in zip(losses, plain)), (losses, plain)
    # verified on save (--verify_saves auto), and loaded by plain transformers: plain weights, no FP8 anywhere
    model = AutoModelForCausalLM.from_pretrained(output)
    assert not any("Float8" in type(m).__name__ for m in model.modules())


@pytest.mark.slow
def test_fp8_training_under_fsdp2_on_two_cpu_ranks_trains_as_unsharded(tmp_path):
    """Sharded on 2 gloo ranks, the weights all-gathered in bf16 and in FP8 (torchao's FP8 all-gather, the scales
    refreshed after each step by SFTTrainer's callback, adamw_bf16_sr): both train as the unsharded model does with
    the same optimizer, and both pass the verified save. ~40 s on 2 cores."""
    out = tmp_path / "fsdp.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29655", str(REPO / "tests" / "fp8_fsdp_worker.py"), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bf16_gather"]["gathered_in_fp8"] == {"weights": 0, "scales": 0}
    assert result["fp8_gather"]["gathered_in_fp8"] == {"weights": 14, "scales": 14}  # every converted weight
    for name in ("bf16_gather", "fp8_gather"):
        run = result[name]
        assert run["float8_layers"] == 14
        assert run["losses"] == pytest.approx(run["plain_losses"], rel=1e-5), name
        assert run["losses"][-1] < run["losses"][0]
        assert run["max_weight_diff"] < 1e-5, name
        # the verified save gathers the shards: the trained weights pass, a changed one is named
        assert run["verified"]["as_trained"] is None
        assert "1 saved tensors differ" in run["verified"]["one_weight_changed"]
        assert "model.layers.0.mlp.up_proj.weight" in run["verified"]["one_weight_changed"]


def test_the_trainer_refreshes_the_fp8_scales_only_where_fsdp2_gathers_in_fp8(tmp_path):
    """SFTTrainer adds the scales' callback for a model converted for FSDP2's FP8 all-gather, and only then; the
    conversion asks for tensorwise scales (rowwise ones are gathered in bf16)."""
    from sft.options.arguments import SFTTrainingArguments
    from sft.speed.fp8_training import Float8ScalesAfterStep, use_fp8_training
    from sft.trainer import SFTTrainer

    args = SFTTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    added = {}
    for all_gather in (False, True):
        model = tiny_llama()
        use_fp8_training(model, "tensorwise", fsdp_all_gather=all_gather)
        trainer = SFTTrainer(model=model, args=args, train_dataset=[])
        added[all_gather] = any(isinstance(c, Float8ScalesAfterStep) for c in trainer.callback_handler.callbacks)
    assert added == {False: False, True: True}
    with pytest.raises(ValueError, match="tensorwise"):
        use_fp8_training(tiny_llama(), "rowwise", fsdp_all_gather=True)


@pytest.mark.parametrize("ram_efficient_loading, gathers", [("false", True), ("true", False)])
def test_fsdp2_gathers_in_fp8_only_where_every_rank_loads_its_weights(monkeypatch, capsys, ram_efficient_loading,
                                                                     gathers):
    """Under FSDP2 with tensorwise scales the weights are gathered in FP8 unless accelerate loads them on rank 0 only
    (fsdp_cpu_ram_efficient_loading, fsdp.yaml's default): its broadcast gives the other ranks plain weights, so the
    ranks would gather different bytes (a hang on 2 gloo ranks). The first screen says which."""
    import dataclasses

    import sft.speed.fp8_training
    from sft.machine import launch, read_launch
    from sft.speed.fp8_training import apply_fp8_training, gathers_in_fp8

    launched = read_launch({"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": ram_efficient_loading})
    assert launched.fsdp and launched.fsdp_ram_efficient_loading == (ram_efficient_loading == "true")
    monkeypatch.setattr(sft.speed.fp8_training, "launch", lambda: dataclasses.replace(launch(), fsdp=True,
                        fsdp_ram_efficient_loading=launched.fsdp_ram_efficient_loading))
    model = tiny_llama()
    apply_fp8_training(model, "tensorwise")
    assert gathers_in_fp8(model) == gathers
    said = capsys.readouterr().out
    assert ("FSDP2 all-gathers them in FP8" in said) == gathers
    assert ("FSDP2 gathers them in bf16 (fsdp_cpu_ram_efficient_loading" in said) == (not gathers)
    model = tiny_llama()
    apply_fp8_training(model, "rowwise")
    assert not gathers_in_fp8(model)
