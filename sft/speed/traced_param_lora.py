"""LoRA on a linear layer's weight targeted as a parameter (peft's ParamWrapper), in a form dynamo can trace.

DeepSeek's MoE families put LoRA on the dense layers' and shared experts' MLP through peft's `target_parameters`
(sft/model/families.py says why). peft's ParamWrapper then registers a torch parametrization on the base layer's
weight for each forward and removes it after (`torch.nn.utils.parametrize`, a `Tensor.set_` on a parameter): dynamo
cannot trace that ("Getting an inplace view on a graph input is not supported"), and a compiled DeepSeek decoder
layer fell back to running eagerly (issue 26: --compile_layers with --quantize_experts on V2-Lite).

When LoRA attaches (sft/model/loading.py; and under --compile_layers for any wrapper attached otherwise) each such
wrapper of a plain nn.Linear becomes a subclass whose forward computes the adapter as peft's lora.Linear does,
`base(x) + B(A(x)) * scaling` for each active adapter, without the parametrization. peft's form,
`linear(x, W + delta_W, b)`, also made a weight-sized `W + B @ A` in every forward and recompute, and its backward
the gradient of that whole weight (a GEMM the size of the layer's forward) to get B's and A's from it; the frozen
base needs none. The same loss and gradients as peft's forward to rounding (tests:
fp32, compiled and eager). Anything else (merged or disabled adapters, a LoRA bias, nested wrappers, fused experts'
3-D weights: sft/speed/expert_lora.py) goes through peft's forward unchanged. Names, state dicts and saved adapters
stay peft's (only the class changes, the way sft/model/quantized_experts.py changes the experts' class).
"""

from __future__ import annotations

import torch
from torch import nn

from sft.speed.peft_class import with_forward


def _param_wrapper_class() -> type:
    from peft.tuners.lora.layer import ParamWrapper

    return ParamWrapper


def add_adapters(wrapper: nn.Module, x: torch.Tensor, out: torch.Tensor, adapters: list[str]) -> torch.Tensor:
    """`out` (the base layer's output) plus each adapter's B(A(x)) * scaling, in peft's order and as its lora.Linear
    computes it (a ParamWrapper has no dropout)."""
    for adapter in adapters:
        a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
        out = out + (b(a(x.to(a.weight.dtype))) * wrapper.scaling[adapter]).to(out.dtype)
    return out


class TracedLinearParamLora:
    """Mixed in before peft's ParamWrapper, for a wrapper whose base is an nn.Linear and whose target its weight."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        if (args or kwargs or self.disable_adapters or self.merged or not adapters
                or any(self.lora_bias.get(a) for a in adapters)):  # peft's delta leaves a LoRA bias out
            return super().forward(x, *args, **kwargs)
        return add_adapters(self, x, self.get_base_layer()(x), adapters)


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
        module.__class__ = with_forward(TracedLinearParamLora, type(module))
    return len(modules)
