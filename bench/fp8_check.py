"""`--fp8` (sft/speed/fp8.py: LoRA's frozen base in FP8) on one FP8 GPU: per-layer speed, then the loss over 50 steps
against the bf16 path's own seed-to-seed spread, through our real entry point. PASS/FAIL lines, a JSON summary
line at the end, exit status 1 on a FAIL.

    python bench/fp8_check.py                       # both parts, one H200 or RTX 4090 (~10 min on one H200)
    python bench/fp8_check.py --part layers         # per-layer speed only (~1 min)
    python bench/fp8_check.py --part loss --seeds 3 --steps 50
    python bench/fp8_check.py --part loss --candidate compile   # --compile_layers (bf16) against plain bf16
    python bench/fp8_check.py --part loss --candidate fp8,fp8-compile   # several, sharing the bf16 runs
    python bench/fp8_check.py --part loss --shape deepseek-v2-lite --candidate quantize-experts  # issue 26 item 1
    python bench/fp8_check.py --part loss --shape deepseek-v2-lite --candidate quantize-experts,quantize-experts-compile
    python bench/fp8_check.py --part loss --shape deepseek-v2-lite --candidate quantize-experts-fp8-compile
    python bench/fp8_check.py --cpu_smoke           # this script's plumbing on a CPU: tiny shapes, no verdict

Layers: each projection shape of deepseek-llm-7b (q/k/v/o 4096x4096, gate/up 4096->11008, down 11008->4096), with
--tokens rows (micro-batch 4 x 2048), frozen weight, forward + input gradient (what LoRA's base does per step, 4MKN
FLOPs): bf16 nn.Linear against Fp8Linear with the quantize step compiled (the default on CUDA) and eager
(SFT_FP8_COMPILE=0); also the compiled quantize's first call (its compile time) and the output's error.
Loss: a random-init model of deepseek-llm-7b's layer shape (or --shape deepseek-v2-lite's: its first layer dense,
the rest MoE; --layers decoder layers, its vocabulary), LoRA through
sft/train.py, --seeds seeds each with and without --fp8 (the same seed: the same data order and adapter init).
The bf16 spread is the range of the bf16 runs' mean loss over the last 10 steps; PASS when every seed's FP8 run is
within that range of its bf16 twin and the FP8 mean within it of the bf16 mean. Random weights cannot show that
the FP8 base learns as well on real weights (issue 15's convergence check does): this shows its numbers do not
move training beyond seed noise. Throughput per run comes from the runs' all_results.json (few layers: the
embedding and LM head, not in FP8, weigh more than in 7B, so the end-to-end gain is understated).

Data and tokenizer: .benchdata/alpaca_sample.json and .benchdata/tokenizer when present (carry ".benchdata"), else
../shared/datasets/alpaca_sample.json and ../shared/tokenizers/deepseek-coder-6.7b-instruct.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared"
BENCHDATA = REPO / ".benchdata"
SHAPES_7B = [("q/k/v/o_proj", 4096, 4096), ("gate/up_proj", 4096, 11008), ("down_proj", 11008, 4096)]
FAILS: list[str] = []


def verdict(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def first_existing(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists()), None)


# ---- part 1: per-layer speed ----------------------------------------------------------------------------------

def time_ms(fn, warmup: int, iters: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def layers(args) -> dict:
    import torch
    from torch import nn

    from sft.speed.fp8 import Fp8Linear, _compiled_quantize

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [("tiny", 64, 128)] if args.cpu_smoke else SHAPES_7B
    m = 64 if args.cpu_smoke else args.tokens
    results = {}
    if device == "cuda":  # the compiled quantize's first call: its compile time (dynamic shapes: once per process)
        x = torch.randn(m, shapes[0][1], device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        _compiled_quantize()(x)
        torch.cuda.synchronize()
        results["quantize_compile_s"] = round(time.perf_counter() - start, 1)
        print(f"compiled quantize, first call (compile): {results['quantize_compile_s']} s", flush=True)
    for name, k, n in shapes:
        torch.manual_seed(0)
        linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
        fp8 = Fp8Linear(linear)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)

        def step(layer):
            def run():
                layer(x).backward(grad)
                x.grad = None
            return run

        row = {}
        for label, layer, compiled in (("bf16", linear, "1"), ("fp8", fp8, "1"), ("fp8_eager_quantize", fp8, "0")):
            os.environ["SFT_FP8_COMPILE"] = compiled
            row[label] = time_ms(step(layer), args.warmup, args.iters)
        os.environ["SFT_FP8_COMPILE"] = "1"
        with torch.no_grad():
            exact = linear(x).float()
            error = ((fp8(x).float() - exact).norm() / exact.norm()).item()
        flops = 4 * m * k * n
        print(f"{name} {k}->{n}, {m} tokens: bf16 {row['bf16']:.3f} ms ({flops / row['bf16'] / 1e9:.0f} TFLOP/s), "
              f"fp8 {row['fp8']:.3f} ms ({flops / row['fp8'] / 1e9:.0f} TFLOP/s, {row['bf16'] / row['fp8']:.2f}x), "
              f"fp8 with eager quantize {row['fp8_eager_quantize']:.3f} ms "
              f"({row['bf16'] / row['fp8_eager_quantize']:.2f}x); output error {error:.4f} of its norm", flush=True)
        results[name] = {**{k_: round(v, 4) for k_, v in row.items()}, "error": round(error, 5), "k": k, "n": n}
        del linear, fp8, x, grad
    if not args.cpu_smoke:
        total = {label: sum(results[name][label] for name, _, _ in shapes) for label in ("bf16", "fp8")}
        verdict("layers/fp8_faster", total["fp8"] < total["bf16"],
                f"the three shapes together {total['bf16'] / total['fp8']:.2f}x bf16")
    return results


# ---- part 2: loss over --steps steps against the bf16 seed-to-seed spread --------------------------------------

def build_model(args, path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from fp8_check import _build; "
            "_build(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))")
    shape = (("tiny-moe" if args.shape == "deepseek-v2-lite" else "tiny") if args.cpu_smoke else args.shape)
    subprocess.run([sys.executable, "-c", code, str(REPO / "bench"), shape, str(args.tokenizer), str(path),
                    str(args.layers)], check=True)
    return path


def _build(shape: str, tokenizer_dir: str, path: str, num_layers: int) -> None:
    """Random init in a child process (this one holds no CUDA memory while the runs train): the bench's shape
    (bench/train_throughput.py MODELS, any family) with fewer layers (bench/ is on sys.path in this child)."""
    from train_throughput import save_random_model

    save_random_model(shape, tokenizer_dir, path, num_hidden_layers=num_layers)


# The loss check's candidates, each against plain bf16 LoRA: FP8's base; --compile_layers in bf16; both (refused by
# sft/train.py since it failed this check on an H200, run 20261201T2145Z-compile).
# fp32 (fp32 base, no autocast) is a reference rather than a candidate: where the bf16 paths part, which one it
# follows (the compiled layers' lower loss of the bench's LoRA rows at a learning rate of 1e-5).
CANDIDATES = {"fp8": ["--fp8", "true"], "compile": ["--compile_layers", "true"],
              "fp8-compile": ["--fp8", "true", "--compile_layers", "true"],
              "fp32": ["--bf16", "false", "--dtype", "float32"],
              # V2-Lite's frozen routed experts held in e4m3 (issue 26 item 1; --shape deepseek-v2-lite), eager and
              # in compiled layers (the resident plan's fastest measured row, run 20261205T0515Z-next)
              "quantize-experts": ["--quantize_experts", "fp8"],
              "quantize-experts-compile": ["--quantize_experts", "fp8", "--compile_layers", "true"],
              # ... with --fp8: the experts' grouped matmuls in FP8 on the held e4m3 (sft/speed/fp8_experts.py,
              # compute capability 9.0/10.0) and the MLA/shared-expert projections in FP8
              "quantize-experts-fp8": ["--quantize_experts", "fp8", "--fp8", "true"],
              "quantize-experts-fp8-compile": ["--quantize_experts", "fp8", "--fp8", "true",
                                               "--compile_layers", "true"]}
# options every run of the check takes (the bf16 twins too) when a candidate needs them: the quantized experts are
# dequantized layer by layer under activation checkpointing, which changes no loss
SHARED_OPTIONS = {name: ["--activation_checkpointing", "true"]
                  for name in CANDIDATES if name.startswith("quantize-experts")}


# --method: LoRA (the base in FP8, sft/speed/fp8.py), or a full fine-tune (every decoder linear layer in FP8
# through torchao, sft/speed/fp8_training.py) with bf16 weights and adamw_bf16_sr, as the full recipe trains.
METHODS = {"lora": ["--lora", "true", "--lora_dropout", "0"],
           "full": ["--dtype", "bfloat16", "--optim", "adamw_bf16_sr"]}


def train(args, model: Path, seed: int, label: str) -> dict:
    """One run (--method): plain bf16 (label "bf16"), or with a candidate's options."""
    out = args.workdir / f"{label}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, str(REPO / "sft" / "train.py"), "--model", str(model), "--dataset", str(args.data),
               "--packing", "true", "--max_length", str(args.seq_len), "--per_device_train_batch_size",
               str(args.micro_batch), "--max_steps", str(args.steps), "--logging_steps", "1", "--learning_rate",
               str(args.learning_rate), "--lr_scheduler_type", "constant", "--warmup_steps", "0", *METHODS[args.method],
               "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none",
               "--fp8", "false", "--compile_layers", "false",  # every `auto` pinned: the runs as measured before it
               "--chunked_loss", "false",
               "--verify_saves", "final", "--seed", str(seed), "--output_dir", str(out),
               "--dataset_cache_dir", str(args.workdir / "dataset-cache"),
               *([] if args.cpu_smoke else ["--bf16", "true"]),
               *[w for c in args.candidates for w in SHARED_OPTIONS.get(c, [])], *CANDIDATES.get(label, [])]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    started = time.time()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    name = f"loss/{label}-seed{seed}/train"
    if proc.returncode != 0:
        verdict(name, False, f"exit {proc.returncode}\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))
        return {}
    logs = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line.strip()]
    losses = [row["loss"] for row in logs if "loss" in row and "step" in row]
    results = json.loads((out / "all_results.json").read_text()) if (out / "all_results.json").exists() else {}
    run = {"losses": losses, "tokens_per_second": results.get("train_real_tokens_per_second"),
           "mfu": results.get("train_mfu"), "wall_s": round(time.time() - started)}
    print(f"{name}: {len(losses)} losses, last {losses[-1] if losses else None}, "
          f"{run['tokens_per_second']} real tok/s, MFU {run['mfu']}", flush=True)
    return run


def loss(args) -> dict:
    """Each seed's bf16 run once, then each candidate's run of that seed; a verdict per candidate."""
    model = build_model(args, args.workdir / "model")
    labels = ["bf16", *args.candidates]
    runs = {(seed, label): train(args, model, seed, label) for seed in range(args.seeds) for label in labels}
    if not all(runs.values()):
        return {"runs": {f"{s}-{label}": r for (s, label), r in runs.items()}}
    tail = min(10, args.steps)
    window = {key: statistics.fmean(run["losses"][-tail:]) for key, run in runs.items()}
    bf16 = [window[(s, "bf16")] for s in range(args.seeds)]
    spread = max(bf16) - min(bf16)
    summary = {"tail_steps": tail, "bf16_tail_loss": bf16, "bf16_spread": spread,
               "runs": {f"{s}-{label}": r for (s, label), r in runs.items()}}
    for candidate in args.candidates:
        mine = [window[(s, candidate)] for s in range(args.seeds)]
        twins = [abs(window[(s, candidate)] - window[(s, "bf16")]) for s in range(args.seeds)]
        speed = [runs[(s, candidate)]["tokens_per_second"] / runs[(s, "bf16")]["tokens_per_second"]
                 for s in range(args.seeds) if runs[(s, "bf16")]["tokens_per_second"]]
        mean_diff = abs(statistics.fmean(mine) - statistics.fmean(bf16))
        summary[candidate] = {"tail_loss": mine, "same_seed_diff": twins, "mean_diff": mean_diff,
                              "over_bf16_tok_s": speed}
        print(f"last-{tail}-step mean loss: bf16 {[round(x, 4) for x in bf16]} (spread {spread:.4f}), "
              f"{candidate} {[round(x, 4) for x in mine]}; same-seed differences {[round(x, 4) for x in twins]}; "
              f"tok/s over bf16: {[round(x, 3) for x in speed]}", flush=True)
        if not args.cpu_smoke:
            verdict(f"loss/{candidate}/same_seed_within_spread", max(twins) <= spread,
                    f"largest same-seed difference {max(twins):.4f} against the bf16 seed spread {spread:.4f}")
            verdict(f"loss/{candidate}/mean_within_spread", mean_diff <= spread,
                    f"{candidate} mean - bf16 mean = {mean_diff:.4f} against the spread {spread:.4f}")
    return summary


def stop(signum, frame):
    """SIGTERM (`timeout`, a scheduler) stops the check as an exception, so that subprocess.run kills the training
    run it waits on: the default handler would leave that run training on the GPU beside whatever comes next."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, stop)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=["all", "layers", "loss"], default="all")
    p.add_argument("--tokens", type=int, default=8192, help="rows per layer call (micro-batch 4 x 2048)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the loss check's model")
    p.add_argument("--shape", default="deepseek-llm-7b", choices=["deepseek-llm-7b", "deepseek-v2-lite"],
                   help="the loss check's model shape (bench/train_throughput.py MODELS), --layers of them")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--method", choices=sorted(METHODS), default="lora")
    p.add_argument("--learning_rate", type=float, help="default 2e-4 (LoRA), 1e-5 (full)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per training run")
    p.add_argument("--candidate", default="fp8",
                   help=f"the paths checked against plain bf16 LoRA, comma-separated, the bf16 runs shared: "
                        f"{', '.join(sorted(CANDIDATES))} (their options: CANDIDATES)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/fp8_check"))
    p.add_argument("--data", type=Path, default=first_existing(BENCHDATA / "alpaca_sample.json",
                                                                SHARED / "datasets" / "alpaca_sample.json"))
    p.add_argument("--tokenizer", type=Path, default=first_existing(
        BENCHDATA / "tokenizer", SHARED / "tokenizers" / "deepseek-coder-6.7b-instruct"))
    p.add_argument("--cpu_smoke", action="store_true", help="plumbing only: tiny shapes, 2 steps, 1 seed, no --fp8 "
                                                            "runs' verdicts (no FP8 GPU)")
    args = p.parse_args(argv)
    args.candidates = args.candidate.split(",")
    if args.learning_rate is None:
        args.learning_rate = 1e-5 if args.method == "full" else 2e-4
    unknown = set(args.candidates) - set(CANDIDATES)
    if unknown:
        p.error(f"--candidate {','.join(sorted(unknown))}: choose from {', '.join(sorted(CANDIDATES))}")
    if args.cpu_smoke:
        args.steps, args.seeds, args.seq_len, args.micro_batch, args.layers = 2, 1, 256, 2, 2
        args.warmup, args.iters = 1, 2
    # one folder per model shape: a check of another --shape must not reuse this one's model or runs (a V2-Lite
    # check once trained the 7B shape's model left there by the check before it)
    args.workdir = args.workdir / f"{args.shape}-{args.layers}layers{'-cpu' if args.cpu_smoke else ''}"
    args.workdir.mkdir(parents=True, exist_ok=True)
    summary = {}
    if args.part in ("all", "layers"):
        summary["layers"] = layers(args)
    if args.part in ("all", "loss"):
        if args.data is None or args.tokenizer is None:
            p.error("no data/tokenizer: carry .benchdata, or give --data and --tokenizer")
        if args.cpu_smoke:  # --fp8 refuses a CPU: the bf16 run's plumbing, and the candidates a CPU runs (the
            # compiled layers too, through inductor's CPU backend)
            model = build_model(args, args.workdir / "model")
            labels = ["bf16", *[c for c in args.candidates if "--fp8" not in CANDIDATES[c]]]
            summary["loss"] = {label: train(args, model, 0, label) for label in labels}
        else:
            summary["loss"] = loss(args)
    print(json.dumps({"fp8_check": summary, "fails": FAILS}), flush=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
