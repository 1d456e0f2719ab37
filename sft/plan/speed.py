"""The speed model: a plan's tokens/s (tokens_per_second), from the measured MFU of the bench rows of its kind
(mfu_reference: strategy family, method, checkpointing and fast paths; the long-document rows for long plans, the
resident rows for resident plans, the rows split over ranks for SP plans) over its FLOPs per token on active
parameters, the routed experts weighted by their measured cost (routed_expert_cost). Plans read the MFU from the
snapshot (sft/plan/snapshot.py); given a results file (`path`), it is read from that file's rows, which is what
sft/plan/refit.py fits the snapshot with.

Above the rows (sft/plan/rows.py) and the sub-plans whose notes it adds (an unmeasured AutoEP or SP plan says so:
expert_parallel.UNMEASURED, sequence_parallel.UNMEASURED), below the plans.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from sft.plan import expert_parallel, resident, sequence_parallel, snapshot
from sft.plan.fast_paths import NAMES as FAST_PATH_NAMES
from sft.plan.long_rows import is_long, is_long_document_row, long_row_flops_per_token
from sft.plan.rows import (RESULTS, STRATEGY_OF_ROW, bench_rows, fast_of_row, measured_rows, option_value,
                           ran_planned_attention, row_options, row_shape, split_size, workload_of_row)
from sft.plan.shapes import Shape, shape_name
from sft.plan.snapshot import ANY_MODEL
from sft.plan.workload import Workload


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
        table = snapshot.fitted()["mfu"]
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
        table = snapshot.fitted()["mfu"]
        return mfu_key(expert_parallel.STRATEGY, method, checkpointing, fast, long) in table.get(model,
                                                                                                table[ANY_MODEL])
    rows = long_mfu_rows(path, model) if long else mfu_rows(path, model)
    return any(row_kind(r)[0] == "autoep" for r in rows)


def _long_mfu(strategy: str, method: str, checkpointing: bool, path: Path, model: str | None,
              fast: str) -> tuple[float, str]:
    """mfu_reference of a long plan: the long-document rows of its strategy family and method, else the short
    rows' MFU (which the plan's FLOPs then divide with the long row's attention counted: a slower estimate)."""
    rows = long_mfu_rows(path, model)
    lora = method in ("lora", "qlora")
    if not any(row_kind(r)[:2] == (FAMILY[strategy], lora) for r in rows):
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
        table = snapshot.fitted()["mfu"]
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
        any(row_kind(r)[:2] == (FAMILY[strategy], lora) for r in rows) else []


def _resident_mfu(strategy: str, checkpointing: bool, path: Path | None, model: str | None,
                  fast: str) -> tuple[float, str]:
    """mfu_reference of a resident plan: from the snapshot, or from the rows that ran with --quantize_experts fp8
    (this model's, else any MoE model's, said so), with these fast paths where some did, else without them; a
    LoRA plan's MFU where no row ran with it."""
    if path is None:
        table = snapshot.fitted()["mfu"]
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
    # the attention the plan runs (varlen: 1.23x sdpa's compiled resident row in one run) where a row ran it
    with_them = [r for r in with_them if ran_planned_attention(r)] or with_them
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
    recomputation (long_rows.long_row_flops_per_token), so that 4k and 32k rows of one run read alike. Only rows of
    the attention the planner plans for them (varlen at 16k and 32k, whose one-conversation rows run sdpa's fused
    causal kernel; flex_attention at 4k): at 32k attention is a large share of the step, and that kernel
    (long-r1-32k-sdpa, run 20261205T1315Z-long-h100) ran 1.12x the flex_attention row of run 1120Z."""
    return [r for r in _counted_as_long(_mfu_candidates(path, model)) if ran_planned_attention(r)]


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
    which speak for SP plans only (split_mfu_rows). Not the rows that kept attention outputs for the backward
    (--activation_checkpointing_keep_attention): no plan does that (sft/plan/long_rows.py kept_attention_bytes)."""
    return [r for r in measured_rows(path) if r.get("mfu") and r.get("peer") in ("ours", "zero3-offload-recipe")
            and (split_size(r) > 1) == split
            and "--torch_compile" not in (r.get("train_args") or "") and not workload_of_row(r).keep_attention
            and not any(mark in (r.get("notes") or "") for mark in ("NOT a 1-GPU number", "INVALID"))]


def fast_mfu_rows(rows: list[dict], strategy: str, method: str, fast: str) -> list[dict]:
    """Of `rows`, those that ran with exactly these fast paths, where some are of the plan's strategy family and
    method (else none: another family's speed-up is not this one's)."""
    with_them = [r for r in rows if fast_of_row(r).label == fast]
    lora = method in ("lora", "qlora")
    return with_them if any(row_kind(r)[:2] == (FAMILY[strategy], lora) for r in with_them) else []


def row_kind(r: dict) -> tuple[str, bool, bool]:
    """A row's (strategy family, LoRA, checkpointing): a QLoRA row is a LoRA row (its adapter is all that trains),
    never a full fine-tune's."""
    s = STRATEGY_OF_ROW.get(r["strategy"], r["strategy"])
    return FAMILY[s], r["method"] in ("lora", "qlora"), option_value(row_options(r), "--activation_checkpointing") == "true"


def _median_mfu(rows: list[dict], strategy: str, method: str, checkpointing: bool,
                model: str | None) -> tuple[float, str]:
    lora = method in ("lora", "qlora")
    options = {id(r): row_options(r) for r in rows}
    want = (FAMILY[strategy], lora, checkpointing)
    found = [r for r in rows if row_kind(r) == want]
    kernels_rows = [r for r in found if "flex_attention" in options[id(r)] or "liger" in " ".join(options[id(r)])]
    found = kernels_rows or found
    found = [r for r in found if row_shape(r).name == model] or found  # the same model's rows where there are some
    note, scale = "", 1.0
    if not found:  # the other checkpointing setting, its MFU scaled by the forward that checkpointing recomputes
        found = [r for r in rows if row_kind(r)[:2] == want[:2]]
        # a step does 4N (LoRA) or 6N (full) FLOPs per token, plus 2N recomputed under checkpointing
        recompute = (4 + 2) / 4 if lora else (6 + 2) / 6
        scale = 1 / recompute if checkpointing else recompute
        if want[0] == "zero3_offload":  # bound by the weights streamed from host RAM, not by the recomputed forward
            scale = 1.0
        note = f" (no row with checkpointing {'on' if checkpointing else 'off'}: x{scale:.2f} for the recomputation)"
    if not found:  # nearest kind: FSDP's for the sharded strategies
        found, scale = [r for r in rows if row_kind(r)[0] == want[0]], 1.0
        note = " (no row of this kind: nearest kind)"
    if not found:
        return 0.05, "no measured row: assumed 5%"
    mfu = statistics.median(r["mfu"] for r in found) * scale
    names = sorted({r["name"] for r in found})
    why = f"median MFU {mfu:.1%} of {len(found)} rows ({', '.join(names)}){note}"
    # A sharded or offloaded plan streams every parameter for each micro-batch: where this model has no row of the
    # plan's kind but a row of another such kind, that row bounds it (DeepSeek-V2-Lite under ZeRO-3 measured 1.1%,
    # where the dense offload rows would promise 4.3% for its offload plans: an MoE moves 6.5x its active weights).
    own = [r for r in rows if model and row_shape(r).name == model and row_kind(r)[0] in ("fsdp", "zero3_offload")
           and row_kind(r)[1] == lora]
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
    costs = snapshot.fitted()["routed_expert_cost"] if path is None else expert_costs(path)
    found = costs.get(layer_key(shape.hidden, shape.routed_experts, shape.experts_per_token, shape.moe_intermediate))
    if not found:
        return 1.0, "; routed experts costed as a dense MLP (no bench/moe_layer.py row of this layer)"
    cost, gpu = found
    return cost, (f"; routed experts at {cost:.2f}x the time of a dense MLP of their active FLOPs "
                  f"(bench/moe_layer.py, {gpu})")


def mfu_key(strategy: str, method: str, checkpointing: bool, fast: str = "", long: bool = False,
            resident_experts: bool = False, sequence_parallel_size: int = 1) -> str:
    """The snapshot's key of a kind of plan: what mfu_reference reads of its arguments (QLoRA's is LoRA's), its
    fast paths (FastPaths.label) where it has any, `long` for plans of long rows, `resident` for resident
    plans (--quantize_experts fp8) and `sp<N>` for SP plans (--sequence_parallel N)."""
    return (f"{strategy} {'lora' if method in ('lora', 'qlora') else 'full'} {'ckpt' if checkpointing else 'no-ckpt'}"
            + (f" {fast}" if fast else "") + (" long" if long else "") + (" resident" if resident_experts else "")
            + (f" sp{sequence_parallel_size}" if sequence_parallel_size > 1 else ""))


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
