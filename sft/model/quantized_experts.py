"""`--quantize_experts fp8` (LoRA on DeepSeek-V2/V3): the routed experts, frozen under LoRA and 14.4B of
DeepSeek-V2-Lite's 15.7B parameters, held on the GPU in e4m3 with one scale per output row instead of bf16:
14.4B weights take 13.4 GiB in e4m3 instead of 26.8 in bf16, so the whole base stays resident on one 24 GB card instead of
streaming from host RAM (ZeRO-3 offload, 3-5.6x slower: bench/RESULTS.md).

Each layer's experts are dequantized to bf16 as its forward reads them (`gate_up_proj`, `down_proj` become
properties of the module), so transformers' own experts code (grouped_mm or its eager loop) runs unchanged; the
bf16 copy lives for that layer's forward only, and with activation checkpointing (required) for its recomputation
in the backward: one layer's ~1 GB at a time. The experts' class becomes a subclass of its own (the way torch's
FSDP2 gives a module its FSDP class), so names, hooks and the MoE balance loss (sft/model/moe.py) are unchanged.

Quantizing the frozen base changes the model (the rounding of e4m3: about 2**-4 of each weight at most): the LoRA
adapter is trained against the quantized experts and saved alone, and loads on the bf16 base with plain peft. How
far the logits move is measured against bf16's on held-out data (bench/RESULTS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from sft.machine import is_first_process, launch

from sft.speed.fp8 import E4M3, call_compiled, quantize_rows as quantize_matrix_rows

WEIGHTS = ("gate_up_proj", "down_proj")  # transformers 5's fused experts: [experts, out, in] each


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [experts, rows, k] -> (e4m3 of the same shape, fp32 scales [experts, rows, 1]): sft/speed/fp8.py's row
    quantization, expert by expert (the whole tensor in fp32 at once would double the peak)."""
    q = torch.empty_like(w, dtype=E4M3)
    scale = torch.empty(*w.shape[:-1], 1, dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], scale[e] = quantize_matrix_rows(w[e])
    return q, scale


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # e4m3 and the fp32 scale multiply exactly in fp32, then one rounding to `dtype`: eager and inductor agree
    return (q.float() * scale).to(dtype)


@functools.cache
def _compiled_dequantize():
    return torch.compile(_dequantize_rows, dynamic=False, fullgraph=True)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bf16 weights of one layer's experts. On CUDA one fused kernel (a read of 1 byte and a write of 2 per
    weight; in eager a cast, a copy and a multiply moved 3x the bytes: 17% of V2-Lite's step, run
    20261204T2040Z-resident); elsewhere, or with SFT_FP8_COMPILE=0, eager expert by expert (no fp32 copy of the
    whole tensor). The same numbers either way."""
    if torch.compiler.is_compiling():  # inside a compiled layer (--compile_layers): inductor fuses it there
        return _dequantize_rows(q, scale, dtype)
    if q.is_cuda and launch().fp8_compile:
        return call_compiled(_compiled_dequantize(), q, scale, dtype)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for e in range(q.shape[0]):
        out[e] = _dequantize_rows(q[e], scale[e], dtype)
    return out


class QuantizedExperts:
    """Mixed in before a fused experts class: its weights live as `<name>_e4m3` (a frozen e4m3 parameter, so
    parameter counts and device moves see it) and `<name>_scale`; `<name>` reads them back in `compute_dtype`."""

    compute_dtype: torch.dtype
    # --fp8 where the GPU has an FP8 grouped matmul: sft/speed/fp8_experts.py sets its forward here, which computes
    # on the e4m3 weights as held (called as fp8_forward(module, hidden_states, top_k_index, top_k_weights))
    fp8_forward: Callable | None = None

    def _weight(self, name: str) -> torch.Tensor:
        cache = self.__dict__.get("_dequantized")
        if cache is not None and name in cache:
            return cache[name]
        w = dequantize(getattr(self, f"{name}_e4m3"), getattr(self, f"{name}_scale"), self.compute_dtype)
        if cache is not None:
            cache[name] = w
        return w

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self._weight("gate_up_proj")

    @property
    def down_proj(self) -> torch.Tensor:
        return self._weight("down_proj")

    def forward(self, *args, **kwargs):
        """The experts' own forward, each weight dequantized once per call (the eager loop reads it per expert);
        or, where fp8_forward is set, the FP8 grouped matmuls on the held weights."""
        if self.fp8_forward is not None:
            return self.fp8_forward(self, *args, **kwargs)  # an instance's function attribute: not bound
        self.__dict__["_dequantized"] = None if torch.compiler.is_compiling() else {}
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__["_dequantized"] = None

    def _apply(self, fn, recurse=True):
        """.to()/.cuda() move the scales with the weights; a cast of the whole model keeps e4m3 e4m3 (e4m3 ->
        bf16 -> e4m3 is exact) and the scales fp32."""
        super()._apply(fn, recurse)
        for name in WEIGHTS:
            weight = getattr(self, f"{name}_e4m3")
            if weight.dtype != E4M3:
                weight.data = weight.data.to(E4M3)
            setattr(self, f"{name}_scale", getattr(self, f"{name}_scale").to(weight.device, torch.float32))
        return self


@functools.cache  # one class for all layers: dynamo guards on the class, and one per layer recompiled each layer
def _quantized_class(cls: type) -> type:
    return type(f"Fp8{cls.__name__}", (QuantizedExperts, cls), {"__module__": cls.__module__})


def fused_experts(model: nn.Module) -> list[nn.Module]:
    """The routed experts modules (transformers 5 fuses each MoE layer's experts into one, with 3D weights)."""
    return [m for m in model.modules()
            if all(isinstance(getattr(m, w, None), nn.Parameter) and getattr(m, w).dim() == 3 for w in WEIGHTS)]


def hold_quantized(module: nn.Module, quantized: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   compute_dtype: torch.dtype) -> None:
    """Make `module` (a fused experts module whose WEIGHTS parameters were taken out) hold `quantized` ({name: (e4m3,
    scales)}) and read its weights back in `compute_dtype`: the layout both ways of quantizing give."""
    module.compute_dtype = compute_dtype
    module.__class__ = _quantized_class(type(module))
    for name, (q, scale) in quantized.items():
        module.register_parameter(f"{name}_e4m3", nn.Parameter(q, requires_grad=False))
        setattr(module, f"{name}_scale", scale)  # an attribute, not a buffer: DDP would broadcast buffers


def quantize_experts(model: nn.Module, device: torch.device | None = None) -> int:
    """Hold every routed experts module of `model` in e4m3, quantized on `device` (default: where it is); -> how
    many modules. The experts must be frozen (a LoRA run's base). A model loaded whole; from a checkpoint,
    sft/model/experts_on_load.py quantizes them as they are read, to the same bits."""
    experts = fused_experts(model)
    for module in experts:
        weights = {name: module._parameters.pop(name) for name in WEIGHTS}
        quantized = {name: quantize_rows(w.detach().to(device or w.device)) for name, w in weights.items()}
        hold_quantized(module, quantized, weights["gate_up_proj"].dtype)
    return len(experts)


def quantization_device() -> torch.device | None:
    """Where --quantize_experts quantizes: this process's GPU where there is one (seconds there, minutes on the
    CPU); the e4m3 experts stay there."""
    return torch.device("cuda", launch().local_rank) if torch.cuda.is_available() else None


def apply_quantized_experts(model: nn.Module, quantized_on_load: bool = False, fp8: bool = False) -> None:
    """The hook sft/model/loading.py calls under --quantize_experts fp8, before LoRA attaches: quantize (unless the
    experts were quantized as the checkpoint loaded: `quantized_on_load`), and say what was done (`fp8`: --fp8, whose
    own line says whether the experts compute in FP8 or are dequantized: sft/speed/fp8_experts.py)."""
    from sft.errors import ConfigError

    if quantized_on_load:
        count = sum(isinstance(m, QuantizedExperts) for m in model.modules())
    else:
        count = quantize_experts(model, quantization_device())
    if not count:
        raise ConfigError("--quantize_experts fp8: this model has no routed experts (DeepSeek-V2/V3 MoE layers); "
                          "drop the option.")
    if is_first_process():
        held = sum(p.numel() for m in model.modules() if isinstance(m, QuantizedExperts)
                   for p in m.parameters(recurse=False))
        print(f"Experts: {count} MoE layers' routed experts held in e4m3 ({held / 1e9:.2f}B weights, "
              f"{held / 2**30:.1f} GiB instead of {2 * held / 2**30:.1f})"
              f"{'' if fp8 else ', dequantized layer by layer'}", flush=True)  # --fp8: its own line says how


def keep_out_of_ddp(model: nn.Module) -> int:
    """Leave the e4m3 experts out of DDP's start-of-training broadcast: they are frozen, and every rank quantized
    the same weights the same way, so there is nothing to send (and gloo cannot send float8: 'Invalid scalar
    type'). Names are relative to `model`, the module DDP will wrap (after LoRA). -> how many tensors."""
    from sft.safety.private_names import DDP_IGNORE, expect

    names = [name for name, p in model.named_parameters() if name.endswith(tuple(f"{w}_e4m3" for w in WEIGHTS))]
    expect(DDP_IGNORE)(model, names)
    return len(names)
