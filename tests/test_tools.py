"""The user tools run after training: merge an adapter, chat with the result."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from sft.tools import chat
from sft.tools import merge
from sft import train


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("lora-run") / "out"
    code = train.main(["--model", str(tiny_llama), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
                       "--output_dir", str(out), "--max_steps", "4", "--learning_rate", "1e-2", "--lora",
                       "--per_device_train_batch_size", "4", "--max_length", "128", "--report_to", "none",
                       "--save_strategy", "no", "--dataset_cache_dir", str(out.parent / "cache")])
    assert code == 0
    return out


def test_merge_writes_a_plain_model_equal_to_the_adapter(trained_adapter, tmp_path, capsys):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    merged_dir = tmp_path / "merged"
    assert merge.main([str(trained_adapter), str(merged_dir)]) == 0
    assert "logits match the adapter" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter = AutoPeftModelForCausalLM.from_pretrained(trained_adapter)
    ids = torch.arange(1, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, rtol=1e-4, atol=1e-4)
    assert merge.main([str(trained_adapter), str(merged_dir)]) == 2  # never over an existing model


def test_a_qlora_adapter_says_its_base_was_4_bit_and_merge_tells_the_user(trained_adapter, tmp_path, capsys):
    """peft's adapter_config.json records nothing of a 4-bit base: the run writes it beside the adapter
    (quantized_base.json) and sft.tools.merge says what the merged model then is. The 4-bit model is faked (no
    bitsandbytes on CPU): what is read is the base's hf_quantizer.quantization_config."""
    import shutil
    from types import SimpleNamespace

    from transformers import BitsAndBytesConfig

    from sft.model.loading import record_quantized_base
    from sft.safety.run_dir import QUANTIZED_BASE

    adapter = tmp_path / "adapter"
    shutil.copytree(trained_adapter, adapter)
    def base(**attributes):  # a model's modules() is read for an NF4 base (--qlora under FSDP): none here
        return SimpleNamespace(modules=lambda: iter(()), **attributes)

    plain = SimpleNamespace(get_base_model=lambda: base())
    assert not record_quantized_base(plain, str(adapter)) and not (adapter / QUANTIZED_BASE).exists()
    quantizer = SimpleNamespace(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    assert record_quantized_base(SimpleNamespace(get_base_model=lambda: base(hf_quantizer=quantizer)),
                                 str(adapter))
    assert merge.main([str(adapter), str(tmp_path / "merged")]) == 0
    assert "trained on a 4-bit (nf4) base" in capsys.readouterr().out


def test_merge_refuses_a_directory_without_adapter(tmp_path, capsys):
    assert merge.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "adapter_config.json" in capsys.readouterr().err


def test_chat_answers_one_prompt(trained_adapter, capsys):
    assert chat.main([str(trained_adapter), "--prompt", "What is the capital of Peru?", "--max_new_tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()  # some reply, rendered with the training template


def test_chat_thinking_opens_the_reply_with_think_where_the_template_has_that_switch(trained_adapter, capsys,
                                                                                       monkeypatch):
    """DeepSeek-V3.1's generation prompt ends `</think>` unless asked to think; --thinking asks. A template without
    that switch is refused with one `error:` line before the model loads (it would be ignored in silence)."""
    from sft.data.thinking_templates import DeepSeekV31

    prompts = []
    render = DeepSeekV31.text
    monkeypatch.setattr(DeepSeekV31, "text", lambda self, *a, **k: prompts.append(render(self, *a, **k)) or prompts[-1])
    for flags, opening in (([], "<｜Assistant｜></think>"), (["--thinking"], "<｜Assistant｜><think>")):
        assert chat.main([str(trained_adapter), "--template", "deepseek_v31", *flags, "--prompt", "2+2?",
                          "--max_new_tokens", "2"]) == 0
        asked = [p for p in prompts if "2+2?" in p]  # not chat.reply_frame's probes
        assert len(asked) == 1 and asked[0].endswith("<｜User｜>2+2?" + opening), asked
        prompts.clear()

    monkeypatch.setattr(chat, "load_model", lambda path: pytest.fail("the model loaded before the check"))
    capsys.readouterr()
    assert chat.main([str(trained_adapter), "--thinking", "--prompt", "2+2?"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --thinking: the chat template ") and "(--template auto)" in err, err
    assert "templates with one: deepseek_v31" in err and "\n" not in err


def test_chat_and_merge_say_what_a_directory_is_instead_of_a_traceback(trained_adapter, tiny_llama, tmp_path, capsys):
    """Each was a traceback (or argparse's usage block): one `error:` line, exit code 2, before anything loads."""
    import json
    import shutil

    from sft.safety.checkpoints import mark_complete

    def refused(tool, *argv) -> str:
        try:
            code = tool.main(list(argv))
        except SystemExit as e:  # argparse's errors exit
            code = e.code
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
        return err

    assert "unrecognized arguments: --bad" in refused(chat, str(trained_adapter), "--bad")
    assert "unrecognized arguments: --bad" in refused(merge, "a", "b", "--bad")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{")
    assert "its config.json is not readable JSON" in refused(chat, str(tmp_path / "junk"))
    (tmp_path / "config-only").mkdir()
    shutil.copy(tiny_llama / "config.json", tmp_path / "config-only")
    assert "holds a config.json but no weights" in refused(chat, str(tmp_path / "config-only"))
    assert "a full model, not a LoRA adapter" in refused(merge, str(tiny_llama), str(tmp_path / "m"))
    unfinished = tmp_path / "unfinished"  # a run stopped before its final save: its checkpoint is named
    shutil.copytree(trained_adapter, unfinished / "checkpoint-2", ignore=shutil.ignore_patterns("checkpoint-*"))
    mark_complete(unfinished / "checkpoint-2")
    assert f"give the newest complete one, {unfinished / 'checkpoint-2'}" in refused(chat, str(unfinished))
    moved = tmp_path / "moved-base"  # an adapter whose base is gone
    shutil.copytree(trained_adapter, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(tmp_path / "gone")}))
    assert "whose base cannot be loaded" in refused(chat, str(moved), "--prompt", "hi")
    assert "whose base cannot be loaded" in refused(merge, str(moved), str(tmp_path / "m"))
    (tmp_path / "a-file").write_text("x")
    assert "is a file" in refused(merge, str(trained_adapter), str(tmp_path / "a-file"))
    assert not (tmp_path / "m").exists()



def test_a_wrong_directory_is_said_before_torch_loads(tmp_path):
    """`deepseek-sft chat` / `merge` on a path that is no run: the error line in about a second, not after the
    ~7 s that importing torch, transformers' models and peft takes."""
    import os
    import subprocess
    import sys

    missing = str(tmp_path / "missing")
    for tool, argv in (("chat", [missing]), ("merge", [missing, str(tmp_path / "m")])):
        code = (f"import runpy, sys\nsys.argv = ['{tool}', *{argv!r}]\ntry:\n"
                f"    runpy.run_module('sft.tools.{tool}', run_name='__main__')\nexcept SystemExit as e:\n"
                "    print('exit', e.code)\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'peft'}))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.stdout.splitlines() == ["exit 2", "[]"], (out.stdout, out.stderr[-2000:])
        assert out.stderr.startswith("error: ") and "no such directory" in out.stderr, out.stderr[-2000:]


def test_ctrl_c_in_merge_and_data_leaves_nothing_half_written(trained_adapter, tiny_llama, tmp_path, capsys,
                                                               monkeypatch):
    # was: a KeyboardInterrupt traceback, and merge left a half-written model that looked like a merged one
    from transformers import PreTrainedModel

    from sft.data import dataset

    def interrupted_save(self, directory, *args, **kwargs):
        (tmp_path / "merged" / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", interrupted_save)
    assert merge.main([str(trained_adapter), str(tmp_path / "merged")]) == 130
    assert "stopped (Ctrl-C) while writing" in capsys.readouterr().err and not (tmp_path / "merged").exists()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dataset, "prepare", interrupted)
    assert dataset.main(["--model", str(tiny_llama), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
                         "--dataset_cache_dir", str(tmp_path / "cache")]) == 130
    assert capsys.readouterr().err.strip().startswith("stopped (Ctrl-C) while preparing the data")
