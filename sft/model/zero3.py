"""DeepSpeed ZeRO-3 seen from the model's side: whether the model was created partitioned, and loading a whole copy
in one process while ZeRO-3 is on (reloading a save to check it)."""

from __future__ import annotations

from contextlib import contextmanager


def zero3_partition_report(model) -> str | None:
    """Whether the model was created already partitioned by ZeRO-3 (zero.Init): each parameter then carries
    DeepSpeed's `ds_numel` (full size) and `ds_tensor` (this rank's shard). None when ZeRO-3 is not in use."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return None
    params = list(model.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_numel")]
    if len(partitioned) < len(params):
        return (f"warning: ZeRO-3 is on but {len(params) - len(partitioned)} of {len(params)} parameters were "
                "loaded whole on every rank (no zero.Init): build TrainingArguments before loading the model.")
    full = sum(p.ds_numel for p in partitioned)
    local = sum(p.ds_tensor.numel() for p in partitioned)
    return f"ZeRO-3: model loaded partitioned (zero.Init): {local:,} of {full:,} parameters on this rank"


@contextmanager
def zero3_init_disabled():
    """Load a whole model in one process while ZeRO-3 is on (e.g. reloading a save to check it). Otherwise
    from_pretrained runs under zero.Init, whose collectives the other ranks never join: a hang, or on gloo a
    'collective mismatch' abort. from_pretrained asks transformers' global DeepSpeed config (a weak reference
    that TrainingArguments sets), so that is what is switched off here, and restored after."""
    from transformers.integrations import deepspeed as hf_deepspeed

    from sft.safety.private_names import HF_DEEPSPEED_CONFIG, expect

    ref = expect(HF_DEEPSPEED_CONFIG)
    config = ref() if ref is not None else None
    if config is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(config)
