"""The GPU speed matrix: our rows and TRL 1.16's SFTTrainer at its best, in one invocation, on the same data,
tokenizer, model shape and sequence length, with ratios ours / TRL.

    python bench/throughput.py                          # --rows h200 on a GPU machine, smoke on a CPU one
    python bench/throughput.py --rows lora-best,trl-lora-best --fresh_cache
    python bench/throughput.py --rows smoke             # CPU: the tiny model, ours and TRL, end to end
    python bench/throughput.py --list                   # the rows and groups
    python bench/throughput.py --prepare .benchdata     # data + tokenizer into a folder, for a machine without
                                                        # ../shared; prints the command for the lent GPU machines

Each row is its own launched process tree (bench/train_throughput.py: accelerate launch, one rank per GPU), run
one after the other in this process's boot, each within what is left of --budget_s; each appends one JSON line to
--results (bench/results.jsonl) with `peer` ("ours", "trl", or a recipe run through our trainer), `cold_cache`
(the inductor and Triton compile caches were empty when it started; --fresh_cache gives every row a new empty
one), `nvidia_smi_mem_gib` (NVML's peak of the GPUs its ranks ran on), the GPU name and count, the memory cap,
the commit and --run_id. The table at the end (bench/report.py) gives each of our rows its ratio to its TRL row.
A group may also name a check script of its own (SCRIPTS: bench/qlora_check.py's FSDP run, bench/fsdp_qlora_bytes.py):
it runs after the rows, in the time the budget keeps for it, and says PASS/FAIL; its rows go to --results too.

Data: the 2,000 Alpaca records of ../shared/datasets/alpaca_sample.json (beside the checkout) and the
DeepSeek-Coder tokenizer of ../shared/tokenizers/deepseek-coder-6.7b-instruct, else --data_dir (alpaca_sample.json
and tokenizer/, as --prepare writes them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import long_docs  # noqa: E402
import report  # noqa: E402
import train_throughput as one  # noqa: E402

SHARED = REPO.parent / "shared"
SHARED_DATA = SHARED / "datasets" / "alpaca_sample.json"
SHARED_TOKENIZER = SHARED / "tokenizers" / "deepseek-coder-6.7b-instruct"


@dataclass(frozen=True)
class Row:
    """One measured configuration. `args`: sft/train.py options for our rows, SFTConfig options for TRL's (its
    `--model_init_kwargs` JSON sets the model's attention and dtype); `optim`: the optimizer's options, kept apart
    so that a row can be repeated with another optimizer (replace(row, name=..., optim=...))."""

    name: str
    method: str  # lora, full, qlora
    strategy: str = "single"  # an accelerate config of accelerate_configs/ (train_throughput.CONFIGS)
    n_gpus: int = 1  # 0: every visible GPU (--num_processes)
    micro_batch: int = 1
    grad_accum: int = 1
    mem_cap_gib: float = 24.0  # per-rank allocator cap (a 24 GB card); 0: none
    args: tuple[str, ...] = ()
    optim: tuple[str, ...] = ()
    peer: str = "ours"
    model: str = "deepseek-llm-7b"  # train_throughput.MODELS
    seq_len: int = 2048
    precision: str = "bf16"  # Trainer autocast: bf16, fp16, none (the weights' dtype)
    warmup: int = 2
    steps: int = 6
    profile_steps: int = 1
    repeat_data: int = 2
    vs: str | None = None  # the TRL row of the same run this row's ratio is against
    scaling_of: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    timeout: int = 300
    long_docs: bool = False  # rows of ONE conversation of about seq_len tokens each (bench/long_docs.py), not packed
    #                          Alpaca records: attention over the whole row, as in a long reasoning trace
    needs_gib: float = 0.0  # uncapped: the GPU memory the row was measured to take (nvidia-smi, GiB); a smaller GPU
    #                         skips it instead of spending the budget on its load, compile and out-of-memory error


LIGER = ("--use_liger_kernel", "true")
FLEX = ("--attn_implementation", "flex_attention")
CKPT = ("--activation_checkpointing", "true")
# V2-Lite's rows from before --chunked_loss auto (on for MLA models) measured the whole logits: they keep doing so
WHOLE_LOGITS = ("--chunked_loss", "false")
NO_UNUSED = ("--ddp_find_unused_parameters", "false")
SR8 = ("--optim", "adamw_torch_8bit", "--optim_args", "bf16_stochastic_round=True")
SR4 = ("--optim", "adamw_torch_4bit", "--optim_args", "bf16_stochastic_round=True,block_size=128")


def trl_args(attn: str, dtype: str | None, micro_batch: int, seq_len: int, *more: str) -> tuple[str, ...]:
    """A TRL row's SFTConfig options: the model's attention and dtype, no activation checkpointing (TRL's default
    is on); flex_attention compiles per shape, so the flattened batch is padded to one length (as ours pads rows)."""
    init = {"attn_implementation": attn, **({"dtype": dtype} if dtype else {})}
    pad = ("--pad_to_multiple_of", str(micro_batch * seq_len)) if attn == "flex_attention" else ()
    return ("--model_init_kwargs", json.dumps(init), "--activation_checkpointing", "false", *pad, *more)


# The matrix of issue 4 (formerly bench/run_matrix.sh), options unchanged so that earlier rows can be rerun.
LORA_FAST = (*LIGER, "--lora_dropout", "0", *FLEX, *CKPT, "--activation_checkpointing_skip_layers", "3")
FULL = dict(method="full", strategy="fsdp", n_gpus=0, precision="none", micro_batch=2, warmup=3, steps=5)
PEER = dict(method="full", strategy="zero3_offload", peer="zero3-offload-recipe", n_gpus=0, warmup=1, steps=3,
            args=CKPT)
M13 = dict(model="deepseek-coder-1.3b", method="full", n_gpus=2, micro_batch=2, warmup=3, steps=5)
MATRIX = [
    Row("lora-1", "lora", micro_batch=4, args=LORA_FAST, timeout=240),
    Row("lora-ddp", "lora", "ddp", 0, micro_batch=4, args=LORA_FAST + NO_UNUSED, scaling_of="lora-1", timeout=240),
    Row("lora-1-ckpt", "lora", micro_batch=2, grad_accum=2, args=CKPT, timeout=240),
    Row("lora-ddp-ckpt", "lora", "ddp", 0, micro_batch=2, grad_accum=2, args=CKPT + NO_UNUSED,
        scaling_of="lora-1-ckpt", timeout=240),
    Row("full-fsdp-4bit", args=("--dtype", "bfloat16", *CKPT, *LIGER), optim=SR4, **FULL),
    Row("full-fsdp-8bit", args=("--dtype", "bfloat16", *CKPT, *LIGER), optim=SR8, **FULL),
    # the box's full plan as it runs by default on FP8 GPUs (issue 28 item 4): FP8 and compiled layers under FSDP2
    Row("full-fsdp-4bit-fp8", args=("--dtype", "bfloat16", *CKPT, *LIGER, "--fp8", "true", "--compile_layers", "true"),
        optim=SR4, timeout=420, **FULL),
    Row("full-fsdp-4bit-cap22", mem_cap_gib=22, args=("--dtype", "bfloat16", *CKPT, *LIGER), optim=SR4, **FULL),
    Row("peer-mb1", micro_batch=1, **PEER),
    Row("peer-mb2", micro_batch=2, **PEER),
    Row("lora-zero2-fp16", "lora", "zero2", 0, micro_batch=4, precision="fp16", args=LORA_FAST + ("--dtype", "float16"),
        timeout=240),
    Row("fsdp-1.3b", strategy="fsdp", args=CKPT, **M13),
    Row("tp-1.3b", strategy="tp", args=CKPT, **M13),
    Row("fsdp-1.3b-flex", strategy="fsdp", args=(*LIGER, *FLEX, *CKPT), **M13),
    Row("tp-1.3b-flex", strategy="tp", args=(*FLEX, *CKPT), **M13),  # Liger's fused loss cannot take TP's lm_head
    Row("fsdp-1.3b-mb8", strategy="fsdp", args=CKPT, **{**M13, "micro_batch": 8}),
    Row("tp-1.3b-mb8", strategy="tp", args=CKPT, **{**M13, "micro_batch": 8}),
]

# Which LoRA plan is fastest on one 24 GB card (formerly bench/lora_variants.sh): each variant on one GPU
# (lora-1-<variant>) and with DDP on every GPU (lora-ddp-<variant>, scaling against the 1-GPU row); Liger, no LoRA
# dropout, 8,192 tokens per optimizer step per GPU (16,384 for mb8). <variant>-peftcast: with peft's own fp32 casts
# of the LoRA inputs (which sft skips under autocast; sft/model/loading.py). The old script ran a wave of 1-GPU rows side by
# side (one per GPU); here every row runs alone.
VARIANTS = {
    "sdpa-mb1": (1, 4, ("--attn_implementation", "sdpa")),
    "flex-mb1": (1, 4, FLEX),
    "flex-mb2-ckpt": (2, 2, FLEX + CKPT),
    "flex-mb4-ckpt": (4, 1, FLEX + CKPT),
    "flex-mb4-ckpt-skip3": (4, 1, FLEX + CKPT + ("--activation_checkpointing_skip_layers", "3")),
    "flex-mb2-ckpt-skip8": (2, 2, FLEX + CKPT + ("--activation_checkpointing_skip_layers", "8")),
    "flex-mb4-ckpt-compile": (4, 1, FLEX + CKPT + ("--torch_compile", "true")),
    "flex-mb8-ckpt": (8, 1, FLEX + CKPT),
}
for _cast in ("", "-peftcast"):
    for _variant, (_mb, _ga, _args) in VARIANTS.items():
        _common = dict(method="lora", micro_batch=_mb, grad_accum=_ga, timeout=420,
                       args=(*LIGER, "--lora_dropout", "0", *NO_UNUSED, *_args),
                       env=(("SFT_PEFT_INPUT_CAST", "1"),) if _cast else ())
        MATRIX += [Row(f"lora-1-{_variant}{_cast}", **_common),
                   Row(f"lora-ddp-{_variant}{_cast}", strategy="ddp", n_gpus=0,
                       scaling_of=f"lora-1-{_variant}{_cast}", **_common)]

# Issue 15: ours against TRL at its best on one uncapped H200 (bfd packing, padding-free, flex_attention, Liger, no
# checkpointing; LoRA at micro-batch 8, the full fine-tune with plain bf16 fused AdamW at 4), same shape and length.
# Issue 28's ratio rows measure 16 steps, not 6: in 6, one step that compiles a kernel for a new specialization
# (Liger's loss, whose Triton kernel takes the batch's labelled-token count as an integer, at the first count that is a
# multiple of 16: step 7 of this data) weighed 7% (run 20261205T1525Z-lora2x; both peers use Liger's loss).
RATIO_STEPS = 16
MATRIX += [
    Row("lora-best", "lora", micro_batch=8, mem_cap_gib=0, warmup=3, args=(*LIGER, "--lora_dropout", "0", *FLEX),
        vs="trl-lora-best"),
    Row("trl-lora-best", "lora", peer="trl", micro_batch=8, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=trl_args("flex_attention", "bfloat16", 8, 2048, *LIGER), needs_gib=95.0),  # H200 runs; an H100: OOM
    # correct precision: bf16 weights, the update rounded stochastically (the optimizer is the row's own option)
    Row("full-sr", "full", micro_batch=4, mem_cap_gib=0, warmup=3, precision="none",
        args=("--dtype", "bfloat16", *LIGER, *FLEX), optim=SR8, vs="trl-full"),
    Row("trl-full", "full", peer="trl", micro_batch=4, mem_cap_gib=0, warmup=3,
        args=trl_args("flex_attention", "bfloat16", 4, 2048, *LIGER, "--optim", "adamw_torch_fused")),
    # DeepSeek-V2-Lite (MoE, MLA; MFU on the active parameters): sdpa (MLA's value and key head sizes differ)
    Row("moe-lora", "lora", model="deepseek-v2-lite", micro_batch=4, mem_cap_gib=0, warmup=3,
        args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *WHOLE_LOGITS), vs="trl-moe-lora"),
    # the same with the MoE layers compiled whole (issue 26 item 3's first lever; sft/speed/traced_param_lora.py)
    Row("moe-lora-compile", "lora", model="deepseek-v2-lite", micro_batch=4, mem_cap_gib=0, warmup=3,
        args=("--lora_dropout", "0", "--attn_implementation", "sdpa", "--compile_layers", "true", *WHOLE_LOGITS),
        vs="trl-moe-lora", timeout=420),
    # issue 26 item 3's other levers, each beside moe-lora-compile: FP8 matmuls for MLA and the dense MLP, the loss in
    # chunks (no Liger for MLA models: the whole logits otherwise), LoRA on the routed experts too; flex_attention,
    # which skips the masked blocks of packed rows (~15 Alpaca conversations a 2,048-token row) where sdpa computes
    # the whole causal square: MLA's attention under sdpa took 75 of the compiled step's 313 ms (run
    # 20261205T1855Z-next-h100); flex pads MLA's key size 192 to 256 inside its kernel
    *[Row(f"moe-lora-compile-{name}", "lora", model="deepseek-v2-lite", micro_batch=4, mem_cap_gib=0, warmup=3,
          args=("--lora_dropout", "0", "--attn_implementation", attention, "--compile_layers", "true",
                *(lever if "--chunked_loss" in lever else (*lever, *WHOLE_LOGITS))),
          vs="trl-moe-lora", timeout=420)
      for name, attention, lever in (("fp8", "sdpa", ("--fp8", "true")),
                                     ("chunked", "sdpa", ("--chunked_loss", "true")),
                                     ("experts", "sdpa", ("--lora_experts", "true")),
                                     ("flex", "flex_attention", ()),
                                     ("flex-fp8-chunked", "flex_attention", ("--fp8", "true", "--chunked_loss",
                                                                             "true")),
                                     # ... and the routed experts held in e4m3, their grouped matmuls in FP8 as
                                     # held (sft/speed/fp8_experts.py: no bf16 copy, so no checkpoints needed)
                                     ("fp8-experts", "sdpa", ("--fp8", "true", "--quantize_experts", "fp8")),
                                     # torch's varlen FlashAttention: each packed document's attention alone
                                     # (sft/speed/varlen_attention.py), MLA's values padded 128 -> 192
                                     ("varlen", "varlen", ()),
                                     ("varlen-fp8", "varlen", ("--fp8", "true")),
                                     ("flex-fp8-chunked-experts", "flex_attention", (
                                         "--fp8", "true", "--chunked_loss", "true", "--quantize_experts", "fp8")))],
    # ... at micro-batch 8, which an uncapped H200 holds with the loss in chunks (about 100 GiB; an H100's 80 GB not)
    Row("moe-lora-compile-varlen-mb8", "lora", model="deepseek-v2-lite", micro_batch=8, mem_cap_gib=0, warmup=3,
        args=("--lora_dropout", "0", "--attn_implementation", "varlen", "--compile_layers", "true", "--chunked_loss",
              "true"), vs="trl-moe-lora", timeout=420, needs_gib=110.0),
    # --lora_experts (LoRA on the 64 routed experts, fused) beside its twin without: moe-lora-compile-experts ran out
    # of an 80 GB H100 (run 20261206T0903Z-resident-varlen-h100: without checkpoints the backward kept each MoE
    # layer's weight-sized LoRA delta, before sft/speed/expert_lora.py computed it low-rank), so both checkpointed,
    # the loss in chunks, varlen: the plan a user would run
    *[Row(f"moe-lora-ckpt-varlen{name}", "lora", model="deepseek-v2-lite", micro_batch=4, mem_cap_gib=0, warmup=3,
          args=("--lora_dropout", "0", "--attn_implementation", "varlen", "--compile_layers", "true", *CKPT,
                "--chunked_loss", "true", *lever), timeout=420)
      for name, lever in (("", ()), ("-experts", ("--lora_experts", "true")))],
    Row("trl-moe-lora", "lora", peer="trl", model="deepseek-v2-lite", micro_batch=4, mem_cap_gib=0, warmup=3,
        args=trl_args("sdpa", "bfloat16", 4, 2048)),
    Row("qlora-1", "qlora", micro_batch=4, args=("--lora_dropout", "0", *FLEX, *CKPT)),
    # the levers (sft/speed/sr_adamw.py, sft/speed/fp8.py) against the same TRL rows
    Row("full-sr16", "full", micro_batch=4, mem_cap_gib=0, warmup=3, precision="none",
        args=("--dtype", "bfloat16", *LIGER, *FLEX), optim=("--optim", "adamw_bf16_sr"), vs="trl-full"),
    Row("lora-best-fp8", "lora", micro_batch=8, mem_cap_gib=0, warmup=3,
        args=(*LIGER, "--lora_dropout", "0", *FLEX, "--fp8", "true"), vs="trl-lora-best"),
    # --compile_layers (sft/speed/regional_compile.py): each decoder layer compiled in place, Liger's fused loss only
    Row("lora-best-compile", "lora", micro_batch=8, mem_cap_gib=0, warmup=3,
        args=(*LIGER, "--lora_dropout", "0", *FLEX, "--compile_layers", "true"), vs="trl-lora-best", timeout=420),
    Row("lora-best-fp8-compile", "lora", micro_batch=8, mem_cap_gib=0, warmup=3,
        args=(*LIGER, "--lora_dropout", "0", *FLEX, "--fp8", "true", "--compile_layers", "true"),
        vs="trl-lora-best", timeout=420),
    # ... with inductor rounding its fused intermediates to bf16 as eager does (the compiled layers then give the
    # eager run's losses: run 20261202T0728Z-emulatecheck): what that costs in speed
    Row("lora-best-fp8-compile-eagerround", "lora", micro_batch=8, mem_cap_gib=0, warmup=3,
        args=(*LIGER, "--lora_dropout", "0", *FLEX, "--fp8", "true", "--compile_layers", "true"),
        env=(("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "1"),), vs="trl-lora-best", timeout=420),
    # Liger's fused loss alone, no compile: tells lora-best-compile's loss difference from Liger's in-layer kernels
    Row("lora-best-flce", "lora", micro_batch=8, mem_cap_gib=0, warmup=3,
        args=(*LIGER, "--liger_kernel_config", json.dumps({"rope": False, "rms_norm": False, "swiglu": False,
                                                             "cross_entropy": False, "fused_linear_cross_entropy": True}),
              "--lora_dropout", "0", *FLEX), vs="trl-lora-best"),
    # The compiled layers' lower loss without flex_attention: the compiled and eager rows with sdpa (run
    # 20261202T0245Z-E ruled out Liger's in-layer kernels; without Liger and with sdpa the 50-step losses agree)
    Row("lora-best-sdpa", "lora", micro_batch=8, mem_cap_gib=0, warmup=3,
        args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "sdpa"), vs="trl-lora-best"),
    Row("lora-best-compile-sdpa", "lora", micro_batch=8, mem_cap_gib=0, warmup=3,
        args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "sdpa", "--compile_layers", "true"),
        vs="trl-lora-best", timeout=420),
    Row("full-sr16-compile", "full", micro_batch=4, mem_cap_gib=0, warmup=3, precision="none",
        args=("--dtype", "bfloat16", *LIGER, *FLEX, "--compile_layers", "true"), optim=("--optim", "adamw_bf16_sr"),
        vs="trl-full", timeout=420),
    # Issue 28: the full fine-tune's linear layers in FP8 (torchao's float8 training, sft/speed/fp8_training.py),
    # bf16 weights with adamw_bf16_sr, compiled layers: tensorwise (the default) and rowwise scales
    Row("full-fp8", "full", micro_batch=4, mem_cap_gib=0, warmup=3, precision="none",
        args=("--dtype", "bfloat16", *LIGER, *FLEX, "--fp8", "true", "--compile_layers", "true"),
        optim=("--optim", "adamw_bf16_sr"), vs="trl-full", timeout=420),
    Row("full-fp8-rowwise", "full", micro_batch=4, mem_cap_gib=0, warmup=3, precision="none",
        args=("--dtype", "bfloat16", *LIGER, *FLEX, "--fp8", "true", "--fp8_recipe", "rowwise", "--compile_layers",
              "true"), optim=("--optim", "adamw_bf16_sr"), vs="trl-full", timeout=420),
    # what a user gets with no speed option: --fp8 and --compile_layers left at auto (sft/options/resolve.py); since
    # 2026-12-05 14:00 UTC the FP8 forward's matmuls accumulate fast on Hopper by default (sft/machine.py)
    Row("lora-best-default", "lora", micro_batch=8, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=(*LIGER, "--lora_dropout", "0", *FLEX, "--fp8", "auto", "--compile_layers", "auto"),
        vs="trl-lora-best", timeout=420),
    # ... with each packed document's attention alone (torch's varlen FlashAttention, sft/speed/varlen_attention.py)
    # instead of flex_attention's masked blocks: 1.20x on V2-Lite's compiled step (run 20261206T0640Z-varlen-h100)
    Row("lora-best-default-varlen", "lora", micro_batch=8, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "varlen", "--fp8", "auto", "--compile_layers",
              "auto"), vs="trl-lora-best", timeout=420),
    # ... with the loss in torch chunks instead of Liger's (no `.item()` in the step; 1.04x Liger's on an H100, run
    # 20261205T1525Z-lora2x): the two levers measured apart, together
    *[Row(f"lora-best-default-varlen-chunked{'-mb12' if mb == 12 else ''}", "lora", micro_batch=mb, mem_cap_gib=0,
          warmup=3, steps=RATIO_STEPS, args=("--chunked_loss", "true", "--lora_dropout", "0", "--attn_implementation",
                                             "varlen", "--fp8", "auto", "--compile_layers", "auto"),
          vs="trl-lora-best", timeout=420) for mb in (8, 12)],
    # the same with the FP8 forward keeping cuBLAS's fp32 promotion (the default before; run 20261205T0550Z-lora2x
    # measured fast accumulation at 1.07x it, as row lora-best-default-fastaccum)
    Row("lora-best-default-promoted", "lora", micro_batch=8, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=(*LIGER, "--lora_dropout", "0", *FLEX, "--fp8", "auto", "--compile_layers", "auto"),
        env=(("SFT_FP8_FAST_ACCUM", "0"),), vs="trl-lora-best", timeout=420),
    # the same with the loss in torch chunks instead of Liger's fused loss, whose forward reads its labelled-token
    # count back from the GPU (`.item()`): the step with no host wait but the logs (issue 28 item 2). On an H100
    # (run 20261205T1525Z-lora2x) its steps took 0.62-0.66 s against Liger's 0.60-0.63 (and one 0.89 s: RATIO_STEPS)
    Row("lora-best-default-chunked", "lora", micro_batch=8, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=("--chunked_loss", "true", "--lora_dropout", "0", *FLEX, "--fp8", "auto", "--compile_layers", "auto"),
        vs="trl-lora-best", timeout=420),
    # ... at micro-batch 12, which the uncapped H200 holds for ours (82 GiB at 8) and not for TRL's (95 GiB at 8)
    Row("lora-best-default-chunked-mb12", "lora", micro_batch=12, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=("--chunked_loss", "true", "--lora_dropout", "0", *FLEX, "--fp8", "auto", "--compile_layers", "auto"),
        vs="trl-lora-best", timeout=420),
    # issue 28's ratio where no H200 comes: TRL's best that fits an 80 GB H100 (micro-batch 8 takes 95 GiB; run
    # 20261205T1525Z-lora2x ran out of memory) at micro-batch 4 x 2, beside ours with the same 16,384 tokens a step
    Row("trl-lora-best-mb4", "lora", peer="trl", micro_batch=4, grad_accum=2, mem_cap_gib=0, warmup=3,
        steps=RATIO_STEPS, args=trl_args("flex_attention", "bfloat16", 4, 2048, *LIGER)),
    Row("lora-best-default-mb4", "lora", micro_batch=4, grad_accum=2, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=(*LIGER, "--lora_dropout", "0", *FLEX, "--fp8", "auto", "--compile_layers", "auto"),
        vs="trl-lora-best-mb4", timeout=420),
    # ... with sdpa (the attention a dense model's run gets when none is given: the packed rows' documents kept apart
    # by a mask) and with varlen (each packed document alone): whether varlen should be the dense default too
    *[Row(f"lora-best-default-{attention}-mb4", "lora", micro_batch=4, grad_accum=2, mem_cap_gib=0, warmup=3,
          steps=RATIO_STEPS, args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", attention, "--fp8", "auto",
                                   "--compile_layers", "auto"), vs="trl-lora-best-mb4", timeout=420)
      for attention in ("sdpa", "varlen")],
    # ... what a dense model's run got before 2026-12-06 with no attention and no loss given: sdpa over each packed
    # row behind its documents' mask, the whole logits (spelled out, so the row keeps meaning that after defaults move)
    Row("lora-best-default-sdpa-whole-mb4", "lora", micro_batch=4, grad_accum=2, mem_cap_gib=0, warmup=3,
        steps=RATIO_STEPS, args=("--chunked_loss", "false", "--lora_dropout", "0", "--attn_implementation", "sdpa",
                                 "--fp8", "auto", "--compile_layers", "auto"), vs="trl-lora-best-mb4", timeout=420),
    # ... the two levers apart: varlen with the whole logits; and neither named, which is varlen and the loss in
    # chunks since 2026-12-06 15:30 UTC (sft/options/resolve.py packed_documents_attend_alone,
    # loss_in_chunks_unless_liger): what a user gets with no option
    Row("lora-best-default-varlen-whole-mb4", "lora", micro_batch=4, grad_accum=2, mem_cap_gib=0, warmup=3,
        steps=RATIO_STEPS, args=("--chunked_loss", "false", "--lora_dropout", "0", "--attn_implementation", "varlen",
                                 "--fp8", "auto", "--compile_layers", "auto"), vs="trl-lora-best-mb4", timeout=420),
    Row("lora-best-default-none-mb4", "lora", micro_batch=4, grad_accum=2, mem_cap_gib=0, warmup=3,
        steps=RATIO_STEPS, args=("--lora_dropout", "0", "--fp8", "auto", "--compile_layers", "auto"),
        vs="trl-lora-best-mb4", timeout=420),
    # ... varlen with Liger's fused loss, beside the row above (varlen, the loss in torch chunks, whose frozen lm_head's
    # chunks since 2026-12-06 18:30 UTC are projected once, their gradient computed in the forward: sft/speed/
    # chunked_loss.py FrozenHeadCrossEntropy): the two losses at the same attention; and the defaults at micro-batch 8,
    # ours at its best on an 80 GB H100, where TRL's best fits 4 x 2 only
    Row("lora-best-default-varlen-liger-mb4", "lora", micro_batch=4, grad_accum=2, mem_cap_gib=0, warmup=3,
        steps=RATIO_STEPS, args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "varlen", "--fp8", "auto",
                                 "--compile_layers", "auto"), vs="trl-lora-best-mb4", timeout=420),
    Row("lora-best-default-none", "lora", micro_batch=8, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=("--lora_dropout", "0", "--fp8", "auto", "--compile_layers", "auto"), vs="trl-lora-best-mb4",
        timeout=420),
    # ... with one down-projection matmul per adapter, as before 2026-12-07 18:30 UTC (sft/speed/
    # shared_input_adapters.py: q/k/v's adapters, and gate/up's, read their one input in one matmul since)
    Row("lora-best-default-none-unshared", "lora", micro_batch=8, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
        args=("--lora_dropout", "0", "--fp8", "auto", "--compile_layers", "auto"), vs="trl-lora-best-mb4",
        env=(("SFT_SHARED_INPUT_ADAPTERS", "0"),), timeout=420),
    # ... with flex_attention instead of varlen (the faster attention on packed 2k rows at the median step in run
    # 20261206T1747Z, with Liger's loss: 2.7%) beside the loss in torch chunks: the two faster halves together
    *[Row(f"lora-best-default-flex{'-mb4' if mb == 4 else ''}", "lora", micro_batch=mb, grad_accum=8 // mb,
          mem_cap_gib=0, warmup=3, steps=RATIO_STEPS, args=("--lora_dropout", "0", *FLEX, "--fp8", "auto",
                                                            "--compile_layers", "auto"),
          vs="trl-lora-best-mb4", timeout=420) for mb in (4, 8)],
    # ... with inductor's multi-kernel reductions (TORCHINDUCTOR_MULTI_KERNEL=1: a persistent variant for rows up to
    # 16,384 values beside the looped one, the faster kept at the first call): the FP8 quantization's row reductions
    # over the MLP's 11,008 values read their inputs twice when looped (73 ms of run 20261206T1747Z's 616 ms of kernels)
    *[Row(f"lora-best-default-none{'-mb4' if mb == 4 else ''}-mk", "lora", micro_batch=mb, grad_accum=8 // mb,
          mem_cap_gib=0, warmup=3, steps=RATIO_STEPS, args=("--lora_dropout", "0", "--fp8", "auto", "--compile_layers",
                                                            "auto"),
          env=(("TORCHINDUCTOR_MULTI_KERNEL", "1"),), vs="trl-lora-best-mb4", timeout=480) for mb in (4, 8)],
    # ... the same two on R1-Distill-Qwen-7B's shape (grouped-query attention: 28 query heads on 4 key/value heads,
    # which torch 2.11's varlen kernel takes repeated; a 152k vocabulary)
    *[Row(f"r1-lora-default-{name}-mb4", "lora", model="r1-distill-qwen-7b", micro_batch=4, grad_accum=2,
          mem_cap_gib=0, warmup=3, steps=RATIO_STEPS, args=(*lever, "--lora_dropout", "0", "--fp8", "auto",
                                                            "--compile_layers", "auto"), timeout=420)
      for name, lever in (("sdpa-whole", ("--chunked_loss", "false", "--attn_implementation", "sdpa")), ("none", ()))],
    # ... with varlen attention and the loss in chunks (the two levers of lora-best-default-varlen-chunked)
    Row("lora-best-default-varlen-chunked-mb4", "lora", micro_batch=4, grad_accum=2, mem_cap_gib=0, warmup=3,
        steps=RATIO_STEPS, args=("--chunked_loss", "true", "--lora_dropout", "0", "--attn_implementation", "varlen",
                                 "--fp8", "auto", "--compile_layers", "auto"), vs="trl-lora-best-mb4", timeout=420),
    # ... with inductor tuning its generated kernels' launch configs (coordinate descent: the FP8 quantization's row
    # reductions were 18% of the compiled step's kernels in run 20261206T0958Z-lora2x-varlen-h100), and with
    # autotuning its pointwise kernels: what each gives, and what each adds to the first step's compile
    # (at micro-batch 4 x 2 beside TRL's best on an H100, at 8 x 1 beside TRL's best on an H200)
    *[Row(f"lora-best-default-varlen-chunked{'-mb4' if mb == 4 else ''}-{name}", "lora", micro_batch=mb,
          grad_accum=8 // mb, mem_cap_gib=0, warmup=3, steps=RATIO_STEPS,
          args=("--chunked_loss", "true", "--lora_dropout", "0", "--attn_implementation", "varlen", "--fp8", "auto",
                "--compile_layers", "auto"),
          env=((variable, "1"),), vs="trl-lora-best-mb4" if mb == 4 else "trl-lora-best", timeout=480)
      for mb in (4, 8)
      for name, variable in (("cdt", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"),
                             ("pw", "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE"))],
    # ... and the box's LoRA plan on one 24 GiB card (lora-1's options) with them
    Row("lora-1-compile", "lora", micro_batch=4, args=(*LORA_FAST, "--compile_layers", "true"), timeout=420),
    Row("lora-1-fp8-compile", "lora", micro_batch=4, args=(*LORA_FAST, "--fp8", "true", "--compile_layers", "true"),
        timeout=420),
    # ... and with DDP on every GPU (issue 15: the box's LoRA scaling >= 0.95 N)
    Row("lora-ddp-fp8-compile", "lora", "ddp", 0, micro_batch=4,
        args=(*LORA_FAST, *NO_UNUSED, "--fp8", "true", "--compile_layers", "true"), scaling_of="lora-1-fp8-compile",
        timeout=420),
    # DeepSeek-V2-Lite on ONE 24 GiB card: its 29 GiB bf16 base only fits with the weights in host RAM (ZeRO-3
    # parameter offload; sft/plan/planner.py's only plan that fits one card)
    Row("moe-lora-offload-1", "lora", "zero3_offload", 1, model="deepseek-v2-lite", micro_batch=4, warmup=2,
        steps=4, profile_steps=0, args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, *WHOLE_LOGITS),
        timeout=420),
    # ... and on every GPU (the recipe's plan on 2-3 cards): the weights stream from host RAM to each GPU
    Row("moe-lora-offload", "lora", "zero3_offload", 0, model="deepseek-v2-lite", micro_batch=4, warmup=2, steps=4,
        profile_steps=0, args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, *WHOLE_LOGITS),
        scaling_of="moe-lora-offload-1", timeout=420),
    # ... with --chunked_loss at micro-batch 8 (no whole logits: what micro-batch 4 could not hold)
    Row("moe-lora-offload-1-chunked", "lora", "zero3_offload", 1, model="deepseek-v2-lite", micro_batch=8, warmup=2,
        steps=4, profile_steps=0, args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT,
                                        "--chunked_loss", "true"), timeout=420),
    # ... resident instead (issue 26 item 1): the routed experts in e4m3 on the GPU (--quantize_experts fp8), one
    # card held to 24 GiB, no offload; and under DDP on every card (only LoRA gradients cross PCIe)
    Row("moe-lora-resident-1", "lora", "single", 1, model="deepseek-v2-lite", micro_batch=8, warmup=2, steps=4,
        args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--chunked_loss", "true",
              "--quantize_experts", "fp8"), timeout=420),
    # ... at micro-batch 4 x 2 (micro-batch 8 took 24.68 GiB by nvidia-smi held to 24 GiB, over a real card, and
    # ran out of memory held to 22.25: runs 20261204T2105Z-resident, 20261204T2135Z-resident22)
    Row("moe-lora-resident-1-mb4", "lora", "single", 1, model="deepseek-v2-lite", micro_batch=4, grad_accum=2,
        warmup=2, steps=4, args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--chunked_loss",
                                 "true", "--quantize_experts", "fp8"), timeout=420),
    # ... with each decoder layer compiled (--compile_layers true; left off by auto beside --quantize_experts until
    # this row says it is faster within memory): the profiled mb4 step was 25% GPU idle on launches. Not measured yet
    Row("moe-lora-resident-1-mb4-compile", "lora", "single", 1, model="deepseek-v2-lite", micro_batch=4, grad_accum=2,
        warmup=3, steps=4, args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--chunked_loss",
                                 "true", "--quantize_experts", "fp8", "--compile_layers", "true"), timeout=600),
    # ... with each packed document's attention alone (varlen: 1.20x uncapped, run 20261206T0640Z-varlen-h100), what
    # the V2-Lite recipe would take once this row has run
    Row("moe-lora-resident-1-mb4-compile-varlen", "lora", "single", 1, model="deepseek-v2-lite", micro_batch=4,
        grad_accum=2, warmup=3, steps=4, args=("--lora_dropout", "0", "--attn_implementation", "varlen", *CKPT,
                                               "--chunked_loss", "true", "--quantize_experts", "fp8",
                                               "--compile_layers", "true"), timeout=600),
    # ... with --fp8: the experts' grouped matmuls in FP8 as held (no bf16 copy per layer: sft/speed/fp8_experts.py)
    # and the MLA/shared-expert projections in FP8
    Row("moe-lora-resident-1-mb4-fp8", "lora", "single", 1, model="deepseek-v2-lite", micro_batch=4, grad_accum=2,
        warmup=2, steps=4, args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--chunked_loss",
                                 "true", "--quantize_experts", "fp8", "--fp8", "true"), timeout=420),
    # ... and at micro-batch 6, between the two (mb4: 21.59 GiB by nvidia-smi at 11,386 tok/s, run 20261205T0235Z-next)
    Row("moe-lora-resident-1-mb6", "lora", "single", 1, model="deepseek-v2-lite", micro_batch=6, warmup=2, steps=4,
        args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--chunked_loss", "true",
              "--quantize_experts", "fp8"), timeout=420),
    Row("moe-lora-resident-ddp", "lora", "ddp", 0, model="deepseek-v2-lite", micro_batch=4, grad_accum=2, warmup=2,
        steps=4,
        args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--chunked_loss", "true",
              "--quantize_experts", "fp8", *NO_UNUSED), scaling_of="moe-lora-resident-1-mb4", timeout=420),
    # ... as the planner plans it now: varlen and compiled layers (1.23x sdpa's on one card held to 24 GiB, run
    # 20261206T0903Z-resident-varlen-h100), beside that one-card row
    Row("moe-lora-resident-ddp-compile-varlen", "lora", "ddp", 0, model="deepseek-v2-lite", micro_batch=4,
        grad_accum=2, warmup=3, steps=4,
        args=("--lora_dropout", "0", "--attn_implementation", "varlen", *CKPT, "--chunked_loss", "true",
              "--quantize_experts", "fp8", "--compile_layers", "true", *NO_UNUSED),
        scaling_of="moe-lora-resident-1-mb4-compile-varlen", timeout=600),
    # ... against expert parallelism through DeepSpeed AutoEP (issue 26 item 2; accelerate_configs/autoep.yaml,
    # ZeRO-0), the experts in bf16, 32 of each layer's 64 on each of 2 cards held to 24 GiB. Per card (V2-Lite:
    # hidden 2048, 27 layers, the first dense, 64 routed experts of 3 x 2048 x 1408, 2 shared, vocab 102,400):
    #   routed experts 26 x 64 x 3 x 2048 x 1408 = 14.40B x 2 B = 28.8 GB (26.8 GiB) / 2 = 13.4 GiB
    #   the rest (MLA 27 x 13.8M, dense MLP 67M, shared experts 26 x 17.3M, embeddings + lm_head 2 x 210M) =
    #   1.31B x 2 B = 2.4 GiB, whole on each card
    #   weights 15.85 GiB; the LoRA adapter (r 16) with its fp32 master and Adam's moments ~0.4 GiB; which leaves
    #   ~7.7 GiB of the 24 for the activations of micro-batch 4 x 2048 (checkpointed, the loss in chunks), one
    #   layer's recomputation and the all-to-all buffers: the resident row's micro-batch, so it can fit. Each rank
    #   builds the whole bf16 model in host RAM first (31 GB each) and keeps its share on the GPU.
    Row("moe-lora-autoep-ddp", "lora", "autoep", 2, model="deepseek-v2-lite", micro_batch=4, grad_accum=2, warmup=2,
        steps=4, args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--chunked_loss", "true"),
        timeout=600),
    # ... with varlen (DeepSpeed's engine takes no compiled layers): AutoEP's best against the resident plan's
    Row("moe-lora-autoep-ddp-varlen", "lora", "autoep", 2, model="deepseek-v2-lite", micro_batch=4, grad_accum=2,
        warmup=2, steps=4, args=("--lora_dropout", "0", "--attn_implementation", "varlen", *CKPT, "--chunked_loss",
                                 "true"), timeout=600),
    # DeepSeek-V2-Lite on TWO 24 GiB cards: ZeRO-3 shards the bf16 base (micro-batch 4 ran out of memory: the
    # logits of MLA models are whole, no Liger; run 20261201T0930Z-x2)
    Row("moe-lora-z3-2", "lora", "zero3", 2, model="deepseek-v2-lite", micro_batch=1, grad_accum=4, warmup=2, steps=4,
        profile_steps=0, args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, *WHOLE_LOGITS),
        timeout=420),
    # issue 27 item 1: long rows on one card held to 24 GiB, each row one conversation of its length; the 4k rows
    # are the reference of the same model in the same run (attention's own FLOPs make ~80% of 4k's tok/s the ideal
    # at 32k). The long rows run the MLP 4,096 tokens at a time; at 32k the checkpoints wait in host RAM too (28-30
    # layers x 32k tokens x hidden x 2 bytes: 6.6-8 GB beside a 14-15 GB base).
    *[Row(f"long-{short}-{n // 1024}k", "lora", model=model, seq_len=n, micro_batch=max(1, 16384 // n), warmup=2,
          steps=4 if n <= 4096 else 3, profile_steps=0, repeat_data=1, long_docs=True, timeout=420,
          args=(*LIGER, "--lora_dropout", "0", *FLEX, *CKPT,
                *(("--mlp_tile_tokens", "4096") if n > 4096 else ()),
                *(("--offload_activations", "true") if n > 16384 else ())))
      for short, model in (("r1", "r1-distill-qwen-7b"), ("llm", "deepseek-llm-7b"))
      for n in (4096, 16384, 32768)],
    # long-r1-32k as the planner and recipes/r1-distill-qwen-7b-long.yaml run it: --fp8 and --compile_layers at auto
    # (on where the GPU allows; the bench turns them off unless a row names them), the compiled layers tracing the
    # tiled MLP (sft/speed/tiled_mlp.py). Its first step's compile at 32k is part of the user's wait. 7,066 tok/s,
    # 0.696 of long-r1-4k, which has neither lever (run 20261205T1120Z-long-h100, an H100)
    Row("long-r1-32k-default", "lora", model="r1-distill-qwen-7b", seq_len=32768, warmup=2, steps=3, profile_steps=0,
        repeat_data=1, long_docs=True, timeout=600,
        args=(*LIGER, "--lora_dropout", "0", *FLEX, *CKPT, "--mlp_tile_tokens", "4096", "--offload_activations", "true",
              "--fp8", "auto", "--compile_layers", "auto")),
    # The recipes as users run them (--config: the recipe's own fast paths and checkpoint settings), on one conversation
    # per row: the 32k recipe (FP8, no compiled layers: the planner's DDP plan, docs/planner.md "Fast paths that do
    # not fit") against the 4k one (FP8 and compiled layers, micro-batch 2, two layers kept whole), the same tokens
    # per optimizer step. Issue 27 item 1's ratio: the plans a user gets at each length. (At 4k, micro-batch 4 with
    # FP8 and compiled layers, predicted 23.4 GiB, ran out of 24 GiB: run 20261205T1315Z-long-h100.)
    Row("long-r1-32k-recipe", "lora", model="r1-distill-qwen-7b", seq_len=32768, grad_accum=2, warmup=1, steps=2,
        profile_steps=0, repeat_data=1, long_docs=True, timeout=600,
        args=("--config", str(REPO / "recipes" / "r1-distill-qwen-7b-long.yaml"))),
    # ... with the eager layers' recompute running the tiled MLP again, as before sft/speed/layer_checkpoint.py marked
    # it (2.875 MLP forwards a step at 8 tiles instead of 2): what the mark saves the recipe, in the same run
    Row("long-r1-32k-recipe-layer-recompute", "lora", model="r1-distill-qwen-7b", seq_len=32768, grad_accum=2,
        warmup=1, steps=2, profile_steps=0, repeat_data=1, long_docs=True, timeout=600,
        args=("--config", str(REPO / "recipes" / "r1-distill-qwen-7b-long.yaml")),
        env=(("SFT_TILED_MLP_LAYER_RECOMPUTE", "1"),)),
    # ... the same pair with sdpa (each row one trace: sdpa's causal kernel, nothing compiled; flex_attention's first
    # step at a new length took 47-58 s at 32k and 285 s at 16k), the quicker pair to run
    *[Row(f"long-r1-32k-recipe-sdpa{name}", "lora", model="r1-distill-qwen-7b", seq_len=32768, grad_accum=2, warmup=1,
          steps=2, profile_steps=0, repeat_data=1, long_docs=True, timeout=480,
          args=("--config", str(REPO / "recipes" / "r1-distill-qwen-7b-long.yaml"), "--attn_implementation", "sdpa"),
          env=env) for name, env in (("", ()), ("-layer-recompute", (("SFT_TILED_MLP_LAYER_RECOMPUTE", "1"),)))],
    Row("long-r1-4k-recipe", "lora", model="r1-distill-qwen-7b", seq_len=4096, micro_batch=2, grad_accum=8, warmup=1,
        steps=2, profile_steps=0, repeat_data=1, long_docs=True, timeout=420,
        args=("--config", str(REPO / "recipes" / "r1-distill-qwen-7b-lora.yaml"))),
    # the same 32k row with sdpa: no compile per shape; one conversation and its padding need no mask but the causal
    # order (the collator's padding continues the last document), so sdpa runs its fused causal kernel
    Row("long-r1-32k-sdpa", "lora", model="r1-distill-qwen-7b", seq_len=32768, warmup=2, steps=3, profile_steps=0,
        repeat_data=1, long_docs=True, timeout=420, args=(*LIGER, "--lora_dropout", "0", "--attn_implementation",
                                                          "sdpa", *CKPT, "--offload_activations", "true",
                                                          "--mlp_tile_tokens", "4096")),
    # ... with FP8 and compiled layers at auto: sdpa compiles nothing per row length (its first step took 17 s where
    # the flex rows took 51-74 s, run 20261205T1315Z-long-h100), and plain sdpa ran 1.12x the plain flex row
    Row("long-r1-32k-sdpa-default", "lora", model="r1-distill-qwen-7b", seq_len=32768, warmup=2, steps=3,
        profile_steps=0, repeat_data=1, long_docs=True, timeout=420,
        args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--offload_activations", "true",
              "--mlp_tile_tokens", "4096", "--fp8", "auto", "--compile_layers", "auto")),
    # ... under varlen, whose rows of one conversation each come without offsets and run sdpa's causal kernel
    # (sft/speed/varlen_attention.py): what packed rows' default attention gives a long trace
    Row("long-r1-32k-varlen-default", "lora", model="r1-distill-qwen-7b", seq_len=32768, warmup=2, steps=3,
        profile_steps=0, repeat_data=1, long_docs=True, timeout=420,
        args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "varlen", *CKPT, "--offload_activations", "true",
              "--mlp_tile_tokens", "4096", "--fp8", "auto", "--compile_layers", "auto")),
    # ... keeping each layer's attention output for the backward instead of recomputing it (sft/speed/kept_attention.py):
    # the compiled layers save it with their checkpoint, so it waits in host RAM beside it (+6.2 GiB host RAM, two
    # layers' worth on the GPU: +0.45 GiB); the recompute skips attention's forward, ~6.6 of ~71 GFLOP a token at 32k
    Row("long-r1-32k-sdpa-keep", "lora", model="r1-distill-qwen-7b", seq_len=32768, warmup=2, steps=3,
        profile_steps=0, repeat_data=1, long_docs=True, timeout=420,
        args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--offload_activations", "true",
              "--mlp_tile_tokens", "4096", "--fp8", "auto", "--compile_layers", "auto",
              "--activation_checkpointing_keep_attention", "true")),
    # ... profiled (one step after the measured ones: top kernels, the GPU's idle time by host op): where the 32k
    # step's time goes besides attention, the kept row being 0.676 of the 4k recipe (run 20261206T0611Z-long-h100)
    Row("long-r1-32k-sdpa-keep-profiled", "lora", model="r1-distill-qwen-7b", seq_len=32768, warmup=2, steps=2,
        profile_steps=1, repeat_data=1, long_docs=True, timeout=480,
        args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--offload_activations", "true",
              "--mlp_tile_tokens", "4096", "--fp8", "auto", "--compile_layers", "auto",
              "--activation_checkpointing_keep_attention", "true")),
    # ... at the 4k recipe's 65,536 tokens per optimizer step (2 x 32k; the long recipe's accumulation too): the
    # optimizer, the clipping and the step's host work once per 65,536 tokens on both sides of issue 27's ratio,
    # where the row above steps every 32,768; and deepseek-llm-7b the same way beside its own recipe at 4k (the
    # issue names both models: llm-7b's 32 key/value heads and hidden 4,096 give attention a larger share)
    *[Row(f"long-{short}-32k-sdpa-keep-ga2", "lora", model=model, seq_len=32768, grad_accum=2, warmup=2, steps=3,
          profile_steps=0, repeat_data=1, long_docs=True, timeout=480,
          args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--offload_activations", "true",
                "--mlp_tile_tokens", "4096", "--fp8", "auto", "--compile_layers", "auto",
                "--activation_checkpointing_keep_attention", "true"))
      for short, model in (("r1", "r1-distill-qwen-7b"), ("llm", "deepseek-llm-7b"))],
    Row("long-llm-4k-recipe", "lora", model="deepseek-llm-7b", seq_len=4096, micro_batch=2, grad_accum=8, warmup=1,
        steps=2, profile_steps=0, repeat_data=1, long_docs=True, timeout=420,
        args=("--config", str(REPO / "recipes" / "deepseek-llm-7b-lora.yaml"))),
    # 16k rows with the fast paths: long-r1-16k (flex_attention, none) took 285 s for its first step where the 32k
    # rows took 47-58 s (run 20261205T1855Z-next-h100): is it flex_attention's compile at 16,384 tokens (sdpa
    # compiles nothing per length), and how do the fast paths run between 4k and 32k
    *[Row(f"long-r1-16k-{name}default", "lora", model="r1-distill-qwen-7b", seq_len=16384, warmup=2, steps=3,
          profile_steps=0, repeat_data=1, long_docs=True, timeout=600,
          args=(*LIGER, "--lora_dropout", "0", "--attn_implementation", attention, *CKPT, "--mlp_tile_tokens", "4096",
                "--fp8", "auto", "--compile_layers", "auto"))
      for name, attention in (("", "flex_attention"), ("sdpa-", "sdpa"))],
    # issue 27 item 2: 65,536-token rows (one conversation each) over 2 cards held to 24 GiB, each row split by
    # --sequence_parallel 2 (DeepSpeed Ulysses under ZeRO-3, which also halves the bf16 base: 7.6 GB a card): each
    # card runs 32k tokens outside attention, as long-r1-32k does on one card (the reference, its own run)
    Row("long-r1-64k-sp2", "lora", "zero3", 2, model="r1-distill-qwen-7b", seq_len=65536, warmup=2, steps=3,
        profile_steps=0, repeat_data=1, long_docs=True, timeout=600,
        args=("--lora_dropout", "0", "--attn_implementation", "sdpa", *CKPT, "--offload_activations", "true",
              "--mlp_tile_tokens", "4096", "--sequence_parallel", "2")),
    # the README's recipes as users run them (--config recipes/<x>.yaml, its accelerate config), on every GPU held to
    # 24 GiB; the bench's options (model, data, steps, length, micro-batch, accumulation) are the recipe's own values
    Row("recipe-coder-lora", "lora", "ddp", 0, model="deepseek-coder-6.7b", micro_batch=4, grad_accum=4, steps=4,
        args=("--config", str(REPO / "recipes" / "deepseek-coder-6.7b-lora.yaml")), timeout=300),
    Row("recipe-r1-lora", "lora", "ddp", 0, model="r1-distill-qwen-7b", seq_len=4096, micro_batch=2, grad_accum=8,
        steps=3, args=("--config", str(REPO / "recipes" / "r1-distill-qwen-7b-lora.yaml")), timeout=300),
    # (run 20261201T0940Z-x2 measured this recipe's first version: zero3.yaml, micro-batch 1 x 16; its rows before
    # --chunked_loss auto ran the whole logits, later ones the loss in chunks, as the recipe runs: they record it)
    Row("recipe-v2-lite-lora", "lora", "zero3_offload", 0, model="deepseek-v2-lite", micro_batch=4, grad_accum=4,
        warmup=1, steps=2, profile_steps=0, args=("--config", str(REPO / "recipes" / "deepseek-v2-lite-lora.yaml")),
        timeout=420),
    # the CPU smoke test: the tiny model, both peers, end to end (sdpa and no Liger: neither runs on a CPU)
    Row("tiny-lora", "lora", model="tiny", seq_len=256, micro_batch=2, mem_cap_gib=0, warmup=1, steps=2,
        profile_steps=0, repeat_data=1, args=("--lora_dropout", "0", "--attn_implementation", "sdpa"),
        vs="trl-tiny-lora"),
    Row("trl-tiny-lora", "lora", peer="trl", model="tiny", seq_len=256, micro_batch=2, mem_cap_gib=0, warmup=1,
        steps=2, profile_steps=0, repeat_data=1, args=trl_args("sdpa", None, 2, 256)),
    Row("tiny-full", "full", model="tiny", seq_len=256, micro_batch=2, mem_cap_gib=0, warmup=1, steps=2,
        profile_steps=0, repeat_data=1, args=("--attn_implementation", "sdpa"), vs="trl-tiny-full"),
    Row("trl-tiny-full", "full", peer="trl", model="tiny", seq_len=256, micro_batch=2, mem_cap_gib=0, warmup=1,
        steps=2, profile_steps=0, repeat_data=1, args=trl_args("sdpa", None, 2, 256, "--optim", "adamw_torch_fused")),
]
ROWS = {row.name: row for row in MATRIX}
assert len(ROWS) == len(MATRIX), "row names must be unique"


@dataclass(frozen=True)
class Script:
    """A check of its own in a group, not a throughput row: `python3 <argv>`, with {run_id}, {results}, {out}, {data}
    and {tokenizer} filled in, stopped after `seconds` (which the budget keeps for it from the rows before it)."""

    name: str
    argv: tuple[str, ...]
    n_gpus: int = 1
    seconds: int = 300
    needs: tuple[str, ...] = ()  # the optional packages it imports

    def command(self, **fields: str) -> list[str]:
        return [sys.executable, *(word.format(**fields) for word in self.argv)]


SCRIPTS = {script.name: script for script in [
    # issue 26 item 4: --qlora under FSDP on 2 GPUs through sft/train.py, past the refusal that this check lifts
    # (bitsandbytes' DDP run beside it only where bitsandbytes is installed: the session's .whl has none)
    Script("fsdp-qlora-check", ("bench/qlora_check.py", "--run_id", "{run_id}", "--fsdp", "two", "--skip_single",
                                "--timeout", "300", "--data", "{data}", "--tokenizer", "{tokenizer}",
                                "--results", "{results}", "--workdir", "{out}/fsdp-qlora-check",
                                "--out", "{out}/fsdp-qlora-check/out"), n_gpus=2, seconds=480, needs=("torchao",)),
    # issue 26 item 4's byte check on one GPU: FSDP2's copies of the NF4 bytes, two ranks on one GPU
    Script("fsdp-qlora-bytes", ("bench/fsdp_qlora_bytes.py", "--run_id", "{run_id}", "--results", "{results}"),
           n_gpus=1, seconds=240, needs=("torchao",)),
    # issue 26 item 3: V2-Lite's experts' grouped matmuls in FP8 on the held e4m3 against their emulation and against
    # the dequantized bf16 path, one MoE layer's forward and backward timed (sft/speed/fp8_experts.py)
    Script("fp8-experts-check", ("bench/fp8_experts_check.py", "--run_id", "{run_id}", "--results", "{results}"),
           n_gpus=1, seconds=120),
    # --attn_implementation varlen's kernel against sdpa with the packed mask: MLA's and grouped heads' shapes
    Script("varlen-check", ("bench/varlen_check.py", "--run_id", "{run_id}", "--results", "{results}"),
           n_gpus=1, seconds=90),
    # issue 27 item 1: a 32k conversation's attention under each of sdpa's kernels (and varlen), which one sdpa picks
    Script("long-attention-check", ("bench/long_attention_check.py", "--run_id", "{run_id}", "--results",
                                    "{results}"), n_gpus=1, seconds=90),
]}
assert not set(SCRIPTS) & set(ROWS), "script and row names must differ"

GROUPS = {
    # one H200, about 8 minutes of GPU time: LoRA and the full fine-tune against TRL, and the 24 GiB-capped LoRA row
    "h200": ["lora-best", "trl-lora-best", "full-sr", "trl-full", "lora-1"],
    "levers": ["full-sr16", "trl-full", "lora-best-fp8", "lora-best", "trl-lora-best"],
    "smoke": ["tiny-lora", "trl-tiny-lora", "tiny-full", "trl-tiny-full"],
    "moe": ["moe-lora", "trl-moe-lora"],
    "resident": ["moe-lora-resident-1-mb4", "moe-lora-resident-1-mb4-fp8", "moe-lora-resident-1-mb4-compile",
                 "moe-lora-resident-1-mb6",
                 "moe-lora-resident-1"],  # issue 26 item 1, one GPU held to 24 GiB
    # two GPUs held to 24 GiB: V2-Lite sharded, DDP scaling of the LoRA plan, the recipes
    "x2": ["moe-lora-z3-2", "lora-1", "lora-ddp", "recipe-coder-lora", "recipe-r1-lora"],  # run 20261201T0930Z-x2
    # issue 30's rows that exist (2026-12-03), on nvidia-h200-x2, each rank held to 24 GiB, with --fresh_cache:
    # the LoRA plan with FP8 and compiled layers under DDP beside its one-GPU row; the full plan (FSDP2, FP8) beside
    # the same plan in bf16 and the peers' ZeRO-3 offload recipe; V2-Lite's plan of today (ZeRO-3 over 2 cards)
    # and (issue 26 item 4) the FSDP QLoRA check, bench/qlora_check.py --fsdp two, which lifts its refusal
    "issue30": ["lora-1-fp8-compile", "lora-ddp-fp8-compile", "full-fsdp-4bit-fp8", "full-fsdp-4bit", "peer-mb1",
                "moe-lora-resident-1-mb4", "moe-lora-resident-ddp", "moe-lora-autoep-ddp", "moe-lora-z3-2",
                "long-r1-32k", "long-r1-64k-sp2", "fsdp-qlora-check",
                # the V2-Lite plan the planner gives now (varlen, compiled layers) under DDP and AutoEP's with varlen
                "moe-lora-resident-1-mb4-compile-varlen", "moe-lora-resident-ddp-compile-varlen",
                "moe-lora-autoep-ddp-varlen"],
    # issue 15 on two or three GPUs held to 24 GiB: the LoRA plan's DDP scaling, the full plan on a fresh machine
    # against the peers' offload recipe (run with --fresh_cache)
    "box": ["lora-1-fp8-compile", "lora-ddp-fp8-compile", "full-fsdp-4bit-fp8", "full-fsdp-4bit", "peer-mb1"],
    "recipes": ["recipe-coder-lora", "recipe-r1-lora", "recipe-v2-lite-lora"],
    # the next GPU session's rows, on an H200 (`needs_h200`: TRL's best takes 95 GiB): LoRA against TRL over 16 steps
    # (issue 28 item 2; 1.93x on an H100 at 4 x 2, run 20261205T1835Z-lora2x-h100), then V2-Lite's levers beside its
    # compiled row and TRL's (issue 26 item 3; the compiled row ran 30.0% MFU on an H100, run 20261205T1855Z-next-h100)
    "next": ["trl-lora-best", "lora-best-default", "lora-best-default-chunked", "moe-lora-compile",
             "moe-lora-compile-flex", "moe-lora-compile-flex-fp8-chunked", "moe-lora-compile-fp8",
             "moe-lora-compile-chunked", "trl-moe-lora"],
    # issue 26 item 4's one-GPU byte check (passed on an H100, run 20261205T1855Z-next-h100): FSDP2's copy and
    # all-gather of the NF4 bytes, bit for bit
    "qlora-bytes": ["fsdp-qlora-bytes"],
    # --compile_layers beside the plain rows and TRL's best, same run (2026-12-01, evening)
    "compile": ["lora-best-fp8-compile", "lora-best-compile", "lora-best", "trl-lora-best", "lora-best-fp8"],
    # why lora-best-compile logged a lower loss with the same gradient norms: not Liger's in-layer kernels
    # (lora-best-flce = lora-best, run 20261202T0245Z-E); flex_attention's masks (the sdpa twins), with
    # bench/compile_check.py --attn flex_attention
    "compile-check": ["lora-best-compile", "lora-best-compile-sdpa", "lora-best-sdpa", "lora-best"],
    "fp8-full": ["trl-full", "full-fp8", "full-fp8-rowwise", "full-sr16", "lora-best-fp8-compile",
                 "lora-best-fp8-compile-eagerround"],
    "defaults": ["trl-lora-best", "lora-best-default"],
    # issue 28 item 2 (LoRA >= 2.0x TRL): the step without host waits (the NaN guard's verdict on the GPU, the token
    # count, the labelled positions and the packed documents from the collator, no NaN filter), the FP8 forward's
    # fast accumulation (the default; the promoted row without it), beside TRL's best; with the loss in torch chunks:
    # no wait left in the step (Liger's `.item()`)
    "lora2x": ["trl-lora-best", "lora-best-default", "lora-best-default-promoted", "lora-best-default-chunked",
               "lora-best-default-chunked-mb12"],
    # the same ratio on an 80 GB H100 (device kind nvidia-h100-x1), each peer at micro-batch 4 x 2, then ours at 8
    # issue 28 item 2 on an H200: TRL's best against ours with flex_attention and with varlen, same run
    "lora2x-varlen": ["trl-lora-best", "lora-best-default-varlen-chunked", "lora-best-default-varlen",
                      "lora-best-default-varlen-chunked-mb12", "lora-best-default", "long-attention-check"],
    "lora2x-h100": ["trl-lora-best-mb4", "lora-best-default-mb4", "lora-best-default"],
    # ... with varlen attention and the loss in chunks, beside the same TRL row and today's default
    "lora2x-h100-varlen": ["trl-lora-best-mb4", "lora-best-default-varlen-chunked-mb4", "lora-best-default-mb4",
                           "lora-best-default-varlen-chunked"],
    # issue 27 item 1 at 16k: the first step's wait (285 s for long-r1-16k's flex_attention) with and without it
    "long16": ["long-r1-16k-sdpa-default", "long-r1-16k-default", "long-r1-16k"],
    # issue 27 item 1's next lever, with its references in the same run: the 4k recipe and the 32k row without it
    "long-keep": ["long-r1-4k-recipe", "long-r1-32k-sdpa-default", "long-r1-32k-sdpa-keep"],
    # issue 27 item 1, one GPU held to 24 GiB (run with --fresh_cache: the first step's compile is the user's wait)
    "long": ["long-r1-4k", "long-r1-32k", "long-llm-4k", "long-llm-32k", "long-r1-16k", "long-llm-16k",
             "long-r1-32k-sdpa", "long-r1-4k-recipe", "long-r1-32k-default", "long-r1-32k-recipe",
             "long-r1-32k-sdpa-default"],
    # issue 26 item 3: V2-Lite's LoRA step uncapped, each lever beside the compiled row and TRL's, same run; and the
    # eager row, whose profiled step's idle_ms says what the balance loss's host waits cost (58.9 ms in run
    # 20261205T0515Z-next, with them)
    # issue 26 item 3: packed rows' attention per document (varlen) beside the compiled rows, TRL's and the kernel check
    "moe-varlen": ["moe-lora-compile-varlen-fp8", "moe-lora-compile-varlen", "moe-lora-compile-fp8", "trl-moe-lora",
                   "varlen-check"],
    "moe-varlen-h200": ["moe-lora-compile-varlen-mb8", "moe-lora-compile-varlen", "trl-moe-lora"],
    # the V2-Lite recipe's resident plan (24 GiB) with varlen, beside its sdpa twin, before the recipe takes it
    "resident-varlen": ["moe-lora-resident-1-mb4-compile-varlen", "moe-lora-resident-1-mb4-compile"],
    # issue 26 item 3's last lever, --lora_experts, checkpointed beside its twin
    "moe-experts": ["moe-lora-ckpt-varlen-experts", "moe-lora-ckpt-varlen"],
    # --lora_experts low-rank (sft/speed/expert_lora.py, not measured yet): the checkpointed pair, then without
    # checkpoints beside its compiled twin and TRL (moe-lora-compile-experts ran out of an 80 GB card with peft's
    # expert-sized delta kept for every layer)
    "experts-split": ["moe-lora-ckpt-varlen-experts", "moe-lora-ckpt-varlen", "moe-lora-compile-experts",
                      "moe-lora-compile", "trl-moe-lora"],
    # issue 28 item 2: inductor's kernel tuning on the compiled step, beside TRL's best that fits an H100
    "lora2x-tuning": ["trl-lora-best-mb4", "lora-best-default-varlen-chunked-mb4",
                      "lora-best-default-varlen-chunked-mb4-cdt", "lora-best-default-varlen-chunked-mb4-pw"],
    # issue 28 item 2 on an H200 with today's default at micro-batch 8 and 12, beside TRL's best (8 x 1)
    # a dense model's packed rows: sdpa (the default without --plan) against varlen, same run
    "dense-attention": ["lora-best-default-sdpa-mb4", "lora-best-default-varlen-mb4"],
    # a dense model's defaults: before (sdpa behind the packed mask, whole logits), the candidate (varlen, the loss in
    # chunks), the README table's options (Liger, flex_attention), TRL's best, at the same 16,384 tokens a step
    # the two levers of the new default apart, what no option gives now, and a long trace under varlen against sdpa
    "dense-default-2": ["lora-best-default-sdpa-whole-mb4", "lora-best-default-varlen-whole-mb4",
                        "lora-best-default-none-mb4", "long-r1-32k-sdpa-default", "long-r1-32k-varlen-default"],
    "r1-default": ["r1-lora-default-sdpa-whole-mb4", "r1-lora-default-none-mb4"],
    # the loss in torch chunks with a frozen lm_head's gradient in the forward (the default without Liger) beside
    # Liger's at the same varlen attention, Liger + flex_attention (the recipes'), TRL's best that fits an H100, ours
    # at micro-batch 8, and R1-Distill's shape
    # inductor's multi-kernel reductions on the defaults at 4 x 2 and 8 x 1, each beside its twin without, and TRL's
    "multi-kernel": ["trl-lora-best-mb4", "lora-best-default-none-mb4", "lora-best-default-none-mb4-mk",
                     "lora-best-default-none", "lora-best-default-none-mk"],
    # the LoRA adapters inside the FP8 matmuls beside the defaults (beside them), and TRL's best that fits an H100
    "frozen-head-loss": ["trl-lora-best-mb4", "lora-best-default-none-mb4", "lora-best-default-varlen-liger-mb4",
                         "lora-best-default-mb4", "lora-best-default-none", "r1-lora-default-none-mb4"],
    "dense-default": ["lora-best-default-sdpa-whole-mb4", "lora-best-default-varlen-chunked-mb4", "lora-best-default-mb4",
                      "trl-lora-best-mb4"],
    "lora2x-h200-default": ["trl-lora-best", "lora-best-default-varlen-chunked", "lora-best-default-varlen-chunked-mb12"],
    "lora2x-tuning-h200": ["trl-lora-best", "lora-best-default-varlen-chunked", "lora-best-default-varlen-chunked-cdt",
                           "lora-best-default-varlen-chunked-pw"],
    # issue 27 item 1's long recipe with and without the marked recompute; issue 28 item 2: flex_attention with the
    # loss in torch chunks at micro-batch 8 against TRL's best on an 80 GB H100 (4 x 2)
    "tile-flex": ["long-r1-32k-recipe", "long-r1-32k-recipe-layer-recompute", "trl-lora-best-mb4",
                  "lora-best-default-flex", "lora-best-default-flex-mb4"],
    # issue 27 item 1: the long recipe (eager layers, tiled MLPs) with and without the marked recompute, beside the 4k
    # recipe and the compiled 32k row of the ratio
    "tile-recompute": ["long-r1-4k-recipe", "long-r1-32k-recipe", "long-r1-32k-recipe-layer-recompute",
                       "long-r1-32k-sdpa-keep-ga2"],
    # issue 27 item 1 for both models at the same tokens per optimizer step as their 4k recipes
    "long-ratio-ga2": ["long-r1-4k-recipe", "long-r1-32k-sdpa-keep-ga2", "long-llm-4k-recipe",
                       "long-llm-32k-sdpa-keep-ga2"],
    # issue 27 item 1: which attention kernel is fastest at 32k, and the kept 32k step's profile
    "long-profile": ["long-attention-check", "long-r1-32k-sdpa-keep-profiled"],
    "moe-levers": ["trl-moe-lora", "moe-lora-compile", "moe-lora-compile-flex", "moe-lora-compile-flex-fp8-chunked",
                   "moe-lora-compile-fp8-experts", "moe-lora-compile-flex-fp8-chunked-experts", "moe-lora-compile-fp8",
                   "moe-lora-compile-chunked", "moe-lora-compile-experts", "moe-lora", "fp8-experts-check"],
    "compile-full": ["full-sr16-compile", "full-sr16", "trl-full", "lora-1-fp8-compile", "lora-1-compile", "lora-1"],
    # bench/run_matrix.sh's groups
    "lora": ["lora-1", "lora-ddp"], "lora-ckpt": ["lora-1-ckpt", "lora-ddp-ckpt"],
    "full": ["full-fsdp-4bit", "full-fsdp-8bit"], "full4": ["full-fsdp-4bit"], "full8": ["full-fsdp-8bit"],
    "full22": ["full-fsdp-4bit-cap22"], "peer": ["peer-mb1", "peer-mb2"], "peer1": ["peer-mb1"],
    "peer2": ["peer-mb2"], "zero2": ["lora-zero2-fp16"], "tp": ["fsdp-1.3b", "tp-1.3b"],
    "tpfast": ["fsdp-1.3b-flex", "tp-1.3b-flex"], "tp8": ["fsdp-1.3b-mb8", "tp-1.3b-mb8"],
    "matrix": ["lora-1", "lora-ddp", "full-fsdp-4bit", "full-fsdp-8bit", "peer-mb1", "peer-mb2", "lora-zero2-fp16"],
    # bench/lora_variants.sh's default
    "variants": ["lora-1-flex-mb1", "lora-1-flex-mb2-ckpt"],
}


def fail(message: str):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def select(spec: str) -> list[Row | Script]:
    """Row, script and group names, comma- or space-separated, in order, each once."""
    names: list[str] = []
    for word in spec.replace(",", " ").split():
        if word not in ROWS and word not in SCRIPTS and word not in GROUPS:
            fail(f"--rows: no row or group named {word!r} (python bench/throughput.py --list)")
        names += [n for n in GROUPS.get(word, [word]) if n not in names]
    return [ROWS.get(n) or SCRIPTS[n] for n in names]


def needs(row: Row) -> list[str]:
    """The optional packages the row imports."""
    words = set(row.args + row.optim)
    return [module for module, needed in (
        ("trl", row.peer == "trl"),
        ("liger_kernel", "--use_liger_kernel" in words),
        ("torchao", any(w.startswith(("adamw_torch_4bit", "adamw_torch_8bit")) for w in words)),
        ("deepspeed", row.strategy.startswith("zero") or row.strategy == "autoep"),
        ("bitsandbytes", row.method == "qlora"),
    ) if needed]


def why_not(row: Row | Script, gpus: int, gpu_gib: float = math.inf) -> str | None:
    """Why this machine (`gpus` GPUs of `gpu_gib` each) cannot run the row (or script), or None."""
    if isinstance(row, Script):
        missing = [m for m in row.needs if find_spec(m) is None]
        return (f"not installed: {', '.join(missing)}" if missing else
                "needs a GPU" if not gpus else f"needs {row.n_gpus} GPUs, {gpus} visible" if row.n_gpus > gpus
                else None)
    missing = [m for m in needs(row) if find_spec(m) is None]
    if missing:
        return f"not installed: {', '.join(missing)}"
    if row.model != "tiny" and not gpus:
        return f"the {row.model} shape needs a GPU"
    if row.long_docs and row.peer == "trl":
        return "long-document rows are ours only (TRL reads the Alpaca file)"
    if row.n_gpus > max(gpus, 1):
        return f"needs {row.n_gpus} GPUs, {gpus} visible"
    if row.needs_gib > gpu_gib:
        return f"took {row.needs_gib:g} GiB of GPU memory where it ran, this GPU has {gpu_gib:.1f}"
    return None


def row_flags(row: Row, args, n_gpus: int, data: Path, tokenizer: Path, timeout: float) -> list[str]:
    """bench/train_throughput.py's options for the row (its training options, row.args + row.optim, follow `--`)."""
    cap = row.mem_cap_gib if args.mem_cap_gib is None else args.mem_cap_gib
    profiled = row.profile_steps if args.profile_steps is None else args.profile_steps
    flags = dict(run_id=args.run_id, name=row.name, model=row.model, method=row.method, strategy=row.strategy,
                 peer=row.peer, n_gpus=n_gpus, precision=row.precision, seq_len=row.seq_len,
                 micro_batch=row.micro_batch, grad_accum=row.grad_accum, warmup=row.warmup, steps=row.steps,
                 profile_steps=profiled, mem_cap_gib=cap, data=data, repeat_data=row.repeat_data,
                 tokenizer=tokenizer, results=args.results, out=args.out, timeout=int(timeout), vs=row.vs,
                 scaling_of=row.scaling_of)
    return [w for k, v in flags.items() if v is not None for w in (f"--{k}", str(v))] + (
        ["--fresh_cache"] if args.fresh_cache else [])


def long_data(row: Row, n_gpus: int, data: Path, tokenizer: Path, out: Path) -> Path:
    """The row's file of conversations of about row.seq_len tokens: enough for every step of every rank, twice."""
    count = 2 * (row.warmup + row.steps + row.profile_steps + 1) * row.micro_batch * row.grad_accum * n_gpus
    return long_docs.write_long_conversations(data, tokenizer, row.seq_len, count,
                                              out / f"long-{row.seq_len}-{count}.jsonl")


def resolve_data(args) -> tuple[Path, Path]:
    """(data file, tokenizer directory): --data/--tokenizer, else ../shared's, else --data_dir's."""
    data_dir = Path(args.data_dir)
    data = Path(args.data) if args.data else next(
        (p for p in (SHARED_DATA, data_dir / "alpaca_sample.json") if p.is_file()), None)
    tokenizer = Path(args.tokenizer) if args.tokenizer else next(
        (p for p in (SHARED_TOKENIZER, data_dir / "tokenizer") if (p / "tokenizer.json").is_file()), None)
    if data is None or not data.is_file() or tokenizer is None or not (tokenizer / "tokenizer.json").is_file():
        fail(f"no bench data: neither {SHARED_DATA} and {SHARED_TOKENIZER} nor {data_dir}/alpaca_sample.json and "
             f"{data_dir}/tokenizer/ exist (or --data/--tokenizer name a missing file). Where ../shared exists: "
             f"python bench/throughput.py --prepare DIR, then carry DIR and give --data_dir DIR.")
    return data, tokenizer


def prepare(target: Path) -> int:
    """Copy the data and tokenizer into `target` and print the command for the lent GPU machines."""
    if not SHARED_DATA.is_file() or not (SHARED_TOKENIZER / "tokenizer.json").is_file():
        fail(f"--prepare copies {SHARED_DATA} and {SHARED_TOKENIZER}: not found")
    (target / "tokenizer").mkdir(parents=True, exist_ok=True)
    shutil.copy2(SHARED_DATA, target / "alpaca_sample.json")
    for f in SHARED_TOKENIZER.glob("tokenizer*.json"):
        shutil.copy2(f, target / "tokenizer" / f.name)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(f"{target}: alpaca_sample.json and tokenizer/ ({size / 2**20:.1f} MiB)")
    if Path(relative(target)).is_absolute():
        print("note: the device tool carries folders of the checkout only (e.g. --prepare .benchdata)")
    print(f"GPU command (device tool, carry [\"{relative(target)}\", \".whl\"]):\n  {gpu_command(target)}")
    return 0


def relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def gpu_command(target: Path, rows: str = "h200", budget_s: int = 540) -> str:
    """The lent GPU machines (torch there; no datasets, trl, liger, torchao: the wheels of .whl, which
    ../shared/tools/device-wheels.sh fills, installed into /tmp/site). The rows come back in $OUT/results.jsonl,
    the logs in $OUT/bench-logs.tgz."""
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl "
            "&& export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false "
            f"NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 BENCH_COMMIT={commit}-dirty "
            f"&& python3 bench/throughput.py --rows {rows} --data_dir {relative(target)} --budget_s {budget_s} "
            "--results $OUT/results.jsonl --out /tmp/bench; "
            "tar czf $OUT/bench-logs.tgz -C /tmp/bench --exclude=dataset-cache --exclude=models --exclude=output .")


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", help="Rows and groups (--list), comma- or space-separated, run in this order. Default: "
                                  "h200 with a GPU, smoke without.")
    p.add_argument("--run_id", default=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-throughput")
    p.add_argument("--budget_s", type=float, default=3600, help="Seconds for all rows; a row starts only with "
                                                                "60 s left, and stops when the budget is spent.")
    p.add_argument("--mem_cap_gib", type=float, help="Every row's per-rank allocator cap instead of its own (0: none).")
    p.add_argument("--profile_steps", type=int, help="Every row's profiled steps (after the measured ones) instead of "
                                                     "its own: the first follows a synchronize, the others are steady "
                                                     "steps, as the measured ones ran.")
    p.add_argument("--num_processes", type=int, help="GPUs of the multi-GPU rows (default: every visible GPU).")
    p.add_argument("--fresh_cache", action="store_true",
                   help="Every row starts with new, empty compile caches: the first run on a fresh machine.")
    p.add_argument("--data", help=f"Alpaca JSON (default: {SHARED_DATA}, else DATA_DIR/alpaca_sample.json).")
    p.add_argument("--tokenizer", help=f"Tokenizer directory (default: {SHARED_TOKENIZER}, else DATA_DIR/tokenizer).")
    p.add_argument("--data_dir", default=str(REPO / ".benchdata"), help="Where --prepare put the data and tokenizer.")
    p.add_argument("--prepare", metavar="DIR", help="Copy the data and tokenizer into DIR (to carry to a machine "
                                                    "without ../shared) and print the GPU command; train nothing.")
    p.add_argument("--results", default=str(one.RESULTS))
    p.add_argument("--out", help="Logs and outputs (default: output/bench/RUN_ID).")
    p.add_argument("--list", action="store_true", help="Print the rows and groups.")
    args = p.parse_args(argv)
    args.out = args.out or str(REPO / "output" / "bench" / args.run_id)
    return args


def list_rows() -> None:
    for row in MATRIX:
        words = " ".join(shlex.quote(w) for w in row.args + row.optim)
        print(f"{row.name:28} {row.peer:20} {row.method:5} {row.strategy:13} gpus {row.n_gpus or 'all'} "
              f"mb {row.micro_batch}x{row.grad_accum} cap {row.mem_cap_gib or '-'} {row.model}: {words}")
    for script in SCRIPTS.values():
        print(f"{script.name:28} {'script':20} gpus {script.n_gpus} at most {script.seconds} s: "
              f"{shlex.join(script.argv)}")
    for group, names in GROUPS.items():
        print(f"group {group}: {' '.join(names)}")


def run_script(script: Script, command: list[str], out: Path, timeout: float) -> bool:
    """Run a group's check script, its output in OUT/<name>.log; print its PASS/FAIL lines. -> it passed."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{script.name}.log"
    print(f"[throughput] {script.name}: {shlex.join(command[1:])} (at most {timeout:.0f} s)", flush=True)
    started = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its launched ranks with it
            proc.wait()
            rc = "timeout"
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(("PASS", "FAIL")):
            print(f"[throughput] {script.name}: {line[:300]}", flush=True)
    print(f"[throughput] {script.name}: exit {rc} after {time.monotonic() - started:.0f} s ({log})", flush=True)
    return rc == 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        list_rows()
        return 0
    if args.prepare:
        return prepare(Path(args.prepare))
    import torch

    gpus = torch.cuda.device_count()
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpus else math.inf
    rows = select(args.rows or ("h200" if gpus else "smoke"))
    data, tokenizer = resolve_data(args)
    deadline = time.monotonic() + args.budget_s
    print(f"run_id {args.run_id}: {len(rows)} rows, {gpus} GPU(s) visible, data {data}, out {args.out}", flush=True)
    not_run = []
    runnable = {row.name for row in rows if why_not(row, gpus, gpu_gib) is None}
    for i, row in enumerate(rows):
        kept = sum(s.seconds for s in rows[i + 1:] if isinstance(s, Script) and s.name in runnable)  # for the scripts
        left = deadline - time.monotonic() - 10 - kept
        reason = why_not(row, gpus, gpu_gib) or (
            "budget spent" if left < (row.seconds if isinstance(row, Script) else 60) else None)
        if reason:
            print(f"[throughput] {row.name}: not run ({reason})", flush=True)
            not_run.append(f"{row.name} ({reason})")
            runnable.discard(row.name)
            continue
        if isinstance(row, Script):
            fields = dict(run_id=args.run_id, results=args.results, out=args.out, data=data, tokenizer=tokenizer)
            if not run_script(row, row.command(**{k: str(v) for k, v in fields.items()}), Path(args.out), left):
                not_run.append(f"{row.name} (failed)")
            continue
        n = row.n_gpus or args.num_processes or max(gpus, 1)
        row_data = long_data(row, n, data, tokenizer, Path(args.out)) if row.long_docs else data
        step = one.parser().parse_args(row_flags(row, args, n, row_data, tokenizer, min(row.timeout, left)))
        step.train_args_text = shlex.join(row.args + row.optim)
        if one.run_row(step, list(row.args + row.optim), dict(row.env)) is None:
            not_run.append(f"{row.name} (failed)")
    results = [r for r in report.load(Path(args.results)) if r.get("run_id") == args.run_id
               and r.get("real_tok_s") is not None]  # the throughput rows (a byte check's row has none)
    if results:
        print(report.table(results), flush=True)
    for line in report.ratios(results):
        print(line, flush=True)
    if not_run:
        print(f"not run: {'; '.join(not_run)}", flush=True)
    return 0 if not not_run else 1


if __name__ == "__main__":
    sys.exit(main())
