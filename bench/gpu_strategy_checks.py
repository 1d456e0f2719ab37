"""Each multi-GPU strategy, for real: train a few steps (full and LoRA), save, reload the saved files with plain
transformers/peft and compare them with the strategy's own checkpoint, resume from a checkpoint. One PASS/FAIL
line per check; exit status 1 if any check failed.

    python bench/gpu_strategy_checks.py                              # all strategies, 2 GPUs (~100M llama)
    python bench/gpu_strategy_checks.py --strategies zero3,fsdp --methods lora
    python bench/gpu_strategy_checks.py --extras fp16,tp             # fp16 (dynamic loss scaling), tensor parallel
    python bench/gpu_strategy_checks.py --cpu --small                # develop on a CPU box (gloo; no FSDP)

What "compare" means: the final save (model.safetensors, or adapter_model.safetensors) is reloaded and every
tensor is compared with the same tensor taken from the last checkpoint in the strategy's native format,
consolidated independently of the save path (ZeRO: DeepSpeed's zero_to_fp32 on the shards; FSDP: the
torch.distributed.checkpoint shards; DDP: the checkpoint's safetensors). A LoRA adapter must hold every adapted
module's A and B (our peers save empty adapters under ZeRO-3: trl #4416) and B must have moved from zero.
Resume: a second run starts from checkpoint-2 of the first and must end where the first ended.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
STRATEGIES = ("ddp", "fsdp", "zero2", "zero3", "zero3_offload")
RESULTS: list[dict] = []


def report(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append({"check": name, "ok": bool(ok), "detail": detail})
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


# ---- the model ---------------------------------------------------------------------------------------------

def build_model(path: Path, small: bool) -> Path:
    """A Llama (deepseek-llm architecture) of ~85M parameters (12 x 768), random init, with the embedded tiny
    model's tokenizer: no download."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from sft.model.tiny import ensure_tiny_model

    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    size = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4) if small else \
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12)
    config = LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=size["num_attention_heads"],
                         max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:.1f}M parameters -> {path}", flush=True)
    return path


# ---- launching ---------------------------------------------------------------------------------------------

def launch(args, strategy: str, out: Path, train_args: list[str], log: Path, port: int,
           processes: int | None = None) -> tuple[int, str, float]:
    # `python -m accelerate.commands.launch`: the accelerate of this interpreter (and of PYTHONPATH, where the GPU
    # machines get the carried wheels), whatever `accelerate` script is first on PATH.
    config = REPO / "accelerate_configs" / f"{strategy}.yaml"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(processes or args.num_processes),
               "--main_process_port", str(port), str(REPO / "sft" / "train.py"), *train_args,
               "--output_dir", str(out)]
    if args.cpu:  # on CPU accelerate picks no backend by itself; DDP needs MULTI_CPU, DeepSpeed needs gloo
        command += ["--ddp_backend", "gloo"] if strategy.startswith("zero") else ["--use_cpu", "true"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(command) + "\n")
        f.flush()
        try:
            rc = subprocess.run(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, log.read_text(errors="replace"), time.monotonic() - started


def base_train_args(args, model: Path, method: str, extra: list[str]) -> list[str]:
    lr = "1e-3"  # large enough that 4 steps move weights well past bf16 rounding (the comparisons rely on it)
    train = ["--model", str(model), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
             "--max_length", "256", "--packing", "true", "--per_device_train_batch_size", "2",
             "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
             "--learning_rate", lr, "--warmup_steps", "0", "--lr_scheduler_type", "constant",
             "--report_to", "none", "--seed", "0", "--dataloader_num_workers", "0",
             "--fp8", "false", "--compile_layers", "false"]
    if not args.cpu:
        train += ["--bf16", "true", "--activation_checkpointing", "true"]
    if method == "lora":
        train += ["--lora", "true", "--lora_dropout", "0"]
    if args.no_verify:
        train += ["--verify_saves", "no"]  # sft's own reload-and-compare off (this script's checks stay)
    return train + extra


# ---- reading weights ---------------------------------------------------------------------------------------

def normalise(key: str) -> str:
    for junk in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.", "module."):
        key = key.replace(junk, "")
    return key.replace(".default.", ".")


def saved_tensors(directory: Path, lora: bool) -> dict:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if lora else "model.safetensors"
    shards = name.replace(".safetensors", "-*.safetensors")
    files = [directory / name] if (directory / name).exists() else sorted(directory.glob(shards))
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def checkpoint_tensors(checkpoint: Path, strategy: str, lora: bool) -> tuple[dict, str]:
    """The weights of a checkpoint, consolidated from its native format (not from the Trainer's save path)."""
    import torch

    if strategy.startswith("zero"):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))), "zero_to_fp32 of the ZeRO shards"
    shards = sorted(checkpoint.glob("pytorch_model_fsdp_*"))
    if shards and shards[0].is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        target = checkpoint / "_consolidated_for_check.pt"
        dcp_to_torch_save(str(shards[0]), str(target))
        state = torch.load(target, weights_only=True)
        target.unlink()
        state = state.get("model", state)
        return {k: v for k, v in state.items() if torch.is_tensor(v)}, "torch.distributed.checkpoint shards"
    return saved_tensors(checkpoint, lora), "the checkpoint's safetensors"


def match(saved: dict, reference: dict) -> tuple[list[tuple[str, object, object]], list[str]]:
    by_norm = {normalise(k): v for k, v in reference.items()}
    pairs, missing = [], []
    for key, tensor in saved.items():
        n = normalise(key)
        hits = [r for r in by_norm if r == n or r.endswith("." + n) or n.endswith("." + r)]
        if not hits:
            missing.append(key)
            continue
        pairs.append((key, tensor, by_norm[min(hits, key=len)]))
    return pairs, missing


def max_rel_diff(pairs) -> float:
    worst = 0.0
    for _, a, b in pairs:
        a, b = a.float(), b.float()
        if a.shape != b.shape:
            return math.inf
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item())
    return worst


def distance(a: dict, b: dict, keys) -> float:
    return math.sqrt(sum(float(((a[k].float() - b[k].float()) ** 2).sum()) for k in keys))


# ---- one strategy x method ---------------------------------------------------------------------------------

def losses(output: Path) -> dict[int, float]:
    state = output / "trainer_state.json"
    if not state.exists():
        candidates = sorted(output.glob("checkpoint-*/trainer_state.json"),
                            key=lambda p: int(p.parent.name.split("-")[1]))
        if not candidates:
            return {}
        state = candidates[-1]
    history = json.loads(state.read_text()).get("log_history", [])
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def check_training(name: str, rc: int, log: str, output: Path, args, strategy: str, seconds: float) -> bool:
    tail = "\n".join(log.splitlines()[-15:])
    if not report(f"{name}/train", rc == 0, f"exit {rc} after {seconds:.0f} s" + ("" if rc == 0 else f"\n{tail}")):
        return False
    world = re.search(r"Training on (\d+) process", log)
    report(f"{name}/world_size", bool(world) and int(world.group(1)) == args.num_processes,
           f"{world.group(1) if world else '?'} processes")
    found = losses(output)
    report(f"{name}/loss_finite", bool(found) and all(math.isfinite(v) for v in found.values()),
           ", ".join(f"step {s}: {v:.4f}" for s, v in sorted(found.items())))
    if strategy in ("zero3", "zero3_offload"):
        line = re.search(r"ZeRO-3: model loaded partitioned.*", log)
        report(f"{name}/zero3_partitioned_load", bool(line),
               line.group(0) if line else "no zero.Init report in the log")
    if strategy == "fsdp" and not args.cpu:
        applied = re.search(r"FSDP: (.*; )?--activation_checkpointing applied", log)
        report(f"{name}/fsdp_activation_checkpointing", bool(applied))
    return True


def check_save(name: str, output: Path, strategy: str, lora: bool, model: Path) -> dict | None:
    import torch

    saved = saved_tensors(output, lora)
    what = "adapter_model.safetensors" if lora else "model.safetensors"
    size = sum(f.stat().st_size for f in output.glob("*.safetensors"))
    if not report(f"{name}/save_exists", bool(saved), f"{len(saved)} tensors in {what} ({size / 2**20:.1f} MiB)"):
        return None
    # Reload as a user would.
    try:
        from transformers import AutoModelForCausalLM

        if lora:
            from peft import PeftModel

            base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            reloaded = PeftModel.from_pretrained(base, output)
        else:
            reloaded = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
        ids = torch.randint(0, reloaded.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = reloaded(input_ids=ids, use_cache=False).logits
        report(f"{name}/reload", bool(torch.isfinite(logits).all()),
               "loaded with plain transformers/peft, finite logits")
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        report(f"{name}/reload", False, f"{type(e).__name__}: {e}")
    initial = saved_tensors(model, False)
    if lora:
        n_layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        expected = 2 * 7 * n_layers  # A and B of q,k,v,o,gate,up,down in every layer
        b = [k for k in saved if "lora_B" in k]
        moved = sum(1 for k in b if saved[k].float().abs().max() > 0)
        report(f"{name}/adapter_complete", len(saved) == expected and all(v.numel() > 0 for v in saved.values()),
               f"{len(saved)} tensors (expected {expected}), {moved}/{len(b)} lora_B trained away from zero")
        report(f"{name}/adapter_trained", len(b) > 0 and moved == len(b))
    else:
        pairs, missing = match(saved, initial)
        changed = sum(1 for _, a, b in pairs if not torch.equal(a.float(), b.float()))
        report(f"{name}/model_complete", not missing and len(saved) == len(initial),
               f"{len(saved)} tensors (base has {len(initial)})"
               + (f"; unknown: {', '.join(missing[:3])}" if missing else ""))
        report(f"{name}/model_trained", changed == len(pairs), f"{changed}/{len(pairs)} tensors changed by training")
    checkpoints = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if not checkpoints:
        report(f"{name}/equals_checkpoint", False, "no checkpoint written")
        return saved
    try:
        reference, how = checkpoint_tensors(checkpoints[-1], strategy, lora)
        pairs, missing = match(saved, reference)
        worst = max_rel_diff(pairs)
        half = any(v.dtype in (torch.bfloat16, torch.float16) for v in saved.values())
        tolerance = 1e-2 if half else 1e-5  # a 16-bit save of fp32 master weights rounds to 2^-8
        report(f"{name}/equals_checkpoint", not missing and pairs and worst <= tolerance,
               f"{len(pairs)} tensors vs {checkpoints[-1].name} ({how}): max relative diff {worst:.2e} "
               f"(allowed {tolerance:g}){'; missing: ' + ', '.join(missing[:3]) if missing else ''}")
    except Exception as e:  # noqa: BLE001
        report(f"{name}/equals_checkpoint", False, f"{type(e).__name__}: {e}")
    return saved


def check_resume(name: str, args, strategy: str, method: str, model: Path, first: Path, saved: dict,
                 work: Path, port: int, extra: tuple[str, ...] = ()) -> None:
    checkpoint = first / "checkpoint-2"
    if not checkpoint.is_dir():
        report(f"{name}/resume", False, f"{checkpoint} missing")
        return
    out = work / f"{strategy}-{method}-resumed"
    shutil.rmtree(out, ignore_errors=True)
    train = base_train_args(args, model, method, [*args.extra, *extra]) + ["--resume_from_checkpoint", str(checkpoint)]
    rc, log, seconds = launch(args, strategy, out, train, work / f"{strategy}-{method}-resumed.log", port)
    tail = "\n".join(log.splitlines()[-15:])
    ran = f"exit {rc} after {seconds:.0f} s" + ("" if rc == 0 else f"\n{tail}")
    if not report(f"{name}/resume_runs", rc == 0, ran):
        return
    before, after = losses(first), losses(out)
    steps = sorted(s for s in after if s > 2)
    same = steps == [3, 4] and all(abs(after[s] - before[s]) <= 0.02 * abs(before[s]) + 1e-3 for s in steps)
    report(f"{name}/resume_continues", same,
           "steps " + ", ".join(f"{s}: {after[s]:.4f} vs {before.get(s, float('nan')):.4f}" for s in steps))
    resumed = saved_tensors(out, method == "lora")
    keys = [k for k in saved if k in resumed and (method != "lora" or "lora_B" in k)]
    if method == "lora":
        travelled = math.sqrt(sum(float((saved[k].float() ** 2).sum()) for k in keys))  # B starts at zero
    else:
        initial = saved_tensors(model, False)
        keys = [k for k in keys if k in initial]
        travelled = distance(saved, initial, keys)
    gap = distance(saved, resumed, keys)
    report(f"{name}/resume_same_weights", bool(keys) and gap <= 0.1 * travelled,
           f"|resumed - uninterrupted| = {gap:.3g}, training moved the weights {travelled:.3g}")


def run_strategy(args, strategy: str, method: str, model: Path, work: Path, port: int, extra: list[str],
                 tag: str = "") -> None:
    name = f"{strategy}/{method}{tag}"
    out = work / f"{strategy}-{method}{tag.replace('/', '-')}"
    shutil.rmtree(out, ignore_errors=True)
    train = base_train_args(args, model, method, args.extra + extra)
    rc, log, seconds = launch(args, strategy, out, train, work / f"{out.name}.log", port)
    if not check_training(name, rc, log, out, args, strategy, seconds):
        return
    saved = check_save(name, out, strategy, method == "lora", model)
    if saved is not None and "fp16" in tag:  # DeepSpeed's fp16 engine holds (and saves) fp16 weights
        dtypes = sorted({str(v.dtype) for v in saved.values()})
        report(f"{name}/fp16_active", dtypes == ["torch.float16"], f"saved dtypes: {', '.join(dtypes)}")
    if saved is not None and not tag and not args.skip_resume:
        check_resume(name, args, strategy, method, model, out, saved, work, port + 1)


def run_tp(args, model: Path, work: Path, port: int) -> None:
    name = "tp/full"
    out = work / "tp-full"
    shutil.rmtree(out, ignore_errors=True)
    tp = ("--tp_size", str(args.num_processes))
    train = base_train_args(args, model, "full", [*args.extra, *tp])
    rc, log, seconds = launch(args, "tp", out, train, work / "tp-full.log", port)
    if check_training(name, rc, log, out, args, "tp", seconds):
        saved = check_save(name, out, "tp", False, model)
        # transformers checkpoints only the weights of a model sharded at load time; sft adds the sharded
        # training state (sft/parallel/tensor_parallel.py), which the resume below reads
        checkpoints = sorted(out.glob("checkpoint-*"))
        resumable = [c.name for c in checkpoints if (c / "tp_state").is_dir() and (c / "scheduler.pt").is_file()]
        report(f"{name}/resumable_checkpoints", bool(checkpoints) and len(resumable) == len(checkpoints),
               f"{len(resumable)} of {len(checkpoints)} checkpoints hold tp_state/ and scheduler.pt")
        if saved is not None and not args.skip_resume:
            check_resume(name, args, "tp", "full", model, out, saved, work, port + 2, tp)
        # The TP ranks hold one model copy between them, so they must read the same batches (data-parallel size
        # 1): the losses are then those of one GPU alone on the same options, up to the split matmuls' rounding.
        one = work / "tp-reference-1gpu"
        shutil.rmtree(one, ignore_errors=True)
        rc, _, _ = launch(args, "single_gpu", one, base_train_args(args, model, "full", args.extra),
                          work / "tp-reference-1gpu.log", port + 1, processes=1)
        ref, got = losses(one), losses(out)
        steps = sorted(set(ref) & set(got))
        worst = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in steps), default=math.inf)
        report(f"{name}/matches_one_gpu", rc == 0 and len(steps) == len(got) > 0 and worst <= 0.02,
               f"one GPU exit {rc}; " + ", ".join(f"step {s}: {got[s]:.4f} vs {ref[s]:.4f}" for s in steps)
               + f"; worst relative difference {worst:.2g} (allowed 0.02)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--methods", default="full,lora")
    parser.add_argument("--extras", default="", help="comma list: fp16 (zero2 LoRA and zero3 full in fp16), tp")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/gpu_strategy_checks")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where to write checks.json (default $OUT)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per training run (a hang fails it)")
    parser.add_argument("--skip_resume", action="store_true")
    parser.add_argument("--no_verify", action="store_true", help="turn sft's own --verify_saves off")
    parser.add_argument("--cpu", action="store_true", help="CPU development run: gloo, fp32, FSDP skipped")
    parser.add_argument("--small", action="store_true", help="a 2-layer model instead of ~85M parameters")
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("extra", nargs="*", help="more sft/train.py options, after --")
    args = parser.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(work / "torch_extensions"))
    model = build_model(work / ("model-small" if args.small else "model"), args.small)
    started = time.monotonic()
    port = args.port
    for strategy in [s for s in args.strategies.split(",") if s]:
        if strategy not in STRATEGIES:
            parser.error(f"unknown strategy {strategy}: use {', '.join(STRATEGIES)}")
        if args.cpu and strategy in ("fsdp", "zero3_offload"):
            print(f"SKIP {strategy}: GPU only (FSDP becomes DDP on CPU; offload needs a GPU to offload from)",
                  flush=True)
            continue
        for method in [m for m in args.methods.split(",") if m]:
            run_strategy(args, strategy, method, model, work, port, [])
            port += 2
    extras = [e for e in args.extras.split(",") if e]
    if "fp16" in extras:
        # 8 steps: dynamic loss scaling starts at 2^16 and skips the first steps that overflow (by design).
        fp16 = ["--fp16", "true", "--bf16", "false", "--max_steps", "8", "--save_steps", "4"]
        run_strategy(args, "zero2", "lora", model, work, port, fp16, "/fp16")
        run_strategy(args, "zero3", "full", model, work, port + 2, fp16, "/fp16")
        port += 4
    if "tp" in extras:
        run_tp(args, model, work, port)
    failed = [r for r in RESULTS if not r["ok"]]
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed in {time.monotonic() - started:.0f} s")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "checks.json").write_text(json.dumps(RESULTS, indent=1))
        for log in work.glob("*.log"):
            shutil.copy(log, Path(args.out) / log.name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
