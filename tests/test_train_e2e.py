"""End to end, as a user runs it: the README's demo, LoRA on and off, and the saved outputs loaded back with plain
transformers/peft. Two-process DDP on CPU, its model loaded back too: test_resume_advice.py's
test_two_ranks_without_output_dir_train_into_one_directory (the same launch, which this file ran a second time)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_train, tensorboard_scalars

pytestmark = pytest.mark.slow


def accelerate() -> list[str]:
    return [str(Path(sys.executable).with_name("accelerate")), "launch"]


def test_demo_with_no_arguments(tmp_path):
    """`accelerate launch sft/train.py`: trains the embedded default, loss falls in TensorBoard, says where."""
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / ".cache"), "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    result = run_train([], launcher=accelerate() + ["--num_processes", "1"], env=env, cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((tmp_path / "output" / "tiny-deepseek" / "full").iterdir())  # its own directory, and `latest`
    output = next(p for p in runs if p.name != "latest")
    assert sorted(p.name for p in runs) == [output.name, "latest"] and (output.parent / "latest").resolve() == output
    assert f"Output directory: {output}" in result.stdout and f"Saved model and tokenizer: {output}" in result.stdout
    assert "TensorBoard logs:" in result.stdout
    losses = tensorboard_scalars(output / "runs", "train/loss")
    assert len(losses) >= 5, losses
    assert losses[-1] < 0.6 * losses[0], f"loss did not fall: {losses}"
    eval_losses = tensorboard_scalars(output / "runs", "eval/loss")
    assert eval_losses and eval_losses[-1] < eval_losses[0]
    for tag in ("train/learning_rate", "train/grad_norm", "train/real_tokens_per_second"):
        assert tensorboard_scalars(output / "runs", tag), f"{tag} missing from TensorBoard"
    print(f"demo took {elapsed:.1f} s")  # ~36 s on a quiet 2-core CPU; a test checks it works, bench/ times it

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(output)
    tokenizer = AutoTokenizer.from_pretrained(output)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of Japan?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Tokyo" in reply, reply  # the demo data is learnable: the tiny model answers it after a minute

    from sft.options.arguments import DEMO_PROMPT

    assert f"--prompt '{DEMO_PROMPT}'" in result.stdout  # the chat question its closing lines suggest is one it learnt
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": DEMO_PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fine_tune_saves_a_loadable_model(tmp_path, tiny_llama, lora):
    out = tmp_path / "out"
    args = ["--model", str(tiny_llama), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
            "--output_dir", str(out), "--max_steps", "6", "--learning_rate", "1e-2", "--logging_steps", "1",
            "--per_device_train_batch_size", "4", "--max_length", "128", "--report_to", "none",
            "--dataset_cache_dir", str(tmp_path / "cache"), "--save_strategy", "no"]
    result = run_train(args + (["--lora", "--lora_r", "4"] if lora else []))
    assert result.returncode == 0, result.stderr[-3000:]

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    if lora:
        from peft import AutoPeftModelForCausalLM, PeftModel

        assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
        tuned = PeftModel.from_pretrained(base, out)
        lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
        assert len(lora_b) == 2 * 7  # 7 projections x 2 layers of the tiny llama
        assert all(p.abs().sum() > 0 for p in lora_b), "LoRA B weights are still at their zero init"
        merged = AutoPeftModelForCausalLM.from_pretrained(out).merge_and_unload()
        assert type(merged).__name__ == "LlamaForCausalLM"
    else:
        tuned = AutoModelForCausalLM.from_pretrained(out)
        assert (out / "model.safetensors").is_file()
        assert tuned.model.embed_tokens.weight.dtype == torch.float32  # fp32 master weights, saved as such
        changed = [n for (n, a), (_, b) in zip(base.named_parameters(), tuned.named_parameters())
                   if not torch.equal(a, b)]
        assert len(changed) == len(list(base.parameters()))  # every weight trained
