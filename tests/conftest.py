"""Shared test fixtures: tiny random-init models saved with save_pretrained, the shared real data, and a way to
run the training entry point in a fresh process (as a user does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
ALPACA_SAMPLE = SHARED / "datasets" / "alpaca_sample.json"
OASST_SAMPLE = SHARED / "datasets" / "oasst1_sample.jsonl"
DEEPSEEK_TOKENIZER = SHARED / "tokenizers" / "deepseek-coder-6.7b-instruct"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared (real samples and tokenizer) is absent "
                                                              "in this checkout; CI has it")


def tiny_config(model_type: str, vocab_size: int = 1024, **overrides):
    """A few-layer config of each family we support (sizes only; the architecture is the real one)."""
    from transformers import AutoConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if model_type in ("deepseek_v2", "deepseek_v3"):
        common.update(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                      num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, topk_method="greedy")
        if model_type == "deepseek_v3":
            common.update(n_group=2, topk_group=1, q_lora_rank=16)
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def save_tiny_model(path: Path, model_type: str = "llama", tokenizer_dir: Path | None = None, seed: int = 0) -> Path:
    """Save a random-init model (and a tokenizer: the embedded demo's, or the one given) to `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft.model.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or ensure_tiny_model())
    config = tiny_config(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


def run_train(args: list[str], *, launcher: list[str] | None = None, env: dict | None = None,
              timeout: int = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `sft/train.py` in a new process (optionally under a launcher such as `accelerate launch ...`)."""
    command = (launcher or [sys.executable]) + [str(REPO / "sft" / "train.py"), *args]
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(command, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def tensorboard_scalars(logdir: Path, tag: str) -> list[float]:
    """Every value logged under `tag` in the TensorBoard event files below `logdir`, in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values += [e.value for e in accumulator.Scalars(tag)]
    return values
