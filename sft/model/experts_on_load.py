"""--quantize_experts fp8 from a checkpoint: the routed experts quantized to e4m3 as from_pretrained reads them, not
after the whole bf16 model is in host RAM (V2-Lite: 31 GB per process, 3 copies under DDP on the box).

transformers 5's own extension point for quantizers: an HfQuantizer registered under our method's name (its public
register_quantizer / register_quantization_config), passed to from_pretrained as `quantization_config`. Before the
weights load, each fused experts module's gate_up_proj and down_proj become e4m3 (meta) parameters with an fp32
(meta) scale buffer beside each; from_pretrained then reads the checkpoint layer by layer, fuses each layer's
per-expert tensors as it always does (its conversion mapping: stacked, gate and up concatenated), casts them to the
model's dtype, and hands the fused bf16 tensor to our ConversionOps, which quantizes it on this process's GPU (where
there is one) with sft/model/quantized_experts.py's quantize_rows, drops the checkpoint pages this process read
(sft/model/mapped_pages.py) and returns the e4m3 weight and its scales. After loading, each experts module takes
quantize_experts' layout (quantized_experts.hold_quantized) and the model forgets the quantizer (no
quantization_config, hf_quantizer or is_quantized: LoRA, the Trainer, saves and the verified save see the model
quantize_experts gives). The same bits as loading whole and then quantizing: the same tensors, cast the same way,
quantized by the same function on the same device (tests/test_experts_on_load.py).

Host RAM per process, at its peak: one MoE layer's experts in flight (the fused gate_up_proj: the per-expert pages
read, the two stacked halves, their concatenation: 3 x its bf16 bytes; sft/plan/resident.py load_host_bytes), the
rest of the base in bf16 (mapped from the files until it moves to the GPU), and the e4m3 experts only where there is
no GPU to hold them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.quantizers_utils import get_module_from_name
from transformers.utils.quantization_config import QuantizationConfigMixin

from sft.model.mapped_pages import drop_file_pages
from sft.model.quantized_experts import E4M3, WEIGHTS, fused_experts, hold_quantized, quantize_rows

QUANT_METHOD = "sft_fp8_experts"
SCALE = "_scale"  # the scales' suffix: quantized_experts' attribute name, a buffer while loading


@register_quantization_config(QUANT_METHOD)
class ExpertsFp8Config(QuantizationConfigMixin):
    """from_pretrained's `quantization_config` for --quantize_experts fp8; `device`: where to quantize (None: where
    the weights load, host RAM)."""

    def __init__(self, device: str | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.device = device


class QuantizeExperts(ConversionOps):
    """The last step of loading a fused experts weight: bf16 in, (e4m3 parameter, fp32 scales) out."""

    def __init__(self, quantizer: "ExpertsFp8Quantizer"):
        self.quantizer = quantizer

    @torch.no_grad()
    def convert(self, input_dict: dict, source_patterns=None, target_patterns=None, **kwargs) -> dict:
        out = {}
        device = self.quantizer.quantization_config.device
        for name in list(input_dict):
            weight = input_dict.pop(name)  # nothing else holds the bf16 tensor: it goes once quantized
            weight = weight[0] if isinstance(weight, list) else weight
            q, scale = quantize_rows(weight.to(device or weight.device))
            del weight
            out[name] = nn.Parameter(q, requires_grad=False)
            out[name + SCALE] = scale
        drop_file_pages(self.quantizer.files)  # this layer's per-expert pages, read by the fusing
        return out


@register_quantizer(QUANT_METHOD)
class ExpertsFp8Quantizer(HfQuantizer):
    requires_calibration = False

    def __init__(self, quantization_config: ExpertsFp8Config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.experts: dict[nn.Module, torch.dtype] = {}  # the experts modules -> the dtype they compute in
        self.files: list[str] = []

    def validate_environment(self, *args, **kwargs):
        if self.pre_quantized:  # sft/model/loading.py passes us only for checkpoints without a quantization_config
            raise ValueError(f"{QUANT_METHOD} quantizes bf16 checkpoints as they load, not quantized ones")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        """On the weightless model: each fused experts weight an e4m3 parameter, its scales a buffer beside it, so
        that loading routes the fused tensor through QuantizeExperts and sets both."""
        self.files = list(checkpoint_files or [])
        for module in fused_experts(model):
            self.experts[module] = module.gate_up_proj.dtype
            for name in WEIGHTS:
                meta = module._parameters[name]
                module._parameters[name] = nn.Parameter(torch.empty_like(meta, dtype=E4M3, device="meta"),
                                                        requires_grad=False)
                module.register_buffer(name + SCALE, torch.empty(*meta.shape[:-1], 1, dtype=torch.float32,
                                                                 device="meta"))
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, name = get_module_from_name(model, param_name)
        return name in WEIGHTS and module in self.experts

    def get_quantize_ops(self):
        return QuantizeExperts(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        """quantize_experts' layout on every experts module; then the model as from_pretrained gives it unquantized."""
        for module, compute_dtype in self.experts.items():
            quantized = {}
            for name in WEIGHTS:
                q, scale = module._parameters.pop(name), module._buffers.pop(name + SCALE)
                if q.is_meta or scale.is_meta:
                    raise RuntimeError(f"--quantize_experts fp8: {name} of {type(module).__name__} was not loaded")
                quantized[name] = (q.data, scale)
            hold_quantized(module, quantized, compute_dtype)
        drop_file_pages(self.files)
        self.experts.clear()
        forget_quantizer(model)
        return model

    def is_serializable(self):
        return False

    @property
    def is_trainable(self) -> bool:
        return True


def forget_quantizer(model) -> None:
    """Undo what from_pretrained records of a quantizer (the model, its config and sub-configs): the experts are
    the base's own from here, as after quantize_experts (peft, the Trainer and saves read these marks)."""
    from transformers import PreTrainedModel

    for name in ("hf_quantizer", "quantization_method", "is_quantized"):
        model.__dict__.pop(name, None)
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            for name in ("quantization_config", "_is_quantized"):
                module.config.__dict__.pop(name, None)


def on_load_config(config, device: torch.device | None) -> dict:
    """from_pretrained's arguments that quantize the experts as they load, or {} where the checkpoint is quantized
    already (loaded as it is; quantize_experts then quantizes what it can)."""
    from sft.safety.private_names import QUANTIZER_AFTER_LOADING, QUANTIZER_BEFORE_LOADING, expect

    if getattr(config, "quantization_config", None):
        return {}
    expect(QUANTIZER_BEFORE_LOADING), expect(QUANTIZER_AFTER_LOADING)  # the hooks ExpertsFp8Quantizer overrides
    return {"quantization_config": ExpertsFp8Config(str(device) if device is not None else None)}
