"""Trainer callbacks. Each adds to the logs that TensorBoard (and every other `report_to` logger) receives."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

# Dense bf16 matmul peak per GPU, FLOP/s. H200: measured on our lent machines (the ceiling MFU is quoted
# against); the others are vendor datasheet figures (RTX 4090: tensor cores with fp32 accumulation).
PEAK_FLOPS = {"H200": 790e12, "H100": 790e12, "A100": 312e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
              "L40S": 362e12, "A6000": 155e12}


def peak_flops(override_tflops: float | None = None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(model, lora: bool) -> float:
    """Model FLOPs per trained token: 6N for full fine-tuning, 4N under LoRA (the frozen weights get no weight
    gradient), N = parameters of the matmuls (all but the input embeddings). Attention scores are not counted."""
    embeddings = model.get_input_embeddings()
    n = sum(full_numel(p) for p in model.parameters()) - (full_numel(embeddings.weight) if embeddings else 0)
    return (4 if lora else 6) * n


def full_numel(p) -> int:
    """Elements of the whole parameter, also when ZeRO-3 has partitioned it (its local numel is then 0)."""
    return getattr(p, "ds_numel", None) or p.numel()


class ThroughputCallback(TrainerCallback):
    """Real (non-padding) tokens per second, MFU and peak GPU memory, over the steps since the last log.

    Time spent evaluating or saving is left out, so the numbers describe training steps. Tokens come from the
    Trainer's own count (`include_num_input_tokens_seen="non_padding"`), summed over ranks; under tensor
    parallelism the ranks of one model copy see the same batch, so that sum counts each token tp_size times.
    """

    def __init__(self, flops_per_token: float, peak_flops_per_gpu: float | None):
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_gpu
        self.busy = 0.0
        self.mark = time.perf_counter()
        self.tokens_at_last_log = 0
        self.logged_tokens = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.mark = time.perf_counter()
        self.tokens_at_last_log = state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.busy += now - self.mark
        self.mark = now

    def _pause_ended(self, args, state, control, **kwargs):
        self.mark = time.perf_counter()

    on_evaluate = on_save = _pause_ended

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self.busy <= 0:
            return
        same_batch = getattr(kwargs.get("model"), "tp_size", None) or 1  # ranks that share one batch (TP)
        tokens = (state.num_input_tokens_seen - self.tokens_at_last_log) / same_batch
        self.logged_tokens = tokens  # over the window just logged (bench/train_throughput.py reads it)
        rate = tokens / self.busy
        logs["real_tokens_per_second"] = round(rate, 1)
        if self.peak:
            logs["mfu"] = round(rate * self.flops_per_token / (self.peak * max(1, args.world_size)), 4)
        if torch.cuda.is_available():
            logs["peak_memory_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        self.tokens_at_last_log = state.num_input_tokens_seen
        self.busy = 0.0
