"""`--fp8 true` with `--lora`: the frozen base's linear layers compute in FP8 (e4m3) on GPUs that have FP8 matmuls
(compute capability 8.9 or more: RTX 4090, L40, H100, H200); the LoRA adapter stays as it was (bf16 matmuls).

Each base `nn.Linear` inside a peft LoRA layer (`lora_layer.base_layer`) becomes an `Fp8Linear`, quantized once
when it is attached, on the GPU:
- forward, x @ W^T: W in e4m3 with one scale per output channel (row of W), the activation quantized per row
  (token) as it comes, both through `torch._scaled_mm` (bf16 out);
- backward, grad_x = grad_out @ W: a second e4m3 copy of W, transposed, with one scale per input channel, and
  grad_out quantized per row. The base gets no gradient, so there is no grad_weight matmul and nothing is saved
  for backward (the bf16 linear saves nothing either: its weight needs no gradient).
The two e4m3 copies take 2 bytes per weight, as the bf16 weight they replace did; dequantizing one copy for the
backward instead would save 1 byte per weight but add a bf16 copy per layer per backward and leave that matmul in
bf16. Rowwise scales follow torchao's rowwise float8 recipe (e4m3 for gradients too, since each row has its own
scale).

Under LoRA a token costs 4N FLOPs, all of it in the base's two matmuls but the adapter's small ones: those two
run at FP8's rate (2x bf16's peak on H100/H200 and RTX 4090) minus the quantization of activations and gradients
(a read of 2 bytes and a write of 1 per value; fused by torch.compile on CUDA, eager elsewhere).

Only numbers change (FP8's rounding in the base's forward and input gradient): the saved adapter loads on the
bf16 base as any other (sft.safety.verify checks it beside the trained one, on the same FP8 base).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from sft.machine import fp8_fast_accum_on, is_first_process, launch
from sft.speed.peft_class import with_forward
from sft.speed.traced_param_lora import add_adapters

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) and newer


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with x ~= q * scale: each row's largest magnitude maps to
    e4m3's largest value (448). An all-zero row gets a tiny scale (its values stay 0)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


@functools.lru_cache(maxsize=None)
def _compiled_quantize():
    return torch.compile(quantize_rows, dynamic=True, fullgraph=True)


def call_compiled(compiled: Callable, *args):
    """Call a compiled kernel function (no autograd, no autocast in it) under one global state, on detached
    tensors. Dynamo guards on grad mode and autocast, which differ between a forward (autocast on), its backward
    (off) and a checkpoint's recompute, and on each tensor's requires_grad and, for a view (a tiled MLP's slice of
    the sequence), on its base's sizes and strides; each compiled anew, and the 9th compile is a hard failure under
    fullgraph (`--fp8` on 32,768-token rows with tiled MLPs and checkpoints: runs 20261205T1315Z-long-h100 and,
    with the state fixed but not the tensors, 20261205T1535Z-long-h100). `detach()` is no view: no base to guard."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad(), torch.autocast(args[0].device.type, enabled=False):
        return compiled(*args)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows, compiled into one kernel per call on CUDA (amax, scale and cast fused: a read of x and a
    write of 1 byte per value); eager elsewhere (SFT_FP8_COMPILE=0 makes it eager on CUDA too). It runs inside
    the eager ops below; under --compile_layers the quantization is traced into the layer instead."""
    if x.is_cuda and launch().fp8_compile:
        return call_compiled(_compiled_quantize(), x)
    return quantize_rows(x)


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
                  fast_accum: bool = False) -> torch.Tensor:
    """(a * a_scale) @ (b_t * b_scale^T)^T in bf16: a [M, K] e4m3 row-major, b_t [N, K] e4m3 row-major (so its
    transpose is the column-major operand _scaled_mm wants), scales [M, 1] and [1, N]. `fast_accum`: Hopper's FP8
    accumulation without the periodic promotion to fp32 (faster, fewer accumulator bits), as torchao's float8
    recipes use for the forward's output matmul only (sft/machine.py fp8_fast_accum_on)."""
    return torch._scaled_mm(a, b_t.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def forward_matmul(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """The forward's x @ W^T: scaled_matmul, accumulating fast on Hopper or where SFT_FP8_FAST_ACCUM=1 asks
    (gradients never)."""
    return scaled_matmul(a, a_scale, b_t, b_scale, fast_accum=forward_fast_accum(a.device))


def forward_fast_accum(device: torch.device) -> bool:
    """Whether a forward's FP8 matmul on `device` accumulates fast (never off CUDA)."""
    return device.type == "cuda" and _fast_accum(launch().fp8_fast_accum, device)


@functools.cache
def _fast_accum(asked: bool | None, device: torch.device) -> bool:
    """fp8_fast_accum_on for a CUDA device, once per device: every FP8 matmul asks."""
    return fp8_fast_accum_on(asked, torch.cuda.get_device_capability(device))


def quantized_matmul(a: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """a [M, K] (bf16/fp32) @ the e4m3 b_t [N, K]^T: a quantized per row as it comes, then the FP8 matmul."""
    q, scale = quantize(a)
    return scaled_matmul(q, scale, b_t, b_scale)


# The FP8 matmuls are ops of their own, opaque to torch.compile, with their autograd formulas registered. Traced
# instead (an autograd.Function inside the compiled layer), the input gradient came out zero on an H200
# (bench/compile_check.py, run 20261202T0020Z-A) while CPU compiles were exact.
#
# Two forms of the same layer. Eager: `sft::fp8_linear` quantizes inside its forward and its backward, with the
# compiled quantize kernel. Under --compile_layers: the quantization is traced beside the op, so inductor fuses it
# into the kernel that makes the activation (RMSNorm, SwiGLU) and computes it once for q/k/v and for gate/up, which
# read the same input (the graph's common-subexpression pass); `sft::fp8_linear_quantized` takes x beside its
# quantized form only so that its formula can give x its gradient, and that formula quantizes grad_out in traced
# code too (AOTAutograd traces it into the backward graph), leaving the matmuls opaque.
@torch.library.custom_op("sft::fp8_matmul", mutates_args=())
def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """scaled_matmul as an op opaque to torch.compile."""
    return scaled_matmul(a, a_scale, b_t, b_scale)


@torch.library.custom_op("sft::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_t: torch.Tensor,
               weight_t_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T in bf16, W held as `weight` [N, K] (its gradient path as `weight_t` [K, N])."""
    q, scale = quantize(x)
    return forward_matmul(q, scale, weight, weight_scale)


@torch.library.custom_op("sft::fp8_linear_input_grad", mutates_args=())
def fp8_linear_input_grad(grad_out: torch.Tensor, weight_t: torch.Tensor, weight_t_scale: torch.Tensor) -> torch.Tensor:
    """grad_x = grad_out [M, N] @ W, through the transposed copy."""
    return quantized_matmul(grad_out, weight_t, weight_t_scale)


@torch.library.custom_op("sft::fp8_linear_quantized", mutates_args=())
def fp8_linear_quantized(x: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor, weight_t: torch.Tensor,
                         weight_t_scale: torch.Tensor) -> torch.Tensor:
    """fp8_linear with x quantized by the caller (x_q, x_scale = quantize_rows(x)); x itself is not read."""
    return forward_matmul(x_q, x_scale, weight, weight_scale)


def _matmul_shape(a, a_scale, b_t, b_scale):
    return a.new_empty((a.shape[0], b_t.shape[0]), dtype=torch.bfloat16)


def _fp8_linear_shape(x, weight, weight_scale, weight_t, weight_t_scale):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def _input_grad_shape(grad_out, weight_t, weight_t_scale):
    return grad_out.new_empty((grad_out.shape[0], weight_t.shape[0]), dtype=torch.bfloat16)


def _quantized_shape(x, x_q, x_scale, weight, weight_scale, weight_t, weight_t_scale):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


fp8_matmul.register_fake(_matmul_shape)
fp8_linear.register_fake(_fp8_linear_shape)
fp8_linear_input_grad.register_fake(_input_grad_shape)
fp8_linear_quantized.register_fake(_quantized_shape)


def _keep_transposed_copy(ctx, inputs, output):
    ctx.save_for_backward(*inputs[-2:])  # the transposed copy and its scales: references, no copies


def _fp8_linear_backward(ctx, grad_out):
    weight_t, weight_t_scale = ctx.saved_tensors
    return fp8_linear_input_grad(grad_out.contiguous(), weight_t, weight_t_scale), None, None, None, None


def _fp8_linear_quantized_backward(ctx, grad_out):
    weight_t, weight_t_scale = ctx.saved_tensors
    q, scale = quantize_rows(grad_out)
    return fp8_matmul(q, scale, weight_t, weight_t_scale), None, None, None, None, None, None


fp8_linear.register_autograd(_fp8_linear_backward, setup_context=_keep_transposed_copy)
fp8_linear_quantized.register_autograd(_fp8_linear_quantized_backward, setup_context=_keep_transposed_copy)


def fp8_linear_traced(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_t: torch.Tensor,
                      weight_t_scale: torch.Tensor) -> torch.Tensor:
    """fp8_linear's form for code torch.compile traces: the quantization in the graph, the matmul opaque."""
    x_q, x_scale = quantize_rows(x.detach())
    return fp8_linear_quantized(x, x_q, x_scale, weight, weight_scale, weight_t, weight_t_scale)


class Fp8Linear(nn.Module):
    """A frozen nn.Linear whose matmuls run in FP8. `weight` stays a (frozen, e4m3) parameter, so parameter counts
    (MFU) and peft's look-ups see the layer as before; `compute_dtype` is the dtype peft gives adapters attached to
    it (as for bitsandbytes' layers). The scales and the transposed copy are plain attributes, not buffers: DDP
    would broadcast buffers at every forward."""

    def __init__(self, linear: nn.Linear, device: torch.device | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        w = linear.weight.detach().to(device or linear.weight.device)
        q, scale = quantize_rows(w)
        q_t, scale_t = quantize_rows(w.t().contiguous())
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale, self.weight_t, self.weight_t_scale = scale.view(1, -1), q_t, scale_t.view(1, -1)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(w.device),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = fp8_linear_traced if torch.compiler.is_compiling() else fp8_linear
        out = linear(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale, self.weight_t,
                     self.weight_t_scale).view(*x.shape[:-1], self.out_features).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _apply(self, fn, recurse=True):
        """.to()/.cuda() move the scales and the transposed copy with the weight; a cast of the whole model
        (.bfloat16(), DeepSpeed's engine) is undone for the weight: e4m3 -> bf16/fp16 -> e4m3 is exact."""
        super()._apply(fn, recurse)
        if self.weight.dtype != E4M3:
            self.weight.data = self.weight.data.to(E4M3)
        device = self.weight.device
        self.weight_scale, self.weight_t, self.weight_t_scale = (
            t.to(device) for t in (self.weight_scale, self.weight_t, self.weight_t_scale))
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3 rowwise"


def fp8_shape_ok(linear: nn.Linear) -> bool:
    """_scaled_mm needs both dimensions to be multiples of 16 (every DeepSeek projection is)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


class SplitParamLora:
    """Mixed in before peft's ParamWrapper (LoRA on a weight targeted as a parameter: the MoE families' dense and
    shared-expert MLPs, sft/model/families.py) whose nn.Linear base became an Fp8Linear. peft adds B @ A to the
    base's weight in each forward (a parametrization), which an e4m3 weight held in two copies cannot take: the
    adapter dropped out of the forward and got no gradient. Here the same product is split as peft's lora.Linear
    computes it: base(x) + B(A(x)) * scaling, the base's matmuls in FP8 (as sft/speed/traced_param_lora.py does
    for a bf16 base)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or self.merged:  # never under --fp8: e4m3 weights cannot merge, and peft passes nothing
            raise RuntimeError("--fp8: a LoRA wrapper of an FP8 base layer got arguments or merged adapters; "
                               "run without --fp8.")
        out = self.base_layer(x)
        if self.disable_adapters:
            return out
        return add_adapters(self, x, out, [a for a in self.active_adapters if a in self.lora_A])


def _weight_wrapper(module) -> bool:
    """peft's ParamWrapper of one nn.Linear's weight (not fused experts' 3-D weights)."""
    from peft.tuners.lora.layer import ParamWrapper

    return (isinstance(module, ParamWrapper) and module.parameter_name == "weight"
            and getattr(module, "num_experts", None) == 1)


def use_fp8_base(model, device: torch.device | None = None) -> tuple[int, int]:
    """Replace the base nn.Linear of every peft LoRA layer by an Fp8Linear, quantized on `device` (default: this
    process's GPU when there is one: quantizing there takes milliseconds, and the model goes there anyway).
    -> (layers converted, LoRA layers left in bf16 because of their shape)."""
    from peft.tuners.lora import LoraLayer

    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", launch().local_rank)
    converted = skipped = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or type(module.base_layer) is not nn.Linear:
            continue
        wrapper = hasattr(module, "parameter_name")  # peft's ParamWrapper: LoRA on the weight itself
        if not fp8_shape_ok(module.base_layer) or (wrapper and not _weight_wrapper(module)):
            skipped += 1
            continue
        if wrapper:
            module.__class__ = with_forward(SplitParamLora, type(module))
        module.base_layer = Fp8Linear(module.base_layer, device)
        converted += 1
    return converted, skipped


def apply_fp8_base(model) -> None:
    """The hook sft/model/loading.py calls after attaching LoRA under --fp8: convert, and say what was converted."""
    from sft.errors import ConfigError
    from sft.machine import machine

    why = machine().fp8_problem()
    if why:  # refused before loading (sft/options/checks.py fp8_base_needs); this guards callers that skip checks
        raise ConfigError(f"--fp8: {why}. Drop --fp8 (the same LoRA in bf16).")
    converted, skipped = use_fp8_base(model)
    if is_first_process():
        print(f"FP8: {converted} frozen base linear layers compute in e4m3 (rowwise scales)"
              f"{f'; {skipped} left in bf16 (a dimension not a multiple of 16)' if skipped else ''}", flush=True)
