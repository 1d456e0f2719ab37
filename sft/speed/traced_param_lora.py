"""LoRA on a linear layer's weight targeted as a parameter (peft's ParamWrapper), in a form dynamo can trace.

DeepSeek's MoE families put LoRA on the dense layers' and shared experts' MLP through peft's `target_parameters`
(sft/model/families.py says why). peft's ParamWrapper then registers a torch parametrization on the base layer's
weight for each forward and removes it after (`torch.nn.utils.parametrize`, a `Tensor.set_` on a parameter): dynamo
cannot trace that ("Getting an inplace view on a graph input is not supported"), and a compiled DeepSeek decoder
layer fell back to running eagerly (issue 26: --compile_layers with --quantize_experts on V2-Lite).

Under --compile_layers each such wrapper of a plain nn.Linear becomes a subclass whose forward computes what the
parametrization computes -- `linear(x, W + delta_W, b)`, delta_W from peft's own `get_delta_weight`, summed over the
active adapters in the same order -- without the parametrization. The same numbers as peft's forward (tests:
compiled-vs-eager). Anything else (merged or disabled adapters, nested wrappers, fused experts' 3-D weights) goes
through peft's forward unchanged. Names, state dicts and saved adapters stay peft's (only the class changes, the way
sft/model/quantized_experts.py changes the experts' class).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def _param_wrapper_class() -> type:
    from peft.tuners.lora.layer import ParamWrapper

    return ParamWrapper


class TracedLinearParamLora:
    """Mixed in before peft's ParamWrapper, for a wrapper whose base is an nn.Linear and whose target its weight."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        if args or kwargs or self.disable_adapters or self.merged or not adapters:
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        delta = None
        for adapter in adapters:  # as ParamWrapper._activate_lora sums them
            step = self.get_delta_weight(adapter)
            delta = step if delta is None else delta + step
        return F.linear(x, base.weight + delta, base.bias)  # _LoraParameterProxy: W + delta_W


@functools.cache  # one class per peft class: a new class per layer would make dynamo compile each layer anew
def _traced_class(cls: type) -> type:
    # The class keeps peft's name: peft tells its wrappers apart by `__class__.__name__ == "ParamWrapper"` (loading a
    # second adapter beside this one, as the save check does, refused a wrapper of another name)
    return type(cls.__name__, (TracedLinearParamLora, cls),
                {"__module__": cls.__module__, "__qualname__": f"Traced{cls.__qualname__}"})


def traceable(module: nn.Module, wrapper: type) -> bool:
    """A ParamWrapper of one nn.Linear's weight (not a fused experts tensor, not a wrapper around a wrapper)."""
    return (isinstance(module, wrapper) and not isinstance(module, TracedLinearParamLora)
            and module.parameter_name == "weight" and getattr(module, "num_experts", None) == 1
            and type(module.base_layer) is nn.Linear)


def trace_param_lora(model: nn.Module) -> int:
    """Give every traceable ParamWrapper of `model` the forward above; -> how many."""
    wrapper = _param_wrapper_class()
    modules = [m for m in model.modules() if traceable(m, wrapper)]
    for module in modules:
        module.__class__ = _traced_class(type(module))
    return len(modules)
