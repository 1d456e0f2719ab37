"""A peft layer's class with a forward of ours mixed in before peft's: how sft/speed/ changes what a LoRA layer
computes (traced_param_lora.py, fp8.py, expert_lora.py) without patching a live object. The layer's
class is swapped for the mixed one; its modules, parameters, state dict and saved adapter stay peft's."""

from __future__ import annotations

import functools


@functools.cache  # one class per (mixin, peft class): dynamo guards on a module's class, so a class made per layer
def with_forward(mixin: type, cls: type, **attributes) -> type:  # would make it compile each layer anew
    """`cls` with `mixin` first in its method order. The class keeps peft's name: peft tells its wrappers apart by
    `__class__.__name__` (a ParamWrapper of another name was refused when a second adapter loaded beside it)."""
    return type(cls.__name__, (mixin, cls), {"__module__": cls.__module__,
                                              "__qualname__": f"{mixin.__name__}.{cls.__qualname__}", **attributes})
