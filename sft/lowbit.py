"""torchao's low-bit AdamW (`--optim adamw_torch_8bit` with `--optim_args bf16_stochastic_round=True`): the
optimizer of the bf16 full fine-tune plan (bench/RESULTS.md), made to work under FSDP2.

torchao 0.18 gives each quantized optimizer state the parameter's dtype as an "appearance" dtype (bf16 for bf16
weights). Its compiled update then calls `state.float()`, which under FSDP2 (DTensor states) and
torch.compile dies on the first step: "OptimState8bit dispatch: attempting to run unimplemented operator ...
aten.view.dtype" (seen on torch 2.11 on H200s and torch 2.13 on CPU with 2 gloo ranks; pytorch/ao PR #4216 is
the open upstream report). Registering view.dtype alone is not enough (the traced view then fails dynamo's
metadata check), and eager mode fails too ("expected dtype torch.bfloat16 for `end`"). Giving the states a
float32 appearance dtype, as torchao did before, makes `.float()` a no-op: the states are stored the same way
(uint8 codes + fp32 block scales), only their reported dtype differs. 4-bit states still fail under FSDP2
("wrong number of dimensions"), so the plan uses 8-bit.
"""

from __future__ import annotations


LOW_BIT_OPTIMIZERS = ("adamw_torch_8bit", "adamw_torch_4bit")


def prepare_optimizer(optim: str) -> None:
    """Called before the Trainer builds its optimizer: patch torchao when `--optim` is one of its low-bit AdamWs."""
    if optim in LOW_BIT_OPTIMIZERS:
        patch_torchao_state_dtype()


def patch_torchao_state_dtype() -> list[str]:
    """Make torchao's 8/4-bit Adam(W) create optimizer states with a float32 appearance dtype. -> classes patched."""
    import torch

    try:
        from torchao.optim import adam
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        return []
    patched = []
    for name, state in (("Adam8bit", OptimState8bit), ("AdamW8bit", OptimState8bit),
                        ("Adam4bit", OptimState4bit), ("AdamW4bit", OptimState4bit)):
        cls = getattr(adam, name, None)
        if cls is None or getattr(cls, "_sft_float32_states", False):
            continue

        def zeros(p, signed: bool, block_size: int, _state=state):
            return _state.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

        cls._subclass_zeros = staticmethod(zeros)
        cls._sft_float32_states = True
        patched.append(name)
    return patched
