"""The embedded default model: a tiny DeepSeek-architecture model and its tokenizer, built here, no download.

The architecture is deepseek-llm's (a Llama-type decoder with DeepSeek's proportions, special tokens and chat
template), scaled down to train in seconds on a CPU. The tokenizer is a byte-level BPE trained on the bundled
data. Both are written with `save_pretrained` to a directory and loaded back through the normal loading path,
so the demo exercises exactly what a real model goes through.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from sft.configs import DEMO_DATA
from sft.machine import launch

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"
VERSION = "1"  # bump when the recipe below changes, so cached builds are rebuilt
# deepseek-llm-7b-chat's template (BOS, optional system text, `User: ...\n\nAssistant: ...<eos>`).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def default_dir() -> Path:
    cache = Path(launch().xdg_cache_home or Path.home() / ".cache")
    return cache / "deepseek-sft" / f"tiny-deepseek-v{VERSION}"


def corpus(data_dir: Path) -> list[str]:
    """Every string in the bundled data files, for training the tokenizer."""
    texts: list[str] = []
    for path in sorted(data_dir.glob("*.json*")):
        raw = path.read_text()
        records = json.loads(raw) if path.suffix == ".json" else [json.loads(x) for x in raw.splitlines() if x]
        for record in records:
            texts += [v for v in record.values() if isinstance(v, str)]
    return texts


def build_tokenizer(data_dir: Path, vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus(data_dir), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        model_max_length=4096)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    # deepseek-llm-7b: hidden 4096, intermediate 11008 (x2.6875), 30 layers, 32 heads, rope_theta 10000.
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def ensure_tiny_model(target: Path | None = None, data_dir: Path | None = None) -> Path:
    """Build the tiny model and tokenizer once into `target` (atomically, so concurrent ranks agree)."""
    target = Path(target or default_dir())
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(data_dir or DEMO_DATA)
    model = build_model(tokenizer)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
    tokenizer.save_pretrained(staging)
    model.save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first: its build is identical
        shutil.rmtree(staging, ignore_errors=True)
    return target
