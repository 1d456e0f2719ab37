"""--push_to_hub (sft/safety/hub_push.py): refused with one error line before any model loads where it could not
upload, and the final folder uploaded once, after the save has been reloaded and checked. The Hub is not reached:
huggingface_hub's HfApi methods are replaced at the class by a recorder, which the Trainer's own calls go through too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import HfApi
from huggingface_hub.hf_api import RepoUrl

from conftest import REPO, train_here
from sft.safety import hub_push
from sft.safety.run_dir import FINAL_MARKER

DATA = str(REPO / "data" / "alpaca_demo.json")


def run(tiny_llama: Path, out: Path, *extra: str):
    return train_here(["--model", str(tiny_llama), "--dataset", DATA, "--lora", "--max_steps", "2",
                       "--max_length", "256", "--save_strategy", "no", "--report_to", "none", "--output_dir",
                       str(out), *extra])


@pytest.fixture
def hub(monkeypatch) -> list[tuple]:
    """The Hub's calls, recorded: create_repo answers as the Hub does; upload_folder notes the folder's files and
    whether the run had marked its final save checked when the upload began."""
    calls: list[tuple] = []

    def create_repo(self, repo_id, *, token=None, private=None, exist_ok=False, **kwargs):
        calls.append(("create_repo", repo_id, token or self.token))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, **kwargs):
        folder = Path(folder_path)
        calls.append(("upload_folder", repo_id, sorted(p.name for p in folder.iterdir()), ignore_patterns,
                      (folder / FINAL_MARKER).exists()))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(hub_push, "is_offline_mode", lambda: False)  # CI exports HF_HUB_OFFLINE=1
    monkeypatch.setenv("HF_TOKEN", "hf_made_up")
    return calls


def test_the_checked_adapter_is_uploaded_once_with_a_model_card(tiny_llama, tmp_path, hub):
    result = run(tiny_llama, tmp_path / "out", "--push_to_hub", "--hub_model_id", "someone/tiny-sft")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Uploaded to https://huggingface.co/someone/tiny-sft" in result.stdout
    assert hub[0] == ("create_repo", "someone/tiny-sft", "hf_made_up")  # ours, before the model loaded
    uploads = [call for call in hub if call[0] == "upload_folder"]
    assert len(uploads) == 1  # not the Trainer's unchecked one as its save_model ends
    _, repo, files, ignored, checked = uploads[0]
    assert repo == "someone/tiny-sft" and checked
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer_config.json"} <= set(files)
    assert "checkpoint-*" in ignored and ".run.lock" in ignored


def test_a_failed_upload_is_one_line_and_keeps_the_result(tiny_llama, tmp_path, hub, monkeypatch):
    def refuse(self, **kwargs):
        raise OSError("connection reset by peer")

    monkeypatch.setattr(HfApi, "upload_folder", refuse)
    out = tmp_path / "out"
    result = run(tiny_llama, out, "--push_to_hub", "--hub_model_id", "someone/tiny-sft")
    assert result.returncode == 1
    assert "error: the upload to someone/tiny-sft failed (OSError: connection reset by peer)" in result.stderr
    assert "hf upload someone/tiny-sft" in result.stderr and "Traceback" not in result.stderr
    assert (out / FINAL_MARKER).exists() and (out / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("extra, says", [
    (["--push_to_hub"], "--push_to_hub needs --hub_model_id"),
    (["--hub_model_id", "someone/tiny-sft"], "add --push_to_hub"),
    (["--push_to_hub", "--hub_model_id", "someone/tiny sft"], "give <user or organization>/<name>"),
])
def test_an_upload_that_names_no_repository_is_refused_before_loading(tiny_llama, tmp_path, extra, says):
    result = run(tiny_llama, tmp_path / "out", *extra)
    assert result.returncode == 2 and says in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_no_token_or_offline_or_a_refused_repository_stops_before_loading(tiny_llama, tmp_path, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(hub_push, "get_token", lambda: None)
    result = run(tiny_llama, tmp_path / "a", "--push_to_hub", "--hub_model_id", "someone/tiny-sft")
    assert result.returncode == 2 and "needs a Hugging Face token" in result.stderr and "hf auth login" in result.stderr

    monkeypatch.setattr(hub_push, "is_offline_mode", lambda: True)
    result = run(tiny_llama, tmp_path / "b", "--push_to_hub", "--hub_model_id", "someone/tiny-sft",
                 "--hub_token", "hf_given")
    assert result.returncode == 2 and "HF_HUB_OFFLINE is set" in result.stderr

    def forbidden(self, repo_id, **kwargs):
        raise PermissionError("403 Forbidden: no write access to someone")

    monkeypatch.setattr(hub_push, "is_offline_mode", lambda: False)
    monkeypatch.setattr(HfApi, "create_repo", forbidden)
    result = run(tiny_llama, tmp_path / "c", "--push_to_hub", "--hub_model_id", "someone/tiny-sft",
                 "--hub_token", "hf_given")
    assert result.returncode == 2 and "could not create or find someone/tiny-sft" in result.stderr
    assert "403 Forbidden" in result.stderr
    assert not [c for c in hub if c[0] == "upload_folder"]


def test_ctrl_c_during_the_final_upload_says_the_result_is_kept(tmp_path):
    """After the final save is checked, a Ctrl-C (the upload, the closing lines) is no stop mid-training: no resume
    command, the result's place, and the upload command where the upload was running."""
    from types import SimpleNamespace

    from sft.train import Run, stopped_message

    run = Run(["--push_to_hub", "--hub_model_id", "someone/tiny-sft"])
    run.output_dir, run.trainer = str(tmp_path), SimpleNamespace(state=SimpleNamespace(global_step=220))
    (tmp_path / FINAL_MARKER).write_text("{}")  # a finished run resumed for more steps keeps it while it trains
    assert "after training finished" not in stopped_message(run, "Ctrl-C")
    run.saved, run.uploading_to = True, "someone/tiny-sft"
    said = stopped_message(run, "Ctrl-C")
    assert said.startswith("stopped (Ctrl-C) after training finished; the result is saved and checked in ")
    assert f"hf upload someone/tiny-sft {tmp_path.resolve()}" in said and "resume" not in said
    run.uploading_to = None
    assert "hf upload" not in stopped_message(run, "Ctrl-C")


def test_merge_uploads_the_checked_merged_model_with_a_card(tmp_path, hub, monkeypatch, capsys):
    """`deepseek-sft merge ADAPTER OUT --push_to_hub NAME`: the repository checked before anything loads (nothing
    written where it cannot be), the merged model uploaded once written, with a model card naming how it was made."""
    from conftest import lora_demo_run
    from sft.tools import merge

    lora_demo_run(tmp_path, "lora")
    monkeypatch.setattr(hub_push, "get_token", lambda: None)
    assert merge.main([str(tmp_path / "lora"), str(tmp_path / "no-token"), "--push_to_hub", "someone/merged"]) == 2
    assert "needs a Hugging Face token" in capsys.readouterr().err and not (tmp_path / "no-token").exists()

    monkeypatch.setattr(hub_push, "get_token", lambda: "hf_made_up")
    assert merge.main([str(tmp_path / "lora"), str(tmp_path / "merged"), "--push_to_hub", "someone/merged"]) == 0
    assert "Uploaded to https://huggingface.co/someone/merged" in capsys.readouterr().out
    uploads = [call for call in hub if call[0] == "upload_folder"]
    assert len(uploads) == 1 and uploads[0][1] == "someone/merged"
    assert {"README.md", "config.json", "model.safetensors", "tokenizer_config.json"} <= set(uploads[0][2])
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "lora-merged" in card and "checked against the adapter's" in card
