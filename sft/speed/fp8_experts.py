"""`--fp8 true` beside `--quantize_experts fp8`: the routed experts' grouped matmuls compute in FP8 on the e4m3
weights as they are held (sft/model/quantized_experts.py), instead of dequantizing each layer's experts to bf16
three times a step (its forward, its recomputation under activation checkpointing, its backward) and running bf16
grouped matmuls. On GPUs where torch has an FP8 grouped matmul (`torch._scaled_grouped_mm`: compute capability 9.0
and 10.0, H100/H200/B200); elsewhere (an RTX 4090 is 8.9) the experts stay dequantized, as the first screen says.

- forward, x @ W^T per expert: W's e4m3 [experts, out, in] with one scale per output row is already the operand the
  kernel wants (its transpose is column-major, its scales run along the output); each token's row is quantized as
  it comes.
- backward, grad_x = grad_out @ W: W's row scales lie along this matmul's contraction, so they move onto grad_out
  (each row multiplied by its own expert's scales) before grad_out is quantized per row; W's e4m3 is transposed
  for the kernel, one layer at a time (a copy of one byte per weight: the bf16 dequantization wrote two).
The experts are frozen (a LoRA run's base), so there is no weight gradient, and nothing is saved for the backward
but references to the held weights and the routing.

The routing around the two matmuls (sort by expert, the gate, the weighted sum back per token) is transformers'
grouped_mm experts forward, written out in sft/speed/grouped_experts.py.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from sft.machine import is_first_process, launch
from sft.speed.fp8 import call_compiled, forward_fast_accum, quantize, quantize_rows
from sft.speed.grouped_experts import routed_experts_forward

# ---- the kernel: one op, opaque to torch.compile, on the GPU's FP8 grouped matmul (an exact emulation on CPU) ----

@torch.library.custom_op("sft::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   offsets: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """Rows offsets[e-1]:offsets[e] of `a` (e4m3 [S, K], scales [S]) times expert e's `b` (e4m3 [E, N, K], scales
    [E, N], one per row of b[e]) transposed -> bf16 [S, N]."""
    return torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_scale, b_scale, offs=offsets,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def emulated_fp8_grouped_mm(a, a_scale, b, b_scale, offsets, fast_accum=False):
    """What the GPU kernel computes, in fp32 on any device: e4m3 and fp32 scales multiply exactly, the sums are
    fp32's, one rounding to bf16 (rows past the last offset stay 0). The op's CPU kernel; on a GPU, the reference
    bench/fp8_experts_check.py holds the kernel to."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        rows = a[start:end].float() * a_scale[start:end, None]
        out[start:end] = rows @ (b[e].float() * b_scale[e][:, None]).t()
        start = end
    return out.to(torch.bfloat16)


fp8_grouped_mm.register_kernel("cpu")(emulated_fp8_grouped_mm)


@fp8_grouped_mm.register_fake
def _(a, a_scale, b, b_scale, offsets, fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


def _forward(x_q, x_scale, weight, weight_scale, offsets) -> torch.Tensor:
    return fp8_grouped_mm(x_q, x_scale.reshape(-1), weight, weight_scale, offsets, forward_fast_accum(x_q.device))


def scaled_rows(grad: torch.Tensor, weight_scale: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """grad_out [S, N] times the scales of its expert's weight rows [E, N] (row s by expert_ids[s]): the factor of
    the input gradient's contraction that e4m3's per-row scales leave out."""
    return grad.float() * weight_scale[expert_ids]


def quantize_scaled_rows(grad, weight_scale, expert_ids):
    return quantize_rows(scaled_rows(grad, weight_scale, expert_ids))


@functools.cache
def _compiled_quantize_scaled():
    return torch.compile(quantize_scaled_rows, dynamic=True, fullgraph=True)


def _input_grad(grad_q, grad_scale, weight, offsets) -> torch.Tensor:
    weight_t = weight.transpose(-2, -1).contiguous()  # [E, K, N]: the contraction (N) innermost, as the kernel wants
    ones = torch.ones(weight_t.shape[:2], dtype=torch.float32, device=weight.device)  # the scales are in grad_q's
    return fp8_grouped_mm(grad_q, grad_scale.reshape(-1), weight_t, ones, offsets)


# Two forms of the same layer, as sft/speed/fp8.py's dense one: eager, the op quantizes inside its forward and
# backward with compiled kernels; under --compile_layers the quantization is traced beside the op (inductor fuses it
# with the gather of the tokens and with the gate), and the op takes x beside its quantized form only so that its
# formula can give x its gradient.
@torch.library.custom_op("sft::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, expert_ids: torch.Tensor,
                       offsets: torch.Tensor) -> torch.Tensor:
    """x [S, K] (rows sorted by expert_ids) @ each expert's W^T -> bf16 [S, N]; W held as e4m3 [E, N, K] with
    scales [E, N]."""
    q, scale = quantize(x)
    return _forward(q, scale, weight, weight_scale, offsets)


@torch.library.custom_op("sft::fp8_grouped_linear_quantized", mutates_args=())
def fp8_grouped_linear_quantized(x: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                                 weight_scale: torch.Tensor, expert_ids: torch.Tensor,
                                 offsets: torch.Tensor) -> torch.Tensor:
    """fp8_grouped_linear with x quantized by the caller (x_q, x_scale = quantize_rows(x)); x itself is not read."""
    return _forward(x_q, x_scale, weight, weight_scale, offsets)


@fp8_grouped_linear.register_fake
def _(x, weight, weight_scale, expert_ids, offsets):
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=torch.bfloat16)


@fp8_grouped_linear_quantized.register_fake
def _(x, x_q, x_scale, weight, weight_scale, expert_ids, offsets):
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=torch.bfloat16)


def _keep_weight_and_routing(ctx, inputs, output):
    ctx.save_for_backward(*inputs[-4:])  # the held weight, its scales, the routing: references, no copies


def _eager_backward(ctx, grad_out):
    weight, weight_scale, expert_ids, offsets = ctx.saved_tensors
    if grad_out.is_cuda and launch().fp8_compile:
        q, scale = call_compiled(_compiled_quantize_scaled(), grad_out, weight_scale, expert_ids)
    else:
        q, scale = quantize_scaled_rows(grad_out, weight_scale, expert_ids)
    return _input_grad(q, scale, weight, offsets), None, None, None, None


def _traced_backward(ctx, grad_out):
    weight, weight_scale, expert_ids, offsets = ctx.saved_tensors
    q, scale = quantize_scaled_rows(grad_out, weight_scale, expert_ids)
    return _input_grad(q, scale, weight, offsets), None, None, None, None, None, None


fp8_grouped_linear.register_autograd(_eager_backward, setup_context=_keep_weight_and_routing)
fp8_grouped_linear_quantized.register_autograd(_traced_backward, setup_context=_keep_weight_and_routing)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, expert_ids: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        x_q, x_scale = quantize_rows(x.detach())
        return fp8_grouped_linear_quantized(x, x_q, x_scale, weight, weight_scale, expert_ids, offsets)
    return fp8_grouped_linear(x, weight, weight_scale, expert_ids, offsets)


# ---- the experts' forward around them ----

def fp8_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """A quantized experts module's forward (QuantizedExperts.forward calls it where apply_fp8_experts set it):
    transformers' grouped_mm experts forward, its two grouped matmuls in FP8."""
    def project(name: str, x: torch.Tensor, expert_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        weight, scale = getattr(experts, f"{name}_e4m3"), getattr(experts, f"{name}_scale")
        return grouped_linear(x, weight, scale.squeeze(-1), expert_ids, offsets)

    return routed_experts_forward(experts, hidden_states, top_k_index, top_k_weights, project)


def fp8_shape_ok(experts: nn.Module) -> bool:
    """What fp8_experts_forward computes: gated experts without biases, not transposed, whole (no expert
    parallelism), every matmul dimension a multiple of 16 (the kernel's)."""
    flags_ok = (getattr(experts, "has_gate", False) and not getattr(experts, "has_bias", True)
                and not getattr(experts, "is_transposed", True) and getattr(experts, "is_concatenated", False)
                and not getattr(experts, "has_post_expert_norm", True)
                and not getattr(experts, "_is_expert_parallel", True))
    dims = (*experts.gate_up_proj_e4m3.shape[1:], *experts.down_proj_e4m3.shape[1:])
    return flags_ok and all(d % 16 == 0 for d in dims)


def apply_fp8_experts(model: nn.Module) -> None:
    """The hook sft/model/loading.py calls under --fp8 beside --quantize_experts fp8 (after the experts are held in
    e4m3): where this machine has an FP8 grouped matmul, their matmuls compute in FP8; say what was done."""
    from sft.machine import machine
    from sft.model.quantized_experts import QuantizedExperts

    why = machine().fp8_grouped_problem()
    if not why and torch.cuda.is_available() and not hasattr(torch, "_scaled_grouped_mm"):
        why = f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    held = [module for module in model.modules() if isinstance(module, QuantizedExperts)]
    fp8 = [module for module in held if not why and fp8_shape_ok(module)]
    for module in fp8:
        module.fp8_forward = fp8_experts_forward  # one function for all layers: the compiled layers share a graph
    if is_first_process() and held:
        if fp8:
            print(f"FP8: {len(fp8)} MoE layers' routed experts compute in e4m3 as held (grouped FP8 matmuls, "
                  f"rowwise scales: no bf16 copy)"
                  f"{f'; {len(held) - len(fp8)} dequantized to bf16 (their layout)' if len(fp8) < len(held) else ''}",
                  flush=True)
        else:
            print(f"FP8: the routed experts stay dequantized to bf16 layer by layer for their matmuls "
                  f"({why or 'a layout the grouped FP8 kernel does not take'})", flush=True)
