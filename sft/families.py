"""What we know about each DeepSeek family, keyed by the transformers `model_type`, and nothing else.

LoRA targets are explicit per family. For the MoE families (deepseek_v2: V2/V2-Lite, deepseek_v3) transformers 5
stores the routed experts as fused 3-D parameters, and peft 0.21 rewrites any `gate_proj`/`up_proj`/`down_proj`
target into LoRA on those fused experts only: the dense first layers' MLP and the shared experts then get no
adapter, and `"all-linear"` also adapts the router. So the MoE default names the MLA attention projections and the
routed experts (`target_parameters`) explicitly, and never the router; tests check which modules received
adapters after save and reload.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MLA_TARGETS = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # our template for this family's chat models (sft/templates.py)
    lora_modules: list[str]
    lora_parameters: list[str] = field(default_factory=list)  # fused 3-D expert weights (peft target_parameters)


FAMILIES = {
    # deepseek-llm-7b/67b and deepseek-coder-6.7b/33b are Llama-architecture models; R1-Distill-Llama too.
    "llama": Family("deepseek-llm / deepseek-coder / R1-Distill-Llama", "deepseek", DENSE_TARGETS),
    "qwen2": Family("R1-Distill-Qwen", "r1_distill", DENSE_TARGETS),
    "deepseek_v2": Family("DeepSeek-V2 / V2-Lite (MoE, MLA)", "deepseek", MLA_TARGETS,
                          ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "deepseek_v3": Family("DeepSeek-V3 (MoE, MLA)", "deepseek_v3", MLA_TARGETS,
                          ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


def family_of(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)
