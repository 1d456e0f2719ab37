"""`deepseek-sft plan` / `python -m sft.plan.planner`: which strategy, activation checkpointing and micro-batch to use on
this box, with the predicted GPU memory per card (as nvidia-smi shows it), host RAM and tokens/s of each plan,
the fastest plan that fits with MARGIN_GIB of the card to spare as an exact command (the model's hub id, the
kernels its first line names), and why the others do not fit. Host RAM is this machine's unless --host_ram says
another box's; where it cannot be read it is unknown, and each plan says what it needs. Each plan runs with the
fast paths (--fp8, --compile_layers) its run gets on the box's GPU (--gpu; sft/plan/fast_paths.py asks the run's
own rule), and is predicted with them.

    python -m sft.plan.planner --model deepseek-llm-7b --gpus 3 --gpu_mem 24 --lora --max_length 2048
    python -m sft.plan.planner --model deepseek-llm-7b --lora --gpu "RTX 3090"   # no FP8 (compute capability 8.6)
    python -m sft.plan.planner --model ./my-model-dir --gpus 2 --gpu_mem 24 --host_ram 128
    python -m sft.plan.planner --check     # predicted against every measured row of bench/results.jsonl
    python -m sft.plan.planner --write_snapshot  # after new bench rows: refit sft/plan/fitted.json, which plans read

The memory model (per card, in bytes): the training state from the strategy table (sft/parallel/strategies.py:
weights, gradients, optimizer, masters, DDP buckets), plus activations (checkpointed layer inputs, the layers
kept whole, the backward working set of one layer, the logits unless Liger's fused loss is used), plus the
sharded strategies' transient buffers (all-gathered layers and their gradients); what PyTorch's allocator keeps
cached on top (fitted), and the CUDA context and NCCL buffers that nvidia-smi adds (fitted); the fast paths' own
share of the activations (fitted on their rows: fast_path_memory; a resident plan's compiled layers, of its
dequantized experts). Rows over 4,096 tokens are long rows
(sft/plan/long_rows.py): one conversation each, with the MLP tile and offloaded checkpoints where a plan needs them
to fit, and their speed from the long-document bench rows; a long row of a dense model is also planned split over N
cards by --sequence_parallel (sft/plan/sequence_parallel.py: ZeRO-3 or ZeRO-2, first principles, its speed from the
rows split as it is, which speak for no other plan; none is measured yet). LoRA of an MoE model is also planned
resident (sft/plan/resident.py: --quantize_experts fp8, the routed experts in e4m3, one layer's dequantized at a
time), its speed from its own bench rows. LoRA and QLoRA under FSDP (the 67B/70B plans on 3 x 24 GB) count their
gathered buffers from accelerate's units and the NF4 base's bytes (fsdp_adapter_buffers), every rank's bf16 load of
the base in host RAM, and the full fine-tune's fitted cache and MFU: no FSDP LoRA row is measured yet; a plan the
run refuses until its GPU check passes (refused_today: FSDP + QLoRA) is marked so and never recommended. The fitted
constants and the rows they come from are in CALIBRATION below and in the snapshot; `--check` prints predicted
against measured for every row with a measured peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from sft.report.console import ToolParser
from sft.options.recipe import load_recipe
from sft.configs import RECIPES
from sft.names import RELEASES, hub_id, known_as
from sft.machine import GIB, GPU_KINDS, Machine, gpu_kind, host_ram_gib as this_host_ram
from sft.model.nf4_layout import dequantize_peak_bytes
from sft.parallel.strategies import NF4_BYTES, PRECISION_OPTIONS, REPO, STRATEGIES, Setup, StateBytes
from sft.plan.fast_paths import (NAMES as FAST_PATH_NAMES, Asked, FastPaths, described_machine, fast_paths,
                                 refused_today)
from sft.plan.long_rows import Levers, is_long, ladder, is_long_document_row, long_row_flops_per_token, tile_tokens
from sft.plan import expert_parallel, long_rows, resident, sequence_parallel

RESULTS = REPO / "bench" / "results.jsonl"  # the source of truth, in a checkout only
# What the planner fits from RESULTS, snapshotted as package data: plans read this, so that a wheel plans as a checkout
FITTED = Path(__file__).resolve().with_name("fitted.json")
SNAPSHOT_COMMAND = "python -m sft.plan.planner --write_snapshot"
ANY_MODEL = "*"  # the snapshot's MFU table for a model that has no bench row of its own
# A plan is recommended only with this much of the card left free by nvidia-smi's count (the bench's target on 24 GB
# cards: nvidia-smi <= 23 GiB): below it, the allocator's cache and the prediction's own error meet the card's edge.
MARGIN_GIB = 1.0
# The memory model's worst error on the bench rows (7.3% of the allocator's peak, 7.3% of nvidia-smi's): plans whose
# predictions are closer than this cannot be told apart by their headroom.
HEADROOM = 0.075
# tok/s estimates this close are one speed: the estimate is one measured MFU per kind of plan, and one configuration
# measured again moves that much (full-sr16, 7 runs on the H200: MFU 65.0-68.8%).
SPEED_TIE = 0.05
# What a plan's speed source says when no bench row of its kind exists yet (Plan.speed_unmeasured)
UNMEASURED_SPEEDS = (expert_parallel.UNMEASURED, sequence_parallel.UNMEASURED)
# What lifts the run's refusal of --qlora under FSDP (sft/options/checks.py qlora_under_fsdp_awaits_its_gpu_run)
AWAITED_CHECK = "`python bench/qlora_check.py --fsdp two` on 2 GPUs"

# ---------------------------------------------------------------------------------------------------------------
# Shapes: built in for the DeepSeek families (offline), else from a config.json.


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
        shared experts. From peft's code, not fitted (no MoE row is measured)."""
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


# ---------------------------------------------------------------------------------------------------------------
# Calibration: the few constants fitted against bench/results.jsonl (see RESULTS.md, "Planner").

CALIBRATION = {
    # nvidia-smi minus the allocator's peak reserved (CUDA context, NCCL buffers): mean over the rows that have
    # both numbers, by launcher: single: mean of the 4 one-GPU rows; nccl: median of the 20 DDP/FSDP/TP rows (their
    # mean, 2.09, is pulled down by 3 FSDP rows at the allocator cap, where NVML's 0.5 s sampling missed the peak);
    # deepspeed: mean of the 6 ZeRO-2 / ZeRO-3-offload rows.
    "context_gib": {"single": 1.35, "nccl": 2.17, "deepspeed": 2.45},
    # peak reserved minus peak allocated: what PyTorch's caching allocator holds on top, by kind of strategy.
    # unsharded: LoRA rows (single/DDP/ZeRO-2); fsdp/tp: the 1.3B rows with a fused loss; zero3: the 4 ZeRO-3
    # offload rows (DeepSpeed's buffers on a side stream); plus a share of the unfused logits for sharded plans.
    "cache_gib": {"none": 0.35, "tp": 0.7},
    # sharded plans: the cache grows with the gathered buffers (FSDP's all-gather stream, DeepSpeed's side
    # streams), as a multiple of the transient gathered weights and gradients: fsdp from the two fused-loss
    # 1.3B rows (fsdp-1.3b-flex: 1.02 GiB over 0.62 GiB gathered), zero3 from the 4 ZeRO-3 offload rows.
    # zero3_moe: an MoE block is a ZeRO-3 leaf, gathered and freed whole (one large block the allocator reuses):
    # from the two DeepSeek-V2-Lite rows (recipe-v2-lite-lora 0940Z: 2.86 GiB, moe-lora-offload-1 1015Z: 2.80 GiB
    # over 2.14 GiB gathered).
    "cache_per_gathered": {"fsdp": 1.64, "zero3": 2.5, "zero3_moe": 1.3},
    # host RAM per byte offloaded: CPU Adam's fp32 state (masters, moments, gradients) and the offloaded 16-bit
    # weights, fitted together on the 4 dense full-fine-tune offload rows (16P/world and 2P/world bytes per card:
    # 215.7-215.9 GiB) and moe-lora-offload-1 (weights only: 48.2 GiB), with 8 GiB + 4 GiB per process on top.
    # activations (--offload_activations, pinned): long-r1-32k and long-llm-32k (20.5 and 20.0 GiB; 6.6 and 8.0 GiB
    # offloaded), their host RAM over those 12 GiB, summed, over the bytes offloaded, summed.
    "host_per_offloaded": {"optimizer": 1.79, "weights": 1.24, "activations": 1.13},
    "cache_logits_share": 0.5,
    # the activations autograd keeps per layer (and the backward working set), against the count in
    # Shape.layer_activation_bytes (which counts Liger's in-layer kernels where they run: Workload.liger_layers): the
    # scale with the least worst error over every measured row, reserved and nvidia-smi (--check: 7.3% and 7.3%;
    # below 0.935 lora-best-sdpa's reserved is worse, above 0.94 long-llm-32k's nvidia-smi), refitting
    # dequantized_copies and the fast paths' shares (--write_snapshot) at each scale tried. On a CPU, autograd's
    # saved tensors of a frozen deepseek-llm-7b layer are 0.78 x the count without Liger, a V2-Lite MoE layer's
    # about 0.79 x (with the GPU's attention tensors in place of CPU sdpa's math path).
    "activation_scale": 0.94,
    # --quantize_experts fp8: bf16 copies of one MoE layer's experts alive in its recomputation and backward (the
    # dequantized weights the forward reads, and what the grouped matmuls' backward makes of them), in units of
    # resident.dequantized_layer_bytes: fitted on moe-lora-resident-1 (20261204T2105Z-resident, micro-batch 8:
    # 23.3 GiB allocated, 2.27 GiB over the rest of the memory model at activation_scale 0.94; the same run held to
    # 22.25 GiB ran out of memory at micro-batch 8). A count per layer, not per token: at smaller micro-batches it
    # errs on the safe side.
    "dequantized_copies": 2.2,
}


def kernels(strategy: str, shape: "Shape", sequence_parallel_size: int = 1) -> dict:
    """The kernel options of a plan: those of our measured fast plans (flex_attention skips packed rows' masked
    blocks; Liger's fused loss), except under TP (Liger's loss fails on the sharded lm_head) and for MLA models
    (DeepSeek-V2/V3: key and value head sizes differ; no V2 run with flex or Liger yet), which keep sdpa. Without
    the fused loss the logits are materialised: the memory model counts them (fused_loss). An SP plan runs what its
    bench row runs (sequence_parallel.KERNELS: sdpa, its loss in chunks)."""
    if sequence_parallel_size > 1:
        return dict(sequence_parallel.KERNELS)
    if strategy == "tp" or shape.kv_lora_rank:
        return {"attn_implementation": "sdpa", "use_liger_kernel": False}
    return {"attn_implementation": "flex_attention", "use_liger_kernel": True}


def kernels_text(shape: "Shape", strategies: list[str], sequence_parallel_sizes: list[int] | None = None) -> str:
    """What the plans of these strategies run, as their commands pass it (kernels): one description where they
    agree, else the first strategy's and each other's; an SP plan (its size beside its strategy, > 1) as
    plan_table names it (zero3+sp2)."""
    def text(k: dict) -> str:
        return k["attn_implementation"] + (" + Liger" if k["use_liger_kernel"] else ", no Liger")

    sizes = sequence_parallel_sizes or [1] * len(strategies)
    seen = {strategy_label(s, n): text(kernels(s, shape, n)) for s, n in zip(strategies, sizes)}
    first = next(iter(seen.values()), "")
    others = sorted({f"{s}: {t}" for s, t in seen.items() if t != first})
    return first + (f" ({'; '.join(others)})" if others else "")


@dataclass(frozen=True)
class Workload:
    """One planned (or measured) configuration."""

    strategy: str
    setup: Setup
    world: int
    micro_batch: int
    seq_len: int
    checkpointing: bool
    skip_layers: int = 0
    fused_loss: bool = True        # --use_liger_kernel: Liger's fused linear cross-entropy, no logits tensor
    lora_r: int = 16
    grad_accum: int = 1
    peft_input_cast: bool = False  # peft's own fp32 casts of the LoRA inputs (sft before 51be3c5)
    fp8: bool = False              # --fp8: LoRA's FP8 base (sft/speed/fp8.py), torchao's float8 training for full
    compiled: bool = False         # --compile_layers (sft/speed/regional_compile.py)
    mlp_tile_tokens: int = 0       # --mlp_tile_tokens (sft/speed/tiled_mlp.py); 0: the MLP runs whole
    offload_activations: bool = False  # --offload_activations: checkpoints wait in host RAM (sft/trainer.py)
    chunked_loss: bool = False     # --chunked_loss: one chunk's logits at a time (sft/speed/chunked_loss.py)
    resident: bool = False         # --quantize_experts fp8: the routed experts in e4m3 (sft/plan/resident.py)
    sequence_parallel: int = 1     # --sequence_parallel N: each row split over N ranks (sft/plan/sequence_parallel.py)

    @property
    def slice_len(self) -> int:
        """Tokens of each row on one card: the row's, or under --sequence_parallel N its slice (rows padded to a
        multiple of N: sft/options/resolve.py sequence_parallel_slices_rows)."""
        return -(-self.seq_len // self.sequence_parallel)

    @property
    def levers(self) -> Levers:
        """Its long-row options (sft/plan/long_rows.py)."""
        return Levers(self.mlp_tile_tokens, self.offload_activations)

    @property
    def liger_layers(self) -> bool:
        """Whether Liger's in-layer kernels (RMSNorm, SwiGLU) run, not its loss only: --use_liger_kernel without
        --compile_layers, beside which Liger keeps only its fused loss (sft/options/resolve.py
        compiled_layers_keep_liger_loss_only). What the layers keep depends on it (Shape.layer_activation_bytes)."""
        return self.fused_loss and not self.compiled

    @property
    def fast(self) -> str:
        """Its fast paths as the snapshot names them (FastPaths.label): fp8+compiled, compiled, fp8 or ""."""
        return FastPaths(self.fp8, self.compiled).label


@dataclass
class Prediction:
    workload: Workload
    allocated_gib: float
    reserved_gib: float           # what torch.cuda.max_memory_reserved() would report (no cap)
    smi_gib: float                # what nvidia-smi would show per card
    need_gib: float               # what the card must hold (allocated + minimal cache + context)
    host_gib: float
    parts: dict[str, float] = field(default_factory=dict)

    def capped(self, cap_gib: float) -> tuple[float, float]:
        """(reserved, nvidia-smi) under an allocator cap of `cap_gib` (the bench rows' 24 GiB emulation):
        the allocator gives cached blocks back before it refuses, so reserved stops at the cap."""
        reserved = min(self.reserved_gib, cap_gib)
        strategy = STRATEGIES[self.workload.strategy]
        return reserved, reserved + CALIBRATION["context_gib"][strategy.launcher]


def mean_layer_activation_bytes(shape: Shape, liger: bool = False) -> float:
    """What autograd keeps per token of one decoder layer, on average over the layers (fitted scale); `liger`:
    Liger's in-layer kernels on (Workload.liger_layers)."""
    per_layer = (shape.layer_activation_bytes(i, liger) for i in range(shape.layers))
    return CALIBRATION["activation_scale"] * sum(per_layer) / shape.layers


def whole_layer_activations(shape: Shape, w: Workload) -> float:
    """Bytes of the activations of the layers autograd holds whole at the start of backward: every layer without
    checkpointing; with it, the layers kept whole (--activation_checkpointing_skip_layers) and the one recomputed.
    What the fast paths' memory is counted in (fast_path_bytes)."""
    whole = shape.layers if not w.checkpointing else min(w.skip_layers + 1, shape.layers)
    return w.micro_batch * w.seq_len * whole * mean_layer_activation_bytes(shape, w.liger_layers)


def fast_path_bytes(shape: Shape, w: Workload) -> float:
    """What the plan's fast paths add to its peak (negative: what they save), per the snapshot's fit
    (fast_path_memory): for each path on, a share of its kind's unit (fast_path_unit), by kind of plan. The compiled
    layers keep inductor's own saved tensors and workspaces; LoRA's FP8 base adds its quantized activations and
    scales; torchao's float8 training saves its matmul inputs in FP8, half of bf16's bytes, so a full fine-tune's
    share is negative. A resident plan's compiled layers change what its MoE layers' dequantized experts hold (one
    layer's bf16 copies, not its activations: measured less memory than eager): its own fit where a resident row
    ran with them beside its eager twin, else LoRA's."""
    if not (w.fp8 or w.compiled):
        return 0.0
    memory, total = fitted()["fast_path_memory"], 0.0
    for name in [n for n, on in (("compiled", w.compiled), ("fp8", w.fp8)) if on]:
        kind = fast_path_kind(w)
        if name not in memory.get(kind, {}):  # no row of this kind ran with the path: LoRA's share (a resident plan)
            kind = "lora"
        total += memory[kind][name][0] * fast_path_unit(shape, w, kind)
    return total


def fast_path_kind(w: Workload) -> str:
    """Which fit of fast_path_memory speaks for a plan (or a row): a resident plan's own (--quantize_experts fp8),
    a full fine-tune's, else LoRA's (QLoRA's too)."""
    return "resident" if w.resident else "full" if w.setup.method == "full" else "lora"


def fast_path_unit(shape: Shape, w: Workload, kind: str) -> float:
    """What a kind's fast-path shares are shares of: one MoE layer's dequantized experts for the resident kind
    (resident.dequantized_layer_bytes), else the whole layers' activations (whole_layer_activations)."""
    return resident.dequantized_layer_bytes(shape) if kind == "resident" else whole_layer_activations(shape, w)


def predict(shape: Shape, w: Workload, with_fast_paths: bool = True) -> Prediction:
    """The plan's memory; without its fast paths' own term (fast_path_bytes) where `with_fast_paths` is false: what
    the rest of the model says, as fast_path_memory fits that term against."""
    strategy = STRATEGIES[w.strategy]
    params = shape.params()
    lora = w.setup.method in ("lora", "qlora")
    trainable = shape.lora_params(w.lora_r) if lora else params
    state: StateBytes = strategy.state_bytes(params, trainable, w.setup, w.world, shape.linear_params())
    if w.resident:  # the routed experts in e4m3 with their row scales, the rest of the base in bf16
        state = dataclasses.replace(state, weights=state.weights - resident.bytes_saved(shape))
    if w.strategy == expert_parallel.STRATEGY:  # AutoEP: this card's share of the routed experts only
        state = dataclasses.replace(state, weights=state.weights - expert_parallel.experts_elsewhere(shape))
    tokens = w.micro_batch * w.slice_len  # this card's: under --sequence_parallel, its slices
    h, layers = shape.hidden, shape.layers
    # activations (bytes)
    k = CALIBRATION["activation_scale"]
    a_mean = mean_layer_activation_bytes(shape, w.liger_layers)
    if lora and w.peft_input_cast:  # peft's fp32 round trip (sft before 51be3c5): bf16 re-casts of the inputs
        a_mean += shape.lora_cast_bytes()
    # --mlp_tile_tokens: a layer keeps its MLP's input only (counted in its bytes); the MLP's intermediates exist
    # for the one tile the backward recomputes
    tile = tile_tokens(w)
    mlp = k * sum(shape.mlp_activation_bytes(i, w.liger_layers) for i in range(layers)) / layers \
        if tile < tokens else 0.0
    per_layer, one_tile = tokens * (a_mean - mlp), tile * mlp
    if w.checkpointing:
        kept = min(w.skip_layers, layers)
        checkpoints, whole_layers = (layers - kept) * 2 * h * tokens, kept * per_layer
        recompute = per_layer if kept == 0 else 0.0
    else:
        checkpoints, whole_layers, recompute = 0.0, layers * per_layer, 0.0
    offloaded = 0.0
    if w.offload_activations:  # all of it waits in host RAM; the backward brings back one layer's at a time, and
        offloaded = checkpoints + whole_layers  # the next checkpoint ahead of its asking
        checkpoints = long_rows.CHECKPOINTS_ON_GPU * 2 * h * tokens if checkpoints else 0.0
        whole_layers = per_layer if whole_layers else 0.0
    # MoE LoRA: the W + BA weights of the layers whose forward is kept (the recomputed one's under checkpointing)
    deltas = [shape.parameter_lora_bytes(i) for i in range(shape.layers)] if lora else [0.0]
    whole = min(w.skip_layers, len(deltas))  # --activation_checkpointing_skip_layers keeps the LAST layers whole
    kept_deltas = sum(deltas[len(deltas) - whole:]) + max(deltas) if w.checkpointing else sum(deltas)
    logits = 0.0 if w.fused_loss or w.chunked_loss else 12.0 * shape.vocab  # log_softmax output + two fp32 grads
    loss_chunk = resident.loss_chunk_bytes(shape.vocab) if w.chunked_loss else 0.0
    # --quantize_experts: one MoE layer's experts in bf16 while the backward recomputes that layer
    dequantized = CALIBRATION["dequantized_copies"] * resident.dequantized_layer_bytes(shape) if w.resident else 0.0
    if strategy.sharded_kind == "tp":
        logits += 2.0 * shape.vocab if not w.fused_loss else 0.0  # the gathered (replicated) bf16 logits
    backward = k * (tokens * shape.backward_working_bytes() - (tokens - tile) * shape.mlp_working_bytes())
    if w.strategy == expert_parallel.STRATEGY:  # the all-to-all buffers of the layer in its backward
        backward += expert_parallel.dispatch_bytes(shape, tokens)
    ulysses = 0.0  # --sequence_parallel: the layer's attention over the whole row, heads / N, and its all-to-alls
    if w.sequence_parallel > 1:
        ulysses = sum(f(shape, w.seq_len, w.sequence_parallel, w.micro_batch)
                      for f in (sequence_parallel.attention_bytes, sequence_parallel.all_to_all_bytes))
    working = max(tokens * logits, loss_chunk, recompute + one_tile + backward + dequantized + ulysses)
    extras = 8 * h  # final norm (fp32 input + output) and the loss's input
    if w.offload_activations:  # what the norm and the fused loss save waits in host RAM too: the GPU holds the
        extras = 4 * h         # gradient into the last layer and the saved tensor brought back for it (2h each)
        offloaded += tokens * 4 * h
    fast = fast_path_bytes(shape, w) if with_fast_paths else 0.0
    activations = checkpoints + whole_layers + working + tokens * extras + kept_deltas + fast
    # transient buffers of the sharded strategies
    transient = 0.0
    grad_bytes = 2 if (lora or w.setup.precision != "fp32_master") else 4
    layer = max(shape.layer_params(i) for i in range(shape.layers))
    end_transient = 0.0
    own_grad = 0 if lora else grad_bytes
    gathered = None  # of the transient, what FSDP's all-gathers hold (the allocator's cache grows with it)
    if strategy.sharded_kind == "fsdp" and lora:
        transient, gathered = fsdp_adapter_buffers(shape, w)
        end_transient = gathered
    elif strategy.sharded_kind == "fsdp":
        root = shape.embedding_params() + (0 if shape.tied else shape.embedding_params())
        # the root unit (embeddings, lm_head) stays gathered in bf16 through forward and backward, and its
        # gradients stay unsharded until the end of backward; two layers gathered (prefetch), one layer's gradient
        # (the full fine-tune's count, as fitted on its rows: cache_per_gathered)
        transient = root * 2 + layer * (2 * 2 + own_grad)
        end_transient = root * (2 + own_grad)
    elif strategy.sharded_kind == "zero3":
        big = shape.largest_module_params()
        own_grad = 0 if lora else 2  # 16-bit gradients before the reduce-scatter into fp32 partitions
        transient = big * (2 + own_grad) + layer * 2
        end_transient = big * (2 + own_grad)
    gpu_state = state.gpu
    grads_live = state.gradients if (w.grad_accum > 1 or lora) else 0.0
    # three moments: the start of backward (every stored activation, no gradient yet unless accumulated), the end of
    # backward (all gradients, the sharded plans' root/largest module still gathered with its gradient), the step
    phase_backward = gpu_state - state.gradients + grads_live + activations + transient
    phase_end = gpu_state + end_transient
    allocated = max(phase_backward, phase_end)
    kind = "zero3_moe" if strategy.sharded_kind == "zero3" and shape.routed_experts else strategy.sharded_kind
    if kind in CALIBRATION["cache_per_gathered"]:
        cache = CALIBRATION["cache_per_gathered"][kind] * (transient if gathered is None else gathered)
    else:
        cache = CALIBRATION["cache_gib"]["none" if kind == "none" else kind] * GIB
    if kind in ("fsdp", "tp") and not w.fused_loss:
        cache += CALIBRATION["cache_logits_share"] * tokens * logits
    context = CALIBRATION["context_gib"][strategy.launcher] * GIB
    reserved = allocated + cache
    need = allocated + min(cache, CALIBRATION["cache_gib"]["none"] * GIB) + context
    pinned = CALIBRATION["host_per_offloaded"]  # processes + offloaded state with DeepSpeed's pinned buffers
    host = (8 + 4 * w.world) * GIB + w.world * (pinned["optimizer"] * (state.host - state.host_weights)
                                                 + pinned["weights"] * state.host_weights
                                                 + pinned["activations"] * offloaded)
    if strategy.sharded_kind == "fsdp" and w.setup.method == "qlora":
        host = max(host, (8 + 4 * w.world) * GIB + w.world * nf4_load_host_bytes(shape))
    if w.resident:  # each process quantizes its own copy of the experts as it reads the checkpoint
        host = max(host, (8 + 4 * w.world) * GIB + w.world * resident.load_host_bytes(shape))
    parts = {"weights": state.weights, "gradients": state.gradients, "optimizer": state.optimizer,
             "masters": state.masters, "buckets": state.buckets, "activations": activations,
             "lora_weights": kept_deltas, "fast_paths": fast, "transient": transient, "cache": cache,
             "dequantized_experts": dequantized, "sequence_parallel_attention": ulysses,
             "context": context, "offloaded_activations": offloaded}
    return Prediction(w, allocated / GIB, reserved / GIB, (reserved + context) / GIB, need / GIB, host / GIB,
                      {k: v / GIB for k, v in parts.items()})


def nf4_load_host_bytes(shape: Shape) -> float:
    """Host RAM one rank holds at its peak while it loads the --qlora base under FSDP, from the code
    (sft/model/nf4_loading.py), not measured: the decoder layers' linear weights read one at a time and quantized to
    NF4 as they are read (on the GPU), so the NF4 base, the unquantized weights (embeddings, lm_head, norms) in bf16,
    and the largest linear weight in flight in bf16 (the file's mapped pages, released with it). Every rank loads its
    own copy (FSDP2 shards it afterwards; no RAM-efficient loading under --qlora: sft/parallel/fsdp.py)."""
    linears = shape.linear_params()
    largest = max(out * inp for i in range(shape.layers) for out, inp in shape.linear_shapes(i))
    return linears * NF4_BYTES + (shape.params() - linears) * 2 + largest * 2


def fsdp_adapter_buffers(shape: Shape, w: Workload) -> tuple[float, float]:
    """(transient bytes at the peak, of which all-gathered) of a LoRA or QLoRA plan under FSDP2, from the units
    accelerate 1.16 builds (fsdp2_prepare_model) and what our run does with them, not from a measured row (no FSDP
    LoRA or QLoRA row yet: the cache on top is the full fine-tune's cache_per_gathered, over the gathered bytes):
    - the input embedding is a unit of its own, gathered for the forward only (sft/parallel/fsdp.py skips its
      backward's gather): at the start of the step, when no activation is kept yet; not at the peak;
    - the tail (final norm, lm_head; the embedding too when tied) stays gathered in bf16 from the end of the
      forward to the loss's backward (reshard_after_forward=False): beside every checkpoint;
    - two decoder layers gathered (the one computing, the next prefetched), in the bytes FSDP2 moves: bf16 for
      LoRA, NF4 for QLoRA (sft/model/nf4_base.py; norms in bf16, the adapter in fp32: no cast in the all-gather);
    - QLoRA: one linear dequantized at a time, in pieces (sft/model/nf4_layout.py: its bf16 weight and one piece of
      torchao's working set), in the forward, the recomputation and the backward, beside the gathered layers.
    The peak is the larger of the tail's moment and a layer's."""
    h, qlora = shape.hidden, w.setup.method == "qlora"
    tail = 2 * (shape.vocab * h + h)
    adapter = shape.lora_params(w.lora_r) / shape.layers * (4 if qlora else 2)
    layer_bytes, dequantized = [], 0.0
    for i in range(shape.layers):
        linears = shape.layer_params(i) - 2 * h
        layer_bytes.append((linears * NF4_BYTES if qlora else 2 * linears) + 2 * 2 * h + adapter)
        if qlora:
            dequantized = max(dequantized, *(dequantize_peak_bytes(out, inp, w.world) for out, inp in shape.linear_shapes(i)))
    layers = 2 * max(layer_bytes)
    return max(tail, layers + dequantized), max(tail, layers)


# ---------------------------------------------------------------------------------------------------------------
# The measured rows: workload of each bench row, predicted against measured.


def row_shape(row: dict) -> Shape:
    """The built-in shape of a bench row's model (bench/train_throughput.py MODELS, either spelling)."""
    return SHAPES[shape_name(row["model"])]

STRATEGY_OF_ROW = {"single": "single_gpu"}
# Commits of bench rows that ran before 51be3c5 (peft's fp32 input casts under autocast); fp16 ZeRO-2 rows never
# had them (DeepSpeed's fp16 engine holds the adapter in fp16). From `git log`.
PEFT_CAST_COMMITS = {"b2e66a6", "9a66dc6", "1a37de6", "54b7c4e", "606734a"}


def _arg(args: list[str], name: str, default=None):
    """The option's last value (a recipe's options come first, the command line's win)."""
    if name in args:
        i = len(args) - 1 - args[::-1].index(name)
        return args[i + 1] if i + 1 < len(args) else default
    return default


# What a recipe held when a bench row ran it, where the shipped recipe has changed since ((run_id, row name) ->
# options): r1-distill-qwen-7b-lora kept 3 layers whole until the compiled layers' memory was planned (issue 28).
RECIPE_AS_RUN = {("20261201T0930Z-x2", "recipe-r1-lora"): ("--activation_checkpointing_skip_layers", "3")}


def row_options(row: dict) -> list[str]:
    """The sft/train.py options of a bench row: its recipe's (`--config recipes/<x>.yaml`, the shipped recipe of that
    name, wherever the row ran, as it was then: RECIPE_AS_RUN) before its own."""
    as_run = RECIPE_AS_RUN.get((row.get("run_id"), row.get("name")), ())
    return list(_options(row.get("train_args") or "", as_run))


@functools.lru_cache(maxsize=None)
def _options(train_args: str, as_run: tuple[str, ...] = ()) -> tuple[str, ...]:  # every plan reads every row: once
    args = shlex.split(train_args)
    recipe = _arg(args, "--config")
    return tuple((load_recipe(str(RECIPES / Path(recipe).name)) if recipe else []) + list(as_run) + args)


def workload_of_row(row: dict) -> Workload:
    args = row_options(row)
    strategy = STRATEGY_OF_ROW.get(row["strategy"], row["strategy"])
    optim = _arg(args, "--optim", "")
    precision = next((k for k, v in PRECISION_OPTIONS.items() if v and v["optim"] == optim), "fp32_master")
    cast = row["method"] == "lora" and _arg(args, "--dtype") != "float16" and (
        row.get("commit", "").split("-")[0] in PEFT_CAST_COMMITS or row.get("name", "").endswith("-peftcast"))
    fast = fast_of_row(row)
    size = int(_arg(args, sequence_parallel.OPTION, 1))
    return Workload(strategy=strategy, setup=Setup(row["method"], precision), world=row["n_gpus"],
                    peft_input_cast=cast,
                    micro_batch=row["micro_batch"], seq_len=row["seq_len"],
                    checkpointing=_arg(args, "--activation_checkpointing", "false") == "true",
                    skip_layers=int(_arg(args, "--activation_checkpointing_skip_layers", 0)),
                    fused_loss=_arg(args, "--use_liger_kernel", "false") == "true",
                    grad_accum=row.get("grad_accum", 1), fp8=fast.fp8, compiled=fast.compiled,
                    mlp_tile_tokens=int(_arg(args, "--mlp_tile_tokens", 0)),
                    offload_activations=_arg(args, "--offload_activations", "false") == "true",
                    # the loss in chunks: asked for, or always under --sequence_parallel (sft/train.py)
                    chunked_loss=_arg(args, "--chunked_loss", "false") == "true" or size > 1,
                    resident=resident.is_resident_row(args), sequence_parallel=size)


def split_size(row: dict) -> int:
    """The N a bench row split each row over (--sequence_parallel N: such rows speak for SP plans only); 1: none."""
    return int(_arg(row_options(row), sequence_parallel.OPTION, 1))


def fast_of_row(row: dict) -> FastPaths:
    """The fast paths a bench row ran with: its --fp8 and --compile_layers (false where it names neither: the bench
    passes false before a row's own options, and rows from before the `auto` default ran without them), as the
    run's own rule settles them on the row's GPU and strategy (`auto` included)."""
    args = row_options(row)
    asked = Asked(_arg(args, "--fp8", "false"), _arg(args, "--compile_layers", "false"),
                  _arg(args, "--torch_compile", "false") == "true")
    strategy = STRATEGY_OF_ROW.get(row["strategy"], row["strategy"])
    return fast_paths(described_machine(row.get("gpu") or "", row["n_gpus"], 0.0), strategy, row["n_gpus"],
                      row["method"], asked, "fp8" if resident.is_resident_row(args) else "none")


def bench_rows(path: Path = RESULTS) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def measured_rows(path: Path = RESULTS) -> list[dict]:
    """The GPU rows of our own training code (the peers' offload recipe runs it too; TRL's rows do not), less those
    of a --liger_kernel_config or an --fp8_recipe of their own, which the planner does not plan (eager layers
    without Liger's RMSNorm and SwiGLU keep their buffers: +21 GiB, lora-best-flce of run 20261202T0245Z-E; the
    planner's FP8 is the default recipe). Rows of the fast paths (--fp8, --compile_layers) are in: their own
    memory term (fast_path_bytes) and MFU (mfu_reference) are fitted on them."""
    unplanned = ("--liger_kernel_config", "--fp8_recipe")
    return [r for r in bench_rows(path) if r.get("gpu") and r.get("peak_mem_gib") and shape_name(r.get("model") or "")
            and r.get("peer", "ours") != "trl" and not any(o in (r.get("train_args") or "") for o in unplanned)]


def smi_of_row(row: dict, rows: list[dict]) -> tuple[float | None, str]:
    """The row's own nvidia-smi peak, or None and why not. bench/lora_variants.sh runs 1-GPU rows side by side
    and NVML read GPU 0 for each of them: a value two rows share is kept only for the one row it can belong to
    (nvidia-smi at least 1 GiB above its allocator, as on every other row)."""
    smi = row.get("nvidia_smi_mem_gib")
    if smi is None:
        return None, "not recorded"
    if "NOT a 1-GPU number" in (row.get("notes") or ""):
        return None, "shared its GPU with another row"
    if row["n_gpus"] == 1:
        twins = [r for r in rows if r is not row and r.get("run_id") == row.get("run_id") and r["n_gpus"] == 1
                 and r.get("nvidia_smi_mem_gib") == smi]
        if twins:
            plausible = [r for r in [row, *twins] if smi - r["peak_mem_gib"] >= 1.0]
            if plausible != [row]:
                return None, "GPU 0's peak, shared with a row that ran beside it"
    return smi, ""


def check_rows(path: Path = RESULTS) -> list[dict]:
    """Predicted against measured for every bench row with a measured peak."""
    rows = measured_rows(path)
    out = []
    for r in rows:
        w = workload_of_row(r)
        p = predict(row_shape(r), w)
        cap = r.get("mem_cap_gib") or 1e9
        reserved, smi = p.capped(cap)
        measured_smi, why = smi_of_row(r, rows)
        out.append({"name": r["name"], "run_id": r["run_id"], "strategy": w.strategy, "method": r["method"],
                    "sequence_parallel": w.sequence_parallel,
                    "model": r["model"], "n_gpus": r["n_gpus"], "micro_batch": r["micro_batch"],
                    "checkpointing": w.checkpointing, "skip": w.skip_layers, "fused_loss": w.fused_loss,
                    "levers": w.levers.label,
                    "precision": w.setup.precision, "fast": w.fast, "resident": w.resident,
                    "pred_allocated": p.allocated_gib, "allocated": r.get("peak_allocated_gib"),
                    "pred_reserved": reserved, "reserved": r["peak_mem_gib"],
                    "pred_smi": smi, "smi": measured_smi, "smi_note": why,
                    "at_cap": p.reserved_gib >= cap,
                    "err_reserved": reserved / r["peak_mem_gib"] - 1,
                    "err_smi": (smi / measured_smi - 1) if measured_smi else None,
                    "pred_host": p.host_gib, "host": r.get("host_ram_gib"),
                    "offload": bool(STRATEGIES[w.strategy].offload) or w.offload_activations,
                    **host_checked(r, w),
                    "err_host": p.host_gib / r["host_ram_gib"] - 1 if r.get("host_ram_gib") else None})
    return out


def host_checked(row: dict, w: Workload) -> dict:
    """Whether a row's host RAM is held to the prediction ({"host_checked", "host_note"}): where the planner's
    estimate decides something, the offload plans and the resident plans (whose processes each load the base), but
    not the resident rows measured before the experts were quantized as they load (resident.LOADED_WHOLE). Other
    rows are not checked: the same configuration measured 4.6 to 22.9 GiB (torch.compile/Triton worker processes
    and the bench's loading path; bench/RESULTS.md)."""
    old = resident.LOADED_WHOLE.get((row.get("run_id"), row.get("name"))) if w.resident else None
    checked = (bool(STRATEGIES[w.strategy].offload) or w.offload_activations or w.resident) and not old
    return {"host_checked": checked, "host_note": old or ""}


def check_table(results: list[dict]) -> str:
    head = ["row (run)", "strategy", "method", "GPUs", "mb", "ckpt", "Liger", "fast paths", "alloc pred / meas",
            "reserved pred / meas", "err", "nvidia-smi pred / meas", "err", "host RAM pred / meas"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in results:
        ck = ("yes" + (f" (skip {x['skip']})" if x["skip"] else "")) if x["checkpointing"] else "no"
        ck += f", {x['levers']}" if x["levers"] else ""  # the long-row levers (tile, offload)
        smi = f"{x['pred_smi']:.2f} / {x['smi']:.2f}" if x["smi"] else f"{x['pred_smi']:.2f} / - ({x['smi_note']})"
        method = x["method"] + ("" if x["precision"] == "fp32_master" else f" {x['precision']}") \
            + (" resident" if x["resident"] else "")
        lines.append("| " + " | ".join([
            f"{x['name']} ({x['run_id'][9:14]})", strategy_label(x["strategy"], x["sequence_parallel"]), method,
            str(x["n_gpus"]),
            str(x["micro_batch"]), ck, "yes" if x["fused_loss"] else "no", x["fast"] or "-",
            f"{x['pred_allocated']:.2f} / {x['allocated']:.2f}",
            f"{x['pred_reserved']:.2f} / {x['reserved']:.2f}" + (" (cap)" if x["at_cap"] else ""),
            f"{x['err_reserved']:+.1%}", smi, f"{x['err_smi']:+.1%}" if x["err_smi"] is not None else "-",
            f"{x['pred_host']:.0f} / {x['host']:.1f}" + (f" ({x['err_host']:+.0%})" if x["host_checked"] else
                                                          " (loaded whole)" if x["host_note"] else "")
            if x["host"] else "-",
        ]) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Throughput: from the measured MFU of rows of the same kind.

FAMILY = {"single_gpu": "unsharded", "ddp": "unsharded", "zero2": "unsharded", "fsdp": "fsdp", "zero3": "fsdp",
          "zero3_offload": "zero3_offload", "tp": "tp", "autoep": "autoep"}  # whose rows speak for each other's MFU


def mfu_reference(strategy: str, method: str, checkpointing: bool, path: Path | None = None,
                  model: str | None = None, fast: str = "", long: bool = False,
                  resident_experts: bool = False, sequence_parallel_size: int = 1) -> tuple[float, str]:
    """(MFU, which rows) for a kind of plan: the median MFU of our measured rows of the same strategy family,
    method, checkpointing and fast paths (`fast`: a FastPaths.label), with our fast kernels (flex_attention +
    Liger) where such rows exist. A plan with fast paths that no row of its strategy family and method ran with
    takes the rows without them, and says so. `long`: a plan of long rows (sft/plan/long_rows.py) reads the rows
    of one long conversation each, their MFU counted with their attention (long_mfu_rows); the short rows' where
    there is none of its family and method, and says so. `path`: the rows to fit from; None: the snapshot of
    bench/results.jsonl (FITTED). `model`: a built-in shape's name in either spelling (sft/names.py).
    `resident_experts`: a resident plan (--quantize_experts fp8) reads the rows that ran with it (_resident_mfu).
    `sequence_parallel_size` N > 1: an SP plan (of long rows) reads the rows split over N ranks (_split_mfu)."""
    model = (shape_name(model) or model) if model else None
    if sequence_parallel_size > 1:
        return _split_mfu(strategy, method, checkpointing, path, model, fast, sequence_parallel_size)
    if resident_experts:
        return _resident_mfu(strategy, checkpointing, path, model, fast)
    if strategy == expert_parallel.STRATEGY and not _autoep_measured(method, checkpointing, path, model, fast, long):
        mfu, why = mfu_reference("ddp", method, checkpointing, path, model, fast, long,
                                 resident_experts=method == "lora" and not long)
        return mfu, why + expert_parallel.UNMEASURED
    if path is None:
        table = fitted()["mfu"]
        own = table.get(model, table[ANY_MODEL])
        key = mfu_key(strategy, method, checkpointing, fast, long)
        if key in own:  # the snapshot holds a fast kind only where rows of it exist
            return tuple(own[key])
        mfu, why = own[mfu_key(strategy, method, checkpointing, long=long)]
        return mfu, why + unmeasured_fast_note(fast)
    if long:
        return _long_mfu(strategy, method, checkpointing, path, model, fast)
    rows = mfu_rows(path, model)
    if fast:
        with_them = fast_mfu_rows(rows, strategy, method, fast)
        if not with_them:
            mfu, why = mfu_reference(strategy, method, checkpointing, path, model)
            return mfu, why + unmeasured_fast_note(fast)
        return _median_mfu(with_them, strategy, method, checkpointing, model)
    return _median_mfu([r for r in rows if not fast_of_row(r).label], strategy, method, checkpointing, model)


def _autoep_measured(method: str, checkpointing: bool, path: Path | None, model: str | None, fast: str,
                     long: bool) -> bool:
    """Whether rows of strategy autoep speak for this plan: in the snapshot (its key), or among `path`'s rows."""
    if path is None:
        table = fitted()["mfu"]
        return mfu_key(expert_parallel.STRATEGY, method, checkpointing, fast, long) in table.get(model,
                                                                                                table[ANY_MODEL])
    rows = long_mfu_rows(path, model) if long else mfu_rows(path, model)
    return any(_kind(r)[0] == "autoep" for r in rows)


def _long_mfu(strategy: str, method: str, checkpointing: bool, path: Path, model: str | None,
              fast: str) -> tuple[float, str]:
    """mfu_reference of a long plan: the long-document rows of its strategy family and method, else the short
    rows' MFU (which the plan's FLOPs then divide with the long row's attention counted: a slower estimate)."""
    rows = long_mfu_rows(path, model)
    lora = method in ("lora", "qlora")
    if not any(_kind(r)[:2] == (FAMILY[strategy], lora) for r in rows):
        mfu, why = mfu_reference(strategy, method, checkpointing, path, model, fast)
        return mfu, why + "; no row of long documents of this kind: the short rows' MFU, over FLOPs that count " \
                          "the long row's attention"
    rows, note = _rows_of_fast(rows, strategy, method, fast)
    mfu, why = _median_mfu(rows, strategy, method, checkpointing, model)
    return mfu, why + ", rows of one long conversation each, their attention FLOPs counted" + note


def _rows_of_fast(rows: list[dict], strategy: str, method: str, fast: str) -> tuple[list[dict], str]:
    """Of `rows`, those with these fast paths where some of the plan's family and method ran with them, else those
    without any (and the note that says so)."""
    if fast and fast_mfu_rows(rows, strategy, method, fast):
        return [r for r in rows if fast_of_row(r).label == fast], ""
    return [r for r in rows if not fast_of_row(r).label], unmeasured_fast_note(fast)


def _split_mfu(strategy: str, method: str, checkpointing: bool, path: Path | None, model: str | None, fast: str,
               size: int) -> tuple[float, str]:
    """mfu_reference of an SP plan (each row split over `size` ranks): the rows that ran so, of its strategy family
    and method (split_rows_of_kind), from the snapshot or `path`'s rows; where there are none, one card's long-row
    MFU over the whole row's FLOPs, said so (sequence_parallel.UNMEASURED: Plan.speed_unmeasured)."""
    if path is None:
        table = fitted()["mfu"]
        own = table.get(model, table[ANY_MODEL])
        key = mfu_key(strategy, method, checkpointing, fast, long=True, sequence_parallel_size=size)
        plain = mfu_key(strategy, method, checkpointing, long=True, sequence_parallel_size=size)
        if key in own:  # the snapshot holds an SP kind only where rows of it exist (fitted_numbers)
            return tuple(own[key])
        if plain in own:
            mfu, why = own[plain]
            return mfu, why + unmeasured_fast_note(fast)
    else:
        rows = split_rows_of_kind(split_mfu_rows(path, model), strategy, method, size)
        if rows:
            rows, note = _rows_of_fast(rows, strategy, method, fast)
            mfu, why = _median_mfu(rows, strategy, method, checkpointing, model)
            return mfu, why + f", rows split by {sequence_parallel.OPTION} {size}, the whole row's attention FLOPs " \
                              f"counted" + note
    mfu, why = mfu_reference("single_gpu", method, checkpointing, path, model, fast, long=True)
    return mfu, why + sequence_parallel.UNMEASURED


def split_rows_of_kind(rows: list[dict], strategy: str, method: str, size: int) -> list[dict]:
    """Of split rows (split_mfu_rows), those of `size` where some are of the plan's strategy family and method (else
    none: another family's split rows, or another size's all-to-alls, are not this plan's speed)."""
    rows = [r for r in rows if split_size(r) == size]
    lora = method in ("lora", "qlora")
    return rows if method in sequence_parallel.METHODS.get(strategy, ()) and \
        any(_kind(r)[:2] == (FAMILY[strategy], lora) for r in rows) else []


def _resident_mfu(strategy: str, checkpointing: bool, path: Path | None, model: str | None,
                  fast: str) -> tuple[float, str]:
    """mfu_reference of a resident plan: from the snapshot, or from the rows that ran with --quantize_experts fp8
    (this model's, else any MoE model's, said so), with these fast paths where some did, else without them; a
    LoRA plan's MFU where no row ran with it."""
    if path is None:
        table = fitted()["mfu"]
        key = mfu_key(strategy, "lora", checkpointing, fast, resident_experts=True)
        plain = mfu_key(strategy, "lora", checkpointing, resident_experts=True)
        for own in (table.get(model, {}), table[ANY_MODEL]):  # this model's rows, else any MoE model's
            if key in own:
                return tuple(own[key])
            if plain in own:
                mfu, why = own[plain]
                return mfu, why + unmeasured_fast_note(fast)
        mfu, why = mfu_reference(strategy, "lora", checkpointing, model=model, fast=fast)
        return mfu, why + f"; no row ran with {resident.OPTION}"
    rows = resident_mfu_rows(path, model)
    if not rows:
        mfu, why = mfu_reference(strategy, "lora", checkpointing, path, model, fast)
        return mfu, why + f"; no row ran with {resident.OPTION}"
    note = "" if any(row_shape(r).name == model for r in rows) else "; another MoE model's rows"
    with_them = [r for r in rows if fast_of_row(r).label == fast]
    if not with_them:
        with_them, note = [r for r in rows if not fast_of_row(r).label], note + unmeasured_fast_note(fast)
    mfu, why = _median_mfu(with_them, strategy, "lora", checkpointing, model)
    return mfu, why + f", rows with {resident.OPTION}, their MFU over the routed experts' measured cost" + note


def resident_mfu_rows(path: Path, model: str | None) -> list[dict]:
    """The rows a resident plan's MFU is read from: those that ran with --quantize_experts fp8 at today's speed
    (resident.SLOWER_THAN_TODAY), this model's where there are some, with their MFU counted over the planner's
    FLOPs (tokens_per_second: the routed experts at their measured cost), so that the measured configuration's
    plan predicts its measured tok/s."""
    rows = [r for r in _speed_rows(path) if resident.is_resident_row(row_options(r))
            and (r.get("run_id"), r.get("name")) not in resident.SLOWER_THAN_TODAY]
    rows = [r for r in rows if row_shape(r).name == model] or rows
    costs = expert_costs(path)
    out = []
    for r in rows:
        shape = row_shape(r)
        cost = costs.get(layer_key(shape.hidden, shape.routed_experts, shape.experts_per_token,
                                   shape.moe_intermediate), [1.0])[0]
        weighted = shape.matmul_params() + (cost - 1) * shape.routed_active_params()
        out.append({**r, "mfu": r["mfu"] * weighted / shape.matmul_params()})
    return out


def long_mfu_rows(path: Path, model: str | None) -> list[dict]:
    """The rows made of one long conversation each (bench/throughput.py's long-* rows), of the rows MFU is read
    from, with their MFU counted as a long plan's: the bench's 6N/4N plus their attention and the tiled MLP's
    recomputation (long_rows.long_row_flops_per_token), so that 4k and 32k rows of one run read alike."""
    return _counted_as_long(_mfu_candidates(path, model))


def split_mfu_rows(path: Path, model: str | None) -> list[dict]:
    """The rows of one long conversation each that ran split over ranks (--sequence_parallel N): an SP plan's only,
    their MFU counted as its own (the whole row's attention, the tile of each rank's slice), as long_mfu_rows counts
    the rows of one card."""
    return _counted_as_long(_mfu_candidates(path, model, split=True))


def _counted_as_long(rows: list[dict]) -> list[dict]:
    """Of `rows`, those of long documents, their MFU counted with their attention and the tiled MLP's recomputation."""
    out = []
    for r in rows:
        if is_long_document_row(r):
            shape, w = row_shape(r), workload_of_row(r)
            matmul = (4 if r["method"] in ("lora", "qlora") else 6) * shape.matmul_params()
            out.append({**r, "mfu": r["mfu"] * (matmul + long_row_flops_per_token(shape, w)) / matmul})
    return out


def unmeasured_fast_note(fast: str) -> str:
    return f"; no row of this kind with {FAST_PATH_NAMES[fast]}: the rows without them" if fast else ""


def mfu_rows(path: Path, model: str | None) -> list[dict]:
    """The rows MFU is read from for short rows: ours with a measured MFU, not the Trainer's --torch_compile, not a
    row that shared its GPU, not a row marked INVALID (a speed that was not a training speed: bench/RESULTS.md),
    not a row of long documents (its attention costs what a packed short row's does not: long_mfu_rows); an MoE
    row speaks for its own model only (its MFU, on active parameters, is no dense plan's)."""
    return [r for r in _mfu_candidates(path, model) if not is_long_document_row(r)]


def _mfu_candidates(path: Path, model: str | None, split: bool = False) -> list[dict]:
    """The rows of _speed_rows that speak for plans without --quantize_experts (its rows: resident_mfu_rows): those
    that ran each row whole, or (`split`) those split over ranks (--sequence_parallel, an SP plan's only)."""
    rows = [r for r in _speed_rows(path, split) if not resident.is_resident_row(row_options(r))]
    return [r for r in rows if row_shape(r).name == model or not row_shape(r).routed_experts]


def _speed_rows(path: Path, split: bool = False) -> list[dict]:
    """Our rows whose MFU is a training speed: of rows run whole, or (`split`) of rows split by --sequence_parallel,
    which speak for SP plans only (split_mfu_rows)."""
    return [r for r in measured_rows(path) if r.get("mfu") and r.get("peer") in ("ours", "zero3-offload-recipe")
            and (split_size(r) > 1) == split
            and "--torch_compile" not in (r.get("train_args") or "")
            and not any(mark in (r.get("notes") or "") for mark in ("NOT a 1-GPU number", "INVALID"))]


def fast_mfu_rows(rows: list[dict], strategy: str, method: str, fast: str) -> list[dict]:
    """Of `rows`, those that ran with exactly these fast paths, where some are of the plan's strategy family and
    method (else none: another family's speed-up is not this one's)."""
    with_them = [r for r in rows if fast_of_row(r).label == fast]
    lora = method in ("lora", "qlora")
    return with_them if any(_kind(r)[:2] == (FAMILY[strategy], lora) for r in with_them) else []


def _kind(r: dict) -> tuple[str, bool, bool]:
    """A row's (strategy family, LoRA, checkpointing): a QLoRA row is a LoRA row (its adapter is all that trains),
    never a full fine-tune's."""
    s = STRATEGY_OF_ROW.get(r["strategy"], r["strategy"])
    return FAMILY[s], r["method"] in ("lora", "qlora"), _arg(row_options(r), "--activation_checkpointing") == "true"


def _median_mfu(rows: list[dict], strategy: str, method: str, checkpointing: bool,
                model: str | None) -> tuple[float, str]:
    lora = method in ("lora", "qlora")
    options = {id(r): row_options(r) for r in rows}
    want = (FAMILY[strategy], lora, checkpointing)
    found = [r for r in rows if _kind(r) == want]
    kernels_rows = [r for r in found if "flex_attention" in options[id(r)] or "liger" in " ".join(options[id(r)])]
    found = kernels_rows or found
    found = [r for r in found if row_shape(r).name == model] or found  # the same model's rows where there are some
    note, scale = "", 1.0
    if not found:  # the other checkpointing setting, its MFU scaled by the forward that checkpointing recomputes
        found = [r for r in rows if _kind(r)[:2] == want[:2]]
        # a step does 4N (LoRA) or 6N (full) FLOPs per token, plus 2N recomputed under checkpointing
        recompute = (4 + 2) / 4 if lora else (6 + 2) / 6
        scale = 1 / recompute if checkpointing else recompute
        if want[0] == "zero3_offload":  # bound by the weights streamed from host RAM, not by the recomputed forward
            scale = 1.0
        note = f" (no row with checkpointing {'on' if checkpointing else 'off'}: x{scale:.2f} for the recomputation)"
    if not found:  # nearest kind: FSDP's for the sharded strategies
        found, scale = [r for r in rows if _kind(r)[0] == want[0]], 1.0
        note = " (no row of this kind: nearest kind)"
    if not found:
        return 0.05, "no measured row: assumed 5%"
    mfu = statistics.median(r["mfu"] for r in found) * scale
    names = sorted({r["name"] for r in found})
    why = f"median MFU {mfu:.1%} of {len(found)} rows ({', '.join(names)}){note}"
    # A sharded or offloaded plan streams every parameter for each micro-batch: where this model has no row of the
    # plan's kind but a row of another such kind, that row bounds it (DeepSeek-V2-Lite under ZeRO-3 measured 1.1%,
    # where the dense offload rows would promise 4.3% for its offload plans: an MoE moves 6.5x its active weights).
    own = [r for r in rows if model and row_shape(r).name == model and _kind(r)[0] in ("fsdp", "zero3_offload")
           and _kind(r)[1] == lora]
    if want[0] in ("fsdp", "zero3_offload") and own and not any(row_shape(r).name == model for r in found):
        bound = statistics.median(r["mfu"] for r in own)
        if bound < mfu:
            mfu = bound
            names = ", ".join(sorted({r["name"] for r in own}))
            why += f"; at most {bound:.1%}, this model's own sharded rows ({names})"
    return mfu, why


def layer_key(hidden, experts, top_k, moe_intermediate) -> str:
    return f"{hidden}x{experts}x{top_k}x{moe_intermediate}"


def expert_costs(path: Path = RESULTS) -> dict[str, list]:
    """{MoE layer: [time of its routed experts / time of a dense MLP of the same active FLOPs, GPU]}: the median of
    the GPU rows of bench/moe_layer.py of that layer (transformers' default grouped_mm)."""
    rows = [r for r in bench_rows(path) if r.get("bench") == "moe_layer" and r.get("gpu") not in (None, "cpu")
            and "grouped_mm" in (r.get("vs_dense") or {})]
    by_layer: dict[str, list[dict]] = {}
    for r in rows:
        by_layer.setdefault(layer_key(r.get("hidden"), r.get("experts"), r.get("top_k"), r.get("moe_intermediate")),
                            []).append(r)
    return {k: [statistics.median(r["vs_dense"]["grouped_mm"] for r in v), v[0]["gpu"]] for k, v in by_layer.items()}


def routed_expert_cost(shape: Shape, path: Path | None = None) -> tuple[float, str]:
    """(routed experts' time / a dense MLP's of the same active FLOPs, why) for this shape's MoE layer, from
    `path`'s rows or the snapshot (None); 1.0 for dense shapes, and for MoE shapes no row measured (said so)."""
    if not shape.moe:
        return 1.0, ""
    costs = fitted()["routed_expert_cost"] if path is None else expert_costs(path)
    found = costs.get(layer_key(shape.hidden, shape.routed_experts, shape.experts_per_token, shape.moe_intermediate))
    if not found:
        return 1.0, "; routed experts costed as a dense MLP (no bench/moe_layer.py row of this layer)"
    cost, gpu = found
    return cost, (f"; routed experts at {cost:.2f}x the time of a dense MLP of their active FLOPs "
                  f"(bench/moe_layer.py, {gpu})")


# ---------------------------------------------------------------------------------------------------------------
# The snapshot: every number the plans take from bench/results.jsonl, fitted once (FITTED, shipped in the wheel).

def mfu_key(strategy: str, method: str, checkpointing: bool, fast: str = "", long: bool = False,
            resident_experts: bool = False, sequence_parallel_size: int = 1) -> str:
    """The snapshot's key of a kind of plan: what mfu_reference reads of its arguments (QLoRA's is LoRA's), its
    fast paths (FastPaths.label) where it has any, `long` for plans of long rows, `resident` for resident
    plans (--quantize_experts fp8) and `sp<N>` for SP plans (--sequence_parallel N)."""
    return (f"{strategy} {'lora' if method in ('lora', 'qlora') else 'full'} {'ckpt' if checkpointing else 'no-ckpt'}"
            + (f" {fast}" if fast else "") + (" long" if long else "") + (" resident" if resident_experts else "")
            + (f" sp{sequence_parallel_size}" if sequence_parallel_size > 1 else ""))


def fitted_numbers(path: Path = RESULTS) -> dict:
    """What the plans derive from the bench rows, for every question they can ask: the MFU of each kind of plan,
    for each model with bench rows (the rows that speak for that model only) and for any other model (a kind with
    fast paths only where rows ran with them: mfu_reference), what the fast paths do to memory, and the routed
    experts' cost of each measured MoE layer. JSON-shaped (lists, not tuples)."""
    models = sorted({row_shape(r).name for r in measured_rows(path)})  # the shapes' names (sft/names.py)
    kinds = [(s, m, c, f) for s in STRATEGIES for m in ("lora", "full") for c in (True, False) for f in FAST_PATH_NAMES
             if s != expert_parallel.STRATEGY or any(_kind(r)[0] == "autoep" for r in measured_rows(path))]
    mfu = {}
    for name in [*models, ANY_MODEL]:
        model = None if name == ANY_MODEL else name
        rows = mfu_rows(path, model)
        long = long_mfu_rows(path, model)
        mfu[name] = {mfu_key(s, m, c, f): list(mfu_reference(s, m, c, path, model, f)) for s, m, c, f in kinds
                     if not f or fast_mfu_rows(rows, s, m, f)}
        mfu[name].update({mfu_key(s, m, c, f, True): list(mfu_reference(s, m, c, path, model, f, True))
                          for s, m, c, f in kinds if not f or fast_mfu_rows(long, s, m, f)})
        moe = model is None or SHAPES[model].moe  # a resident plan is an MoE model's only
        ran = {fast_of_row(r).label for r in resident_mfu_rows(path, model)} if moe else set()
        mfu[name].update({mfu_key(s, "lora", True, f, resident_experts=True):
                          list(mfu_reference(s, "lora", True, path, model, f, resident_experts=True))
                          for s in resident.STRATEGIES for f in ran})
        mfu[name].update(_split_numbers(path, model, kinds))
    return {"source": "bench/results.jsonl", "refresh": SNAPSHOT_COMMAND, "mfu": mfu,
            "fast_path_memory": fast_path_memory(path), "routed_expert_cost": expert_costs(path)}


def _split_numbers(path: Path, model: str | None, kinds: list[tuple]) -> dict:
    """The snapshot's MFU of the SP plans that rows split over ranks measured (split_rows_of_kind): none until
    such a row exists, so that the other SP plans keep their unmeasured estimate."""
    split = split_mfu_rows(path, model)
    sizes = sorted({split_size(r) for r in split})
    out = {}
    for s, m, c, f in kinds:
        for n in sizes:
            rows = split_rows_of_kind(split, s, m, n)
            if rows and (not f or fast_mfu_rows(rows, s, m, f)):
                out[mfu_key(s, m, c, f, True, sequence_parallel_size=n)] = list(
                    mfu_reference(s, m, c, path, model, f, True, sequence_parallel_size=n))
    return out


def fast_path_memory(path: Path = RESULTS) -> dict:
    """{lora|full|resident: {compiled|fp8: [share, why]}}: what each fast path adds to the peak reserved memory
    (negative: saves), as a share of its kind's unit (fast_path_unit: the whole layers' activations, or for resident
    plans one MoE layer's dequantized experts; fast_path_bytes adds it). Fitted on the rows that ran with the path
    against their twins without it (the same model, workload, allocator cap and other options; in any run: the
    median of the twins' peaks): the sum of the differences, less what the rest of the memory model puts between
    the two (_modelled_difference), over the sum of those rows' units. A pair where either
    peak is within 0.5 GiB of its cap is left out (the cap hides the difference). A QLoRA plan takes LoRA's numbers;
    the resident kind holds only the paths some resident row ran with beside its twin (fast_path_bytes takes LoRA's
    for the others). Rows split over ranks (--sequence_parallel) are left out: their slices and all-to-alls are no
    other plan's memory."""
    rows = [r for r in measured_rows(path) if split_size(r) == 1]
    twins: dict[tuple, list[dict]] = {}
    for r in rows:
        twins.setdefault(_twin_key(r), []).append(r)
    out: dict[str, dict] = {}
    for kind in ("lora", "full", "resident"):
        out[kind] = {}
        for name in ("compiled", "fp8"):
            pairs = []  # (row, its peak over its twins', its kind's unit), GiB
            for r in rows:
                fast, w = fast_of_row(r), workload_of_row(r)
                if fast_path_kind(w) != kind or not getattr(fast, name):
                    continue
                without = FastPaths(fast.fp8 and name != "fp8", fast.compiled and name != "compiled").label
                others = [t for t in twins[_twin_key(r)] if fast_of_row(t).label == without]
                peaks = [t["peak_mem_gib"] for t in others]
                cap = r.get("mem_cap_gib") or math.inf
                if peaks and max(r["peak_mem_gib"], *peaks) < cap - 0.5:
                    x = fast_path_unit(row_shape(r), w, kind) / GIB
                    pairs.append((r, r["peak_mem_gib"] - statistics.median(peaks),
                                  _modelled_difference(r, others[0]), x))
            if not pairs:
                if kind != "resident":
                    out[kind][name] = [0.0, "no row ran with it beside a twin without it: counted as nothing"]
                continue
            share = sum(d - modelled for _, d, modelled, _ in pairs) / sum(x for *_, x in pairs)
            by_name: dict[str, list[float]] = {}
            for r, d, *_ in pairs:
                by_name.setdefault(r["name"], []).append(d)
            named = ", ".join(f"{n} {min(d):+.2f}" + (f" to {max(d):+.2f}" if len(d) > 1 else "") + " GiB"
                              for n, d in sorted(by_name.items()))
            rows_said = f"{len(pairs)} rows against their" if len(pairs) > 1 else "1 row against its"
            modelled = sorted({round(m, 2) for _, _, m, _ in pairs})
            if any(modelled):  # the rest of the model already holds part of the difference
                named += (f"; less {modelled[0]:+.2f}" + (f" to {modelled[-1]:+.2f}" if len(modelled) > 1 else "")
                          + " GiB that the rest of the memory model puts between them")
            unit = "one MoE layer's dequantized experts" if kind == "resident" else "the whole layers' activations"
            out[kind][name] = [share, f"{share:+.3f} x {unit}, from {rows_said} twins without "
                                      f"{FAST_PATH_NAMES[name]} ({named})"]
    return out


def _modelled_difference(row: dict, twin: dict) -> float:
    """GiB the memory model itself puts between a fast-path row and its twin without the path, before the path's
    own term: the layers' activations where the path changes what else runs (Liger keeps only its fused loss beside
    the compiled layers: Workload.liger_layers). The path's share is fitted on what is left, so that it is not
    counted twice."""
    shape = row_shape(row)
    return (predict(shape, workload_of_row(row), with_fast_paths=False).reserved_gib
            - predict(shape, workload_of_row(twin), with_fast_paths=False).reserved_gib)


def _twin_key(row: dict) -> tuple:
    """What a row and its twin without a fast path share: the model, the workload but its fast paths, the
    allocator cap and every other option."""
    w = workload_of_row(row)
    args = row_options(row)
    others = [a for i, a in enumerate(args) if a not in ("--fp8", "--compile_layers")
              and (i == 0 or args[i - 1] not in ("--fp8", "--compile_layers"))]
    return (row["model"], dataclasses.replace(w, fp8=False, compiled=False), row.get("mem_cap_gib"), tuple(others))


@functools.lru_cache(maxsize=1)
def fitted() -> dict:
    return json.loads(FITTED.read_text())


def write_snapshot() -> str:
    FITTED.write_text(json.dumps(fitted_numbers(), indent=1, sort_keys=True) + "\n")
    return f"wrote {FITTED} from {RESULTS}"


def tokens_per_second(shape: Shape, w: Workload, peak_flops: float) -> tuple[float, str]:
    """Measured MFU x peak x GPUs / FLOPs per token, on ACTIVE parameters (an MoE token runs only its experts), the
    routed experts' FLOPs weighted by what they cost against dense FLOPs where bench/moe_layer.py measured it. A long
    row (long_rows.is_long) also pays its attention and the tiled MLP's recomputation, and its MFU, counted the same
    way, comes from the long-document rows; an SP plan's from the rows split as it is (_split_mfu)."""
    long = is_long(w.seq_len)
    mfu, why = mfu_reference(w.strategy, w.setup.method, w.checkpointing, model=shape.name, fast=w.fast,
                             long=long, resident_experts=w.resident, sequence_parallel_size=w.sequence_parallel)
    cost, cost_why = routed_expert_cost(shape)
    matmul = shape.matmul_params() + (cost - 1) * shape.routed_active_params()
    flops = (4 if w.setup.method in ("lora", "qlora") else 6) * matmul
    flops += long_row_flops_per_token(shape, w) if long else 0.0  # one conversation per row: its attention
    return mfu * peak_flops * w.world / flops, why + cost_why


# ---------------------------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class Box:
    """The box a plan is for, as described on the command line (sft.machine.Machine is the one we run on)."""

    gpus: int = 3
    gpu_mem_gib: float = 24.0          # the card's memory as sold (24 GB cards show 23.99 GiB in nvidia-smi)
    host_ram_gib: float | None = None  # None: unknown (plans then say what they need, never assume it is there)
    peak_flops: float = 165e12         # RTX 4090 dense bf16 (sft/machine.py GPU_KINDS)
    gpu: str = "RTX 4090"              # a GPU_KINDS name: its compute capability decides FP8 (fast_paths)
    machine: Machine | None = None     # `--plan auto`: this machine itself (its GPUs, FP8 probe and packages)

    @property
    def card_gib(self) -> float:
        """What nvidia-smi counts as the card's total: a '24 GB' GeForce holds 24,564 MiB."""
        return self.gpu_mem_gib * 1023.5 / 1024 if self.gpu_mem_gib == 24 else self.gpu_mem_gib

    def described(self) -> Machine:
        """The box as the run's rules read a machine (sft/plan/fast_paths.py)."""
        return self.machine or described_machine(self.gpu, self.gpus, self.gpu_mem_gib)


@dataclass
class Plan:
    prediction: Prediction
    tok_s: float
    tok_s_source: str
    fits: bool                         # it could run: the card holds what it needs, and so does host RAM if known
    why_not: str
    shape: Shape
    machine_card: float = 24.0
    host_ram_gib: float | None = None  # the box's; None: unknown
    fast: FastPaths = FastPaths()      # what it runs with, and the run's words for why (w.fp8, w.compiled)
    asked: Asked = Asked()             # --fp8/--compile_layers as given: its command passes those not auto
    awaits: str | None = None          # the run refuses it until a GPU check passes (refused_today): its error

    @property
    def w(self) -> Workload:
        return self.prediction.workload

    @property
    def ready(self) -> bool:
        """It fits with its margin under a recommended strategy and the run takes it today: what is recommended."""
        return self.roomy and recommended(self) and not self.awaits

    @property
    def roomy(self) -> bool:
        """It fits with MARGIN_GIB of the card left free by nvidia-smi's count: the only plans recommended."""
        return self.fits and self.prediction.smi_gib <= self.machine_card - MARGIN_GIB

    @property
    def host_unknown(self) -> bool:
        return self.host_ram_gib is None

    @property
    def host_short(self) -> bool:
        """It needs more host RAM than the box is known to have."""
        return self.host_ram_gib is not None and self.prediction.host_gib > self.host_ram_gib

    def mark(self) -> str:
        """The table's `fits?`: "yes" only for a plan with its margin on a box whose host RAM is known to hold it."""
        unknown = f"host RAM: unknown, needs {self.prediction.host_gib:.0f} GiB"
        if not self.fits:
            text = f"no: {self.why_not}"
        elif not self.roomy:
            text = f"tight: nvidia-smi {self.prediction.smi_gib:.1f} > {self.machine_card - MARGIN_GIB:.1f} " \
                   f"(the card less {MARGIN_GIB:g} GiB)" + (f"; {unknown}" if self.host_unknown else "")
        else:
            text = unknown if self.host_unknown else "yes"
        if self.awaits and self.fits:
            text += f" (refused until {AWAITED_CHECK} passes)"
        if self.speed_unmeasured and self.w.sequence_parallel > 1:
            return text + " (speed not measured" + (": recommended only where no measured plan fits)"
                                                    if self.last_resort else ")")
        if self.speed_unmeasured:
            return text + " (not recommended: speed not measured)"
        return text + ("" if STRATEGIES[self.w.strategy].recommended else " (not recommended)")

    @property
    def speed_unmeasured(self) -> bool:
        """Its tok/s is another kind's MFU: an AutoEP plan or an SP plan before its bench row
        (sft/plan/expert_parallel.py, sft/plan/sequence_parallel.py)."""
        return any(note in self.tok_s_source for note in UNMEASURED_SPEEDS)

    @property
    def last_resort(self) -> bool:
        """An SP plan that fits with its margin under a recommended strategy and that the run takes today: where its
        speed is not measured, it is recommended only where no measured plan is ready (best_plan); once rows split as
        it is measured it, it is also `ready`, ranked by its speed as any plan. AutoEP's plan never is (recommended):
        a V2-Lite LoRA always has a measured plan on the cards AutoEP needs."""
        return (self.roomy and self.w.sequence_parallel > 1 and STRATEGIES[self.w.strategy].recommended
                and not self.awaits)


def _speed_tiers(plans: list[Plan]) -> list[list[Plan]]:
    """`plans` fastest first, cut into tiers of one speed: each holds the plans within SPEED_TIE of its first."""
    tiers: list[list[Plan]] = []
    for p in sorted(plans, key=lambda p: -p.tok_s):
        if tiers and p.tok_s >= tiers[-1][0].tok_s * (1 - SPEED_TIE):
            tiers[-1].append(p)
        else:
            tiers.append([p])
    return tiers


def safe(plan: Plan) -> bool:
    """It keeps its margin even where the memory model is off by its worst error on the bench rows (HEADROOM)."""
    return plan.prediction.smi_gib * (1 + HEADROOM) <= plan.machine_card - MARGIN_GIB


def ranked(plans: list[Plan]) -> list[Plan]:
    """Best first: the plans that fit with their margin (recommended strategies first, then the SP plans whose speed
    is not measured: Plan.last_resort), then the tight ones, then those that do not fit. Within each, the fastest; among plans of one speed (SPEED_TIE) those with headroom
    enough for the memory model's worst error first (safe), then those with fewer long-row levers (a lever is taken
    where it is needed: its own cost is not measured apart), then the larger micro-batch (measured: micro-batch 4
    ran faster than 1 and 2 at the same MFU class), then the order of the strategy table (sft/parallel/strategies.py:
    simpler strategies, and bf16_sr, measured faster than torchao's 8-bit AdamW, first)."""
    def group(p: Plan) -> int:
        return 0 if p.ready else 1 if p.last_resort else 2 if p.roomy else 3 if p.fits else 4

    out: list[Plan] = []
    order = {id(p): i for i, p in enumerate(plans)}
    for g in range(5):
        for tier in _speed_tiers([p for p in plans if group(p) == g]):
            tier.sort(key=lambda p: order[id(p)])
            out += sorted(tier, key=lambda p: (not safe(p), len(p.w.levers.label.split("+")) if p.w.levers.label
                                               else 0, -p.w.micro_batch))  # stable: the table's order
    return out


def enumerate_plans(shape: Shape, box: Box, method: str = "lora", max_length: int = 2048,
                    micro_batches: tuple[int, ...] = (1, 2, 4, 8), lora_r: int = 16, grad_accum: int = 1,
                    asked: Asked = Asked(), levers: Levers | None = None) -> list[Plan]:
    """Every strategy x precision x checkpointing x micro-batch for `shape` on `box`, best first (ranked), each with
    the fast paths its run gets there for the --fp8/--compile_layers `asked` (fast_paths: the run's own rule), and
    for long rows the cheapest long-row levers that leave the card its margin (long_rows.ladder; all of them where
    none does), or `levers` where given. Beside them the resident plans (--quantize_experts fp8) and the SP plans
    (--sequence_parallel) where they apply (resident.offered, sequence_parallel.offered)."""
    plans = []
    for strategy in STRATEGIES.values():
        if method not in strategy.methods or box.gpus < strategy.min_gpus:
            continue
        world = strategy.gpus_for(box.gpus)
        if strategy.name == "tp" and shape.heads % world:
            continue
        precisions = ("fp32_master",) if method != "full" else strategy.precisions
        for precision in precisions:
            if precision != "fp32_master" and strategy.name not in ("single_gpu", "ddp", "fsdp"):
                continue
            for ckpt in (True, False):
                for mb in micro_batches:
                    w = Workload(strategy.name, Setup(method, precision), world, mb, max_length, ckpt,
                                 fused_loss=kernels(strategy.name, shape)["use_liger_kernel"], lora_r=lora_r,
                                 grad_accum=grad_accum)
                    if strategy.name == expert_parallel.STRATEGY:
                        if not expert_parallel.offered(shape, method):
                            continue
                        w = dataclasses.replace(w, chunked_loss=not w.fused_loss)  # as its bench row: no whole logits
                    kinds = [w, _resident(w)] if resident.offered(shape, strategy.name, method, ckpt) else [w]
                    if sequence_parallel.offered(strategy.name, method, max_length):
                        kinds += [_split(w, n, box.gpus) for n in sequence_parallel.sizes(shape, box.gpus)]
                    for kind in kinds:
                        plans += _with_levers(shape, box, kind, asked, levers)
    return ranked(plans)


def _split(w: Workload, size: int, gpus: int) -> Workload:
    """`w` with each row split over `size` ranks (--sequence_parallel), on the processes that launch takes, with
    the kernels its run takes and its loss in chunks."""
    return dataclasses.replace(w, sequence_parallel=size, world=sequence_parallel.processes(gpus, size),
                               fused_loss=False, chunked_loss=True)


def _resident(w: Workload) -> Workload:
    """`w` with the experts in e4m3, its loss in chunks where there is no Liger (the whole logits are what its
    bench rows left out)."""
    return dataclasses.replace(w, resident=True, chunked_loss=not w.fused_loss)


def _with_levers(shape: Shape, box: Box, w: Workload, asked: Asked, levers: Levers | None) -> list[Plan]:
    """`w` with the fast paths its run gets on `box`, and the first long-row levers that leave the card its margin
    (all of them where none does); [] where no lever applies."""
    fast = fast_paths(box.described(), w.strategy, w.world, w.setup.method, asked,
                      "fp8" if w.resident else "none")
    w = dataclasses.replace(w, fp8=fast.fp8, compiled=fast.compiled)
    tried = [_plan(shape, box, dataclasses.replace(w, mlp_tile_tokens=lv.mlp_tile_tokens,
                                                   offload_activations=lv.offload_activations), fast, asked)
             for lv in ([levers] if levers else ladder(shape, w.seq_len, w.checkpointing))
             if w.checkpointing or not lv.offload_activations]  # offloading moves the checkpoints
    return [next((p for p in tried if p.roomy), tried[-1])] if tried else []


def _plan(shape: Shape, box: Box, w: Workload, fast: FastPaths, asked: Asked) -> Plan:
    """`w` predicted on `box`, and whether it fits there (why not)."""
    p = predict(shape, w)
    tok_s, source = tokens_per_second(shape, w, box.peak_flops)
    why = []
    if p.need_gib > box.card_gib:
        why.append(f"needs {p.need_gib:.1f} GiB per card > {box.card_gib:.1f}")
    if box.host_ram_gib is not None and p.host_gib > box.host_ram_gib:
        have = f"{box.host_ram_gib:.1f}".removesuffix(".0")  # this machine's, read to the byte: 23.5, not 23.5403
        why.append(f"needs {p.host_gib:.0f} GiB host RAM > {have}")
    if w.strategy == "tp" and w.setup.method != "full":
        why.append("TP takes no LoRA")
    if fast.refused:  # a --fp8/--compile_layers true this strategy refuses: the run stops there
        why.append(fast.refused.split(". ")[0])
    return Plan(p, tok_s, source, not why, "; ".join(why), shape, box.card_gib, box.host_ram_gib, fast, asked,
                refused_today(box.described(), w.strategy, w.world, w.setup.method))


def command(plan: Plan, model: str, box: Box) -> str:
    w, s = plan.w, STRATEGIES[plan.w.strategy]
    processes = "" if s.name == "single_gpu" or w.world == 3 else f" --num_processes {w.world}"
    split = w.sequence_parallel > 1  # one conversation per row under sdpa: no --packing
    if (REPO / s.accelerate_config).is_file():  # a checkout: the README's command, from its root
        launch = f"accelerate launch -q --config_file {s.accelerate_config}{processes} sft/train.py"
    else:  # an install without the repository: the shipped config by name, from any directory
        launch = f"deepseek-sft train --config_file {Path(s.accelerate_config).name}{processes}"
    opts = [f"--model {hub_id(model)}", "--dataset data.jsonl", *["--packing"] * (not split),
            f"--max_length {w.seq_len}", f"--per_device_train_batch_size {w.micro_batch}"]
    if w.grad_accum > 1:
        opts += [f"--gradient_accumulation_steps {w.grad_accum}"]
    if w.setup.method in ("lora", "qlora"):
        opts += ["--lora", "--lora_dropout 0", "--bf16"]
        if w.setup.method == "qlora":
            opts += ["--qlora"]
    elif w.setup.precision == "fp32_master":
        opts += ["--bf16"]
    else:
        opts += [f"--{k} {v}" for k, v in PRECISION_OPTIONS[w.setup.precision].items()]
    opts += [f"--{k}" if v is True else f"--{k} {v}"
             for k, v in kernels(plan.w.strategy, plan.shape, w.sequence_parallel).items() if v is not False]
    if s.name == "tp":
        opts += [f"--tp_size {w.world}"]
    if w.resident:  # its option, the checkpointing the run requires for it, the chunked loss
        opts += resident.flags(w.chunked_loss)
    else:
        opts += ["--activation_checkpointing"] * w.checkpointing + ["--chunked_loss"] * (w.chunked_loss and not split)
    opts += w.levers.flags()  # long rows: what they need to leave the card its margin
    opts += sequence_parallel.flags(w.sequence_parallel) if split else []
    opts += plan.asked.flags()  # auto, the default, settles as planned on the box: no option needed for it
    return f"{launch} " + " ".join(opts)


def options_of(plan: Plan) -> dict:
    """The training options a plan sets (for `--plan auto`), by option name."""
    w = plan.w
    opts = {"per_device_train_batch_size": w.micro_batch, "activation_checkpointing": w.checkpointing,
            **kernels(plan.w.strategy, plan.shape, w.sequence_parallel)}
    if w.sequence_parallel > 1:  # its loss is in chunks without asking; one conversation per row under sdpa
        opts.update(sequence_parallel=w.sequence_parallel, packing=False)
    if w.resident:
        opts.update(quantize_experts="fp8", chunked_loss=w.chunked_loss)
    elif w.chunked_loss and w.sequence_parallel == 1:
        opts.update(chunked_loss=True)
    if is_long(w.seq_len):  # set either way: a long plan without a lever says so
        opts.update(mlp_tile_tokens=w.mlp_tile_tokens, offload_activations=w.offload_activations)
    if w.setup.method in ("lora", "qlora"):
        opts["lora_dropout"] = 0.0
    else:
        opts.update(PRECISION_OPTIONS[w.setup.precision])
    return opts


def plan_table(plans: list[Plan], limit: int | None = None) -> str:
    """One line a plan; a `long rows` column (its levers: tile, offload) where the rows are long. A resident plan's
    precision is `resident` (the experts in e4m3: sft/plan/resident.py)."""
    long = any(is_long(p.w.seq_len) for p in plans)
    levers = f" {'long rows':<12}" if long else ""
    head = f"{'strategy':<14} {'precision':<11} {'ckpt':<4} {'mb':>2} {'fast paths':<12}{levers} " \
           f"{'GPU GiB/card':>12} {'host GiB':>8} {'est. tok/s':>10}  fits?"
    lines = [head, "-" * len(head)]
    for p in plans[:limit]:
        w = p.w
        prec = "resident" if w.resident else "-" if w.setup.method != "full" else w.setup.precision
        said = f" {w.levers.label or '-':<12}" if long else ""
        lines.append(f"{strategy_label(w.strategy, w.sequence_parallel):<14} {prec:<11} {'yes' if w.checkpointing else 'no':<4} {w.micro_batch:>2} "
                     f"{w.fast or '-':<12}{said} {shown_gib(p):>12.1f} {p.prediction.host_gib:>8.0f} "
                     f"{p.tok_s:>10,.0f}  {p.mark()}")
    return "\n".join(lines)


def strategy_label(strategy: str, sequence_parallel_size: int = 1) -> str:
    """A plan's strategy as the table names it: an SP plan's with its size (zero3+sp2)."""
    return strategy + (f"+sp{sequence_parallel_size}" if sequence_parallel_size > 1 else "")


def fast_paths_said(plan: Plan) -> str:
    """A plan's fast paths and why: "FP8 + compiled layers (defaults on this GPU)" where `auto` turned both on,
    else each on or off, with the run's own reason for one that `auto` left off (sft/options/resolve.py)."""
    f, asked = plan.fast, plan.asked
    if f.fp8 and f.compiled and asked == dataclasses.replace(asked, fp8="auto", compile_layers="auto"):
        return "FP8 + compiled layers (defaults on this GPU)"
    said = []
    for name, option, on, given in (("compiled layers", "compile_layers", f.compiled, asked.compile_layers),
                                    ("FP8", "fp8", f.fp8, asked.fp8)):
        if on:
            said.append(f"{name} on ({'the default' if given == 'auto' else f'--{option} {given}'})")
        else:  # auto left it off for the run's own reason, or the user said false
            reason = next((n.removeprefix(f"{name} off (")[:-1] for n in f.notes if n.startswith(f"{name} off (")),
                          f"--{option} {given}")
            said.append(f"{name} off ({reason})")
    return ", ".join(said)


def fast_paths_text(plans: list[Plan]) -> str:
    """What the plans' commands run with, by strategy, as kernels_text says their kernels: the first plan's
    strategies with why any path is off (fast_paths_said), then the others' where they differ."""
    groups: dict[str, list[Plan]] = {}
    for p in plans:
        same = groups.setdefault(p.fast.label, [])
        if p.w.strategy not in [q.w.strategy for q in same]:
            same.append(p)
    said = [f"{', '.join(q.w.strategy for q in same)}: "
            + (fast_paths_said(same[0]) if i == 0 else same[0].fast.name)
            + (" (refused: the run stops)" if same[0].fast.refused else "") for i, same in enumerate(groups.values())]
    return "; ".join(said)


def best_plan(plans: list[Plan]) -> Plan | None:
    """The first of the ranked plans that fits with its margin (nvidia-smi at most the card less MARGIN_GIB) under a
    recommended strategy, its speed measured; where none is, the first SP plan that fits so (Plan.last_resort: its
    speed is not measured, and the planner says so); None when there is none: a plan at the card's edge is never
    recommended (what it leaves is less than the prediction's own error, and the allocator's cache grows into it)."""
    return next((p for p in ranked(plans) if p.ready or p.last_resort), None)


def split_plan(plans: list[Plan]) -> Plan | None:
    """The first SP plan that fits with its margin (Plan.last_resort), its speed measured or not: beside another
    plan that best_plan recommends, the planner prints it as the other way to run the rows; None when there is
    none."""
    return next((p for p in ranked(plans) if p.last_resort), None)


def awaiting_plan(plans: list[Plan]) -> Plan | None:
    """When no plan is ready (best_plan): the first that fits with its margin under a recommended strategy but that
    the run refuses until a GPU check passes (Plan.awaits); None when there is none."""
    return next((p for p in ranked(plans) if p.roomy and recommended(p) and p.awaits), None)


def recommended(plan: Plan) -> bool:
    """Its strategy is one we recommend, and its speed stands on rows of its own kind: an AutoEP plan before its
    bench row (sft/plan/expert_parallel.py) is a guess from DDP's rows, never put before a measured plan."""
    return STRATEGIES[plan.w.strategy].recommended and not plan.speed_unmeasured


def closest_plan(plans: list[Plan]) -> Plan | None:
    """When nothing fits with its margin: a tight plan (it may run, at the card's edge), else the plan that misses
    by the least (GPU memory and host RAM, each against what the box has)."""
    tight = [p for p in ranked(plans) if p.fits]
    if tight:
        return tight[0]

    def miss(p: Plan) -> float:
        return max(p.prediction.need_gib / p.machine_card, p.prediction.host_gib / (p.host_ram_gib or math.inf))

    return min(plans, key=miss, default=None)


def shown_gib(plan: Plan) -> float:
    """nvidia-smi's figure: the allocator caches up to the card's memory, never beyond."""
    return min(plan.prediction.smi_gib, plan.machine_card)


def cards(m) -> tuple[int, float]:
    """The GPUs a plan is for (the launch's processes, else the machine's) and the smallest one's GiB."""
    return max(1, m.launch.world_size if m.launch.launched else m.gpus), min(m.gpu_memory_gib or (24.0,))


class Planned(NamedTuple):
    """What `--plan auto` chose: the options it sets {name: value} (never one the user gave), and the plan they
    come from (None: nothing planned)."""

    options: dict
    plan: Plan | None


NOT_PLANNED = Planned({}, None)


def planned_options(model_args, lora_args, data_args, training_args, machine=None,
                    given: set[str] | frozenset[str] = frozenset()) -> Planned:
    """`sft/train.py --plan auto`: the strategy options the planner predicts fastest, leaving out every option the
    user gave (`given`: option names). Sets nothing itself: the caller applies them before the options are
    resolved and checked. `machine`: a sft.machine.Machine (this one when None)."""
    from sft.machine import machine as this_machine

    m = machine or this_machine()
    if not m.cuda:
        return NOT_PLANNED  # nothing to plan without GPUs: the options stay as given
    gpus, mem = cards(m)
    kind = gpu_kind(m.gpu_names[0])
    shape = resolve_shape(model_args.model)
    # Options as given (not yet resolved): --qlora alone has not set --lora yet, and plans its own 4-bit memory;
    # --fp8/--compile_layers auto settle after the plan as they settle in it (fast_paths: this machine, the launch).
    method = "qlora" if lora_args.qlora else "lora" if lora_args.lora else "full"
    mbs = (training_args.per_device_train_batch_size,) if "per_device_train_batch_size" in given else (1, 2, 4, 8)
    accumulation = getattr(training_args, "gradient_accumulation_steps", 1) or 1  # its gradients live in between
    asked = Asked(getattr(model_args, "fp8", "auto"), getattr(model_args, "compile_layers", "auto"),
                  bool(getattr(training_args, "torch_compile", False)))
    box = Box(gpus, mem, m.host_ram_gib or None, kind[1].peak_flops if kind else 165e12, m.gpu_names[0], m)
    levers = None  # the user's long-row options win, and are what the plan predicts
    if given & {"mlp_tile_tokens", "offload_activations"}:
        levers = Levers(getattr(model_args, "mlp_tile_tokens", 0) or 0,
                        bool(getattr(training_args, "offload_activations", False)))
    plans = enumerate_plans(shape, box, method, data_args.max_length, mbs, lora_args.lora_r, accumulation, asked,
                            levers)
    strategy = _launched_strategy(m)
    plans = [p for p in plans if strategy is None or p.w.strategy == strategy]  # the launch decides the strategy
    # ... and the processes: an SP plan of as many as were launched, of the size the user gave if any
    size = getattr(training_args, "sequence_parallel", 1) if "sequence_parallel" in given else None
    plans = [p for p in plans if (p.w.sequence_parallel == 1 or p.w.world == gpus)
             and size in (None, p.w.sequence_parallel)]
    # the experts in e4m3 change the model the adapter trains against: a resident plan only where the user asked
    # for it, and then only one (the run refuses --quantize_experts elsewhere)
    experts = getattr(model_args, "quantize_experts", "none") == "fp8"
    plans = [p for p in plans if p.w.resident == experts]
    chosen = best_plan(plans)
    if chosen is None:
        return NOT_PLANNED
    wanted = options_of(chosen)
    if wanted.get("use_liger_kernel") and not m.has("liger_kernel"):
        wanted["use_liger_kernel"] = False  # not installed here: the plan's other options still hold
    if method == "full" and "dtype" in given:  # the user's precision wins: keep plans of that precision
        wanted = {k: v for k, v in wanted.items() if k not in ("dtype", "optim", "optim_args")}
    if chosen.w.strategy == "fsdp" and method == "full" and "dtype" in wanted:
        wanted["bf16"] = False  # the weights are bf16 (sft/checks: no --bf16 with --dtype bfloat16 under FSDP)
    groups = (model_args, lora_args, data_args, training_args)
    return Planned({name: value for name, value in wanted.items()
                    if name not in given and any(hasattr(group, name) for group in groups)}, chosen)


def _launched_strategy(m) -> str | None:
    launch = m.launch
    if not launch.launched:
        return None
    if launch.fsdp:
        return "fsdp"
    if launch.zero_stage:
        # ZeRO-0: the shipped DeepSpeed config of that stage is AutoEP's (accelerate_configs/autoep.yaml)
        return {"0": expert_parallel.STRATEGY, "2": "zero2",
                "3": "zero3_offload" if launch.offload else "zero3"}.get(str(launch.zero_stage))
    return "ddp" if launch.world_size > 1 else "single_gpu"


def prediction_line(plan: Plan) -> str:
    """One line for the run's first screen."""
    p = plan.prediction
    return (f"  {'plan':<12} {plan.w.strategy}, checkpointing {'on' if plan.w.checkpointing else 'off'}, "
            f"micro-batch {plan.w.micro_batch}, {plan.fast.name}{', experts in e4m3' if plan.w.resident else ''}: predicted {shown_gib(plan):.1f} GiB per GPU "
            f"(nvidia-smi; {p.reserved_gib:.1f} GiB reserved by PyTorch), ~{plan.tok_s:,.0f} tok/s")


def nothing_planned_line(model: str, lora: bool, machine=None) -> str:
    """`--plan auto` that set nothing: why, in one line for the run's first screen (`machine`: this one when None)."""
    from sft.machine import machine as this_machine

    m = machine or this_machine()
    if not m.cuda:
        return "Plan (--plan auto): nothing set: this machine has no CUDA GPU (the planner plans GPUs); the options " \
               "stay as given."
    gpus, mem = cards(m)
    return (f"Plan (--plan auto): nothing set: no plan fits {gpus} x {mem:.0f} GiB with {MARGIN_GIB:g} GiB to spare; "
            f"the options stay as given. "
            f"`python -m sft.plan.planner --model {model} --gpus {gpus} --gpu_mem {mem:.0f}{' --lora' if lora else ''}` says "
            f"why each does not fit.")


# ---------------------------------------------------------------------------------------------------------------
# Command line

def parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="deepseek-sft plan", description="Predict GPU memory, host RAM and speed of every "
                "strategy x checkpointing x micro-batch for a model on this box, and recommend the fastest "
                "plan that fits.", epilog="Offline for the built-in DeepSeek shapes: " + ", ".join(SHAPES) + ".")
    p.add_argument("--model", help="hub id, local directory (config.json) or family name")
    p.add_argument("--gpus", type=int, default=3, help="GPUs in the box (default 3)")
    others = ", ".join(name for name in GPU_KINDS if name != "RTX 4090")
    p.add_argument("--gpu", default="RTX 4090", metavar="NAME", help=f"the GPU (default RTX 4090; {others}): its "
                   "compute capability decides FP8")
    p.add_argument("--gpu_mem", type=float, metavar="GB", help="GB per GPU (default: the GPU's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--lora", action="store_true", help="LoRA on a bf16 base (default: full fine-tune)")
    g.add_argument("--qlora", action="store_true", help="LoRA on a 4-bit NF4 base (bitsandbytes)")
    p.add_argument("--max_length", type=int, default=2048, metavar="N", help="tokens per row (default 2048; over 4096: long rows)")
    p.add_argument("--micro_batch", type=int, metavar="N", help="only this micro-batch (default: 1, 2, 4, 8)")
    p.add_argument("--host_ram", type=float, metavar="GIB", help="host RAM in GiB (default: this machine's)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, metavar="N",
                   help="micro-batches per step (default 1)")
    p.add_argument("--lora_r", type=int, default=16, metavar="R", help="LoRA rank (default 16)")
    p.add_argument("--peak_tflops", type=float, metavar="T", help="bf16 peak per GPU (default: the GPU's)")
    for name in ("fp8", "compile_layers"):
        p.add_argument(f"--{name}", choices=("auto", "true", "false"), default="auto", metavar="WHEN",
                       help="auto (default: where the run allows), true, false")
    p.add_argument("--all", action="store_true", help="list every plan, not the first 20")
    p.add_argument("--check", action="store_true", help="predicted vs measured for bench/results.jsonl rows")
    p.add_argument("--markdown", action="store_true", help="with --check: the markdown table of RESULTS.md")
    p.add_argument("--write_snapshot", action="store_true", help="after new bench rows: refit sft/plan/fitted.json")
    return p


def main(argv: list[str] | None = None) -> int:
    from sft.errors import ConfigError

    args = parser().parse_args(argv)
    if (args.check or args.write_snapshot) and not RESULTS.is_file():  # a wheel ships the snapshot, not the rows
        print(f"error: --{'check' if args.check else 'write_snapshot'} reads bench/results.jsonl, which only a clone "
              f"of the repository has: run it there.", file=sys.stderr)
        return 2
    if args.write_snapshot:
        print(write_snapshot())
        return 0
    if args.check:
        results = check_rows()
        print(check_table(results) if args.markdown else check_summary(results))
        return 0
    if not args.model:
        print("error: --model is missing: a hub id, a local directory or a family name "
              f"({', '.join(SHAPES)}).", file=sys.stderr)
        return 2
    for name in ("gpus", "gpu_mem", "max_length", "micro_batch", "lora_r", "gradient_accumulation_steps", "host_ram"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            print(f"error: --{name} {value:g}: give a positive number.", file=sys.stderr)
            return 2
    try:
        shape = resolve_shape(args.model)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    found = gpu_kind(args.gpu)
    if found is None:
        print(f"error: --gpu {args.gpu}: not a GPU the planner knows; give one of {', '.join(GPU_KINDS)} (the one "
              f"of the same compute capability, with --gpu_mem and --peak_tflops).", file=sys.stderr)
        return 2
    gpu, kind = found
    method = "qlora" if args.qlora else "lora" if args.lora else "full"
    ram = args.host_ram if args.host_ram is not None else this_host_ram()
    mem = args.gpu_mem or kind.memory_gb
    box = Box(args.gpus, mem, ram, args.peak_tflops * 1e12 if args.peak_tflops else kind.peak_flops, gpu)
    mbs = (args.micro_batch,) if args.micro_batch else (1, 2, 4, 8)
    accumulation = args.gradient_accumulation_steps
    plans = enumerate_plans(shape, box, method, args.max_length, mbs, args.lora_r, accumulation,
                            Asked(args.fp8, args.compile_layers))
    shown = plans if args.all else plans[:20]
    host = "host RAM: unknown (give --host_ram)" if ram is None else \
        f"host RAM {ram:.0f} GiB ({'--host_ram' if args.host_ram is not None else 'this machine'})"
    print(f"{shape.name} ({shape.model_type}, {shape.params() / 1e9:.2f}B parameters; shape: {shape.checked}), "
          f"{method}, {args.gpus} x {gpu} {mem:g} GB ({box.card_gib:.2f} GiB by nvidia-smi; a plan keeps "
          f"{MARGIN_GIB:g} GiB of it free), {host}, rows of {args.max_length} tokens"
          f"{f' x {accumulation} micro-batches per step' if accumulation > 1 else ''}, "
          f"{kernels_text(shape, [p.w.strategy for p in shown], [p.w.sequence_parallel for p in shown])}; "
          f"{fast_paths_text(shown)}")
    print(plan_table(shown))
    best = best_plan(plans)
    waiting = awaiting_plan(plans) if best is None else None
    if waiting:  # it fits, and the run refuses it until its GPU check passes: its command, not as ready to run
        print(f"\nFits, but refused until {AWAITED_CHECK} passes (nothing else fits): "
              f"{command(waiting, args.model, box)}")
        print(f"  the run today: error: {waiting.awaits}")
        print(plan_summary(waiting, box, ram))
        return 1
    if best is None:
        closest = closest_plan(plans)
        print(f"\nNothing fits with {MARGIN_GIB:g} GiB of the card to spare. Closest: "
              + (f"{closest.w.strategy}, micro-batch {closest.w.micro_batch}: {closest.mark()}" if closest
                 else "no strategy applies"))
        more_ram = next((p for p in plans if p.host_short and STRATEGIES[p.w.strategy].recommended
                         and p.prediction.smi_gib <= box.card_gib - MARGIN_GIB), None)  # host RAM is all it lacks
        if more_ram:
            print(f"With more host RAM: {more_ram.w.strategy}, micro-batch {more_ram.w.micro_batch}: "
                  f"{more_ram.why_not}")
        return 1
    unmeasured = " (its speed is not measured, and no plan whose speed is measured fits)" * best.speed_unmeasured
    print(f"\nRecommended{unmeasured}: {command(best, args.model, box)}")
    print(plan_summary(best, box, ram))
    split = split_plan(plans)
    if split is not None and split is not best:  # the rows split over cards, beside the recommendation
        why = " (its speed is not measured, so it is not recommended while a measured plan fits)" \
            * split.speed_unmeasured
        print(f"\nEach row split over {split.w.sequence_parallel} cards instead{why}: "
              f"{command(split, args.model, box)}")
        print(plan_summary(split, box, ram))
    return 0


def plan_summary(plan: Plan, box: Box, ram: float | None) -> str:
    """The lines under a plan's command: its fast paths, and its predicted memory, host RAM and speed."""
    needs = f"host RAM: unknown, needs {plan.prediction.host_gib:.0f} GiB" if ram is None else \
        f"{plan.prediction.host_gib:.0f} of {ram:.0f} GiB host RAM"
    return (f"  {fast_paths_said(plan)}\n"
            f"  predicted {shown_gib(plan):.1f} GiB per GPU (nvidia-smi), {needs}; ~{plan.tok_s:,.0f} tok/s, an "
            f"estimate: {plan.tok_s_source}, scaled to {box.peak_flops / 1e12:g} TFLOP/s per GPU")


def check_summary(results: list[dict]) -> str:
    worst_r = max(abs(x["err_reserved"]) for x in results)
    smi = [x for x in results if x["err_smi"] is not None]
    worst_s = max(abs(x["err_smi"]) for x in smi) if smi else 0
    host = [x for x in results if x["host_checked"] and x["err_host"] is not None]
    worst_h = max(abs(x["err_host"]) for x in host) if host else 0
    return (check_table(results) + f"\n\n{len(results)} rows; worst error: reserved {worst_r:.1%}, "
            f"nvidia-smi {worst_s:.1%} ({len(smi)} rows with their own nvidia-smi peak); host RAM of the offload "
            f"and resident plans {worst_h:.1%} ({len(host)} rows)")


if __name__ == "__main__":
    sys.exit(main())
