"""SFTTrainer's loss paths on a GPU: the labelled-token loss (`--chunked_loss`, and Liger's fused kernel under
`--use_liger_kernel`, which has no CPU backend) gives the plain path's loss, one process and under FSDP; the full
fine-tune with `adamw_bf16_sr` (its clipping folded into the update) trains. One PASS/FAIL line per check; exit
status 1 if any failed. CPU tests hold the same equalities exactly (tests/test_chunked_loss.py, test_sr_adamw.py).

    python bench/trainer_paths_check.py [--steps 20] [--work /tmp/trainer-paths] [--run_id R] [--results FILE]

With --run_id the run appends one row to --results (bench/results.jsonl): each run's logged losses and the checks.

Each run is `sft/train.py` on a ~85M Llama (bench/gpu_strategy_checks.py's), bf16 autocast, the same seed and
data; the losses are read from each run's trainer_log.jsonl. Equal means within bf16 autocast's run-to-run
difference: each logged loss within 2% of the plain run's (the paths sum the cross-entropy in another order).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_strategy_checks import build_model  # noqa: E402

TOLERANCE = 0.02


def train(model: Path, out: Path, extra: list[str], steps: int, launcher: list[str] | None = None) -> tuple[int, str]:
    command = [*(launcher or [sys.executable]), str(REPO / "sft" / "train.py"), "--model", str(model),
               "--dataset", str(REPO / "data" / "alpaca_demo.json"), "--output_dir", str(out),
               "--max_length", "512", "--packing", "true", "--per_device_train_batch_size", "4",
               "--max_steps", str(steps), "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
               "--fp8", "false", "--compile_layers", "false",
               "--bf16", "true", "--seed", "0", "--learning_rate", "1e-4", "--verify_saves", "no", *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return done.returncode, done.stdout[-3000:] + done.stderr[-3000:]


def logged_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--work", type=Path, default=Path("/tmp/trainer-paths"))
    parser.add_argument("--run_id", help="append this run's row to --results under this id")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results.jsonl")
    args = parser.parse_args()
    model = build_model(args.work / "model", small=False)
    fsdp = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "1"]
    runs = {
        "lora": ([], None),
        "lora-chunked_loss": (["--chunked_loss", "true"], None),
        "lora-liger": (["--use_liger_kernel", "true"], None),
        "lora-fsdp-chunked_loss": (["--chunked_loss", "true"], fsdp),
        "full-adamw_bf16_sr-clipped": (["--lora", "false", "--optim", "adamw_bf16_sr", "--max_grad_norm", "0.1"],
                                       None),
    }
    losses, ok, checks = {}, True, {}
    for name, (extra, launcher) in runs.items():
        lora = [] if "--lora" in extra else ["--lora", "true", "--lora_dropout", "0"]
        rc, tail = train(model, args.work / name, lora + extra, args.steps, launcher)
        if rc != 0:
            print(f"FAIL {name}: exit {rc}\n{tail}", flush=True)
            ok = False
            continue
        losses[name] = logged_losses(args.work / name)
        print(f"ran {name}: losses {[round(x, 4) for x in losses[name]]}", flush=True)
    for name, values in losses.items():
        finite = len(values) == args.steps and all(math.isfinite(v) for v in values)
        falls = values[-1] < values[0] if finite else False
        good = finite and falls
        if name.startswith("lora-") and "lora" in losses and good:
            worst = max(abs(a - b) / abs(b) for a, b in zip(values, losses["lora"]))
            good = worst <= TOLERANCE
            detail = f"max relative difference to the plain LoRA run {worst:.4f} (<= {TOLERANCE})"
        else:
            detail = f"loss {values[0]:.4f} -> {values[-1]:.4f}" if finite else f"{len(values)} finite losses"
        print(f"{'PASS' if good else 'FAIL'} {name}: {detail}", flush=True)
        checks[name] = {"ok": good, "detail": detail}
        ok = ok and good
    if args.run_id:
        record(args, losses, checks, ok)
    return 0 if ok else 1


def record(args, losses: dict, checks: dict, ok: bool) -> None:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    row = {"run_id": args.run_id, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": commit, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "n_gpus": 1,
           "bench": "trainer_paths", "steps": args.steps, "losses": losses, "checks": checks, "ok": ok,
           "notes": f"python bench/trainer_paths_check.py --steps {args.steps}; correctness only, no timing"}
    with open(args.results, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
