"""The measured rows: bench/results.jsonl (RESULTS, in a checkout only) and what the planner reads of each row: its
model's Shape, its sft/train.py options (its recipe's first), its Workload and fast paths, whether the planner plans
its kind (measured_rows), and its own nvidia-smi peak (smi_of_row).

Below what reads the rows: the speed model (sft/plan/speed.py), the fit of the snapshot (sft/plan/refit.py) and
`--check` (sft/plan/bench_check.py); plans never read them (they read the snapshot).
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path

from sft.configs import RECIPES
from sft.options.recipe import load_recipe
from sft.parallel.strategies import PRECISION_OPTIONS, REPO, Setup
from sft.plan import resident, sequence_parallel
from sft.plan.fast_paths import Asked, FastPaths, described_machine, fast_paths, loss_in_chunks_by_default
from sft.plan.kernels import kernels
from sft.plan.long_rows import is_long, is_long_document_row
from sft.plan.shapes import SHAPES, Shape, shape_name
from sft.plan.workload import Workload

RESULTS = REPO / "bench" / "results.jsonl"  # the source of truth, in a checkout only


def row_shape(row: dict) -> Shape:
    """The built-in shape of a bench row's model (bench/train_throughput.py MODELS, either spelling)."""
    return SHAPES[shape_name(row["model"])]

STRATEGY_OF_ROW = {"single": "single_gpu"}
# Commits of bench rows that ran before 51be3c5 (peft's fp32 input casts under autocast); fp16 ZeRO-2 rows never
# had them (DeepSpeed's fp16 engine holds the adapter in fp16). From `git log`.
PEFT_CAST_COMMITS = {"b2e66a6", "9a66dc6", "1a37de6", "54b7c4e", "606734a"}
# Rows dated before this (162167b) ran the tiles of an eager checkpointed layer in its recompute too; rows named
# -layer-recompute still do (SFT_TILED_MLP_LAYER_RECOMPUTE=1). From `git log`.
TILES_MARKED_SINCE = "2026-12-06T20:41:33Z"
# Rows dated before this (ca1f7e7) computed a MoE model's LoRA on its MLP weights as peft's W + B @ A, a new weight
# per adapted layer kept for the backward (sft/plan/memory.py); since, low-rank (sft/speed/traced_param_lora.py).
MLP_LORA_LOW_RANK_SINCE = "2026-12-07T03:25:00Z"


def option_value(args: list[str], name: str, default=None):
    """The option's last value (a recipe's options come first, the command line's win)."""
    if name in args:
        i = len(args) - 1 - args[::-1].index(name)
        return args[i + 1] if i + 1 < len(args) else default
    return default


# What a recipe held when a bench row ran it, where the shipped recipe has changed since ((run_id, row name) ->
# options): r1-distill-qwen-7b-lora kept 3 layers whole until the compiled layers' memory was planned (issue 28);
# r1-distill-qwen-7b-long ran flex_attention until 2026-12-07.
RECIPE_AS_RUN = {("20261201T0930Z-x2", "recipe-r1-lora"): ("--activation_checkpointing_skip_layers", "3"),
                 ("20261205T1845Z-long-h100", "long-r1-32k-recipe"): ("--attn_implementation", "flex_attention")}


def row_options(row: dict) -> list[str]:
    """The sft/train.py options of a bench row: its recipe's (`--config recipes/<x>.yaml`, the shipped recipe of that
    name, wherever the row ran, as it was then: RECIPE_AS_RUN) before its own."""
    as_run = RECIPE_AS_RUN.get((row.get("run_id"), row.get("name")), ())
    return list(_options(row.get("train_args") or "", as_run))


@functools.lru_cache(maxsize=None)
def _options(train_args: str, as_run: tuple[str, ...] = ()) -> tuple[str, ...]:  # every plan reads every row: once
    args = shlex.split(train_args)
    recipe = option_value(args, "--config")
    return tuple((load_recipe(str(RECIPES / Path(recipe).name)) if recipe else []) + list(as_run) + args)


def workload_of_row(row: dict) -> Workload:
    args = row_options(row)
    strategy = STRATEGY_OF_ROW.get(row["strategy"], row["strategy"])
    optim = option_value(args, "--optim", "")
    precision = next((k for k, v in PRECISION_OPTIONS.items() if v and v["optim"] == optim), "fp32_master")
    cast = row["method"] == "lora" and option_value(args, "--dtype") != "float16" and (
        row.get("commit", "").split("-")[0] in PEFT_CAST_COMMITS or row.get("name", "").endswith("-peftcast"))
    fast = fast_of_row(row)
    size = int(option_value(args, sequence_parallel.OPTION, 1))
    fused = option_value(args, "--use_liger_kernel", "false") == "true"
    return Workload(strategy=strategy, setup=Setup(row["method"], precision), world=row["n_gpus"],
                    peft_input_cast=cast,
                    micro_batch=row["micro_batch"], seq_len=row["seq_len"],
                    checkpointing=option_value(args, "--activation_checkpointing", "false") == "true",
                    skip_layers=int(option_value(args, "--activation_checkpointing_skip_layers", 0)),
                    fused_loss=fused,
                    grad_accum=row.get("grad_accum", 1), fp8=fast.fp8, compiled=fast.compiled,
                    mlp_tile_tokens=int(option_value(args, "--mlp_tile_tokens", 0)),
                    tiles_in_layer_recompute=not fast.compiled and tiles_in_layer_recompute_of_row(row),
                    merged_mlp_lora=row.get("date", MLP_LORA_LOW_RANK_SINCE) < MLP_LORA_LOW_RANK_SINCE,
                    offload_activations=option_value(args, "--offload_activations", "false") == "true",
                    keep_attention=option_value(args, "--activation_checkpointing_keep_attention", "false") == "true",
                    # the loss in chunks: as the row ran it, and always under --sequence_parallel (sft/train.py)
                    chunked_loss=loss_in_chunks_of_row(row, args, strategy, fused) or size > 1,
                    resident=resident.is_resident_row(args), sequence_parallel=size)


def tiles_in_layer_recompute_of_row(row: dict) -> bool:
    """Whether an eager row's layer recompute ran its tiled MLP's tiles too (sft/plan/long_rows.py counts their
    FLOPs): before the recompute was marked, or under the bench's switch that unmarks it."""
    dated = row.get("date")  # a row without a date is made up (tests): today's code
    return (dated is not None and dated < TILES_MARKED_SINCE) or row.get("name", "").endswith("-layer-recompute")


def loss_in_chunks_of_row(row: dict, args: list[str], strategy: str, fused_loss: bool) -> bool:
    """Whether a bench row computed its loss in chunks: what it recorded (`loss_in_chunks`, read off its trainer by
    bench/train_throughput.py), else its --chunked_loss (`auto` as the run's rule settles it), else false: a row that
    records neither ran before `auto` became the default, with whole logits unless it named the option."""
    if row.get("loss_in_chunks") is not None:
        return bool(row["loss_in_chunks"])
    if "--chunked_loss" not in args:
        return False
    value = option_value(args, "--chunked_loss", "true")  # a bare flag last: true
    if value == "auto":
        return loss_in_chunks_by_default(strategy, row["n_gpus"], row["method"], fused_loss)
    return value != "false"  # true, or a bare flag with another option after it


def attention_of_row(row: dict) -> tuple[str, str]:
    """-> (the attention the row ran, the one the planner plans for its strategy and model). The row's record
    (`attention`, read off its model by bench/train_throughput.py) where it has one, else its option, else the
    planned one."""
    w = workload_of_row(row)
    long_rows = is_long(w.seq_len) and is_long_document_row(row)
    planned = kernels(w.strategy, row_shape(row), w.sequence_parallel, long_rows)["attn_implementation"]
    ran = row.get("attention") or option_value(row_options(row), "--attn_implementation", planned)
    if long_rows and ran == "sdpa" and planned == "varlen":  # one conversation a row: varlen runs sdpa's causal kernel
        ran = "varlen"
    return ran, planned


def ran_planned_attention(row: dict) -> bool:
    """Whether the row ran the attention the planner plans for its strategy and model."""
    ran, planned = attention_of_row(row)
    return ran == planned


def split_size(row: dict) -> int:
    """The N a bench row split each row over (--sequence_parallel N: such rows speak for SP plans only); 1: none."""
    return int(option_value(row_options(row), sequence_parallel.OPTION, 1))


def fast_of_row(row: dict) -> FastPaths:
    """The fast paths a bench row ran with: what its model held (fp8_layers, compiled_layers: rows since
    2026-12-05 16:00 UTC record them), else its --fp8 and --compile_layers (false where it names neither: the bench
    passed false before a row's own options, and rows from before the `auto` default ran without them), as the
    run's own rule settles them on the row's GPU and strategy (`auto` included)."""
    as_run = RECIPE_AS_RUN.get((row.get("run_id"), row.get("name")), ())
    return _fast_of_row(row.get("train_args") or "", as_run, row.get("fp8_layers"), row.get("compiled_layers"),
                        row["strategy"], row.get("gpu") or "", row["n_gpus"], row["method"])


@functools.lru_cache(maxsize=None)  # a refit asks it of every row some hundred thousand times
def _fast_of_row(train_args: str, as_run: tuple[str, ...], fp8_layers: int | None, compiled_layers: int | None,
                 strategy: str, gpu: str, n_gpus: int, method: str) -> FastPaths:
    args = _options(train_args, as_run)
    if fp8_layers is not None and compiled_layers is not None:
        fp8, compiled = ("true" if held else "false" for held in (fp8_layers, compiled_layers))
    else:
        fp8, compiled = option_value(args, "--fp8", "false"), option_value(args, "--compile_layers", "false")
    asked = Asked(fp8, compiled, option_value(args, "--torch_compile", "false") == "true")
    strategy = STRATEGY_OF_ROW.get(strategy, strategy)
    return fast_paths(described_machine(gpu, n_gpus, 0.0), strategy, n_gpus, method, asked,
                      "fp8" if resident.is_resident_row(list(args)) else "none")


def bench_rows(path: Path = RESULTS) -> list[dict]:
    """The file's rows, parsed once per version of it (a refit reads them hundreds of times); copies, for callers
    that add to a row."""
    if not path.exists():
        return []
    stat = path.stat()
    return [dict(r) for r in _parsed_rows(str(path), (stat.st_ino, stat.st_mtime_ns, stat.st_size))]


@functools.lru_cache(maxsize=16)
def _parsed_rows(path: str, version: tuple[int, int, int]) -> tuple[dict, ...]:
    return tuple(json.loads(x) for x in Path(path).read_text().splitlines() if x.strip())


def measured_rows(path: Path = RESULTS) -> list[dict]:
    """The GPU rows of our own training code (the peers' offload recipe runs it too; TRL's rows do not), less those
    of a --liger_kernel_config or an --fp8_recipe of their own, which the planner does not plan (eager layers
    without Liger's RMSNorm and SwiGLU keep their buffers: +21 GiB, lora-best-flce of run 20261202T0245Z-E; the
    planner's FP8 is the default recipe), or of --lora_experts, whose adapters on the routed experts the planner does
    not count (+4.8 GiB reserved and 0.40x the speed of its twin on V2-Lite at micro-batch 4: run
    20261206T0933Z-experts-long-h100). Rows of the fast paths (--fp8, --compile_layers) are in: their own memory term
    (fast_path_bytes) and MFU (mfu_reference) are fitted on them."""
    unplanned = ("--liger_kernel_config", "--fp8_recipe", "--lora_experts true")
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
