"""`--fp8` LoRA inside compiled layers: the adapter's up-projection computed by the base's FP8 matmuls, not beside them.

peft's lora.Linear over an FP8 base (sft/speed/fp8.py) runs `base(x) + B(A(x)) * scaling`: the up-projection writes a
tensor as large as the layer's output, which the next fused kernel reads again to add, and its backward reads the
output's gradient once more for `grad_u = grad_y @ B`. On deepseek-llm-7b's LoRA step (H100, micro-batch 8) the
adapters' rank-16 GEMMs took ~62 ms of a 605 ms step's kernels (run 20261207T0605Z-mlp-lora-h100's trace); this
removes two of their four (the up-projection and its input gradient) and the second read of the up-projection's
output, and adds a quantization of [x | u'] per layer where q/k/v (and gate/up) shared one of x.

Here, with u = A(dropout(x)) * scaling (rank r, bf16, autograd's as before), the layer computes
    y = [x | u'] @ [W | B']^T          forward: one FP8 matmul over K + r columns
    [grad_x | grad_u] = grad_y @ [W | B]   backward: one FP8 matmul giving K + r columns
    grad_B = grad_y^T @ u              (bf16, as peft's lora_B computes it)
u' = u * g and B' = B / g (g > 0 per rank column: the product is unchanged) let B' take the base's per-output-row
FP8 scales, which the frozen W's quantized copy already has: g_j = max_n |B[n, j]| / max_n' |W[n, n']| over each
output row n, so no B' value exceeds its row's range (the largest reaches it). The activations' row scales are
computed over [x | u'] as they come, so nothing is clipped. In the backward, B^T's rows (the transposed copy's
extra rows) have scales of their own.

What changes: the adapter's forward product and its input gradient are computed in e4m3 (as the base's already
are), where peft computed them in bf16; B = 0 (a fresh adapter) gives the base's output. Each forward builds
[W | B'] and each backward [W^T ; B^T]: a copy of the layer's FP8 weight (arithmetic: ~7 GB a step for a 7B model,
~2 ms at an H100's bandwidth).

Only inside layers torch.compile traces (--compile_layers), where the quantizations are traced beside the opaque
matmul for inductor to fuse with their neighbours; eager layers and anything peft's forward handles otherwise
(merged or disabled adapters, several adapters, DoRA, a LoRA bias) keep peft's forward.

Opt-in (SFT_FP8_FUSED_LORA=1) until measured on a GPU: its speed (bench/throughput.py group `fused-lora`, the
row beside the default's in one run) and its 50-step loss against bf16's seed spread (bench/fp8_check.py --part loss
--candidate fp8-compile, with the variable set). The CPU tests hold it to the unfused path's error.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from sft.speed.fp8 import E4M3, E4M3_MAX, Fp8Linear, forward_fast_accum, fp8_matmul, quantize_rows
from sft.speed.peft_class import with_forward


def rank_rescale(b: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """g [r] for B [N, r] and the base's forward row scales [1, N] (max |W[n, :]| / 448): the smallest g_j with
    |B[n, j] / g_j| <= max |W[n, :]| for every row n; 1 for a column of zeros."""
    ratio = (b.detach().float().abs() / (weight_scale.view(-1, 1).float() * E4M3_MAX)).amax(dim=0)
    return torch.where(ratio > 0, ratio, torch.ones_like(ratio))


def quantize_factor(b: torch.Tensor, g: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """B' = B / g in e4m3 under the base's row scales: [N, r], each value within its row's range by g's choice."""
    scaled = b.detach().float() / g.view(1, -1) / weight_scale.view(-1, 1).float()
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


@torch.library.custom_op("sft::fp8_lora_matmul", mutates_args=())
def fp8_lora_matmul(x: torch.Tensor, u: torch.Tensor, b: torch.Tensor, xu_q: torch.Tensor, xu_scale: torch.Tensor,
                    b_q: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_t: torch.Tensor,
                    weight_t_scale: torch.Tensor) -> torch.Tensor:
    """[x | u'] @ [W | B']^T in bf16 from their e4m3 forms (xu_q, xu_scale = quantize_rows([x | u'])); x, u and b are
    here for the backward only."""
    w_ext = torch.cat([weight, b_q], dim=1)
    return torch._scaled_mm(xu_q, w_ext.t(), scale_a=xu_scale, scale_b=weight_scale, out_dtype=torch.bfloat16,
                            use_fast_accum=forward_fast_accum(xu_q.device))


@fp8_lora_matmul.register_fake
def _(x, u, b, xu_q, xu_scale, b_q, weight, weight_scale, weight_t, weight_t_scale):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def _keep_for_backward(ctx, inputs, output):
    x, u, b, *_, weight_t, weight_t_scale = inputs
    ctx.k = x.shape[1]
    ctx.save_for_backward(u, b, weight_t, weight_t_scale)


def _fp8_lora_backward(ctx, grad_y):
    u, b, weight_t, weight_t_scale = ctx.saved_tensors
    grad_q, grad_scale = quantize_rows(grad_y)
    bt_q, bt_scale = quantize_rows(b.detach().t().float())  # B^T's rows [r, N], each its own scale
    wt_ext = torch.cat([weight_t, bt_q], dim=0)
    scale_ext = torch.cat([weight_t_scale, bt_scale.view(1, -1)], dim=1)
    both = fp8_matmul(grad_q, grad_scale, wt_ext, scale_ext)  # [M, K + r]
    grad_b = (grad_y.t().to(u.dtype) @ u).to(b.dtype)
    return both[:, :ctx.k], both[:, ctx.k:].to(u.dtype), grad_b, None, None, None, None, None, None, None


fp8_lora_matmul.register_autograd(_fp8_lora_backward, setup_context=_keep_for_backward)


def fp8_lora_linear(x: torch.Tensor, u: torch.Tensor, b: torch.Tensor, base: Fp8Linear) -> torch.Tensor:
    """x [M, K] @ W^T + u [M, r] @ B^T [r, N] through the FP8 base's matmuls (module docstring), in traced code:
    the quantization of [x | u'] and of B' fuse into the kernels around the opaque matmul."""
    g = rank_rescale(b, base.weight_scale)
    xu = torch.cat([x.detach(), (u.detach().float() * g).to(x.dtype)], dim=1)
    xu_q, xu_scale = quantize_rows(xu)
    b_q = quantize_factor(b, g, base.weight_scale)
    return fp8_lora_matmul(x, u, b, xu_q, xu_scale, b_q, base.weight, base.weight_scale, base.weight_t,
                           base.weight_t_scale)


class FusedFp8Lora:
    """Mixed in before peft's lora.Linear whose base is an Fp8Linear: inside a compiled layer, one active vanilla
    adapter goes through fp8_lora_linear; everything else through peft's forward."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        if (args or kwargs or not torch.compiler.is_compiling() or self.disable_adapters or self.merged
                or len(adapters) != 1 or adapters[0] in self.lora_variant or self.lora_B[adapters[0]].bias is not None):
            return super().forward(x, *args, **kwargs)
        adapter = adapters[0]
        flat = x.reshape(-1, x.shape[-1])
        a = self.lora_A[adapter]
        u = a(self.lora_dropout[adapter](self._cast_input_dtype(flat, a.weight.dtype))) * self.scaling[adapter]
        base = self.base_layer
        out = fp8_lora_linear(flat, u.to(flat.dtype), self.lora_B[adapter].weight, base)
        out = out.view(*x.shape[:-1], base.out_features).to(x.dtype)
        return out if base.bias is None else out + base.bias.to(out.dtype)


def fused_lora_on() -> bool:
    return os.environ.get("SFT_FP8_FUSED_LORA") == "1"


FLAT_ROW_RATIO = 1e-3  # a weight row this much below the median row's range makes g, and so u', that large


def fusable(module: nn.Module) -> bool:
    """A peft lora.Linear (not a subclass: bitsandbytes', DoRA's are other paths) over an Fp8Linear, with a rank
    that keeps K + r a multiple of 16 (_scaled_mm's need), and no weight row far below the others' range: for such
    a row g, and u' with it, would be large enough to take over the activations' row scales."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if not fused_lora_on() or type(module) is not LoraLinear or not isinstance(module.base_layer, Fp8Linear):
        return False
    if any(a.weight.shape[0] % 16 for a in module.lora_A.values()):
        return False
    rows = module.base_layer.weight_scale.float().flatten()
    return bool(rows.min() >= FLAT_ROW_RATIO * rows.median())


def fuse_lora(module: nn.Module) -> bool:
    """Give a fusable module the fused forward; -> whether it got it."""
    if not fusable(module):
        return False
    module.__class__ = with_forward(FusedFp8Lora, type(module))
    return True


def apply_fused_lora(model: nn.Module) -> int:
    """The hook sft/model/loading.py calls after apply_fp8_base: fuse every fusable LoRA layer, say how many."""
    from sft.machine import is_first_process
    from sft.safety.private_names import PEFT_INPUT_CAST, expect

    if not fused_lora_on():
        return 0
    expect(PEFT_INPUT_CAST)  # the fused forward calls peft's input cast as peft's own forward does
    fused = sum(fuse_lora(module) for module in list(model.modules()))
    if fused and is_first_process():
        print(f"FP8: {fused} LoRA adapters compute inside their base layer's FP8 matmuls in compiled layers "
              f"(SFT_FP8_FUSED_LORA=1, not yet measured on a GPU; unset: beside them, in bf16)", flush=True)
    return fused
