"""Print the rows of one bench run (bench/results.jsonl) as a markdown table, with each row's speed against
the peers' recipe rows measured in the same run, and against the row it names in `vs` (its TRL row:
bench/throughput.py).

    python bench/report.py --run_id 20261130T0500Z-x2     # one run
    python bench/report.py --last                          # the newest run_id in the file
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results.jsonl"
PEER = "zero3-offload-recipe"


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fmt(value, pattern: str = "{}") -> str:
    return "-" if value is None else pattern.format(value)


def table(rows: list[dict]) -> str:
    peers = [r for r in rows if r.get("peer") == PEER and r.get("real_tok_s")]
    best_peer = max(peers, key=lambda r: r["real_tok_s"]) if peers else None
    head = ["row", "method", "strategy", "peer", "GPUs", "mb x ga", "real tok/s",
            f"x best peer ({best_peer['name']})" if best_peer else "x best peer", "MFU",
            "peak reserved GiB (max rank)", "nvidia-smi GiB", "host RAM GiB", "comm share", "scaling", "x vs",
            "cold cache"]
    by_name = {r.get("name"): r for r in rows}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = r["real_tok_s"] / best_peer["real_tok_s"] if best_peer else None
        lines.append("| " + " | ".join([
            r.get("name", "?"), r["method"], r["strategy"], r["peer"], str(r["n_gpus"]),
            f"{r['micro_batch']} x {r['grad_accum']}", f"{r['real_tok_s']:,.0f}", fmt(ratio, "{:.2f}"),
            fmt(r.get("mfu"), "{:.1%}"), fmt(r.get("peak_mem_gib")), fmt(r.get("nvidia_smi_mem_gib")),
            fmt(r.get("host_ram_gib")), fmt(r.get("comm_share"), "{:.0%}"), fmt(r.get("scaling"), "{:.2f}"),
            fmt(vs_ratio(r, by_name), "{:.2f}" + f" ({r.get('vs')})"), fmt(r.get("cold_cache")),
        ]) + " |")
    return "\n".join(lines)


def vs_ratio(row: dict, by_name: dict) -> float | None:
    """This row's real tok/s over that of the row it names in `vs` (same run), if both ran."""
    other = by_name.get(row.get("vs"))
    return row["real_tok_s"] / other["real_tok_s"] if other and other.get("real_tok_s") else None


def ratios(rows: list[dict]) -> list[str]:
    """One line per row with a `vs` row: tok/s, MFU and the ratio of each."""
    by_name = {r.get("name"): r for r in rows}
    lines = []
    for r in rows:
        other, ratio = by_name.get(r.get("vs")), vs_ratio(r, by_name)
        if ratio is None:
            continue
        mfu = f", MFU {fmt(r.get('mfu'), '{:.1%}')} vs {fmt(other.get('mfu'), '{:.1%}')}"
        steady = (f"; at the median step {r['steady_tok_s'] / other['steady_tok_s']:.2f}x"
                  if r.get("steady_tok_s") and other.get("steady_tok_s") else "")
        lines.append(f"{r['name']} / {other['name']}: {ratio:.2f}x ({r['real_tok_s']:,.0f} vs "
                     f"{other['real_tok_s']:,.0f} real tok/s{mfu}){steady}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run_id")
    p.add_argument("--last", action="store_true")
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    rows = [r for r in load(Path(args.results)) if "real_tok_s" in r]  # speed rows (the checks' rows have their own)
    run_id = args.run_id or (rows[-1]["run_id"] if rows and args.last else None)
    if not run_id:
        print("give --run_id or --last", file=sys.stderr)
        return 2
    mine = [r for r in rows if r.get("run_id") == run_id]
    if not mine:
        print(f"no rows for run_id {run_id} in {args.results}")
        return 1
    first = mine[0]
    print(f"run_id {run_id}: {first['date']}, commit {first['commit']}, {first['gpu']}, "
          f"cap {first['mem_cap_gib']} GiB/rank, {first['model']}, seq {first['seq_len']}")
    print(table(mine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
