"""--qlora under FSDP: the frozen base's linear weights held as bytes (torchao's NF4Tensor), so that FSDP2 moves
bytes only.

Why not bitsandbytes here: for FSDP it stores its packed 4-bit values in bf16 tensors, and about 0.1% of those
bytes form bf16 NaN patterns. FSDP2 all-gathers a unit through one buffer; CUDA's float copies into and out of it
(`torch._foreach_copy_`) write every NaN as the one canonical NaN (pytorch #159333, bitsandbytes #1945), so part of
the base silently changed at every all-gather (CPU copies keep the bits: CPU tests passed). torchao's NF4Tensor
keeps the packed values in uint8 and the block scales in int8, and implements FSDP2's all-gather extension
(fsdp_pre_all_gather / fsdp_post_all_gather): what FSDP2 gathers is its uint8/int8 inner tensors plus the
per-16384-value factors (real numbers, no NaN), a unit of mixed dtypes that FSDP2 copies as uint8. No packed
byte is ever held in a float.

The layout: FSDP2 shards dim 0 into equal chunks, and NF4Tensor splits only at whole scale blocks (64 values per
block, 256 blocks per double-quantization block: 16384 values). A 70B's weights (8192 rows) do not split in three,
so each weight is quantized as a (rows, 16384) matrix of its values in order, padded at the end (with its own
first values, which keeps the scales' mean) to a row count that divides by the number of shards. NF4Linear
dequantizes it (piece by piece: torchao's dequantization holds 7x the bf16 weight at once, 2.3 GiB for a 67B's MLP
weight; sft/model/nf4_layout.py), drops the padding and computes the layer; its backward reaches the input only (the
base is frozen), dequantizing again instead of keeping a bf16 copy for backward, as torchao's linear_nf4 does.

The adapter is an ordinary peft LoRA over NF4Linear (an nn.Linear): it saves the same keys as on the bf16 base
and loads there with plain peft.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sft.model.nf4_layout import BLOCK, PIECE_ROWS, ROW, SCALER_BLOCK, dequantize_pieces, stored_rows

QUANT_METHOD = "torchao_nf4"  # the name a verified save and quantized_base.json give this base


def to_nf4_rows(weight: torch.Tensor, shards: int):
    """`weight` as an NF4Tensor of (stored_rows, ROW): its values in order, then padding."""
    from torchao.quantization import to_nf4

    flat = weight.detach().reshape(-1)
    padding = stored_rows(flat.numel(), shards) * ROW - flat.numel()
    if padding:  # its own values, repeated: the scales' mean stays the weight's own
        flat = torch.cat([flat, flat.repeat(-(-padding // flat.numel()))[:padding]])
    return to_nf4(flat.view(-1, ROW).contiguous(), BLOCK, SCALER_BLOCK)


class _DequantizedLinear(torch.autograd.Function):
    """x @ W^T with W dequantized from NF4 in forward and again in backward (no bf16 copy kept between them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.shape = shape
        return F.linear(x, dequantized(weight, shape, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad @ dequantized(weight, ctx.shape, grad.dtype), None, None


def dequantized(weight: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype,
                piece_rows: int = PIECE_ROWS) -> torch.Tensor:
    """The (out, in) weight in `dtype`, dequantized in equal pieces of whole rows (NF4Tensor splits only so) into one
    buffer: the same values as torchao's whole get_original_weight, without its 7x working set of the whole."""
    pieces = dequantize_pieces(weight.shape[0], piece_rows)
    if pieces == 1:
        values = weight.get_original_weight().reshape(-1)
    else:
        values = torch.empty(weight.shape[0] * ROW, dtype=weight.dtype, device=weight.device)
        for piece, out in zip(torch.chunk(weight, pieces), values.chunk(pieces)):
            out.copy_(piece.get_original_weight().reshape(-1))
    return values[: shape[0] * shape[1]].view(shape).to(dtype)


class NF4Linear(nn.Linear):
    """A frozen nn.Linear whose weight is an NF4Tensor of padded rows (see the module's docstring). An nn.Linear, so
    that peft wraps it as it wraps any linear layer; `in_features`/`out_features` are the layer's own."""

    def __init__(self, linear: nn.Linear, shards: int, device: torch.device | None = None):
        """`device`: where to quantize (the GPU: seconds for a 70B's layer); the result stays where `linear` is
        (host RAM until FSDP2 moves each unit to its GPU as it shards it, so no GPU holds the whole base)."""
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.shards = shards  # the stored layout's shard count, which a verified reload must repeat
        source = linear.weight.detach()
        weight = to_nf4_rows(source.to(device) if device is not None else source, shards)
        self.weight = nn.Parameter(weight.to(source.device), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _DequantizedLinear.apply(x, self.weight, (self.out_features, self.in_features))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantized(self.weight, (self.out_features, self.in_features), dtype)


def base_linears(model) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, layer) of every nn.Linear inside the decoder layers: QLoRA's 4-bit weights. The embeddings,
    lm_head and norms stay in bf16, as bitsandbytes' loader leaves them."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: not a decoder-only causal LM")
    found = []
    for layer in layers:
        for parent in layer.modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:  # exactly: not a LoRA or an already quantized layer
                    found.append((parent, name, child))
    return found


@torch.no_grad()
def quantize_base_nf4(model, shards: int, device: torch.device | None = None) -> int:
    """Replace the decoder layers' linear layers by NF4Linear (quantized on `device` if given); -> how many. Before
    peft and before FSDP2 shards the model. Each bf16 weight is freed as its layer is replaced."""
    linears = base_linears(model)
    count = len(linears)
    linears.reverse()  # popped from the end: the model's order
    while linears:  # the list lets each linear go as soon as it is replaced, not when the loop ends
        parent, name, linear = linears.pop()
        setattr(parent, name, NF4Linear(linear, shards, device))
        del linear
    return count


def nf4_settings(model) -> dict | None:
    """The NF4 base's settings (a verified reload repeats them; quantized_base.json records them), else None."""
    shards = {m.shards for m in model.modules() if isinstance(m, NF4Linear)}
    if not shards:
        return None
    return {"quant_method": QUANT_METHOD, "quant_type": "nf4", "block_size": BLOCK, "scaler_block_size": SCALER_BLOCK,
            "double_quant": True, "stored_as": "uint8 (torchao NF4Tensor)", "shards": max(shards)}
