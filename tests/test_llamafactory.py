"""LLaMA-Factory's (and Axolotl's, TRL's) data and recipes at the format boundary: its format names, dataset_info.json
(dataset_dir, columns, tags), preference files given to SFT, its YAML keys, cutoff_len's meaning, tool data on a
family without a tool-call format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, tiny_config
from sft.data.dataset import read_datasets, summarize
from sft.data.formats import DataError, ReadOptions, read_conversations
from sft.errors import ConfigError
from sft.options.arguments import parse_args

DEMO = str(REPO / "data" / "alpaca_demo.json")
QA = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


def write(path: Path, records) -> str:
    path.write_text(json.dumps(records, ensure_ascii=False))
    return str(path)


def data_args(*argv: str):
    return parse_args(["--model", "m", *argv], data_only=True)[1]


def test_sharegpt_and_openai_are_names_of_the_messages_reader(tmp_path):
    path = write(tmp_path / "s.json", [{"conversations": [{"from": "human", "value": "Q"},
                                                          {"from": "gpt", "value": "A"}]}])
    for name in ("sharegpt", "ShareGPT", "openai", "messages"):
        args = data_args("--dataset", path, "--dataset_format", name)  # the option check accepts it
        assert read_datasets(args).train[0]["messages"] == QA
    with pytest.raises(ConfigError, match=r"--dataset_format 'alpacca'.*messages reads OpenAI messages and "
                                          r"ShareGPT conversations; also named sharegpt"):
        data_args("--dataset", path, "--dataset_format", "alpacca")


def test_dataset_dir_reads_dataset_info_entries_with_their_columns_and_tags(tmp_path):
    write(tmp_path / "qa.json", [{"question": "Q", "answer": "A", "sys": "Be brief."}])
    write(tmp_path / "chat.json", [{"msgs": [{"speaker": "me", "text": "Q"}, {"speaker": "bot", "text": "A"},
                                             {"speaker": "fn", "text": '{"name": "now", "arguments": {}}'},
                                             {"speaker": "result", "text": "12:00"},
                                             {"speaker": "bot", "text": "Noon."}],
                                    "functions": json.dumps([{"name": "now", "parameters": {}}])}])
    write(tmp_path / "plain.json", [{"instruction": "Q", "input": "", "output": "A"}])
    write(tmp_path / "dataset_info.json", {
        "qa": {"file_name": "qa.json", "columns": {"prompt": "question", "response": "answer", "system": "sys"}},
        "chat": {"file_name": "chat.json", "formatting": "sharegpt",
                 "columns": {"messages": "msgs", "tools": "functions"},
                 "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot",
                          "function_tag": "fn", "observation_tag": "result"}}})
    # LLaMA-Factory's comma-separated names, and a file of the directory that is no entry
    args = data_args("--dataset_dir", str(tmp_path), "--dataset", "qa,chat", "plain.json")
    qa, chat, plain = read_datasets(args).train
    assert [m["content"] for m in qa["messages"]] == ["Be brief.", "Q", "A"]
    assert [m["role"] for m in chat["messages"]] == ["tools", "user", "assistant", "assistant", "tool", "assistant"]
    assert chat["messages"][3]["tool_calls"][0]["function"]["name"] == "now"
    assert [m["content"] for m in plain["messages"]] == ["Q", "A"]
    with pytest.raises(DataError, match=r"--dataset nope: no such entry in .*dataset_info.json \(chat, qa\)"):
        read_datasets(data_args("--dataset_dir", str(tmp_path), "--dataset", "nope"))
    # the same settings as options, without a dataset_info.json (a recipe gives them as mappings)
    args = data_args("--dataset", str(tmp_path / "qa.json"), "--dataset_columns",
                     '{"prompt": "question", "response": "answer"}')
    assert [m["content"] for m in read_datasets(args).train[0]["messages"]] == ["Q", "A"]
    with pytest.raises(ConfigError, match=r"--dataset_tags: unknown key\(s\) speaker_tag; the keys are role_tag"):
        data_args("--dataset", DEMO, "--dataset_tags", '{"speaker_tag": "x"}')


def test_a_preference_file_trains_on_the_preferred_reply_and_is_counted(tmp_path):
    files = {
        "ranked": [{"instruction": "Q", "input": "", "output": ["A", "worse"]}] * 3,  # LLaMA-Factory's ranked replies
        "pairs": [{"instruction": "Q", "input": "", "chosen": "A", "rejected": "worse"}],  # its alpaca ranking
        "sharegpt": [{"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "gpt", "value": "A"},
                      "rejected": {"from": "gpt", "value": "worse"}}],
        "trl": [{"prompt": "Q", "chosen": "A", "rejected": "worse"},
                {"chosen": QA, "rejected": [QA[0], {"role": "assistant", "content": "worse"}]}],
    }
    for name, records in files.items():
        conversations, stats = read_conversations(write(tmp_path / f"{name}.json", records), None, ReadOptions())
        turns = [[{k: v for k, v in m.items() if k != "input"} for m in c["messages"]] for c in conversations]
        assert turns == [QA] * len(records), name
        assert stats.preferred == len(records) and not stats.skipped and "preferred" not in conversations[0]
    args = data_args("--dataset", str(tmp_path / "ranked.json"), str(tmp_path / "trl.json"))
    stats = read_datasets(args).stats
    summary = summarize(stats, {"ok": 5}, np.array([4] * 5), [], args)
    assert "preference records, trained on the preferred reply: 5 (preference data" in summary


def test_llamafactory_yaml_keys_map_or_are_noted(tmp_path, capsys):
    write(tmp_path / "dataset_info.json", {"demo": {"file_name": DEMO}})
    recipe = tmp_path / "llamafactory.yaml"
    recipe.write_text(f"stage: sft\ndo_train: true\nmodel_name_or_path: m\ndataset: demo\ndataset_dir: {tmp_path}\n"
                      "cutoff_len: 512\noverwrite_cache: true\npreprocessing_num_workers: 3\nplot_loss: true\n")
    _, args, _, _ = parse_args(["--config", str(recipe)], data_only=True)
    assert (args.num_proc, args.max_length, args.overlong) == (3, 512, "cut")
    assert len(read_datasets(args).train) > 0
    notes = capsys.readouterr().err
    assert "did you mean" not in notes
    assert "--stage sft (LLaMA-Factory): supervised fine-tuning is what this toolkit does; nothing to set." in notes
    assert "--plot_loss true (LLaMA-Factory): loss.png is always written to the output directory" in notes
    assert "--overwrite_cache true (LLaMA-Factory): the prepared-data cache is keyed on the data" in notes
    assert "using --max_length 512 --overlong cut (--overlong cut keeps LLaMA-Factory's meaning" in notes
    assert "--preprocessing_num_workers is LLaMA-Factory's name for --num_proc" in notes
    # an explicit --overlong wins over cutoff_len's
    assert data_args("--dataset", DEMO, "--cutoff_len", "64", "--overlong", "drop").overlong == "drop"
    with pytest.raises(ConfigError, match="stage 'dpo': this toolkit does supervised fine-tuning only"):
        data_args("--dataset", DEMO, "--stage", "dpo")
    _, args, lora, _ = parse_args(["--model", "m", "--dataset", DEMO, "--quantization_bit", "4", "--neat_packing",
                                   "true"], data_only=True)
    assert lora.qlora and args.packing
    with pytest.raises(ConfigError, match="quantization_bit 8: this toolkit quantizes the base to 4 bits only"):
        data_args("--dataset", DEMO, "--quantization_bit", "8")


def test_overlong_cut_keeps_the_start_where_no_reply_fits():
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import IGNORE, tokenize_examples
    from sft.model.tiny import ensure_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    long_reply = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 200}]
    template = get_template("deepseek", tokenizer)
    (dropped,) = tokenize_examples(long_reply, tokenizer=tokenizer, template=template, max_length=64)
    assert dropped["status"] == "too long (dropped)"
    (cut,) = tokenize_examples(long_reply, tokenizer=tokenizer, template=template, max_length=64, overlong="cut")
    assert cut["status"] == "cut at --max_length" and cut["length"] == 64
    assert any(label != IGNORE for label in cut["labels"])


def test_tool_data_on_deepseek_llm_gets_one_advice():
    from transformers import AutoTokenizer

    from sft.data.tool_calls import refuse_tools
    from sft.model.families import check_family
    from sft.model.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())  # deepseek-llm's tokens and chat template
    config = tiny_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    with pytest.raises(DataError) as refused:
        refuse_tools("deepseek", [{"role": "assistant", "content": "", "tool_calls": [{}]}])
    assert "--template deepseek_v3" in str(refused.value) and "deepseek-llm" in str(refused.value)
    (warning,) = check_family(config, tokenizer, "deepseek_v3")
    assert "use --template deepseek, which has no tool-call format" in warning
    assert "right for tool data" in warning


def test_dataset_names_without_dataset_dir_read_data_like_llamafactory(tmp_path, monkeypatch, capsys):
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "demo.json", [{"instruction": "Q", "input": "", "output": "A"}])
    write(tmp_path / "data" / "dataset_info.json", {"demo": {"file_name": "demo.json"}})
    monkeypatch.chdir(tmp_path)
    assert len(read_datasets(data_args("--dataset", "demo,demo")).train) == 2  # its default dataset_dir: data
    assert "(LLaMA-Factory's default --dataset_dir data)" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"--dataset a,b: LLaMA-Factory's dataset names\? Give --dataset_dir"):
        read_datasets(data_args("--dataset", "a,b"))


def test_trl_script_options_map_or_are_refused(tmp_path, capsys):
    """TRL's sft script options: use_peft and load_in_4bit (its QLoRA), the loss on completions or the assistant's
    replies (our default), its packing strategies, padding-free rows; raw text is not what this toolkit trains."""
    _, data, lora, _ = parse_args(["--model", "m", "--dataset", DEMO, "--use_peft", "--load_in_4bit",
                                   "--completion_only_loss", "true", "--packing_strategy", "bfd"], data_only=True)
    assert lora.lora and lora.qlora and data.packing and not data.train_on_prompt
    notes = capsys.readouterr().err
    assert "--use_peft is TRL's name for --lora" in notes and "--completion_only_loss true (TRL)" in notes
    _, data, _, _ = parse_args(["--model", "m", "--dataset", DEMO, "--assistant_only_loss", "false", "--padding_free",
                                "true"], data_only=True)
    assert data.train_on_prompt and data.packing
    for argv, says in ((["--packing_strategy", "wrapped"], "never cuts one across rows"),
                       (["--dataset_text_field", "text"], "this toolkit trains conversations"),
                       (["--completion_only_loss", "maybe"], "completion_only_loss 'maybe': give true or false"),
                       (["--eos_token", "<|im_end|>"], "each --template ends a reply with its model's own end token"),
                       (["--dataset_train_split", "test"], "--dataset names files, which are read whole")):
        with pytest.raises(ConfigError, match=says):
            data_args("--dataset", DEMO, *argv)


def test_a_trl_recipe_names_its_hub_datasets_splits_and_dtype(tmp_path, capsys):
    """TRL's `trl sft --config` keys: dataset_name with dataset_train_split, and dataset_test_split read only where
    the run evaluates (as TRL does); torch_dtype (transformers 4's name for dtype)."""
    from sft.options.arguments import expand_argv

    recipe = tmp_path / "trl.yaml"
    recipe.write_text("model_name_or_path: m\ndataset_name: trl-lib/Capybara\ndataset_train_split: train[:90%]\n"
                      "dataset_test_split: test\ntorch_dtype: bfloat16\n")
    argv = expand_argv(["--config", str(recipe)])[0]
    assert argv[argv.index("--dataset") + 1] == "trl-lib/Capybara:train[:90%]" and "--eval_dataset" not in argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and "--dataset_test_split" not in argv
    argv = expand_argv(["--config", str(recipe), "--eval_strategy", "steps"])[0]  # evaluates: the test split too
    assert argv[argv.index("--eval_dataset") + 1] == "trl-lib/Capybara:test"
    assert "TRL's dataset splits: using --dataset trl-lib/Capybara:train[:90%] --eval_dataset trl-lib/Capybara:test" \
        in capsys.readouterr().err


def test_axolotl_switches_map_or_are_refused(capsys):
    """Axolotl's adapter: qlora, lora_target_linear, flash_attention / sdp_attention switches; no 8-bit base."""
    _, _, lora, _ = parse_args(["--model", "m", "--dataset", DEMO, "--adapter", "qlora", "--lora_target_linear",
                                "true"], data_only=True)
    assert lora.lora and lora.qlora and lora.lora_target_modules == ["all-linear"]
    assert "using --lora true --qlora true" in capsys.readouterr().err
    model, _, _, _ = parse_args(["--model", "m", "--dataset", DEMO, "--flash_attention", "true"], data_only=True)
    assert model.attn_implementation == "varlen"
    model, _, _, _ = parse_args(["--model", "m", "--dataset", DEMO, "--sdp_attention", "true"], data_only=True)
    assert model.attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="flash_attention 'maybe': give true or false"):  # never a silent false
        data_args("--dataset", DEMO, "--flash_attention", "maybe")
    with pytest.raises(ConfigError, match="load_in_8bit: this toolkit quantizes the base to 4 bits only"):
        data_args("--dataset", DEMO, "--load_in_8bit", "true")
    with pytest.raises(ConfigError, match=r"--bf16 auto \(Axolotl's\): give --bf16 true where"):
        data_args("--dataset", DEMO, "--bf16", "auto")
    _, data, _, training = parse_args(["--model", "m", "--dataset", DEMO, "--optimizer", "adamw_torch",
                                       "--dataset_prepared_path", "prepared", "--strict", "false"], data_only=True)
    assert training.optim == "adamw_torch" and data.dataset_cache_dir == "prepared"


def test_axolotl_wandb_keys_report_there_or_say_which_variable_to_set(capsys):
    """wandb_project: the project (which our run hands to wandb as WANDB_PROJECT) and --report_to tensorboard wandb
    (TensorBoard, the default, kept), unless the config names its loggers; wandb_name: the run's name; the keys wandb
    reads from the environment only: one line naming the variable (off values: nothing to set)."""
    from sft.report.loggers import wandb_project

    _, _, _, training = parse_args(["--model", "m", "--dataset", DEMO, "--wandb_project", "sft-runs", "--wandb_name",
                                    "first"], data_only=True)
    assert (training.project, training.report_to, training.run_name) == ("sft-runs", ["tensorboard", "wandb"], "first")
    environ: dict[str, str] = {"WANDB_PROJECT": "old"}
    assert wandb_project(training.report_to, training.project, environ) == "sft-runs"
    assert environ == {"WANDB_PROJECT": "sft-runs"}
    _, _, _, training = parse_args(["--model", "m", "--dataset", DEMO, "--wandb_project", "p", "--report_to",
                                    "tensorboard"], data_only=True)
    assert training.report_to == ["tensorboard"]  # the config's own loggers win
    environ = {}
    assert wandb_project(training.report_to, training.project, environ) is None and environ == {}
    assert wandb_project(["wandb"], "huggingface", environ) is None and environ == {}  # no project named
    with pytest.raises(ConfigError, match=r"wandb_entity 'team' \(Axolotl\): .*export WANDB_ENTITY=team"):
        data_args("--dataset", DEMO, "--wandb_entity", "team")
    data_args("--dataset", DEMO, "--wandb_watch", "false")
    assert "--wandb_watch false (Axolotl)" in capsys.readouterr().err


def test_an_axolotl_config_reads_its_datasets_list(tmp_path, capsys):
    """Axolotl's `datasets:` entries: each path read, its format detected from its records; a type or a key that
    would read the records otherwise is one error line."""
    chats = write(tmp_path / "chats.json", [{"conversations": [{"from": "human", "value": "Q"},
                                                               {"from": "gpt", "value": "A"}]}] * 3)
    recipe = tmp_path / "axolotl.yaml"
    recipe.write_text(f"base_model: m\ndatasets:\n  - path: {DEMO}\n    type: alpaca\n  - path: {chats}\n"
                      f"    type: chat_template\n    field_messages: conversations\n    message_property_mappings:\n"
                      f"      role: from\n      content: value\nsequence_len: 512\nadapter: lora\n")
    _, data, lora, _ = parse_args(["--config", str(recipe)], data_only=True)
    assert data.dataset == [DEMO, chats] and data.max_length == 512 and lora.lora
    read = read_datasets(data)
    assert len(read.train) == len(read_datasets(data_args("--dataset", DEMO)).train) + 3
    assert "--datasets is Axolotl's name for --dataset" in capsys.readouterr().err
    recipe.write_text(f"base_model: m\ndatasets:\n  - path: {DEMO}\nsequence_len: 384\npad_to_sequence_len: true\n"
                      f"gradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  use_reentrant: false\n")
    _, data, _, training = parse_args(["--config", str(recipe)], data_only=True)
    assert data.pad_to_max_length and data.pad_to_multiple_of == 384  # every batch's rows: 384 tokens
    assert training.activation_checkpointing and training.activation_checkpointing_kwargs == {"use_reentrant": False}
    with pytest.raises(ConfigError, match="give one of them"):
        parse_args(["--config", str(recipe), "--pad_to_multiple_of", "8"], data_only=True)
    recipe.write_text("base_model: m\ndatasets:\n  - path: mlabonne/FineTome-100k\n    type: chat_template\n"
                      "    split: train[:20%]\n")  # a hub dataset's slice, as load_dataset takes it
    assert parse_args(["--config", str(recipe)], data_only=True)[1].dataset == ["mlabonne/FineTome-100k:train[:20%]"]
    for entry, says in (("    type: completion\n", "datasets type 'completion'"),
                        ("    type: chat_template\n    field_messages: dialog\n", "datasets field_messages: 'dialog'"),
                        ("    split: test\n", r"datasets split: 'test' .*a local file is read whole")):  # a local file
        recipe.write_text(f"base_model: m\ndatasets:\n  - path: {chats}\n{entry}")
        with pytest.raises(ConfigError, match=says):
            parse_args(["--config", str(recipe)], data_only=True)


def test_other_trainers_keys_without_an_equivalent_are_a_note_or_one_line(capsys):
    """Each key of NO_EQUIVALENT (sft/options/argv.py): a value that needs nothing here is one note and no option;
    another is one error line naming the key, whose trainer and what to do (was: "unknown option", or a "did you
    mean" at an unrelated option of ours). A recipe holding several of them reads through."""
    from sft.options.argv import ANY, NO_EQUIVALENT, apply_aliases

    for key, (where, fine, says) in NO_EQUIVALENT.items():
        needs_nothing = "anything" if fine is ANY else fine[0] if fine else None
        if needs_nothing is not None:
            assert apply_aliases([f"--{key}", needs_nothing]) == [], key
            assert capsys.readouterr().err == f"note: --{key} {needs_nothing} ({where}): {says}; nothing to set.\n"
        if fine is not ANY:
            with pytest.raises(ConfigError) as refused:
                apply_aliases([f"--{key}", "something-else"])
            assert str(refused.value) == f"{key} 'something-else' ({where}): {says}.", key
    _, _, _, training = parse_args(["--model", "m", "--dataset", DEMO, "--low_cpu_mem_usage", "true",
                                    "--eval_batch_size", "3", "--lora_task_type", "CAUSAL_LM", "--use_unsloth",
                                    "false"], data_only=True)
    assert training.per_device_eval_batch_size == 3


def test_axolotls_cosine_min_lr_ratio_is_transformers_cosine_with_min_lr(capsys):
    """`lr_scheduler: cosine` with `cosine_min_lr_ratio: 0.1`: the schedule the Trainer builds from the options ends
    at a tenth of the learning rate; with another schedule, or beside --lr_scheduler_kwargs, one error line."""
    import torch
    from transformers import get_scheduler

    _, _, _, training = parse_args(["--model", "m", "--dataset", DEMO, "--lr_scheduler", "cosine",
                                    "--cosine_min_lr_ratio", "0.1", "--learning_rate", "1e-3"], data_only=True)
    assert training.lr_scheduler_type == "cosine_with_min_lr" and training.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=training.learning_rate)
    schedule = get_scheduler(training.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=10,
                             scheduler_specific_kwargs=training.lr_scheduler_kwargs)
    for _ in range(10):
        optimizer.step()
        schedule.step()
    assert schedule.get_last_lr()[0] == pytest.approx(1e-4)
    for argv, says in ((["--lr_scheduler_type", "linear", "--cosine_min_lr_ratio", "0.1"], "is linear: give cosine"),
                       (["--lr_scheduler_kwargs", "{}", "--cosine_min_lr_ratio", "0.1"], "give one of them"),
                       (["--cosine_min_lr_ratio", "1.5"], "from 0 up to 1")):
        with pytest.raises(ConfigError, match=says):
            data_args("--dataset", DEMO, *argv)
