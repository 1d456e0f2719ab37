"""deepseek-sft: fine-tune DeepSeek-family models with the Hugging Face Trainer."""
