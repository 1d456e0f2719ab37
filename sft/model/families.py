"""What we know about each DeepSeek family, keyed by the transformers `model_type`, and nothing else.

What a LoRA adapter adapts by default (`--lora` without `--lora_target_modules`):

| model_type                           | attention                                  | MLP                                 |
|--------------------------------------|--------------------------------------------|-------------------------------------|
| llama (llm, coder, R1-Distill-Llama) | q_proj k_proj v_proj o_proj                | gate_proj up_proj down_proj         |
| qwen2 (R1-Distill-Qwen)              | q_proj k_proj v_proj o_proj                | gate_proj up_proj down_proj         |
| qwen3 (R1-0528-Qwen3-8B)             | q_proj k_proj v_proj o_proj                | gate_proj up_proj down_proj         |
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
With the base sharded it works as is (tests/test_moe_sharded.py, 2 ranks): under ZeRO-3 peft reads a partitioned
weight's shape from `ds_shape`, and DeepSpeed gathers a weight whenever it is read in forward (its ZeROOrderedDict),
so the parametrization peft registers around each forward sees the whole weight; under FSDP2 a decoder layer's
weights are unsharded while its forward runs. Both give the unsharded model's loss and gradients and save the same
adapter modules.

Presets per released model (`VARIANTS`, which sub-family a config is: `identify`), checked when the model loads
(`check_family`: a template the family does not use, an end-of-turn token the tokenizer lacks or that generate()
would not stop at, a BOS the family does not have, deepseek-coder without its RoPE scaling, remote code that is
not needed). (The strategy for a box of 3 x 24 GB GPUs is the planner's: sft/plan/box.py.)

- llama: deepseek-llm-7b/67b (vocabulary 102400): template deepseek; deepseek-coder-1.3b/6.7b/33b (vocabulary 32256,
  `<|EOT|>` and FIM tokens, linear RoPE scaling x4): deepseek_coder, EOS `<|EOT|>`; R1-Distill-Llama-8B/70B
  (vocabulary 128256 with DeepSeek's BOS): r1_distill.
- qwen2: R1-Distill-Qwen-1.5B/7B/14B/32B (vocabulary 151936/152064): r1_distill.
- qwen3: R1-0528-Qwen3-8B (vocabulary 151936, DeepSeek's BOS): r1_0528.
- deepseek_v2: V2, V2-Lite: deepseek (V2.5 and V2-0628 chat: deepseek_v3). deepseek_v3: V3: deepseek_v3; R1: r1;
  R1-0528: r1_0528; V3.1: deepseek_v31. deepseek_v32 (V3.2) is refused (refuse_unsupported).
- BOS `<｜begin▁of▁sentence｜>` everywhere; EOS `<｜end▁of▁sentence｜>` but coder-instruct's `<|EOT|>`.

R1-Distill keeps `<think>...</think>` in the targets (the reasoning is what is distilled); `--template
r1_distill_no_reasoning` trains on the answers alone (sft/data/templates.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sft.data.chat_templates import BUILTIN, matching_builtin  # noqa: F401
from sft.data.templates import CODER_EOT, V3_EOS, R1Distill, R1DistillWithoutReasoning, strip_reasoning  # noqa: F401

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
    template: str  # our template for this family's chat models (sft/data/templates.py)
    lora_modules: list[str]  # peft target_modules
    lora_parameters: list[str] = field(default_factory=list)  # peft target_parameters, by default
    expert_parameters: list[str] = field(default_factory=list)  # routed experts: added by --lora_experts
    moe: bool = False


FAMILIES = {
    # deepseek-llm-7b/67b and deepseek-coder-6.7b/33b are Llama-architecture models; R1-Distill-Llama too.
    "llama": Family("deepseek-llm / deepseek-coder / R1-Distill-Llama", "deepseek", DENSE_TARGETS),
    "qwen2": Family("R1-Distill-Qwen", "r1_distill", DENSE_TARGETS),
    "qwen3": Family("R1-0528-Qwen3", "r1_0528", DENSE_TARGETS),
    "deepseek_v2": Family("DeepSeek-V2 / V2-Lite (MoE, MLA)", "deepseek", MLA_TARGETS, MOE_MLP_WEIGHTS,
                          ROUTED_EXPERTS, moe=True),
    "deepseek_v3": Family("DeepSeek-V3 (MoE, MLA)", "deepseek_v3", MLA_TARGETS, MOE_MLP_WEIGHTS, ROUTED_EXPERTS,
                          moe=True),
}


def family_of(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)


# ---- released models: which sub-family a config is, what it expects, and how to train it on 3 x 24 GB --------

BOS = "<｜begin▁of▁sentence｜>"
EOS = V3_EOS  # "<｜end▁of▁sentence｜>"
FIM_TOKENS = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")  # deepseek-coder's fill-in-the-middle tokens


@dataclass(frozen=True)
class Variant:
    """The released models of one sub-family: what their tokenizer and config hold, and what they are trained with."""
    name: str
    model_type: str
    models: dict[str, float]  # hub id -> parameters (billions; MoE: all of them, the active ones in `active`)
    template: str  # our template for its chat/instruct models
    other_templates: tuple[str, ...] = ()  # other templates some of its chat models use
    vocab_sizes: tuple[int, ...] = ()  # config.vocab_size of its models
    bos: str = BOS
    eos: str = EOS  # the chat/instruct tokenizer's eos_token
    pad: str | None = None  # the published tokenizer's pad_token (None: it has none; load_tokenizer uses EOS)
    rope: dict | None = None  # RoPE scaling its config must keep ({"rope_type": ..., "factor": ...})
    active: dict[str, float] = field(default_factory=dict)  # MoE: activated parameters per token (billions)


VARIANTS = (
    Variant("deepseek-llm", "llama", {"deepseek-ai/deepseek-llm-7b-base": 6.9,
                                      "deepseek-ai/deepseek-llm-7b-chat": 6.9,
                                      "deepseek-ai/deepseek-llm-67b-base": 67.4,
                                      "deepseek-ai/deepseek-llm-67b-chat": 67.4},
            "deepseek", vocab_sizes=(102400,)),
    Variant("deepseek-coder", "llama", {"deepseek-ai/deepseek-coder-1.3b-base": 1.3,
                                        "deepseek-ai/deepseek-coder-1.3b-instruct": 1.3,
                                        "deepseek-ai/deepseek-coder-6.7b-base": 6.7,
                                        "deepseek-ai/deepseek-coder-6.7b-instruct": 6.7,
                                        "deepseek-ai/deepseek-coder-33b-base": 33.3,
                                        "deepseek-ai/deepseek-coder-33b-instruct": 33.3},
            "deepseek_coder", vocab_sizes=(32256,), eos=CODER_EOT, pad=EOS,
            rope={"rope_type": "linear", "factor": 4.0}),
    Variant("R1-Distill-Llama", "llama", {"deepseek-ai/DeepSeek-R1-Distill-Llama-8B": 8.0,
                                          "deepseek-ai/DeepSeek-R1-Distill-Llama-70B": 70.6},
            "r1_distill", vocab_sizes=(128256,), pad=EOS),
    Variant("R1-Distill-Qwen", "qwen2", {"deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": 1.8,
                                         "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": 7.6,
                                         "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": 14.8,
                                         "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": 32.8},
            "r1_distill", vocab_sizes=(151936, 152064), pad=EOS),
    Variant("DeepSeek-V2", "deepseek_v2", {"deepseek-ai/DeepSeek-V2-Lite": 15.7,
                                           "deepseek-ai/DeepSeek-V2-Lite-Chat": 15.7,
                                           "deepseek-ai/DeepSeek-V2": 236.0, "deepseek-ai/DeepSeek-V2-Chat": 236.0},
            "deepseek", other_templates=("deepseek_v3",), vocab_sizes=(102400,),
            active={"deepseek-ai/DeepSeek-V2-Lite": 2.4, "deepseek-ai/DeepSeek-V2": 21.0}),
    Variant("R1-0528-Qwen3", "qwen3", {"deepseek-ai/DeepSeek-R1-0528-Qwen3-8B": 8.2}, "r1_0528",
            vocab_sizes=(151936,)),
    Variant("DeepSeek-V3", "deepseek_v3", {"deepseek-ai/DeepSeek-V3": 671.0, "deepseek-ai/DeepSeek-V3-Base": 671.0,
                                           "deepseek-ai/DeepSeek-R1": 671.0, "deepseek-ai/DeepSeek-R1-0528": 671.0,
                                           "deepseek-ai/DeepSeek-V3.1": 671.0},
            "deepseek_v3", other_templates=("r1", "r1_distill", "r1_0528", "deepseek_v31"), vocab_sizes=(129280,),
            active={"deepseek-ai/DeepSeek-V3": 37.0}),
)
TEMPLATE_LOOKS = {  # for the warnings: what each built-in template writes
    "deepseek": "`User: ...\\n\\nAssistant: ...<｜end▁of▁sentence｜>`",
    "deepseek_coder": "`### Instruction:` / `### Response:` ending in <|EOT|>",
    "deepseek_v3": "`<｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜>`",
    "r1": "the V3 layout (every system text) with a `<think>` generation prompt",
    "r1_distill": "the V3 layout with a `<think>` generation prompt",
    "alpaca": "Stanford Alpaca's `### Instruction:` / `### Response:`",
    "r1_0528": "the V3 layout with `<｜Assistant｜>` written with each question and no forced `<think>`",
    "deepseek_v31": "the V3 layout with `<｜Assistant｜></think>` (or `<think>` when thinking) before a reply",
}


def _tokens(tokenizer) -> set[str]:
    return set(tokenizer.get_vocab()) if tokenizer is not None else set()


def rope_of(config) -> dict:
    """The config's RoPE scaling ({} without one), in transformers 5's names (rope_parameters) or 4's."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope = dict(rope)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def positions_warning(config, longest: int, model: str) -> str | None:
    """Where the training data's longest document runs past the positions the model was trained on
    (`max_position_embeddings`, which a config with RoPE scaling already extends): RoPE encodes any position
    without complaint, but the model never saw those in pretraining. deepseek-llm-7b has 4,096."""
    limit = getattr(config, "max_position_embeddings", None)
    if not limit or longest <= limit:
        return None
    return (f"the longest conversation is {longest:,} tokens, past the {limit:,} positions {model} was trained "
            f"on (its max_position_embeddings): the positions "
            f"beyond {limit:,} are new to it. Stretch its RoPE over them (--rope_scaling yarn or linear), cap "
            f"conversations with --max_length {limit}, or start from a model made for long contexts "
            f"(DeepSeek-R1-Distill-Qwen-7B: 131,072).")


def identify(config, tokenizer=None) -> Variant | None:
    """The sub-family of a config (and tokenizer): by vocabulary size first, then by the tokenizer's special tokens
    (deepseek-coder's `<|EOT|>`/FIM tokens; DeepSeek's BOS for a resized deepseek-llm). None: not one we know (a
    Llama 3 or Qwen2 that is not an R1 distill, say)."""
    model_type = getattr(config, "model_type", None)
    tokens = _tokens(tokenizer)
    bos = getattr(tokenizer, "bos_token", None) if tokenizer is not None else None
    candidates = [v for v in VARIANTS if v.model_type == model_type]
    if model_type == "llama" and (CODER_EOT in tokens or all(t in tokens for t in FIM_TOKENS)):
        return next(v for v in candidates if v.name == "deepseek-coder")
    by_vocab = [v for v in candidates if config.vocab_size in v.vocab_sizes]
    if by_vocab:
        variant = by_vocab[0]
        if tokenizer is not None and bos is not None and bos != variant.bos and variant.name.startswith("R1"):
            return None  # Llama 3 / Qwen2 itself: their vocabularies, not DeepSeek's tokens
        return variant
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return candidates[0]  # a resized or tiny V2/V3: the architecture says it all
    if model_type == "llama" and bos == BOS:
        return candidates[0]  # deepseek-llm's tokens with another vocabulary size (the embedded tiny model)
    if model_type in ("qwen2", "qwen3") and bos == BOS:
        return candidates[0]
    return None


def resolved_template(template_name: str, tokenizer) -> str:
    """What `--template` becomes, as sft/data/chat_templates.py get_template resolves it (`auto`: the built-in that renders as
    the tokenizer's chat_template, else `model`; no chat_template: deepseek)."""
    if template_name != "auto":
        return template_name
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return matching_builtin(tokenizer) or "model"
    return "deepseek"


def _single_token(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer writes it as one token, else None."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def _eos_ids(config) -> set[int]:
    eos = getattr(config, "eos_token_id", None)
    return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())


def check_family(config, tokenizer, template_name: str, trust_remote_code: bool = False) -> list[str]:
    """Warnings about this model, tokenizer and `--template` against the family's preset: a template its chat
    models do not use (saying which one they do), an end-of-turn token the tokenizer lacks or that generation
    would not stop at, a BOS token the family does not use, deepseek-coder without its RoPE scaling, a tokenizer
    bigger than the embedding, remote code that is not needed. Empty when everything matches."""
    model_type = getattr(config, "model_type", None)
    family = family_of(model_type)
    warnings: list[str] = []
    if family is None:
        return [f"model_type {model_type!r} is none of the DeepSeek families ({', '.join(FAMILIES)}): no preset "
                f"applies (LoRA targets: all-linear; --template: as given)."]
    if trust_remote_code:
        warnings.append(f"--trust_remote_code: {model_type} is native in transformers, so the repository's Python "
                        f"code is not needed; with it, that code runs instead of transformers' classes (for "
                        f"DeepSeek-V2/V3 other module names: the LoRA presets and the MoE balance loss of "
                        f"sft/model/moe.py do not apply).")
    variant = identify(config, tokenizer)
    if variant is None:
        return warnings + [f"this {model_type} model (vocabulary {config.vocab_size}, BOS "
                           f"{getattr(tokenizer, 'bos_token', None)!r}) is none of the DeepSeek models we know "
                           f"({', '.join(v.name for v in VARIANTS if v.model_type == model_type)}): the presets "
                           f"may not fit it."]
    template = resolved_template(template_name, tokenizer)
    expected = (variant.template, *variant.other_templates)
    if template in BUILTIN and template not in expected:
        how = f"--template {template_name}" + (f" (resolved to {template})" if template != template_name else "")
        why = " (the tokenizer has no chat template)" if template_name == "auto" and not \
            getattr(tokenizer, "chat_template", None) else ""
        from sft.data.tool_calls import TOOL_TEMPLATES

        if template in TOOL_TEMPLATES and not set(expected) & set(TOOL_TEMPLATES):
            # what refuse_tools (sft/data/tool_calls.py) recommends for tool data on this family: say it agrees
            warnings.append(f"{how} on {variant.name}: this family's chat models use --template {variant.template}, "
                            f"which has no tool-call format; {template} writes "
                            f"{TEMPLATE_LOOKS.get(template, 'another layout')} and its tool calls: right for tool "
                            f"data (the model learns that layout from it), while data without tools trains best "
                            f"with --template {variant.template}.")
        else:
            warnings.append(f"{how} on {variant.name}{why}: this family's chat models use --template "
                            f"{variant.template}, {TEMPLATE_LOOKS[variant.template]}"
                            + (f" (some: {', '.join(variant.other_templates)})" if variant.other_templates else "")
                            + f"; {template} writes {TEMPLATE_LOOKS.get(template, 'another layout')}.")
    if tokenizer is not None:
        end = {"deepseek_coder": CODER_EOT, "deepseek_v3": EOS, "r1": EOS, "r1_distill": EOS, "r1_0528": EOS,
               "deepseek_v31": EOS}.get(
            template, tokenizer.eos_token)
        if end is None:
            warnings.append(f"the tokenizer has no eos_token: --template {template} ends each reply with it.")
        elif template in BUILTIN:
            end_id = _single_token(tokenizer, end)
            if end_id is None:
                warnings.append(f"--template {template} ends each reply with {end}, which this tokenizer does not "
                                f"have as one token: the model cannot learn to stop.")
            elif _eos_ids(config) and end_id not in _eos_ids(config):
                warnings.append(f"--template {template} ends each reply with {end} (id {end_id}), but the model's "
                                f"eos_token_id is {config.eos_token_id}: generate() will not stop at the end of a "
                                f"reply unless eos_token_id (config, generation_config) includes {end_id}.")
        bos = getattr(tokenizer, "bos_token", None)
        if bos != variant.bos:
            warnings.append(f"the tokenizer's BOS is {bos!r}; {variant.name} models start with {variant.bos}.")
        if len(tokenizer) > config.vocab_size:
            warnings.append(f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                            f"{config.vocab_size}: ids beyond it fail (resize the embeddings or fix the tokenizer).")
    if variant.rope:
        rope = rope_of(config)
        if any(rope.get(k) != v for k, v in variant.rope.items()):
            want = ", ".join(f"{k} {v}" for k, v in variant.rope.items())
            warnings.append(f"{variant.name} was trained with RoPE scaling ({want}); this config has "
                            f"{rope.get('rope_type')} {rope.get('factor', '')}".rstrip() +
                            ": every position would be encoded differently. Restore "
                            "rope_scaling {\"type\": \"linear\", \"factor\": 4.0} in config.json.")
    return warnings


def refuse_unsupported(config) -> None:
    """One clear error for a DeepSeek model that loads in transformers but that we cannot train as it is used."""
    if getattr(config, "model_type", None) == "deepseek_v32":
        from sft.errors import ConfigError

        raise ConfigError("DeepSeek-V3.2 (model_type deepseek_v32) is not supported: it ships no Jinja chat template "
                          "(its format is DeepSeek's Python encoding, encoding_dsv32.py, with DSML tool calls), and "
                          "neither its template nor LoRA targets for its sparse-attention indexer are built here; "
                          "train DeepSeek-V3.1 (--template deepseek_v31) or V3 instead.")


def parameter_count(config) -> int:
    """All parameters of the model the config describes, counted on a weightless (meta) copy."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
