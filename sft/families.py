"""What we know about each DeepSeek family, keyed by the transformers `model_type`, and nothing else.

What a LoRA adapter adapts by default (`--lora` without `--lora_target_modules`):

| model_type                           | attention                                  | MLP                                 |
|--------------------------------------|--------------------------------------------|-------------------------------------|
| llama (llm, coder, R1-Distill-Llama) | q_proj k_proj v_proj o_proj                | gate_proj up_proj down_proj         |
| qwen2 (R1-Distill-Qwen)              | q_proj k_proj v_proj o_proj                | gate_proj up_proj down_proj         |
| deepseek_v2 (V2, V2-Lite), deepseek_v3 | MLA: q_proj (V2-Lite) or q_a_proj q_b_proj (V2, V3), kv_a_proj_with_mqa, kv_b_proj, o_proj | gate_proj up_proj down_proj of the first `first_k_dense_replace` (dense) layers and of every MoE layer's shared experts; the routed experts only with `--lora_experts`; the router (`mlp.gate`) never |

Why the MoE MLP is named by weight: transformers 5 fuses the routed experts into 3-D parameters, and peft 0.21
(`peft/utils/transformers_weight_conversion.py`, `_convert_peft_config_moe`, which deepseek_v2/v3 reach through
transformers' `qwen2_moe` conversion mapping) rewrites every `target_modules` entry named `gate_proj`/`up_proj`/
`down_proj` -- bare, by full path, or matched by a regex or `"all-linear"` -- into LoRA on the fused routed experts
only, when the adapter is created and again when a saved adapter is loaded. The dense layers' and shared experts'
MLP would silently get nothing. peft leaves `target_parameters` alone, so those nn.Linear weights are targeted there
(`mlp.gate_proj.weight`, ...): a saved adapter then loads back with plain peft on the plain transformers model and
merges. The price (peft's ParamWrapper): no LoRA dropout in the whole adapter, and each such layer adds the full
low-rank delta to its weight in every forward, which keeps one weight-sized tensor per layer until backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Only self_attn has these names in DeepSeek V2/V3, so bare names are exact; q_proj exists when q_lora_rank is None.
MLA_TARGETS = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]
# Suffixes of parameter names: `mlp.gate_proj.weight` is the dense layers' MLP only (MoE layers have mlp.experts,
# mlp.gate and mlp.shared_experts instead), `mlp.shared_experts.*` the shared experts only.
MOE_MLP_WEIGHTS = [f"{m}.{p}.weight" for m in ("mlp", "mlp.shared_experts") for p in MLP_PROJECTIONS]
ROUTED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # fused [E, 2I, H] and [E, H, I]


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # our template for this family's chat models (sft/templates.py)
    lora_modules: list[str]  # peft target_modules
    lora_parameters: list[str] = field(default_factory=list)  # peft target_parameters, by default
    expert_parameters: list[str] = field(default_factory=list)  # routed experts: added by --lora_experts


FAMILIES = {
    # deepseek-llm-7b/67b and deepseek-coder-6.7b/33b are Llama-architecture models; R1-Distill-Llama too.
    "llama": Family("deepseek-llm / deepseek-coder / R1-Distill-Llama", "deepseek", DENSE_TARGETS),
    "qwen2": Family("R1-Distill-Qwen", "r1_distill", DENSE_TARGETS),
    "deepseek_v2": Family("DeepSeek-V2 / V2-Lite (MoE, MLA)", "deepseek", MLA_TARGETS, MOE_MLP_WEIGHTS,
                          ROUTED_EXPERTS),
    "deepseek_v3": Family("DeepSeek-V3 (MoE, MLA)", "deepseek_v3", MLA_TARGETS, MOE_MLP_WEIGHTS, ROUTED_EXPERTS),
}


def family_of(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)
