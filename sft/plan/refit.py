"""The snapshot's numbers, fitted from bench/results.jsonl (`python -m sft.plan.planner --write_snapshot` writes
sft/plan/fitted.json): the MFU of every kind of plan, for each model with bench rows and for any other (the speed
model asked of the rows: sft/plan/speed.py), what the fast paths do to memory (fast_path_memory: their rows against
their twins without them, less what the memory model already puts between the two), and the routed experts' cost.

Above the memory and speed models it fits for; plans never import it (they read sft/plan/snapshot.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from sft.machine import GIB
from sft.parallel.strategies import STRATEGIES
from sft.plan import expert_parallel, resident
from sft.plan.fast_paths import NAMES as FAST_PATH_NAMES, FastPaths
from sft.plan.memory import fast_path_kind, fast_path_unit, predict
from sft.plan.rows import RESULTS, fast_of_row, measured_rows, row_options, row_shape, split_size, workload_of_row
from sft.plan.shapes import SHAPES
from sft.plan.snapshot import ANY_MODEL, FITTED, SNAPSHOT_COMMAND
from sft.plan.speed import (expert_costs, fast_mfu_rows, long_mfu_rows, mfu_key, mfu_reference, mfu_rows,
                            resident_mfu_rows, row_kind, split_mfu_rows, split_rows_of_kind)


def fitted_numbers(path: Path = RESULTS) -> dict:
    """What the plans derive from the bench rows, for every question they can ask: the MFU of each kind of plan,
    for each model with bench rows (the rows that speak for that model only) and for any other model (a kind with
    fast paths only where rows ran with them: mfu_reference), what the fast paths do to memory, and the routed
    experts' cost of each measured MoE layer. JSON-shaped (lists, not tuples)."""
    models = sorted({row_shape(r).name for r in measured_rows(path)})  # the shapes' names (sft/names.py)
    kinds = [(s, m, c, f) for s in STRATEGIES for m in ("lora", "full") for c in (True, False) for f in FAST_PATH_NAMES
             if s != expert_parallel.STRATEGY or any(row_kind(r)[0] == "autoep" for r in measured_rows(path))]
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
    """{lora|full|resident|long: {compiled|fp8: [share, why]}}: what each fast path adds to the peak reserved memory
    (negative: saves), as a share of its kind's unit (fast_path_unit: the whole layers' activations, or for resident
    plans one MoE layer's dequantized experts; fast_path_bytes adds it). Fitted on the rows that ran with the path
    against their twins without it (the same model, workload, allocator cap and other options; in any run: the
    median of the twins' peaks): the sum of the differences, less what the rest of the memory model puts between
    the two (_modelled_difference), over the sum of those rows' units. A pair where either
    peak is within 0.5 GiB of its cap is left out (the cap hides the difference). A row with both paths and no twin
    with one of them is paired for the compiled layers against its twin with neither, less FP8's share (fitted
    first). A QLoRA plan takes LoRA's numbers; the long kind (LoRA on rows over 4,096 tokens) its own where a long
    row ran with the path, else LoRA's;
    the resident kind holds only the paths some resident row ran with beside its twin (fast_path_bytes takes LoRA's
    for the others). Rows split over ranks (--sequence_parallel) are left out: their slices and all-to-alls are no
    other plan's memory."""
    rows = [r for r in measured_rows(path) if split_size(r) == 1]
    twins: dict[tuple, list[dict]] = {}
    for r in rows:
        twins.setdefault(_twin_key(r), []).append(r)
    out: dict[str, dict] = {}
    for kind in ("lora", "full", "resident", "long"):
        out[kind] = {}
        for name in ("fp8", "compiled"):  # FP8's first: a row with both paths and only a twin with neither needs it
            pairs = []  # (row, its peak over its twins', its kind's unit), GiB
            for r in rows:
                fast, w = fast_of_row(r), workload_of_row(r)
                if fast_path_kind(w) != kind or not getattr(fast, name):
                    continue
                without = FastPaths(fast.fp8 and name != "fp8", fast.compiled and name != "compiled").label
                others = [t for t in twins[_twin_key(r)] if fast_of_row(t).label == without]
                fp8_part = 0.0  # GiB: a row with both paths whose only twin has neither speaks for the compiled
                # layers, less FP8's share (this kind's, else LoRA's: fitted first, on rows with a twin of their own)
                if not others and name == "compiled" and fast.fp8:
                    others = [t for t in twins[_twin_key(r)] if not fast_of_row(t).label]
                    fp8_part = (out[kind].get("fp8") or out["lora"]["fp8"])[0] * fast_path_unit(
                        row_shape(r), w, kind) / GIB
                peaks = [t["peak_mem_gib"] for t in others]
                cap = r.get("mem_cap_gib") or math.inf
                if peaks and max(r["peak_mem_gib"], *peaks) < cap - 0.5:
                    x = fast_path_unit(row_shape(r), w, kind) / GIB
                    pairs.append((r, r["peak_mem_gib"] - statistics.median(peaks) - fp8_part,
                                  _modelled_difference(r, others[0]), x))
            if not pairs:
                if kind not in ("resident", "long"):
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
    allocator cap (uncapped: the card, whose memory is then the cap; an H100 row that filled its 80 GB is no twin of
    an H200 row that took 81) and every other option. Whether an eager layer's recompute ran its tiles is the code of
    the row's day, FLOPs only, not an option."""
    w = workload_of_row(row)
    args = row_options(row)
    others = [a for i, a in enumerate(args) if a not in ("--fp8", "--compile_layers")
              and (i == 0 or args[i - 1] not in ("--fp8", "--compile_layers"))]
    return (row["model"], dataclasses.replace(w, fp8=False, compiled=False, tiles_in_layer_recompute=False), row.get("mem_cap_gib") or row.get("gpu"),
            tuple(others))


def write_snapshot() -> str:
    FITTED.write_text(json.dumps(fitted_numbers(), indent=1, sort_keys=True) + "\n")
    return f"wrote {FITTED} from {RESULTS}"
