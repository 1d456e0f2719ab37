"""What a run leaves is what a user expects of it: the saved config keeps the base's use_cache (training forwards
run without a cache through the batches themselves), the data summary counts eval data apart from training data,
and `python -m sft.tools.chat` says when an answer was cut at --max_new_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_train
from sft.options.arguments import DataArguments, LoraArguments, ModelArguments
from sft.data.packing import Collator, pack_rows


def write_jsonl(path: Path, conversations: list[list[tuple[str, str]]]) -> str:
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conversation]}) + "\n"
                            for conversation in conversations))
    return str(path)


def test_training_and_chat_load_the_models_own_code_without_hub_kernels(tiny_llama):
    """transformers 5.25 turns hub kernels on by default in from_pretrained (a CUDA model then swaps its RMSNorm and
    RoPE for kernels downloaded at its first train()/eval()); ours stay off, as on 5.24 where they were opt-in."""
    from sft.model.loading import load_model
    from sft.tools.chat import load_model as load_chat_model

    model = load_model(ModelArguments(model=str(tiny_llama), dtype="float32"), LoraArguments())
    assert model.use_kernels is False
    model.train()
    assert model.use_kernels is False
    chat_model = load_chat_model(Path(tiny_llama))
    assert chat_model.use_kernels is False


def test_training_and_eval_forwards_run_without_a_cache_and_the_save_keeps_the_base_use_cache(tmp_path, tiny_llama):
    """As sft/train.py builds it: the base's use_cache handed to the Trainer (which copies it onto the config), the
    Collator's batches turning the cache off in every forward, activation checkpointing on."""
    import datasets
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from sft.model.loading import load_model

    model = load_model(ModelArguments(model=str(tiny_llama), dtype="float32"), LoraArguments(), True)
    assert model.config.use_cache is True  # load_model leaves the base's value (the llama default)
    seen: list = []  # use_cache as each decoder layer receives it (where checkpointing would switch a cache off)
    model.model.layers[0].register_forward_pre_hook(lambda m, a, kwargs: seen.append(kwargs.get("use_cache")),
                                                    with_kwargs=True)
    rng = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, model.config.vocab_size, (n,), generator=rng).tolist() for n in (9, 14, 5, 11, 7, 12)]
    rows = datasets.Dataset.from_list(pack_rows(docs, [[-100] + d[1:] for d in docs], 24).to_pylist())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, activation_checkpointing=True, use_cpu=True,
                             use_cache=model.config.use_cache, report_to=[], save_strategy="no",
                             remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, data_collator=Collator(0))
    trainer.train()
    trainer.evaluate()
    assert seen and all(value is False for value in seen), seen  # never a cache, so never a checkpointing warning
    trainer.save_model(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["use_cache"] is True
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert saved(input_ids=torch.tensor([[5, 6, 7]])).cache is not None  # a plain forward caches (5.x: `cache`)


@pytest.mark.slow
def test_a_run_saves_the_base_use_cache_and_checkpointing_does_not_warn(tmp_path, tiny_llama):
    out = tmp_path / "out"
    result = run_train(["--model", str(tiny_llama), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
                        "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "2",
                        "--max_length", "128", "--packing", "true", "--activation_checkpointing", "true",
                        "--report_to", "none", "--dataset_cache_dir", str(tmp_path / "cache"),
                        "--save_strategy", "no"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "use_cache" not in result.stderr and "Caching is incompatible" not in result.stderr, result.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["use_cache"] is True

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out)(input_ids=torch.tensor([[5, 6, 7]])).cache is not None


def test_summary_reports_eval_data_apart(tmp_path):
    from transformers import AutoTokenizer

    from sft.data.dataset import prepare, read_datasets
    from sft.model.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    long = "the capital of France is Paris " * 100
    train = write_jsonl(tmp_path / "train.jsonl", [[("user", f"Question {i}?"), ("assistant", "Answer.")]
                                                   for i in range(4)])
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [
        [("user", "Capital of France?"), ("assistant", "Paris.")],
        [("user", "Capital of Japan?"), ("assistant", "Tokyo."), ("user", "More?"), ("assistant", long)],  # cut
        [("user", long), ("assistant", "Too long.")],  # dropped: not even its first turn fits
    ])
    args = DataArguments(dataset=[train], eval_dataset=[evaluation], max_length=64, num_proc=1,
                         dataset_cache_dir=str(tmp_path / "cache"))
    train_rows, eval_rows, summary = prepare(args, tokenizer, read_datasets(args))
    lines = summary.splitlines()
    assert lines[0] == "Data: 4 records read, 4 conversations kept (template deepseek)"
    start = lines.index("Eval data: 3 records read, 3 conversations kept")
    assert not any("too long" in line or "truncated" in line for line in lines[:start])  # none in training
    eval_tokens = sum(len(row) for row in eval_rows["input_ids"])
    assert lines[start + 1:] == ["  too long (dropped): 1", "  truncated at a turn boundary: 1",
                                 lines[-1]] and lines[-1].endswith(f"; 2 examples, {eval_tokens} tokens")
    train_tokens = sum(len(row) for row in train_rows["input_ids"])
    assert f"; 4 examples, {train_tokens} tokens" in lines[1]


def test_chat_says_when_an_answer_was_cut(tiny_llama, capsys):
    from sft.tools.chat import main

    assert main([str(tiny_llama), "--prompt", "Capital of Japan?", "--max_new_tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert err.strip().endswith("[cut at --max_new_tokens 3]") and out.strip()  # a random model: no EOS in 3


@pytest.mark.parametrize("name, generated, answer", [
    ("deepseek", " Tokyo. \n", "Tokyo. \n"),  # the template's space goes, the answer's own whitespace stays
    ("deepseek_coder", "x = 1\n\n", "x = 1\n"),  # the newline before the end of turn is the template's
])
def test_chat_answer_that_ended_keeps_its_text(tiny_llama, name, generated, answer):
    from transformers import AutoTokenizer

    from sft.tools.chat import reply
    from sft.data.chat_templates import get_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    if name == "deepseek_coder":
        tokenizer.add_special_tokens({"eos_token": "<|EOT|>"})  # as the deepseek-coder tokenizer has it

    class Model:  # generates `generated` and the EOS
        device = torch.device("cpu")

        def generate(self, input_ids, **kwargs):
            new = tokenizer(generated, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            return torch.cat([input_ids, torch.tensor([new])], dim=1)

    template = get_template(name, tokenizer)
    assert reply(Model(), tokenizer, template, [{"role": "user", "content": "Hi"}], 50, 0.0) == (answer, True)


def test_max_samples_counts_what_is_kept(tmp_path):
    """Was "Data: 2000 records read, 1999 conversations kept" under --max_samples 100: the count before the cap."""
    from transformers import AutoTokenizer

    from sft.data.dataset import prepare, read_datasets
    from sft.model.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    data = write_jsonl(tmp_path / "data.jsonl", [[("user", f"Question {i}?"), ("assistant", "Answer.")]
                                                 for i in range(12)])
    args = DataArguments(dataset=[data], max_samples=5, max_length=64, num_proc=1,
                         dataset_cache_dir=str(tmp_path / "cache"))
    rows, _, summary = prepare(args, tokenizer, read_datasets(args))
    assert len(rows) == 5
    assert summary.splitlines()[0] == ("Data: 12 records read, 5 conversations kept (--max_samples 5: 7 more left "
                                       "out) (template deepseek)")


@pytest.mark.slow
def test_a_run_shorter_than_logging_steps_logs_its_last_step_in_one_line(tmp_path, tiny_llama, capsys):
    """Was: 2 steps under the default --logging_steps 10 printed no loss, left TensorBoard without train/loss and
    drew an empty loss.png. Each log is one line on the terminal, the dicts whole in trainer_log.jsonl."""
    from conftest import tensorboard_scalars
    from sft.safety.run_dir import TRAINER_LOG
    from sft.train import main

    out = tmp_path / "out"
    assert main(["--model", str(tiny_llama), "--dataset", str(REPO / "data" / "alpaca_demo.json"), "--output_dir",
                 str(out), "--max_steps", "2", "--max_length", "64", "--report_to", "tensorboard", "--save_strategy",
                 "no", "--dataset_cache_dir", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    logged = [line for line in printed.splitlines() if line.startswith("step ")]
    assert len(logged) == 1 and logged[0].startswith("step 2/2 (epoch ") and " tok/s" in logged[0], printed
    assert "{'loss'" not in printed and "'grad_norm'" not in printed
    assert len(tensorboard_scalars(out / "runs", "train/loss")) == 1
    history = [json.loads(line) for line in (out / TRAINER_LOG).read_text().splitlines()]
    assert [h["step"] for h in history if "loss" in h] == [2] and "grad_norm" in history[0]
