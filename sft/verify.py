"""Verified saves: reload what was just written and compare its logits with the in-memory model's.

A save that silently dropped a tensor, wrote the wrong dtype, saved a LoRA adapter that does not attach to the
base, or wrote nothing (ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`) fails here, loudly, instead
of at the user's first inference. Full models are reloaded from the saved directory; LoRA adapters are reloaded
with peft onto a fresh copy of the base model. The reload happens on CPU in the main process (the GPU is full);
every process computes the in-memory logits, since sharded models (ZeRO-3, FSDP) need all ranks for a forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CHEAP_PARAMETERS = 1e9  # below this, reloading at every checkpoint costs seconds: `--verify_saves auto` does it


class SaveMismatchError(RuntimeError):
    """The saved model does not reproduce the in-memory model."""


def fixed_batch(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (2, 32), generator=generator)


@torch.no_grad()
def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no dropout
    try:
        # use_cache=False: a cache would change the attention mask path (see sft/packing.py)
        return model(input_ids=input_ids.to(device), use_cache=False).logits.float().cpu()
    finally:
        model.train(was_training)


def _is_main() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


def _broadcast(value):
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if PartialState().num_processes == 1:
        return value
    return broadcast_object_list([value])[0]


@dataclass
class SaveVerifier:
    base_model: str  # hub id or directory of the base model (reloaded under LoRA)
    lora: bool
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    checkpoints: bool = True  # verify every checkpoint, not only the final save
    final: bool = True

    def reload(self, path: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        source = self.base_model if self.lora else str(path)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=self.attn_implementation,
                                                     trust_remote_code=self.trust_remote_code, use_safetensors=True)
        if self.lora:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(path))
        return model

    def check(self, model, path: str | Path) -> None:
        """Raise SaveMismatchError (on every rank) unless the files in `path` give the in-memory logits."""
        path = Path(path)
        base = model.get_base_model() if self.lora and hasattr(model, "get_base_model") else model
        input_ids = fixed_batch(base.config.vocab_size)
        expected = logits_of(model, input_ids)
        error = None
        if _is_main():
            dtype = next(p.dtype for p in base.parameters() if not p.requires_grad or not self.lora)
            try:
                reloaded = self.reload(path, dtype)
                got = logits_of(reloaded, input_ids)
                del reloaded
            except Exception as e:  # a save that cannot even be loaded is the loudest mismatch of all
                error = f"{type(e).__name__}: {e}"
            else:
                error = compare(expected, got, dtype, same_device=next(model.parameters()).device.type == "cpu")
        error = _broadcast(error)
        if error:
            what = "LoRA adapter" if self.lora else "model"
            raise SaveMismatchError(f"the {what} saved in {path} does not reproduce the trained model: {error}. "
                                    f"Do not use these files; the run's earlier checkpoints are untouched.")


def compare(expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, same_device: bool) -> str | None:
    if expected.shape != got.shape:
        return f"logits shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    scale = max(1.0, expected.abs().max().item())
    if dtype in (torch.bfloat16, torch.float16):
        tolerance = 2e-2
    else:
        tolerance = 1e-5 if same_device else 1e-3  # other device: other kernels (and TF32) round differently
    diff = (expected - got).abs().max().item()
    if not diff <= tolerance * scale:  # `not <=` also catches NaN
        return f"logits differ by up to {diff:.3g} on a fixed batch (allowed {tolerance * scale:.3g})"
    return None


def make_verifier(mode: str, model, model_path: str, lora: bool, attn_implementation: str,
                  trust_remote_code: bool) -> SaveVerifier | None:
    """--verify_saves: auto (final save always, checkpoints too when the model has < 1e9 parameters), all,
    final, no."""
    if mode == "no":
        return None
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 holds shards
    every_checkpoint = mode == "all" or (mode == "auto" and n < CHEAP_PARAMETERS)
    return SaveVerifier(model_path, lora, attn_implementation, trust_remote_code, checkpoints=every_checkpoint)
