"""deepseek-sft: fine-tune DeepSeek-family models with the Hugging Face Trainer."""

from sft.report.console import quiet_imports as _quiet_imports

_quiet_imports()  # every `python -m sft.<command>` and sft/train.py: known third-party import noise filtered
