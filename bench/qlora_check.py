"""QLoRA against LoRA on one GPU, through our real entry point (sft/train.py), and what happens to the adapter
afterwards. One command; PASS/FAIL lines, one bench/results.jsonl row per training run, exit status 1 on a FAIL.

    python bench/qlora_check.py --run_id R                  # deepseek-coder-1.3b shape (~5 min on one H200)
    python bench/qlora_check.py --run_id R --shape 7b       # deepseek-llm-7b shape
    python bench/qlora_check.py --cpu_smoke                 # this script's plumbing on a CPU: tiny shape, --lora

Steps: build a random-init model of the shape (Llama architecture, bf16) and save it with save_pretrained, with
the real DeepSeek-Coder tokenizer; train it twice with the same data and options (packing, --max_length, micro
batch, --max_steps, activation checkpointing, --bf16), `--lora` then `--qlora`, each process's allocator capped
at --mem_cap_gib (24 GB cards); with 2 GPUs visible also `--qlora` under accelerate_configs/ddp.yaml on both;
`--fsdp two` (2 GPUs) also under accelerate_configs/fsdp.yaml: the base as torchao's NF4 bytes (sft/model/nf4_base.py),
past the refusal that this check lifts (SFT_FSDP_QLORA_CHECK=1), its start-of-training byte round trip said in the
log (bench/fsdp_qlora_bytes.py shows the failure it replaces, and the NF4 bytes, on one GPU). The FSDP check, one
command on 2 GPUs after `--prepare`: python bench/qlora_check.py --run_id R --fsdp two --skip_single; or in a
two-GPU session, `bench/gpu_session.sh RUN BUDGET --rows issue30` (or `--rows fsdp-qlora-check`: bench/throughput.py
SCRIPTS), where the carried wheels hold no bitsandbytes: the DDP run is then left out, the FSDP run needs torchao only.
Numbers per run, as bench/train_throughput.py measures them (its callback, monitor and row): real tok/s over
the steps after --warmup, loss first/last (must fall), peak reserved/allocated memory, nvidia-smi's peak. Then
the QLoRA adapter: saved and verified by the run (training_complete.json), reloaded with plain peft onto the
4-bit base (as trained: bitsandbytes', or the FSDP run's NF4 bytes) and onto the UNQUANTIZED base (what users
load), merged with `python -m sft.tools.merge` (fp32, onto the unquantized base), and the merged model's logits
compared with the adapter's on the unquantized base (equal up to rounding) and on the 4-bit base (the quantization
error).

Data and tokenizer: .benchdata/alpaca_sample.json and .benchdata/tokenizer when present (what a GPU machine gets
carried), else ../shared/datasets/alpaca_sample.json and ../shared/tokenizers/deepseek-coder-6.7b-instruct.
`--prepare` (run here, before a GPU call) puts them in .benchdata/, puts the wheels this check needs in
.whl-qlora/ (those of ../shared/tools/device-wheels.sh --with-bnb it imports: all of them are over the 64 MiB a
call carries) and prints the GPU command, to run with carry [".whl-qlora", ".benchdata"].
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_strategy_checks import RESULTS as CHECKS, report  # noqa: E402
from train_throughput import GIB, MODELS, Monitor, _bench_callback, free_port, make_row  # noqa: E402

SHAPES = {"1.3b": "deepseek-coder-1.3b", "7b": "deepseek-llm-7b", "tiny": "tiny"}
SHARED = REPO.parent / "shared"
BENCHDATA = REPO / ".benchdata"
WHEELS = REPO / ".whl-qlora"
# The wheels of ../shared/tools/device-wheels.sh --with-bnb that this check imports. Not trl, liger, deepspeed,
# pydantic (unused here), nor tokenizers and safetensors (the GPU image's 0.23.2 and 0.8.0 satisfy
# transformers): .whl whole is 70.6 MiB, and the tree, .benchdata and the wheels must stay under 64 MiB a call.
WHEEL_NAMES = ("bitsandbytes", "transformers", "accelerate", "peft", "datasets", "dill", "multiprocess",
               "huggingface_hub", "httpx2", "httpcore2", "truststore", "torchao")  # torchao: FSDP's NF4 base
STARTED = time.monotonic()
BNB = importlib.util.find_spec("bitsandbytes") is not None  # the DDP and one-GPU QLoRA runs need it; FSDP's does not


def log(message: str) -> None:
    print(f"[qlora {time.monotonic() - STARTED:6.1f}s {time.strftime('%H:%M:%S')}] {message}", flush=True)


def first_existing(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists()), None)


# ---- preparing a GPU call (on this machine) ---------------------------------------------------------------

def prepare() -> int:
    """.whl-qlora (the wheels below, bitsandbytes included) and .benchdata (the data and tokenizer), both ignored by
    git (.git/info/exclude) and carried by the GPU call. The wheels are copied from .whl where
    ../shared/tools/device-wheels.sh put them, else fetched by it into .whl-qlora."""
    def have(folder: Path, name: str) -> list[Path]:
        return sorted(folder.glob(f"{name}-*.whl"))

    exclude = REPO / ".git" / "info" / "exclude"
    if exclude.parent.is_dir():
        known = exclude.read_text() if exclude.exists() else ""
        with open(exclude, "a") as f:
            f.writelines(f"{line}\n" for line in ("/.whl-qlora/", "/.benchdata/") if line not in known.split())
    WHEELS.mkdir(exist_ok=True)
    for name in WHEEL_NAMES:
        if not have(WHEELS, name) and have(REPO / ".whl", name):
            shutil.copy2(have(REPO / ".whl", name)[-1], WHEELS)
    if not all(have(WHEELS, name) for name in WHEEL_NAMES):
        subprocess.run(["bash", str(SHARED / "tools" / "device-wheels.sh"), str(WHEELS), "--with-bnb"], cwd=REPO,
                       check=True)
    for wheel in WHEELS.glob("*.whl"):
        if not any(wheel.name.startswith(f"{name}-") for name in WHEEL_NAMES):
            wheel.unlink()
    BENCHDATA.mkdir(exist_ok=True)
    shutil.copy2(SHARED / "datasets" / "alpaca_sample.json", BENCHDATA / "alpaca_sample.json")
    tokenizer = BENCHDATA / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    for f in (SHARED / "tokenizers" / "deepseek-coder-6.7b-instruct").glob("tokenizer*.json"):
        shutil.copy2(f, tokenizer / f.name)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True).stdout.split("\0")
    tree = sum((REPO / f).stat().st_size for f in listed if f and (REPO / f).is_file())
    size = tree + sum(f.stat().st_size for d in (WHEELS, BENCHDATA) for f in d.rglob("*") if f.is_file())
    print(f"the working tree with .whl-qlora and .benchdata: {size / 2**20:.1f} MiB (a call carries at most 64 MiB)")
    print("GPU command (device tool, carry [\".whl-qlora\", \".benchdata\"]):\n  " + gpu_command())
    return 0 if size < 64 * 2**20 else 1


def gpu_command(run_id: str = "$(date -u +%Y%m%dT%H%MZ)-qlora") -> str:
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
            ".whl-qlora/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 "
            "TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "
            f"NVSHMEM_DISABLE_NVLS=1 BENCH_COMMIT={commit}-dirty && "
            f"python3 bench/qlora_check.py --run_id {run_id} --out $OUT")


# ---- the model ----------------------------------------------------------------------------------------------

def build_model(args, path: Path) -> Path:
    """Random init of the shape, in bf16 (fp32 on CPU), saved with save_pretrained with the tokenizer. In a child
    process, so that this one holds no CUDA context while the runs' GPU memory is measured."""
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    code = ("import sys, torch; sys.path.insert(0, sys.argv[4]); from qlora_check import _build; "
            "_build(sys.argv[1], sys.argv[2], sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, SHAPES[args.shape], str(args.tokenizer), str(path),
                    str(REPO / "bench")], check=True)
    return path


def _build(model: str, tokenizer_dir: str, path: str) -> None:
    from train_throughput import save_random_model

    save_random_model(model, tokenizer_dir, path)


# ---- one training run ---------------------------------------------------------------------------------------

def train_args(args, model: Path, output: Path, qlora: bool) -> list[str]:
    precision = [] if args.cpu_smoke else ["--bf16", "true"]
    return ["--model", str(model), "--dataset", str(args.data), "--packing", "true",
            "--max_length", str(args.seq_len), "--per_device_train_batch_size", str(args.micro_batch),
            "--gradient_accumulation_steps", "1", "--max_steps", str(args.steps), "--logging_steps", "1",
            "--learning_rate", str(args.learning_rate), "--lr_scheduler_type", "constant", "--warmup_steps", "0",
            "--activation_checkpointing", "true", "--save_strategy", "no", "--eval_strategy", "no",
            "--report_to", "none", "--seed", "0", "--dataloader_num_workers", "2", "--verify_saves", "final",
            "--fp8", "false", "--compile_layers", "false",
            "--output_dir", str(output), "--dataset_cache_dir", str(args.workdir / "dataset-cache"),
            *precision, "--lora", "true", *(["--qlora", "true"] if qlora else [])]


def run(args, name: str, model: Path, qlora: bool, strategy: str = "single", gpus: int = 1) -> dict | None:
    out = args.workdir / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {"warmup": args.warmup, "steps": args.steps - args.warmup, "profile_steps": 0, "out": str(out),
            "mem_cap_gib": args.mem_cap_gib}
    config = {"single": "single_gpu.yaml", "fsdp": "fsdp.yaml", "ddp": "ddp.yaml"}[strategy]
    training = train_args(args, model, out / "output", qlora)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / config), "--num_processes", str(gpus),
               "--main_process_port", str(free_port()), *(["--cpu"] if args.cpu_smoke else []),
               str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--", *training]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           **({"SFT_FSDP_QLORA_CHECK": "1"} if strategy == "fsdp" else {}),  # past the refusal this check lifts
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 2) // gpus))}
    private = {"--model", "--dataset", "--output_dir", "--dataset_cache_dir"}  # paths of this machine
    shown = shlex.join(a for i, a in enumerate(training) if a not in private and training[i - 1] not in private)
    log(f"{name}: training ({shown})")
    started = time.time()
    with open(out / "log.txt", "w") as f:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        monitor = Monitor(proc.pid)
        monitor.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = "timeout"
        monitor.stop.set()
        monitor.join()
    wall = time.time() - started
    text = (out / "log.txt").read_text(errors="replace")
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if not report(f"{name}/train", rc == 0 and bool(ranks), f"exit {rc} after {wall:.0f} s"
                  + ("" if rc == 0 else "\n" + "\n".join(text.splitlines()[-25:]))):
        return None
    losses = json.loads((out / "losses.json").read_text())
    k = max(1, min(3, len(losses) // 3))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    report(f"{name}/loss_falls", last < first - 0.05,
           f"mean of the first {k} steps {first:.3f} -> of the last {k} {last:.3f} ({len(losses)} steps)")
    quantized = next((line for line in text.splitlines() if line.startswith("QLoRA: ")), None)
    if qlora:  # bitsandbytes' uint8 packing, or under FSDP torchao's NF4 bytes (sft/model/nf4_base.py)
        report(f"{name}/quantized", bool(quantized) and "stored as uint8" in quantized, quantized or "no line")
    if qlora and strategy == "fsdp":
        said = next((line for line in text.splitlines() if line.startswith("FSDP + QLoRA: ")), None)
        report(f"{name}/bytes_round_trip", bool(said) and "bit for bit" in said, said or "no line")
    adapter = out / "output"
    report(f"{name}/adapter_saved_and_verified",
           (adapter / "adapter_model.safetensors").is_file() and (adapter / "training_complete.json").is_file(),
           "adapter_model.safetensors and training_complete.json (written after the reload check passed)")
    row_args = argparse.Namespace(
        run_id=args.run_id, model=SHAPES[args.shape], method="lora", n_gpus=gpus, strategy=strategy, peer="ours",
        seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=1, mem_cap_gib=args.mem_cap_gib,
        scaling_of=None, results=str(args.results), name=name, notes=args.notes, out=str(args.workdir),
        train_args_text=shown)
    row = make_row(row_args, ranks, monitor, wall, args.cpu_smoke)  # F = 4N: QLoRA does LoRA's matmuls
    row.update(method="qlora" if qlora else "lora", bench="qlora_check", cold_cache=args.cold_cache,
               quantization=quantized.removeprefix("QLoRA: ") if quantized else None, losses=losses)
    log(f"{name}: {row['real_tok_s']} tok/s, peak reserved {row['peak_mem_gib']} GiB, allocated "
        f"{row['peak_allocated_gib']} GiB, nvidia-smi {row['nvidia_smi_mem_gib']} GiB, loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}, {wall:.0f} s")
    return row


def worker(spec: dict, argv: list[str]) -> int:
    """One rank: cap the allocator (as bench/train_throughput.py's worker does), then sft.train.main with its
    throughput callback (which writes rank<N>.json) and every step's loss kept."""
    import torch

    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        if spec["mem_cap_gib"]:  # emulate a 24 GB card: the allocator refuses beyond the cap
            total = torch.cuda.get_device_properties(local).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["mem_cap_gib"] * GIB / total), local)
    import sft.parallel.distributed
    import sft.train

    base = _bench_callback(spec, rank)

    class KeepLosses(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.losses: list[float] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            super().on_log(args, state, control, logs=logs, **kwargs)
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

        def on_train_end(self, args, state, control, **kwargs):
            super().on_train_end(args, state, control, **kwargs)
            if rank == 0:
                Path(spec["out"], "losses.json").write_text(json.dumps(self.losses))

    code = sft.train.main(argv, callbacks=[KeepLosses()])
    sft.parallel.distributed.end_process_group()
    return code


# ---- the adapter afterwards: plain peft on the 4-bit and the unquantized base, sft.tools.merge -----------------------

def probe_batch(args):
    """Two real rows of the data, tokenized: 2 x 64 tokens."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    records = json.loads(Path(args.data).read_text())[:2]
    texts = [f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}" * 4 for r in records]
    ids = [tokenizer(t)["input_ids"][:64] for t in texts]
    return torch.tensor(ids)


def relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def adapter_checks(args, name: str, adapter: Path, model: Path, quantized: bool,
                   nf4_shards: int | None = None) -> dict:
    """-> numbers for the row. Each model is loaded, used and freed in turn. `nf4_shards`: the adapter was trained
    under FSDP on torchao's NF4 base laid out for that many ranks (sft/model/nf4_base.py), which is reloaded so;
    else the 4-bit base is bitsandbytes'."""
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sft.model.loading import qlora_quantization_kwargs

    cuda = torch.cuda.is_available()
    device = {"": 0 if cuda else "cpu"}
    ids = probe_batch(args)

    def logits_of(m):
        m.eval()
        with torch.no_grad():
            out = m(input_ids=ids.to(next(m.parameters()).device), use_cache=False).logits.float().cpu()
        return out

    def free(m):
        del m
        if cuda:
            torch.cuda.empty_cache()

    found = {}
    # What users do: plain peft puts the adapter on the base named in adapter_config.json, unquantized.
    on_full = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32, device_map=device)
    full = logits_of(on_full)
    with on_full.disable_adapter():
        plain = logits_of(on_full)
    free(on_full)
    found["adapter_effect_rel"] = round(relative(full, plain), 5)
    if quantized:
        dtype = torch.bfloat16 if cuda else torch.float32
        if nf4_shards:  # the NF4 bytes the FSDP run trained on, read weight by weight as the run did
            from transformers import AutoConfig

            from sft.model.nf4_loading import load_nf4_model

            base = load_nf4_model(str(model), AutoConfig.from_pretrained(model), dtype, nf4_shards,
                                  device=torch.device("cuda", 0) if cuda else None)
        else:
            config = BitsAndBytesConfig(**qlora_quantization_kwargs(dtype, dtype, fsdp=False))
            base = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, quantization_config=config,
                                                        device_map=device)
        on_4bit = logits_of(PeftModel.from_pretrained(base, adapter))
        free(base)
        found["unquantized_vs_4bit_rel"] = round(relative(full, on_4bit), 5)
        report(f"{name}/reload_4bit_base", torch.isfinite(on_4bit).all().item(),
               f"plain peft on the base quantized again: finite logits")
        report(f"{name}/reload_unquantized_base", found["unquantized_vs_4bit_rel"] < 0.5 * max(
            found["adapter_effect_rel"], 1e-9) or found["unquantized_vs_4bit_rel"] < 0.05,
               f"plain peft on the unquantized base: logits {found['unquantized_vs_4bit_rel']:.2%} from the 4-bit "
               f"model's (the quantization error, relative L2); the adapter itself moves them "
               f"{found['adapter_effect_rel']:.2%}")
    merged_dir = args.workdir / f"{name}-merged"
    shutil.rmtree(merged_dir, ignore_errors=True)
    log(f"{name}: python -m sft.tools.merge (fp32, on the unquantized base)")
    merge = subprocess.run([sys.executable, "-m", "sft.tools.merge", str(adapter), str(merged_dir), "--dtype", "float32"],
                           cwd=REPO, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    said = [line for line in (merge.stdout + merge.stderr).splitlines() if line.startswith(("Merged", "error"))]
    if not report(f"{name}/merge", merge.returncode == 0, said[-1] if said else f"exit {merge.returncode}"):
        return found
    merged_model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, device_map=device)
    merged = logits_of(merged_model)
    free(merged_model)
    found["merged_vs_unquantized_adapter_rel"] = relative(merged, full)
    report(f"{name}/merged_equals_adapter_on_unquantized_base", found["merged_vs_unquantized_adapter_rel"] < 1e-4,
           f"relative difference {found['merged_vs_unquantized_adapter_rel']:.1e}")
    if quantized:
        found["merged_vs_4bit_rel"] = round(relative(merged, on_4bit), 5)
        log(f"{name}: merged vs the 4-bit model trained: {found['merged_vs_4bit_rel']:.2%} (quantization error)")
    shutil.rmtree(merged_dir, ignore_errors=True)  # the disk of a lent machine
    return found


# ---- main ---------------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run_id", default=dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%MZ-qlora"))
    p.add_argument("--shape", default="1.3b", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of tok/s")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--mem_cap_gib", type=float, default=24.0, help="per-process allocator cap; 0: none")
    p.add_argument("--fsdp", choices=["no", "two"], default="no",
                   help="also launch --qlora under accelerate_configs/fsdp.yaml on 2 GPUs (see the docstring)")
    p.add_argument("--data", type=Path, default=first_existing(BENCHDATA / "alpaca_sample.json",
                                                               SHARED / "datasets" / "alpaca_sample.json"))
    p.add_argument("--tokenizer", type=Path, default=first_existing(
        BENCHDATA / "tokenizer", SHARED / "tokenizers" / "deepseek-coder-6.7b-instruct"))
    p.add_argument("--workdir", type=Path, default=Path("/tmp/qlora_check"))
    p.add_argument("--out", default=os.environ.get("OUT"), help="copy logs and the new rows here (default $OUT)")
    p.add_argument("--results", type=Path, help="rows appended here (default: $OUT/results.jsonl when --out, "
                                                "else bench/results.jsonl; the CPU smoke: the workdir)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per training run")
    p.add_argument("--notes", default="")
    p.add_argument("--skip_single", action="store_true", help="only the FSDP/DDP runs (their one-process LoRA and "
                   "QLoRA rows measured already)")
    p.add_argument("--cpu_smoke", action="store_true", help="the plumbing on a CPU: tiny shape, --lora only, "
                                                            "9 steps of 256 tokens, no cap (no bitsandbytes run)")
    p.add_argument("--prepare", action="store_true", help="here, before a GPU call: .benchdata, .whl-qlora")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(json.loads(argv[1]), argv[argv.index("--") + 1:])
    p = parser()
    args = p.parse_args(argv)
    if args.prepare:
        return prepare()
    if args.data is None or args.tokenizer is None:
        p.error("no data/tokenizer: run `python bench/qlora_check.py --prepare` (or give --data and --tokenizer)")
    if args.cpu_smoke:
        args.shape, args.steps, args.warmup, args.seq_len, args.micro_batch, args.mem_cap_gib = "tiny", 9, 1, 256, 2, 0
        args.learning_rate = 1e-2
    args.timeout = args.timeout or (600 if args.shape == "7b" else 300)
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.results = args.results or (args.workdir / "results.jsonl" if args.cpu_smoke else
                                    Path(args.out) / "results.jsonl" if args.out else REPO / "bench" / "results.jsonl")
    caches = [Path.home() / ".triton" / "cache", Path(f"/tmp/torchinductor_{os.environ.get('USER', 'root')}")]
    args.cold_cache = not any(c.exists() for c in caches)

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not args.cpu_smoke:
        p.error("no GPU: QLoRA needs one (on a CPU, --cpu_smoke checks this script's plumbing with --lora)")
    log(f"run_id {args.run_id}: shape {args.shape}, {gpus} GPU(s), cap {args.mem_cap_gib or 'none'} GiB, data "
        f"{args.data}, tokenizer {args.tokenizer}, {'cold' if args.cold_cache else 'warm'} compile caches")
    model = build_model(args, args.workdir / "models" / args.shape)
    log(f"model ready: {model}")

    rows = []
    runs = [("lora-1", False)] if args.cpu_smoke else [] if args.skip_single else [("lora-1", False), ("qlora-1", True)]
    for name, qlora in runs:
        row = run(args, f"{args.shape}-{name}", model, qlora)
        if row:
            rows.append(row)
    sharded = []
    if not args.cpu_smoke:
        if gpus >= 2 and not BNB:  # bench/gpu_session.sh's wheels (.whl) carry no bitsandbytes
            log("DDP+QLoRA skipped: bitsandbytes is not installed (the FSDP run needs torchao only)")
        sharded += [("qlora-ddp-2", "ddp", 2)] if gpus >= 2 and BNB else []
        sharded += [("qlora-fsdp-2", "fsdp", 2)] if args.fsdp == "two" and gpus >= 2 else []
    for name, strategy, processes in sharded:
        row = run(args, f"{args.shape}-{name}", model, True, strategy=strategy, gpus=processes)
        if row:
            rows.append(row)
    if gpus < 2 and not args.cpu_smoke:
        log(f"DDP+QLoRA skipped: {gpus} GPU visible (it needs 2)")

    # The adapter afterwards. A CPU smoke checks its LoRA adapter the same way, on a 4-bit base too when
    # bitsandbytes (its CPU backend) is importable.
    smoke_4bit = args.cpu_smoke and BNB
    for row in rows:
        if row["method"] == "qlora" or args.cpu_smoke:
            nf4_shards = row["n_gpus"] if row["method"] == "qlora" and row["strategy"] == "fsdp" else None
            row.update(adapter_checks(args, row["name"], args.workdir / row["name"] / "output", model,
                                      quantized=row["method"] == "qlora" or smoke_4bit, nf4_shards=nf4_shards))
    lora = next((r for r in rows if r["method"] == "lora"), None)
    for row in rows:
        if lora and row is not lora and lora["real_tok_s"]:
            row["tok_s_vs_lora"] = round(row["real_tok_s"] / lora["real_tok_s"], 3)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print("\n| run | tok/s | x LoRA | peak reserved GiB | peak allocated GiB | nvidia-smi GiB | loss first -> last |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['real_tok_s']:,.0f} | {r.get('tok_s_vs_lora', 1.0) if r is not lora else 1.0} | "
              f"{r['peak_mem_gib']} | {r['peak_allocated_gib']} | {r['nvidia_smi_mem_gib']} | "
              f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
    failed = [c for c in CHECKS if not c["ok"]]
    log(f"{len(CHECKS) - len(failed)} passed, {len(failed)} failed; {len(rows)} rows appended to {args.results}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "qlora_checks.json").write_text(json.dumps(CHECKS, indent=1))
        for f in args.workdir.glob("*/log.txt"):
            shutil.copy(f, out / f"{f.parent.name}.log")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
