"""What a run prints: the first screen (RunOverview), the last one (closing_lines), and no third-party noise
(torchao's kernel-load failures, torch's pytree deprecation, DeepSpeed's CPU-accelerator warning) on stderr."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, run_train, tiny_config

NOISE = ("torchao", "_pytree", "register_constant", "Setting accelerator to CPU", "is_gradient_checkpointing",
         "pin_memory", "Loading weights", "Writing model shards", "Tokenizing", "Saving the dataset")


def tiny_model(lora: bool):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=128), dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def overview(tmp_path, lora: bool, **args) -> tuple[str, object]:
    """Train one step in this process with RunOverview and our checkpoint callback among the callbacks, on
    arguments resolved as a run's are (sft/options/resolve.py); -> (its text, the model)."""
    import datasets
    from transformers import Trainer

    from sft.data.packing import Collator
    from sft.options.arguments import DataArguments, LoraArguments, ModelArguments, SFTTrainingArguments, validate
    from sft.report.callbacks import RunOverview
    from sft.safety.checkpoints import checkpoint_callback

    model = tiny_model(lora)
    rows = datasets.Dataset.from_list([{"input_ids": list(range(1, n)), "labels": list(range(1, n))}
                                       for n in (11, 21, 31, 41)])  # 10 + 20 + 30 + 40 tokens: 25 per row
    callback = RunOverview(model, rows, "tiny-llama")
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, use_cpu=True, report_to=["tensorboard"], save_strategy="no",
                    remove_unused_columns=False, disable_tqdm=True)
    training_args = SFTTrainingArguments(**{**settings, **args})
    validate(ModelArguments(), DataArguments(dataset=["rows"]), LoraArguments(), training_args, check_machine=False)
    trainer = Trainer(model=model, args=training_args, train_dataset=rows, data_collator=Collator(0),
                      callbacks=[callback, checkpoint_callback()])
    trainer.train()
    return callback.text, model


def test_overview_of_a_full_fine_tune(tmp_path, monkeypatch):
    import sft.report.console as console
    from sft.machine import Launch

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)  # transformers' TensorBoardCallback reads it
    monkeypatch.setattr(console, "launch", lambda: Launch())  # ours, in the launch read once: not set either
    text, model = overview(tmp_path, lora=False)
    total = sum(p.numel() for p in model.parameters())
    from sft.report.console import count

    assert text.splitlines()[0] == "Training on 1 process(es) (no parallelism) on CPU"
    assert f"tiny-llama: LlamaForCausalLM, {count(total)} parameters" in text and "precision    float32 weights" in text
    assert f"all {count(total)} parameters (full fine-tune)" in text
    assert "4 rows per optimizer step = 2 per device x 2 accumulation steps" in text
    assert "~100 real tokens per optimizer step (25 per row on average)" in text
    assert "1 optimizer step (--max_steps)" in text
    out = tmp_path / "out"
    assert f"{out}  (the final model and tokenizer)" in text and "checkpoints  none (--save_strategy no)" in text
    assert f"tensorboard --logdir {out / 'runs'}" in text
    assert 8 <= len(text.splitlines()) <= 12, text


def test_tensorboard_dir_is_the_launchs_setting_or_the_runs_folder(tmp_path, monkeypatch):
    import sft.report.console as console
    from sft.machine import Launch

    monkeypatch.setattr(console, "launch", lambda: Launch())
    assert console.tensorboard_dir(str(tmp_path), ["wandb"]) is None  # TensorBoard is not a logger of this run
    assert console.tensorboard_dir(str(tmp_path), "tensorboard") == str(tmp_path.resolve() / "runs")
    monkeypatch.setattr(console, "launch", lambda: Launch(tensorboard_logging_dir="~/tb"))
    assert console.tensorboard_dir(str(tmp_path), ["tensorboard", "wandb"]) == os.path.expanduser("~/tb")


def test_overview_counts_the_lora_adapter(tmp_path):
    text, model = overview(tmp_path, lora=True, report_to=[], save_strategy="steps", save_steps=50,
                           save_total_limit=2)
    total = sum(p.numel() for p in model.parameters())
    # q_proj (64 -> 64) and v_proj (64 -> 32, 2 KV heads of 16) in 2 layers, rank 4: A is r x in, B is out x r.
    trainable = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable
    from sft.report.console import count

    assert f"LoRA r=4: {count(trainable)} trainable parameters ({100 * trainable / total:.2g}% of {count(total)})" \
        in text
    assert "LlamaForCausalLM" in text and "the final LoRA adapter and tokenizer" in text
    assert "checkpoints  every 50 steps (the last 2 kept)" in text
    assert "tensorboard" not in text  # not a logger of this run


@pytest.mark.parametrize("kind, plugin, label", [
    ("DEEPSPEED", {"deepspeed_plugin": SimpleNamespace(zero_stage=3, deepspeed_config={"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}}})},
     "DeepSpeed ZeRO-3, optimizer offloaded to CPU"),
    ("DEEPSPEED", {"deepspeed_plugin": SimpleNamespace(zero_stage=2, deepspeed_config={"zero_optimization": {
        "stage": 2}})}, "DeepSpeed ZeRO-2"),
    ("FSDP", {"fsdp_plugin": SimpleNamespace(fsdp_version=2, cpu_offload=None)}, "FSDP2"),
    ("MULTI_GPU", {"backend": "nccl"}, "DDP, nccl backend"),
])
def test_strategy_is_read_from_accelerate_state(monkeypatch, kind, plugin, label):
    from accelerate.utils import DistributedType

    from sft.report.callbacks import describe_strategy

    state = SimpleNamespace(distributed_type=DistributedType[kind], **plugin)
    monkeypatch.setattr("accelerate.state.is_initialized", lambda: True)
    monkeypatch.setattr("accelerate.state.AcceleratorState", lambda: state)
    args = SimpleNamespace(world_size=2, ddp_backend=None, device=torch.device("cuda", 0))
    assert describe_strategy(args) == (label, "2 GPUs")


def test_closing_lines_full_and_lora(tmp_path, monkeypatch):
    from sft.report.console import closing_lines

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no deepseek-sft on PATH: a checkout used as it is
    out = tmp_path / "my run"
    full = closing_lines(str(out), lora=False, tensorboard=str(out / "runs"))
    assert f"Saved model and tokenizer: {out}" in full
    assert f"python -m sft.tools.chat '{out}' --prompt 'Hello! Who are you?'" in full
    assert f"tensorboard --logdir '{out / 'runs'}'" in full and f"TensorBoard logs: {out / 'runs'}" in full
    assert "sft.tools.merge" not in full
    lora = closing_lines(str(out), lora=True, tensorboard=None)
    assert f"Saved LoRA adapter and tokenizer: {out}" in lora
    assert f"python -m sft.tools.merge '{out}' '{out}-merged'" in lora
    assert "tensorboard" not in lora.lower()


def test_the_next_commands_are_what_the_user_types(tmp_path, monkeypatch):
    """Was `python -m sft.tools.chat` even where pip had installed the `deepseek-sft` command (pyproject.toml's
    console script); the demo suggested "Hello! Who are you?", which its data never taught (an unrelated answer)."""
    from sft.options.arguments import DEMO_PROMPT
    from sft.report.console import closing_lines

    installed = tmp_path / "bin"
    installed.mkdir()
    (installed / "deepseek-sft").write_text("#!/bin/sh\n")
    (installed / "deepseek-sft").chmod(0o755)
    monkeypatch.setenv("PATH", str(installed))
    lines = closing_lines(str(tmp_path / "out"), lora=True, tensorboard=None, prompt=DEMO_PROMPT).splitlines()
    assert f"  deepseek-sft chat {tmp_path / 'out'} --prompt 'What is the capital of France?'   # or without " \
           f"--prompt: a chat" in lines
    assert any(line.startswith(f"  deepseek-sft merge {tmp_path / 'out'} {tmp_path / 'out'}-merged") for line in lines)
    assert "capital of France" in (REPO / "data" / "alpaca_demo.json").read_text()  # what the demo trains on


def test_a_log_is_one_short_line():
    """Was the Trainer's dict of 7-9 fields per log (the demo: 43 of them, wrapping into the progress bar)."""
    from sft.report.progress import log_line

    train = {"loss": 5.8451, "grad_norm": 2.689, "learning_rate": 0.0029971, "epoch": 0.90909,
             "num_input_tokens_seen": 9476, "train_runtime": 2.57, "train_tokens_per_second": 3687,
             "real_tokens_per_second": 3838.4, "loss_spikes": 0}
    assert log_line(train, 10, 220) == "step 10/220 (epoch 0.909): loss 5.845, lr 3.00e-03, 3,838 tok/s"
    evaluation = {"eval_loss": 3.8093, "eval_runtime": 0.0758, "epoch": 1.0, "eval_perplexity": 45.123}
    assert log_line(evaluation, 11, 220) == "step 11/220 (epoch 1): eval loss 3.809 (perplexity 45.12)"
    assert log_line({"train_runtime": 53.8, "train_loss": 1.24, "epoch": 20.0}, 220, 220) is None  # the summary's


def test_the_progress_callback_prints_lines_and_no_eval_bar_when_piped(capsys, monkeypatch):
    from sft.report.progress import ConsolePrinter, ConsoleProgress

    state = SimpleNamespace(is_world_process_zero=True, is_local_process_zero=True, global_step=3, max_steps=9)
    progress = ConsoleProgress()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    progress.on_prediction_step(None, state, None, eval_dataloader=[1, 2])
    assert progress.prediction_bar is None  # piped: no bar of cursor codes per evaluation
    progress.on_log(None, state, None, logs={"eval_loss": 1.5})  # after training (its bar closed): still said
    ConsolePrinter().on_log(None, state, None, logs={"loss": 2.0, "learning_rate": 1e-4})
    assert capsys.readouterr().out.splitlines() == ["step 3/9: eval loss 1.5", "step 3/9: loss 2, lr 1.00e-04"]


def test_the_first_steps_wait_is_said_where_it_compiles_and_logged_once(capsys, monkeypatch):
    """A first step that compiles (flex_attention at 16k tokens: minutes) looked like a hung run: one line says
    what compiled and how long it took; every run logs `first_step_seconds` with its first log, once."""
    from sft.report import progress
    from sft.report.progress import FirstStepWait, what_compiles

    assert what_compiles("sdpa", False, False) == []
    compiles = what_compiles("flex_attention", True, False)
    assert compiles == ["the decoder layers (--compile_layers)", "flex_attention"]
    clock = iter([100.0, 144.25])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    state = SimpleNamespace(is_world_process_zero=True)
    wait = FirstStepWait(compiles)
    wait.on_train_begin(None, state, None)
    wait.on_step_end(None, state, None)
    wait.on_step_end(None, state, None)  # later steps: nothing more
    assert capsys.readouterr().out.splitlines() == [
        "first step: 44.2 s, the decoder layers (--compile_layers) and flex_attention compiled for these row "
        "shapes (cached for later runs; a new --max_length compiles again)"]
    logs, later = {"loss": 2.0}, {"loss": 1.9}
    wait.on_log(None, state, None, logs={"eval_loss": 1.0})  # not a training log: waits for one
    wait.on_log(None, state, None, logs=logs)
    wait.on_log(None, state, None, logs=later)
    assert logs["first_step_seconds"] == 44.25 and "first_step_seconds" not in later
    quiet = FirstStepWait([])  # nothing compiles: logged, not said
    clock = iter([0.0, 0.5])
    quiet.on_train_begin(None, state, None)
    quiet.on_step_end(None, state, None)
    assert capsys.readouterr().out == ""


def test_filters_drop_only_the_known_messages(capsys):
    """Each filter is narrow: the known message goes, another message of the same logger still shows."""
    from sft.report.console import quiet_imports

    quiet_imports()
    handler = logging.StreamHandler(sys.stderr)
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree", "DeepSpeed")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        class KernelPreference:  # stands for torchao's enum: only torchao's registrations are dropped
            __module__ = "torchao.quantization.quantize_.common"

        logging.getLogger("torchao").warning("Failed to load /venv/site-packages/torchao/_C_mxfp8.so: no such lib")
        logging.getLogger("torchao").warning("some other torchao warning")
        message = "%s is an Enum subclass and is now natively supported by torch.compile"
        logging.getLogger("torch.utils._pytree").warning(message, KernelPreference)
        logging.getLogger("torch.utils._pytree").warning(message, "<enum 'Mine'>")
        logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU ...")
        logging.getLogger("DeepSpeed").warning("another DeepSpeed warning")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "Failed to load" not in err and "some other torchao warning" in err
    assert err.count("is an Enum subclass") == 1 and "<enum 'Mine'>" in err
    if torch.version.cuda is None:  # CPU-only torch: no GPU could have been found
        assert "Setting accelerator" not in err
    assert "another DeepSpeed warning" in err
    deprecation = "`is_gradient_checkpointing` is deprecated and will be removed in v6."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_imports()  # its warning filters go first again (pytest resets them around each test)
        warnings.warn_explicit(deprecation, FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils")
        warnings.warn_explicit(deprecation, FutureWarning, "elsewhere.py", 1, module="elsewhere")
    assert [w.filename for w in caught] == ["elsewhere.py"]


def stderr_of(code: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.slow
def test_quiet_libraries_silences_importing_and_building_a_trainer(tmp_path):
    """What every run does: import transformers' Trainer (torchao), build a Trainer (deepspeed through accelerate),
    load and save a model, tokenize with datasets."""
    code = f"""
from sft.report.console import quiet_libraries
quiet_libraries()
import datasets, torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from sft.model.tiny import ensure_tiny_model
model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
rows = datasets.Dataset.from_list([{{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}}] * 4)
rows = rows.map(lambda row: row, desc="Tokenizing")
rows.save_to_disk({str(tmp_path / 'rows')!r})
Trainer(model=model, args=TrainingArguments(output_dir={str(tmp_path / 'out')!r}, use_cpu=True, report_to=[]),
        train_dataset=rows).save_model()
"""
    err = stderr_of(code)
    assert not [line for line in err.splitlines() if any(word in line for word in NOISE)], err


@pytest.mark.slow
def test_help_prints_no_library_noise(train_help):
    result = train_help  # python sft/train.py --help, from /
    assert result.returncode == 0 and "--model" in result.stdout
    assert not [line for line in result.stderr.splitlines() if any(word in line for word in NOISE)], result.stderr


@pytest.mark.slow
def test_a_run_shows_the_overview_and_the_next_commands_and_no_noise(tmp_path, tiny_llama):
    out = tmp_path / "out"
    result = run_train(["--model", str(tiny_llama), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
                        "--output_dir", str(out), "--max_steps", "1", "--max_length", "128", "--lora",
                        "--dataset_cache_dir", str(tmp_path / "cache"), "--save_steps", "50",
                        "--save_total_limit", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training on 1 process(es) (no parallelism) on CPU" in result.stdout, result.stdout
    assert "checkpoints  every 50 steps (the last 2 kept)" in result.stdout  # ours keeps the limit the Trainer lacks
    assert "LoRA r=16:" in result.stdout and "1 optimizer step (--max_steps)" in result.stdout
    assert "first step:" not in result.stdout  # sdpa, no compiled layers: nothing compiles, nothing said
    assert "first_step_seconds" in (out / "trainer_log.jsonl").read_text()
    merge = "deepseek-sft merge" if shutil.which("deepseek-sft") else "python -m sft.tools.merge"
    assert f"{merge} {out} {out}-merged" in result.stdout, result.stdout
    assert not [line for line in result.stderr.splitlines() if any(word in line for word in NOISE)], result.stderr
