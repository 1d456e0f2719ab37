"""`--push_to_hub --hub_model_id NAME`: the run's result uploaded to the Hugging Face Hub, once it is verified.

Before any model loads, the main process makes sure the upload can happen: not offline, a token (`--hub_token`,
HF_TOKEN or `hf auth login`), and the repository created or found with it (`create_repo(exist_ok=True)`, as the
Trainer does when it starts). A run that would train for hours and then fail to upload stops in seconds instead.

During training the Trainer uploads each save as it always does (`--hub_strategy`, every_save by default). The
final folder is uploaded here, from the main process, after sft/safety/checkpoints.py's save_final has reloaded and
checked it (SFTTrainer.push_to_hub leaves the Trainer's own upload at the end of save_model, which comes before that
check, to this): the model or LoRA adapter, the tokenizer with the template trained with, a model card, the logs.
Checkpoint folders and names starting with `_` stay local, as the Trainer leaves them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import HfApi, get_token, is_offline_mode

from sft.errors import ConfigError, UploadFailed
from sft.safety.run_dir import LOCK_NAME

IGNORED = ["_*", "checkpoint-*", LOCK_NAME]  # as the Trainer's uploads (checkpoints go up by --hub_strategy);
# the run lock, which the Trainer's uploads of each save took along, removed from the repository at the end
HUB_REPO = re.compile(r"([A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")  # name, or user-or-organization/name


def hub_token(training_args) -> str | None:
    return training_args.hub_token or get_token()


def ensure_repo(name: str, token: str | None, private: bool | None = None) -> str:
    """Before anything loads: the repository `name` created or found with `token`; -> its id. One error line where
    the upload could not happen (a name the Hub refuses, offline, no token, the Hub refused)."""
    if not HUB_REPO.fullmatch(name):
        raise ConfigError(f"--push_to_hub {name!r}: give <user or organization>/<name> (letters, digits, '-', '_' "
                          f"and '.').")
    if is_offline_mode():
        raise ConfigError(f"--push_to_hub uploads to the Hugging Face Hub, and HF_HUB_OFFLINE is set: unset it, or "
                          f"leave out --push_to_hub and upload the result later (hf upload {name} <folder>).")
    if not token:
        raise ConfigError(f"--push_to_hub needs a Hugging Face token with write access to {name}: run `hf auth "
                          f"login`, or set HF_TOKEN, or give --hub_token.")
    try:
        return HfApi(token=token).create_repo(name, private=private, exist_ok=True).repo_id
    except Exception as e:  # no network, a token without write access, a name taken by another's model
        raise ConfigError(f"--push_to_hub could not create or find {name} on the Hugging Face Hub "
                          f"({type(e).__name__}: {first_line(e)}): check the name, the token's write access and the "
                          f"network.") from None


def upload(name: str, folder: str | Path, token: str | None, revision: str | None = None,
           message: str = "End of training") -> str:
    """`folder` to the repository `name` in one commit (the run lock left out, and removed there); -> its URL. A
    failure is UploadFailed: the folder stays as it is."""
    try:
        HfApi(token=token).upload_folder(repo_id=name, folder_path=str(folder), revision=revision,
                                         commit_message=message, ignore_patterns=IGNORED, delete_patterns=[LOCK_NAME])
    except Exception as e:
        raise UploadFailed(f"the upload to {name} failed ({type(e).__name__}: {first_line(e)}); the verified result "
                           f"is kept in {Path(folder).resolve()}: upload it with `hf upload {name} "
                           f"{os.path.relpath(folder)}`.") from None
    return f"https://huggingface.co/{name}"


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def is_hub_id(model: str) -> bool:
    """`owner/name` that is no local path: what a model card can name as the base."""
    return not Path(model).exists() and model.count("/") == 1


def check_hub_push(training_args) -> str | None:
    """Main process, before any model loads: -> the repository's id, where --push_to_hub is on."""
    if not training_args.push_to_hub:
        return None
    return ensure_repo(training_args.hub_model_id, hub_token(training_args), training_args.hub_private_repo)


def push_final(trainer, output_dir: str, base_model: str) -> str:
    """Main process, after the verified final save: the model card, then the folder in one commit. -> its URL."""
    args = trainer.args
    name = args.hub_model_id
    trainer.create_model_card(model_name=name.split("/")[-1], finetuned_from=base_model if is_hub_id(base_model)
                              else None)
    return upload(name, output_dir, hub_token(args), args.hub_revision)
