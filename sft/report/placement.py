"""What a run holds where: the first screen's `held` line for MoE and quantized-base runs (issue 26 item 5), so
that a user sees before the first step which weights sit on each GPU in bf16, which in a quantized form, and which
wait in host RAM (DeepSpeed's parameter offload).

Counted from the model as the Trainer placed it (on_train_begin): each parameter where its storage lives (a
DeepSpeed ZeRO-3 partition's, an FSDP2 DTensor's local shard), in bytes per GPU, grouped by what it is: the LoRA
adapter (what trains), the MoE routed experts (transformers 5's fused 3-D expert weights, or their e4m3 form under
--quantize_experts with its row scales, or this rank's share under DeepSpeed AutoEP), and the rest of the base.
A base held as torchao's NF4Tensor (--qlora under FSDP, sft/model/nf4_base.py) reports dtype bfloat16 at 2 bytes a
value; what it holds is its inner tensors (packed uint8 values, int8 block scales, a few bf16 factors), counted as
"4-bit NF4" at their own bytes.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

GIB = 2**30
QUANTIZED = {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8}  # e4m3 experts, 4-bit/8-bit bytes
QUANTIZED_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.uint8: "4-bit", torch.int8: "int8"}
NF4 = "4-bit NF4"  # torchao's NF4Tensor: its inner tensors together
EXPERT_LAYOUTS = (("gate_up_proj", "down_proj"),  # transformers 5's fused routed experts, [experts, out, in] each
                  ("w1", "w2", "w3"))  # DeepSpeed AutoEP's grouped experts: this rank's share of them


def _is_experts(module: nn.Module) -> bool:
    """Fused routed experts, whole (3-D weights) or in e4m3 (sft/model/quantized_experts.py keeps `<weight>_e4m3`
    parameters), or a rank's share under DeepSpeed AutoEP; read by name, so that this report needs nothing of
    sft/model."""
    own = module._parameters
    return any(all(f"{w}_e4m3" in own or (isinstance(own.get(w), nn.Parameter) and own[w].dim() == 3)
                   for w in layout) for layout in EXPERT_LAYOUTS)


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory this process holds: a ZeRO-3 partition, an FSDP2 shard, or the tensor itself."""
    partition = getattr(t, "ds_tensor", None)
    if partition is not None:
        return partition
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _is_nf4(t: torch.Tensor) -> bool:
    """torchao's NF4Tensor, read by name (no torchao import for a report): a wrapper subclass whose own dtype and
    element size are its dequantized form's, not what it holds."""
    return type(t).__name__ == "NF4Tensor" and hasattr(t, "__tensor_flatten__")


def _dtype_name(t: torch.Tensor) -> str:
    if _is_nf4(t):
        return NF4
    return QUANTIZED_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch.")


def _bytes(t: torch.Tensor) -> int:
    """The bytes `t` holds: an NF4Tensor's inner tensors (torch's __tensor_flatten__ protocol names them: in torchao
    0.18 quantized_data, scaler_mean, quantization_factor, quantized_scalers, nf4), else numel x element size."""
    if _is_nf4(t):
        names, _ = t.__tensor_flatten__()
        return sum(_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def holdings(model: nn.Module) -> dict[tuple[str, str, str], int]:
    """{(place, part, dtype): bytes this process holds}: place "GPU" or "host", part "LoRA adapter" (peft's lora_*
    weights), "routed experts" or "the rest"."""
    held: dict[tuple[str, str, str], int] = defaultdict(int)
    for name, module in model.named_modules():
        experts = _is_experts(module)
        tensors = [(k, t) for k, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]
        if experts:  # --quantize_experts' row scales are plain attributes (DDP would broadcast buffers)
            tensors += [(k, v) for k, v in vars(module).items() if k.endswith("_scale") and isinstance(v, torch.Tensor)]
        for key, t in tensors:
            lora = "lora_" in name or key.startswith("lora_")
            part = "LoRA adapter" if lora else "routed experts" if experts else "the rest"
            local = _storage(t)
            place = "GPU" if local.device.type not in ("cpu", "meta") else "host"
            kind = "scales" if experts and key.endswith("_scale") else _dtype_name(local)
            held[(place, part, kind)] += _bytes(local)
    return dict(held)


def size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def worth_saying(held: dict[tuple[str, str, str], int]) -> bool:
    """MoE runs, quantized bases and offloaded parameters: where what is held where is not obvious."""
    offloaded = {place for place, _, _ in held} == {"GPU", "host"}  # on a machine without GPUs all is host
    quantized = {*QUANTIZED_NAMES.values(), NF4}
    return offloaded or any(part == "routed experts" or dtype in quantized for _, part, dtype in held)


def held_text(held: dict[tuple[str, str, str], int]) -> str:
    """'per GPU: routed experts 13.4 GiB e4m3 (+0.1 scales), the rest 2.9 GiB bfloat16, LoRA adapter 0.1 GiB
    float32; host: none', or on a machine without GPUs 'host RAM (no GPU): ...'."""
    def side(place: str) -> str:
        parts = []
        for part in ("routed experts", "the rest", "LoRA adapter"):
            kinds = {d: b for (p, q, d), b in held.items() if p == place and q == part and b}
            scales = kinds.pop("scales", 0)
            for dtype, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
                parts.append(f"{part} {size(n)} {dtype}" + (f" (+{size(scales)} scales)"
                                                             if scales and dtype in ("e4m3", "e5m2") else ""))
        return ", ".join(parts) or "none"
    if not any(place == "GPU" for place, _, _ in held):
        return f"host RAM (no GPU): {side('host')}"
    return f"per GPU: {side('GPU')}; host: {side('host')}"
