"""`python -m sft.plan.planner --check`: the memory model's prediction (sft/plan/memory.py) against every measured
bench row with a peak (sft/plan/rows.py): allocated, reserved, nvidia-smi and, where the planner's estimate decides
something, host RAM; as RESULTS.md's table (check_table) or with the worst errors under it (check_summary).
"""

from __future__ import annotations

from pathlib import Path

from sft.parallel.strategies import STRATEGIES
from sft.plan import long_rows, resident
from sft.plan.memory import predict
from sft.plan.rows import RESULTS, attention_of_row, measured_rows, row_shape, smi_of_row, workload_of_row
from sft.plan.workload import Workload, strategy_label


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
    not the rows measured before a fix changed what they hold there: the resident rows that loaded the whole base
    (resident.LOADED_WHOLE) or were built on the GPU without a checkpoint (resident.NOT_FROM_A_CHECKPOINT), the long
    rows whose offload copied the model's own tensors (long_rows.OFFLOADED_MODEL_TENSORS); nor a row whose attention
    is not the one the planner plans; nor a long row that compiled nothing (no flex_attention, compiled layers or
    FP8: no compile workers, which the estimate counts; long-r1-32k-sdpa held 11.3 GiB where its compiled twins held
    18.0-20.5). Other rows are not checked: the same configuration measured 4.6 to 22.9 GiB (torch.compile/Triton
    worker processes and the bench's loading path; bench/RESULTS.md)."""
    key = (row.get("run_id"), row.get("name"))
    old = (resident.LOADED_WHOLE.get(key) or resident.NOT_FROM_A_CHECKPOINT.get(key) if w.resident
           else long_rows.OFFLOADED_MODEL_TENSORS.get(key))
    ran, planned = attention_of_row(row)
    other = None if ran == planned else f"ran {ran}, where the planner plans {planned}"
    idle = None if not long_rows.is_long_document_row(row) or ran == "flex_attention" or w.fp8 or w.compiled \
        else "nothing compiled: no compile workers"
    checked = (bool(STRATEGIES[w.strategy].offload) or w.offload_activations or w.resident) and not (old or other or
                                                                                                   idle)
    return {"host_checked": checked, "host_note": old or other or idle or ""}


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
                                                          " (not checked)" if x["host_note"] else "")
            if x["host"] else "-",
        ]) + " |")
    return "\n".join(lines)


def check_summary(results: list[dict]) -> str:
    worst_r = max(abs(x["err_reserved"]) for x in results)
    smi = [x for x in results if x["err_smi"] is not None]
    worst_s = max(abs(x["err_smi"]) for x in smi) if smi else 0
    host = [x for x in results if x["host_checked"] and x["err_host"] is not None]
    worst_h = max(abs(x["err_host"]) for x in host) if host else 0
    return (check_table(results) + f"\n\n{len(results)} rows; worst error: reserved {worst_r:.1%}, "
            f"nvidia-smi {worst_s:.1%} ({len(smi)} rows with their own nvidia-smi peak); host RAM of the offload "
            f"and resident plans {worst_h:.1%} ({len(host)} rows)")
