"""torchao's low-bit AdamW (`--optim adamw_torch_8bit` / `adamw_torch_4bit` with
`--optim_args bf16_stochastic_round=True`): the optimizer of the bf16 full fine-tune plan (bench/RESULTS.md).

torchao 0.18's optimizer-state subclasses implement `aten._to_copy` (they only change their "appearance" dtype)
but not `aten.view.dtype`, which torch.compile's trace of the optimizer step calls on PyTorch >= 2.9.1, so the
first step dies with "OptimState8bit dispatch: attempting to run unimplemented operator ... aten.view.dtype"
(seen on torch 2.11 with FSDP2; pytorch/ao PR #4216 adds the same registration upstream). Registering it as
"change the appearance dtype" is what that PR does and what `_to_copy` already does.
"""

from __future__ import annotations


def patch_torchao_view_dtype() -> list[str]:
    """Register aten.view.dtype for torchao's optimizer-state subclasses that lack it. -> names patched."""
    import importlib

    import torch

    aten = torch.ops.aten
    patched = []
    for module, name in (("torchao.optim.subclass_8bit", "OptimState8bit"),
                         ("torchao.optim.subclass_4bit", "OptimState4bit"),
                         ("torchao.optim.subclass_fp8", "OptimStateFp8")):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        table = getattr(cls, "_ATEN_OP_TABLE", {}).get(cls, {})
        to_copy = table.get(aten._to_copy.default)
        if to_copy is None or aten.view.dtype in table:
            continue

        def view_dtype(func, types, args, kwargs, _to_copy=to_copy):
            return _to_copy(aten._to_copy.default, types, (args[0],), {"dtype": args[1]})

        cls.implements(aten.view.dtype)(view_dtype)
        patched.append(name)
    return patched
