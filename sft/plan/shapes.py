"""The models' shapes the planner counts in: a Shape (hidden size, layers, heads, the MLA and MoE sizes) and what it
gives per token and per layer (parameters, the activations autograd keeps, the backward's working set), built in
for the DeepSeek families (SHAPES, offline), else read from a config.json (resolve_shape).

The lowest of the planner's modules: every other one counts in a Shape (the workload's long-row and sub-plan
arithmetic, the memory and speed models, the plans) and it imports none of them. Without torch: the planner's
command line reads no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sft.names import RELEASES, known_as


@dataclass(frozen=True)
class Shape:
    name: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    tied: bool = False
    qkv_bias: bool = False
    # DeepSeek-V2/V3 (MLA + MoE)
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    routed_experts: int = 0
    shared_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    first_dense: int = 0
    checked: str = ""  # where the numbers were checked

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.routed_experts > 0

    # ---- parameters
    def attention_params(self) -> int:
        h = self.hidden
        if self.kv_lora_rank:  # MLA
            qd = self.heads * (self.qk_nope + self.qk_rope)
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * qd) if self.q_lora_rank else h * qd
            kv = h * (self.kv_lora_rank + self.qk_rope) + self.kv_lora_rank \
                + self.kv_lora_rank * self.heads * (self.qk_nope + self.v_head)
            return q + kv + self.heads * self.v_head * h
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        return h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def moe_mlp_params(self, active: bool = False) -> int:
        h, i = self.hidden, self.moe_intermediate
        routed = (self.experts_per_token if active else self.routed_experts) * 3 * h * i
        return routed + self.shared_experts * 3 * h * i + self.routed_experts * h

    def layer_params(self, index: int, active: bool = False) -> int:
        mlp = self.moe_mlp_params(active) if self.moe and index >= self.first_dense else self.dense_mlp_params()
        return self.attention_params() + mlp + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.embedding_params() + head + self.hidden + sum(self.layer_params(i) for i in range(self.layers))

    def matmul_params(self) -> int:
        """Active parameters of the matmuls per token (lm_head included, input embeddings not): the N of 6N/4N."""
        return self.vocab * self.hidden + sum(self.layer_params(i, active=True) for i in range(self.layers))

    def routed_active_params(self) -> int:
        """Parameters of the routed experts one token runs through (all MoE layers)."""
        moe_layers = self.layers - self.first_dense if self.moe else 0
        return moe_layers * self.experts_per_token * 3 * self.hidden * self.moe_intermediate

    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear weights (what QLoRA stores in 4 bits)."""
        return sum(self.layer_params(i) - 2 * self.hidden for i in range(self.layers))

    def linear_shapes(self, index: int) -> list[tuple[int, int]]:
        """(out, in) of layer `index`'s nn.Linear weights: what QLoRA stores in 4 bits (the routed experts of an MoE
        layer are fused parameters, not linears, and the router is no nn.Linear)."""
        h = self.hidden
        if self.kv_lora_rank:
            qd = self.heads * (self.qk_nope + self.qk_rope)
            attn = [(self.q_lora_rank, h), (qd, self.q_lora_rank)] if self.q_lora_rank else [(qd, h)]
            attn += [(self.kv_lora_rank + self.qk_rope, h), (self.heads * (self.qk_nope + self.v_head),
                                                              self.kv_lora_rank), (h, self.heads * self.v_head)]
        else:
            q, kv = self.heads * self.hd, self.kv_heads * self.hd
            attn = [(q, h), (kv, h), (kv, h), (h, q)]
        inter = self.shared_experts * self.moe_intermediate if self.moe and index >= self.first_dense \
            else self.intermediate
        return attn + ([(inter, h), (inter, h), (h, inter)] if inter else [])

    def lora_params(self, r: int) -> int:
        """Trainable parameters of our default LoRA targets (sft/model/families.py): every attention and MLP projection
        of dense models; MLA projections, the dense layers' MLP and the shared experts on DeepSeek MoE."""
        h, per = self.hidden, 0
        total = 0
        for i in range(self.layers):
            if self.kv_lora_rank:
                qd = self.heads * (self.qk_nope + self.qk_rope)
                attn = [(h, self.q_lora_rank), (self.q_lora_rank, qd)] if self.q_lora_rank else [(h, qd)]
                attn += [(h, self.kv_lora_rank + self.qk_rope),
                         (self.kv_lora_rank, self.heads * (self.qk_nope + self.v_head)),
                         (self.heads * self.v_head, h)]
            else:
                q, kv = self.heads * self.hd, self.kv_heads * self.hd
                attn = [(h, q), (h, kv), (h, kv), (q, h)]
            if self.moe and i >= self.first_dense:
                inter = self.shared_experts * self.moe_intermediate
            else:
                inter = self.intermediate
            mlp = [(h, inter), (h, inter), (inter, h)] if inter else []
            per = sum(r * (a + b) for a, b in attn + mlp)
            total += per
        return total

    def largest_module_params(self) -> int:
        return max(self.embedding_params(), max(self.layer_params(i) for i in range(self.layers)))

    # ---- activations, bytes per token (bf16 autocast)
    def layer_activation_bytes(self, index: int, liger: bool = False) -> float:
        """What autograd keeps for one decoder layer's backward: the two RMSNorm inputs in fp32 (4h each), the
        attention and MLP inputs (2h each), q, k, v and the attention output, and the MLP's gate, up, activation
        and product (2I each). With Liger's in-layer kernels on (`liger`: Workload.liger_layers), its RMSNorm keeps
        its bf16 input (2h each, and one fp32 number per row)."""
        h = self.hidden
        if self.kv_lora_rank:
            qd = self.heads * (self.qk_nope + self.qk_rope)
            attn = 2 * qd + 2 * (self.kv_lora_rank + self.qk_rope) + 4 * self.kv_lora_rank \
                + 2 * self.heads * (self.qk_nope + self.v_head) + 2 * qd + 2 * self.heads * self.v_head \
                + 2 * self.heads * self.v_head
        else:
            q, kv = self.heads * self.hd, self.kv_heads * self.hd
            attn = 2 * q + 4 * kv + 2 * q
        norms = 4 * h if liger else 8 * h
        return norms + 4 * h + attn + self.mlp_activation_bytes(index, liger)

    def mlp_activation_bytes(self, index: int, liger: bool = False) -> float:
        """The MLP's share of layer_activation_bytes: what --mlp_tile_tokens keeps for one tile at a time. Liger's
        SwiGLU (`liger`) keeps gate and up and recomputes the activation in its backward: 6I where eager keeps 8I.
        Counted for the dense MLPs only: an MoE layer's experts are no module Liger's SwiGLU replaces, and no
        measured row ran Liger on an MoE model (the planner plans none: kernels)."""
        if self.moe and index >= self.first_dense:
            return (self.experts_per_token * (2 * self.hidden + 8 * self.moe_intermediate)
                    + 8 * self.shared_experts * self.moe_intermediate + 4 * self.routed_experts)
        return (6 if liger else 8) * self.intermediate

    def lora_cast_bytes(self) -> float:
        """peft's fp32 round trip of the adapted layers' inputs (what sft skipped from 51be3c5 on): a bf16 re-cast
        kept per distinct input of the LoRA matmuls (attention, o_proj, MLP: 2h each; down_proj: 2I)."""
        inter = self.shared_experts * self.moe_intermediate if self.moe else self.intermediate
        return 6 * self.hidden + 2 * inter

    def parameter_lora_bytes(self, index: int) -> float:
        """Bytes a DeepSeek MoE LoRA keeps per layer whatever the tokens: its MLP weights are targeted as parameters
        (sft/model/families.py), and peft's ParamWrapper computes W + BA as a new bf16 weight in every forward
        (`_LoraParameterProxy`), which the linear keeps for its backward: the dense layers' MLP, the MoE layers'
        shared experts. From peft's code, not fitted. Rows measured before ca1f7e7 only (Workload.merged_mlp_lora):
        since, that LoRA is computed low-rank (sft/speed/traced_param_lora.py) and keeps no such weight."""
        if not self.moe:
            return 0.0
        inter = self.shared_experts * self.moe_intermediate if index >= self.first_dense else self.intermediate
        return 2 * 3 * self.hidden * inter

    def backward_working_bytes(self) -> float:
        """Gradient temporaries of one layer's backward beyond its activations: an intermediate-sized gradient
        pair and a few hidden-sized ones."""
        return self.mlp_working_bytes() + 4 * self.hidden

    def mlp_working_bytes(self) -> float:
        """The intermediate-sized gradient pair of backward_working_bytes (one tile's under --mlp_tile_tokens)."""
        inter = (self.experts_per_token * self.moe_intermediate + self.shared_experts * self.moe_intermediate
                 if self.moe else self.intermediate)
        return 2 * inter


def _dense(name, model_type, h, i, layers, heads, kv, vocab, **kw) -> Shape:
    return Shape(name, model_type, h, i, layers, heads, kv, vocab, **kw)


# Checked: deepseek-coder-6.7b against its config.json in ../shared/tokenizers/deepseek-coder-6.7b-instruct;
# deepseek-llm-7b and deepseek-coder-1.3b as bench/train_throughput.py builds them (the measured rows' shapes);
# DeepSeek-V2-Lite against a copy of its config.json quoted in a public test suite. The R1-Distill shapes and
# R1-0528-Qwen3-8B's (Qwen3-8B's) are the published config.json values as we know them, NOT checked here (a local
# config.json overrides). Qwen3's per-head q/k RMSNorm weights (2 x head_dim a layer, 9,216 of 8.2B parameters) and
# the inputs they keep are not counted.
SHAPES: dict[str, Shape] = {s.name: s for s in [
    _dense("deepseek-llm-7b", "llama", 4096, 11008, 30, 32, 32, 102400, checked="bench shape"),
    _dense("deepseek-llm-67b", "llama", 8192, 22016, 95, 64, 8, 102400, checked="not checked"),
    _dense("deepseek-coder-6.7b", "llama", 4096, 11008, 32, 32, 32, 32256, checked="config.json (shared)"),
    _dense("deepseek-coder-1.3b", "llama", 2048, 5504, 24, 16, 16, 32256, checked="bench shape"),
    _dense("deepseek-r1-distill-qwen-1.5b", "qwen2", 1536, 8960, 28, 12, 2, 151936, qkv_bias=True,
           checked="not checked"),
    _dense("deepseek-r1-distill-qwen-7b", "qwen2", 3584, 18944, 28, 28, 4, 152064, qkv_bias=True,
           checked="not checked"),
    _dense("deepseek-r1-distill-qwen-14b", "qwen2", 5120, 13824, 48, 40, 8, 152064, qkv_bias=True,
           checked="not checked"),
    _dense("deepseek-r1-distill-llama-8b", "llama", 4096, 14336, 32, 32, 8, 128256, checked="not checked"),
    _dense("deepseek-r1-distill-llama-70b", "llama", 8192, 28672, 80, 64, 8, 128256, checked="not checked"),
    _dense("deepseek-r1-0528-qwen3-8b", "qwen3", 4096, 12288, 36, 32, 8, 151936, head_dim=128,
           checked="not checked"),
    Shape("deepseek-v2-lite", "deepseek_v2", 2048, 10944, 27, 16, 16, 102400, kv_lora_rank=512, q_lora_rank=None,
          qk_nope=128, qk_rope=64, v_head=128, routed_experts=64, shared_experts=2, experts_per_token=6,
          moe_intermediate=1408, first_dense=1, checked="config.json copy (third party)"),
]}
# RELEASES: the released models of each built-in shape, as hub ids (sft/names.py, where training reads them too).
ALIASES = {hub.rsplit("/", 1)[1].lower(): name for name, hubs in RELEASES.items() for hub in hubs}  # -> the shape


def shape_name(model: str) -> str | None:
    """The built-in shape a family name, released name or bench row's model means, in either spelling
    (sft/names.py: `r1-distill-qwen-7b` is `deepseek-r1-distill-qwen-7b`), else None."""
    key = model.rsplit("/", 1)[-1].lower()
    return known_as(key, SHAPES) or ALIASES.get(key)


def shape_from_config(config, name: str) -> Shape:
    """A Shape from a transformers config (a local config.json); a model that training refuses (DeepSeek-V3.2) is
    refused here with training's own error, so that no plan recommends a run that cannot start."""
    from sft.model.families import refuse_unsupported

    refuse_unsupported(config)
    get = lambda k, d=None: getattr(config, k, d)  # noqa: E731
    heads = get("num_attention_heads")
    return Shape(name=name, model_type=get("model_type", "?"), hidden=get("hidden_size"),
                 intermediate=get("intermediate_size") or 0, layers=get("num_hidden_layers"), heads=heads,
                 kv_heads=get("num_key_value_heads") or heads, vocab=get("vocab_size"), head_dim=get("head_dim"),
                 tied=bool(get("tie_word_embeddings", False)), qkv_bias=get("model_type") == "qwen2",
                 kv_lora_rank=get("kv_lora_rank"), q_lora_rank=get("q_lora_rank"),
                 qk_nope=get("qk_nope_head_dim", 0) or 0, qk_rope=get("qk_rope_head_dim", 0) or 0,
                 v_head=get("v_head_dim", 0) or 0, routed_experts=get("n_routed_experts", 0) or 0,
                 shared_experts=get("n_shared_experts", 0) or 0,
                 experts_per_token=get("num_experts_per_tok", 0) or 0,
                 moe_intermediate=get("moe_intermediate_size", 0) or 0,
                 first_dense=get("first_k_dense_replace", 0) or 0, checked="config.json")


def resolve_shape(model: str) -> Shape:
    """A family name or hub id of a built-in shape (offline), or a local directory with a config.json."""
    from sft.errors import ConfigError

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {model}: the directory holds no config.json.")
        from transformers import AutoConfig

        return shape_from_config(AutoConfig.from_pretrained(str(path)), path.name)
    key = model.rsplit("/", 1)[-1].lower()
    if shape_name(model):
        return SHAPES[shape_name(model)]
    if model.count("/") == 1:  # a hub id we have no built-in shape for: its config.json (cache or hub)
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model)
        except Exception as e:  # noqa: BLE001  (offline, unknown, gated...)
            raise ConfigError(f"--model {model}: no built-in shape and its config.json could not be read "
                              f"({type(e).__name__}). Give a local directory, or one of: "
                              f"{', '.join(SHAPES)}.") from None
        return shape_from_config(config, key)  # outside the try: its own refusal is no unreadable config
    raise ConfigError(f"--model {model}: not a directory, hub id or known family; known: {', '.join(SHAPES)}.")
