"""LoRA on the routed experts (--lora_experts) computed as LoRA is on a linear layer: the base weight's grouped
matmul, plus the adapter's two low-rank grouped matmuls beside it.

peft adapts transformers' fused expert weights (3-D: experts x out x in) as `target_parameters`: its ParamWrapper
registers a parametrization around each forward that makes `W + scaling * B @ A` for every expert (one `baddbmm`),
a tensor the size of all the layer's experts, in every forward and every recompute. Its grouped matmul then needs the
gradient of that whole weight, a weight-gradient GEMM of the experts' own size, from which autograd takes the small
gradients of B and A; the frozen base alone needs none. On V2-Lite that made the LoRA step 2.5x slower than without
LoRA on the experts, with 4.8 GiB more (bench/RESULTS.md, run 20261206T0933Z-experts-long-h100); under
--compile_layers the parametrization's `Tensor.set_` broke each layer's graph and its per-module class recompiled
each layer.

Here the wrapper peft builds is ours (peft's custom-module dispatch, keyed on the experts' class: sft/model/
loading.py): its forward routes the tokens as transformers' grouped_mm experts do, and each adapted projection
computes `grouped(x, W) + scaling * grouped(grouped(x, A), B)` with peft's own factors (`get_delta_factors`): the
same sum, without the expert-sized tensor or its gradient GEMM. The state dict, the saved adapter and merging stay
peft's (a subclass of its ParamWrapper, its name kept: peft tells wrappers apart by name). Anything else (merged or
disabled adapters, several adapters at once, expert parallelism, biases, an FP8 or quantized weight, a rank whose
rows the grouped matmul cannot align: 4 in bf16) goes through peft's forward unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from sft.speed.grouped_experts import routed_experts_forward
from sft.speed.peft_class import with_forward


class SplitExpertLora:
    """Mixed in before peft's ParamWrapper, for a wrapper of one fused expert weight (gate_up_proj or down_proj).
    peft nests the two: the outer wrapper's forward computes the layer for both."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        factors = self._split_factors()
        if factors is None or kwargs or len(args) != 2:
            return super().forward(hidden_states, *args, **kwargs)
        top_k_index, top_k_weights = args
        return experts_with_lora(self.get_base_layer(), hidden_states, top_k_index, top_k_weights, factors,
                                 self.grouped_linear)

    def _split_factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None:
        """{weight name: (lhs, rhs, scaling)} of every wrapper down to the experts, or None where peft's own forward
        must run."""
        factors = {}
        module = self
        while isinstance(module, SplitExpertLora):
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if module.disable_adapters or module.merged or len(adapters) > 1:
                return None
            if adapters:
                dtype = module.get_param().dtype
                if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    return None
                # torch's grouped matmul wants each row of the rank-r activations 16-byte aligned
                if module.r[adapters[0]] * torch.finfo(dtype).bits // 8 % 16:
                    return None
                factors[module.parameter_name] = module.get_delta_factors(adapters[0])
            module = module.base_layer
        experts = module
        if (getattr(experts, "_is_expert_parallel", False) or getattr(experts, "has_bias", True)
                or not hasattr(experts, "num_experts")):
            return None
        return factors


@torch.library.custom_op("sft::row_major_copy", mutates_args=())
def dense(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy of `t`, opaque to inductor. A copy inductor sees through (`.contiguous()`, `empty().copy_()`)
    gets a layout inductor picks, and on CUDA it picked the source's own (experts' stride 1), which torch's grouped
    matmul refuses ("Invalid strides/sizes": runs 20261207T0024Z, 0228Z); a custom op's output keeps the layout its
    fake says."""
    return t.clone(memory_format=torch.contiguous_format)


@dense.register_fake
def _(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(t.shape)


dense.register_autograd(lambda ctx, grad: grad)  # a copy: the gradient passes unchanged


def projection(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool,
               lora: tuple[torch.Tensor, torch.Tensor, float] | None, grouped: Callable) -> torch.Tensor:
    """x (tokens sorted by expert) through each expert's `weight`, plus its LoRA: peft's delta is lhs @ rhs in the
    weight's own layout, so x @ delta.T is (x @ rhs.T) @ lhs.T, and x @ delta (a transposed layout) x @ lhs @ rhs.
    `grouped`: transformers' grouped linear (weight, offsets, layout)."""
    out = grouped(x, weight, offsets, is_transposed=transposed)
    if lora is None:
        return out
    lhs, rhs, scaling = lora
    # peft's factors are views of its 2-D lora_A/lora_B (experts interleaved): the grouped matmul wants each expert's
    # matrix dense (they are small: experts x rank x width)
    first, second = ((lhs, rhs) if transposed else (rhs, lhs))
    first, second = dense(first), dense(second)
    low = grouped(grouped(x, first, offsets, is_transposed=transposed), second, offsets, is_transposed=transposed)
    return out + low * scaling


def experts_with_lora(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                      grouped: Callable) -> torch.Tensor:
    """transformers' grouped_mm experts forward with each adapted weight's LoRA beside its grouped matmul."""
    def project(name: str, x: torch.Tensor, expert_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return projection(x, getattr(experts, name), offsets, experts.is_transposed, factors.get(name), grouped)

    return routed_experts_forward(experts, hidden_states, top_k_index, top_k_weights, project)


@functools.cache  # once per peft class: the check runs once, and the class is made once (with_forward's cache
def split_class(cls: type) -> type:  # cannot see that a new staticmethod of the same function is the same)
    from sft.safety.private_names import GROUPED_LINEAR, expect

    # transformers' grouped linear, checked here, once: not inside a forward dynamo traces
    return with_forward(SplitExpertLora, cls, grouped_linear=staticmethod(expect(GROUPED_LINEAR)))


def fused_experts_classes(model: nn.Module) -> set[type]:
    """The classes of the model's fused routed experts (transformers' `use_experts_implementation` ones: they
    carry `num_experts` and a 3-D `down_proj`)."""
    return {type(m) for m in model.modules()
            if hasattr(m, "num_experts") and isinstance(getattr(m, "down_proj", None), nn.Parameter)
            and m.down_proj.dim() == 3}


def register_split_expert_lora(config, model: nn.Module) -> int:
    """Have peft build our wrapper for the model's fused experts (its custom-module dispatch); -> classes
    registered."""
    from peft.tuners.lora.layer import ParamWrapper

    from sft.safety.private_names import PEFT_CUSTOM_MODULES, expect

    classes = fused_experts_classes(model)
    if classes:
        expect(PEFT_CUSTOM_MODULES)
        config._register_custom_module({cls: split_class(ParamWrapper) for cls in classes})
    return len(classes)
