"""Measure ONE training configuration of our trainer (sft/train.py, unchanged) and append one JSON line to
bench/results.jsonl.

    python bench/train_throughput.py --run_id R --name lora-ddp-2 --strategy ddp --n_gpus 2 --method lora \
        --micro_batch 1 --grad_accum 4 -- --use_liger_kernel true

The parent process launches `accelerate launch ... bench/train_throughput.py --worker ...` (one process per
GPU), samples GPU memory as `nvidia-smi` sees it (NVML) and host RAM (psutil: RSS summed over the launcher's
process tree) every 0.5 s, then joins what each rank wrote and appends the row.

Each worker rank runs `sft.train.main` with our real options, data path (read -> template -> tokenize ->
pack to --seq_len) and Trainer callbacks. The bench only swaps in what a benchmark needs:
  * the model is built from a config (deepseek-llm-7b shape, random init) instead of downloaded: directly on
    the rank's GPU, or partitioned at creation under ZeRO-3 (transformers' zero.Init path);
  * every rank's PyTorch allocator is capped (torch.cuda.set_per_process_memory_fraction) to emulate 24 GB cards;
  * the final save is skipped (saving is proven by the strategy checks, not timed here);
  * a subclass of our ThroughputCallback also keeps what it logs, per step, and profiles a few steps after the
    measured ones to get the share of step time the NCCL kernels run (torch.profiler, CUDA activity).

Numbers: real tokens/s is the callback's (non-padding tokens, summed over ranks, over training-step time)
aggregated over the measured steps (after --warmup steps); MFU = real tok/s x F / (peak x GPUs) with F = 6N
(full) or 4N (LoRA), N = parameters of the matmuls from the config (lm_head included, input embeddings not),
peak 790 TFLOP/s per H200 (sft.callbacks.PEAK_FLOPS); attention score FLOPs and recomputation are not counted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results.jsonl"
GIB = 2**30

# deepseek-llm-7b's shape (LlamaForCausalLM); "tiny" is the same architecture at a size a CPU trains in seconds.
MODELS = {
    "deepseek-llm-7b": dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30,
                            num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0,
                            max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # deepseek-coder-1.3b's shape: small enough that a full fine-tune with fp32 master weights fits two 24 GB cards
    # sharded (FSDP or tensor parallel) but not one replica per card: the size where TP and FSDP compete.
    "deepseek-coder-1.3b": dict(vocab_size=32256, hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                                num_attention_heads=16, num_key_value_heads=16, rope_theta=100000.0,
                                max_position_embeddings=16384, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny": dict(vocab_size=32256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0, max_position_embeddings=4096,
                 tie_word_embeddings=False),
}


def matmul_params(shape: dict) -> int:
    """Parameters of every matmul (lm_head included, input embeddings and norms not), as our MFU counts them."""
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    head = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    return layers * per_layer + v * h


# Each strategy is launched with the repository's own accelerate config (what users run), with the number of
# processes given here. DeepSpeed rows may name another JSON (the peers' recipe) with --ds_config.
CONFIGS = {"single": "single_gpu.yaml", "ddp": "ddp.yaml", "fsdp": "fsdp.yaml", "zero2": "zero2.yaml",
           "zero3": "zero3.yaml", "zero3_offload": "zero3_offload.yaml", "tp": "tp.yaml"}


def launch_flags(strategy: str, n_gpus: int, ds_config: str | None, port: int, cpu: bool) -> list[str]:
    flags = ["--config_file", str(REPO / "accelerate_configs" / CONFIGS[strategy]), "--num_processes", str(n_gpus),
             "--main_process_port", str(port)]
    if cpu:
        flags += ["--cpu"] if strategy == "single" else []
    if strategy == "fsdp":
        # The bench builds the (random) weights on every rank's GPU, so there is nothing to load on rank 0 only.
        flags += ["--fsdp_cpu_ram_efficient_loading", "false"]
    if ds_config:
        flags += ["--deepspeed_config_file", str(Path(ds_config).resolve())]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# Parent: launch, watch memory, write the row.

class Monitor(threading.Thread):
    """Peak host RAM (RSS summed over a process tree) and peak GPU memory per device as NVML (nvidia-smi) sees it."""

    def __init__(self, pid: int, gpus: list[int]):
        super().__init__(daemon=True)
        self.pid, self.gpus = pid, gpus
        self.host_peak = 0
        self.gpu_peak: dict[int, int] = {}
        self.stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = {g: pynvml.nvmlDeviceGetHandleByIndex(g) for g in gpus}
        except Exception:
            self.nvml = None

    def run(self):
        import psutil

        root = psutil.Process(self.pid)
        while not self.stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.host_peak = max(self.host_peak, total)
            except psutil.Error:
                pass
            if self.nvml:
                for g, h in self.handles.items():
                    used = self.nvml.nvmlDeviceGetMemoryInfo(h).used
                    self.gpu_peak[g] = max(self.gpu_peak.get(g, 0), used)
            self.stop.wait(0.5)


def git_commit() -> str:
    if os.environ.get("BENCH_COMMIT"):  # a copy of the tree without git (the lent GPU machines)
        return os.environ["BENCH_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "") if sha else "unknown"
    except OSError:
        return "unknown"


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
        return out[0].strip() if out else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def parent(args, train_args: list[str]) -> int:
    import torch

    cpu = not torch.cuda.is_available()
    out = Path(args.out).resolve() / args.name
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    spec = {k: getattr(args, k) for k in ("name", "model", "method", "strategy", "seq_len", "micro_batch",
                                           "grad_accum", "warmup", "steps", "profile_steps", "mem_cap_gib")}
    spec["out"] = str(out)
    command = [sys.executable, "-m", "accelerate.commands.launch",  # this interpreter's accelerate
               *launch_flags(args.strategy, args.n_gpus, args.ds_config, free_port(), cpu),
               str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--",
               *worker_train_args(args, cpu), *train_args]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           # torchrun/accelerate would set 1 thread per process, which starves DeepSpeed's CPU Adam.
           "OMP_NUM_THREADS": (os.environ.get("OMP_NUM_THREADS")
                               or str(max(1, (os.cpu_count() or 2) // max(1, args.n_gpus))))}
    if args.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    print(f"[bench] {args.name}: {shlex.join(command)}", flush=True)
    log = open(out / "log.txt", "w")
    start = time.time()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    monitor = Monitor(proc.pid, list(range(args.n_gpus)))
    monitor.start()
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = "timeout"
    monitor.stop.set()
    monitor.join()
    wall = time.time() - start
    log.close()
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if rc != 0 or not ranks:
        tail = (out / "log.txt").read_text()[-3000:]
        print(f"[bench] {args.name}: FAILED (exit {rc}) after {wall:.0f}s: {error_line(tail)}", flush=True)
        failure = {"run_id": args.run_id, "name": args.name, "status": "failed", "exit": rc,
                   "error": error_line(tail)}
        with open(out.parent / "failures.jsonl", "a") as f:
            f.write(json.dumps(failure) + "\n")
        return 1
    row = make_row(args, ranks, monitor, wall, cpu)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a") as f:  # shared file: append only
        f.write(json.dumps(row) + "\n")
    print(f"[bench] {args.name}: {row['real_tok_s']} tok/s, MFU {row['mfu']}, peak reserved {row['peak_mem_gib']} "
          f"GiB, nvidia-smi {row['nvidia_smi_mem_gib']} GiB, host {row['host_ram_gib']} GiB, comm "
          f"{row['comm_share']}, {wall:.0f}s", flush=True)
    return 0


def error_line(tail: str) -> str:
    lines = [x for x in tail.splitlines() if "Error" in x or "error" in x]
    return (lines[-1] if lines else tail.strip().splitlines()[-1] if tail.strip() else "")[:300]


def make_row(args, ranks: list[dict], monitor: Monitor, wall: float, cpu: bool) -> dict:
    from sft.callbacks import PEAK_FLOPS

    r0 = next(r for r in ranks if r["rank"] == 0)
    shape = MODELS[args.model]
    n = matmul_params(shape)
    flops = (4 if args.method == "lora" else 6) * n
    name = gpu_name() if not cpu else "cpu"
    peak = next((v for k, v in PEAK_FLOPS.items() if name and k in name), None)
    tok_s = r0["real_tok_s"]
    scaling = None
    if args.scaling_of:
        base = [json.loads(x) for x in Path(args.results).read_text().splitlines() if x.strip()] \
            if Path(args.results).exists() else []
        base = [b for b in base if b.get("run_id") == args.run_id and b.get("name") == args.scaling_of]
        if base and base[-1].get("real_tok_s"):
            scaling = round(tok_s / base[-1]["real_tok_s"], 3)
    row = {
        "run_id": args.run_id,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "gpu": name,
        "n_gpus": args.n_gpus,
        "mem_cap_gib": args.mem_cap_gib or None,
        "model": args.model,
        "method": args.method,
        "strategy": args.strategy,
        "peer": args.peer,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "real_tok_s": round(tok_s, 1),
        "mfu": round(tok_s * flops / (peak * args.n_gpus), 4) if peak else None,
        "peak_mem_gib": round(max(r["max_reserved_gib"] for r in ranks), 2) if not cpu else None,
        "host_ram_gib": round(monitor.host_peak / GIB, 1),
    }
    if args.n_gpus > 1:
        row["scaling"] = scaling
    row.update({
        "name": args.name,
        "peak_allocated_gib": round(max(r["max_allocated_gib"] for r in ranks), 2) if not cpu else None,
        "nvidia_smi_mem_gib": round(max(monitor.gpu_peak.values()) / GIB, 2) if monitor.gpu_peak else None,
        "comm_share": r0.get("comm_share"),
        "copy_share": r0.get("copy_share"),
        "compute_share": r0.get("compute_share"),
        "top_kernels": r0.get("top_kernels"),
        "step_s": r0.get("step_s"),
        "tokens_per_step": r0.get("tokens_per_step"),
        "callback_mfu": r0.get("callback_mfu"),
        "measured_steps": r0.get("measured_steps"),
        "loss_first_last": r0.get("loss_first_last"),
        "wall_s": round(wall, 1),
        "train_args": args.train_args_text,
        "notes": args.notes,
    })
    return row


def model_dir(args) -> Path:
    """A model directory holding only config.json and the tokenizer: the worker builds random weights from it
    (sft's model loading, the host-RAM check and the LoRA target lookup read it like any model directory).
    Tensor parallel rows get random bf16 weights on disk instead: transformers shards a TP model while loading
    its files, so those rows load through the real from_pretrained."""
    from transformers import AutoTokenizer, LlamaConfig

    weights = args.strategy == "tp"
    path = Path(args.out).resolve() / "models" / (args.model + ("-weights" if weights else ""))
    if not (path / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        config = LlamaConfig(**MODELS[args.model], bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_cache=False)
        if weights:
            import torch
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
        else:
            config.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def worker_train_args(args, cpu: bool) -> list[str]:
    """Options of sft/train.py every bench row shares; a row's own options come after and win."""
    data = Path(args.data).resolve()
    steps = args.warmup + args.steps + args.profile_steps
    precision = [] if cpu else (["--fp16", "true"] if args.precision == "fp16" else
                                ["--bf16", "true"] if args.precision == "bf16" else [])
    return ["--model", str(model_dir(args)),
            "--dataset", *[str(data)] * args.repeat_data, "--packing", "true", "--max_length", str(args.seq_len),
            "--per_device_train_batch_size", str(args.micro_batch),
            "--gradient_accumulation_steps", str(args.grad_accum), "--max_steps", str(steps),
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--eval_strategy", "no",
            "--learning_rate", "1e-5", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
            "--output_dir", str(Path(args.out).resolve() / args.name / "output"),
            "--dataset_cache_dir", str(Path(args.out).resolve() / "dataset-cache"),
            "--dataloader_num_workers", "2", "--seed", "0", "--verify_saves", "no", *precision,
            *(["--lora", "true"] if args.method == "lora" else []),
            *(["--tp_size", str(args.n_gpus)] if args.strategy == "tp" else [])]


# ---------------------------------------------------------------------------------------------------------------
# Worker: one rank of the run.

def worker(spec: dict, train_argv: list[str]) -> int:
    import torch

    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        if spec["mem_cap_gib"]:  # emulate a 24 GB card: the allocator refuses beyond the cap
            total = torch.cuda.get_device_properties(local).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["mem_cap_gib"] * GIB / total), local)

    import transformers

    import sft.callbacks
    import sft.model
    import sft.train

    if spec["strategy"] != "tp":  # TP rows load their random weights from disk, sharded as they load
        sft.model.AutoModelForCausalLM = _RandomInitModel()
    sft.train.ThroughputCallback = _bench_callback(spec, rank)  # sft.train holds its own reference
    # Saving is not timed here (the strategy checks prove it): skip the final save and FSDP's consolidation.
    transformers.Trainer.save_model = lambda self, *a, **k: None
    sft.train.save_final = sft.train.consolidate_fsdp_saves = lambda *a, **k: None
    host_ram = os.environ.get("SFT_BENCH_HOST_RAM_GIB")
    if host_ram:  # the GPU VMs report a MemTotal that grows as memory is used: give the offload check the real size
        import sft.distributed

        check = sft.distributed.check_offload_ram
        size = int(float(host_ram) * GIB)
        sft.distributed.check_offload_ram = lambda *a, **k: check(*a, **{**k, "available": size, "total": size})
    code = sft.train.main(train_argv)
    sft.distributed.end_process_group()
    return code


class _RandomInitModel:
    """Stands in for AutoModelForCausalLM inside sft.model: random weights from the directory's config.json."""

    def from_pretrained(self, name, dtype=None, attn_implementation=None, **kwargs):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        config = AutoConfig.from_pretrained(name)
        build = dict(dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32,
                     attn_implementation=attn_implementation)
        torch.manual_seed(0)
        if is_deepspeed_zero3_enabled() or not torch.cuda.is_available():
            # zero.Init partitions at creation (on GPU, or on CPU under offload_param): no full copy per rank
            return AutoModelForCausalLM.from_config(config, **build)
        with torch.device("cuda", torch.cuda.current_device()):
            return AutoModelForCausalLM.from_config(config, **build)


def _bench_callback(spec: dict, rank: int):
    """Our ThroughputCallback, plus: keep each step's logged numbers, profile a few steps, write rank JSON."""
    import torch

    from sft.callbacks import ThroughputCallback

    warmup, steps, profile_steps = spec["warmup"], spec["steps"], spec["profile_steps"]

    class BenchThroughput(ThroughputCallback):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.windows: list[dict] = []
            self.prof = None
            self.prof_t0 = 0.0
            self.comm = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            super().on_log(args, state, control, logs=logs, **kwargs)
            if logs and "real_tokens_per_second" in logs:
                self.windows.append({"step": state.global_step, "tokens": self.logged_tokens,
                                     "rate": logs["real_tokens_per_second"], "mfu": logs.get("mfu"),
                                     "loss": logs.get("loss")})

        def on_step_end(self, args, state, control, **kwargs):
            super().on_step_end(args, state, control, **kwargs)
            if profile_steps and rank == 0 and state.global_step == warmup + steps:
                self._start_profile()
            elif self.prof is not None and state.global_step == warmup + steps + profile_steps:
                self._stop_profile()

        def _start_profile(self):
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.prof_t0 = time.perf_counter()

        def _stop_profile(self):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall_us = (time.perf_counter() - self.prof_t0) * 1e6
            self.prof.__exit__(None, None, None)
            self.comm = profile_shares(self.prof, wall_us)
            self.prof = None

        def on_train_end(self, args, state, control, **kwargs):
            measured = [w for w in self.windows if warmup < w["step"] <= warmup + steps]
            tokens = sum(w["tokens"] for w in measured)
            seconds = sum(w["tokens"] / w["rate"] for w in measured if w["rate"])
            result = {"rank": rank, "measured_steps": len(measured),
                      "real_tok_s": tokens / seconds if seconds else 0.0,
                      "step_s": round(seconds / len(measured), 3) if measured else None,
                      "tokens_per_step": round(tokens / len(measured)) if measured else None,
                      "callback_mfu": measured[-1]["mfu"] if measured else None,
                      "loss_first_last": [self.windows[0]["loss"], self.windows[-1]["loss"]] if self.windows else None,
                      "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB if torch.cuda.is_available() else None,
                      "max_allocated_gib": (torch.cuda.max_memory_allocated() / GIB
                                            if torch.cuda.is_available() else None),
                      **(self.comm or {})}
            Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))

    return BenchThroughput


def profile_shares(prof, wall_us: float) -> dict:
    """Share of the profiled wall time during which NCCL kernels ran (union of their intervals, on any stream),
    and likewise host<->device copies and every other kernel (compute). NCCL time that overlaps compute is counted
    too: this is the time spent communicating, an upper bound on what communication adds to the step. A low
    compute share means the GPU waited (on the host, or on a peer); the top kernels say where its time went."""
    nccl, copies, compute = [], [], []
    kernel_us: dict[str, float] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) is None or str(e.device_type) != "DeviceType.CUDA":
            continue
        start, end = e.time_range.start, e.time_range.end
        if "nccl" in e.name.lower():
            nccl.append((start, end))
        elif "Memcpy HtoD" in e.name or "Memcpy DtoH" in e.name:
            copies.append((start, end))
        else:
            compute.append((start, end))
            kernel_us[e.name] = kernel_us.get(e.name, 0.0) + (end - start)
    top = sorted(kernel_us.items(), key=lambda kv: -kv[1])[:4]
    share = (lambda x: round(x / wall_us, 3) if wall_us else None)
    return {"comm_share": share(union(nccl)), "copy_share": share(union(copies)),
            "compute_share": share(union(compute)), "profiled_us": round(wall_us),
            "top_kernels": [f"{share(us)} {name[:70]}" for name, us in top]}


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


# ---------------------------------------------------------------------------------------------------------------

def parse(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run_id", required=True, help="One id per bench invocation, shared by the rows compared.")
    p.add_argument("--name", required=True, help="Row name, unique within the run (used by --scaling_of).")
    p.add_argument("--model", default="deepseek-llm-7b", choices=sorted(MODELS))
    p.add_argument("--method", default="lora", choices=["lora", "full"])
    p.add_argument("--strategy", default="single", choices=sorted(CONFIGS))
    p.add_argument("--peer", default="ours", help="ours, trl, zero3-offload-recipe, ...")
    p.add_argument("--n_gpus", type=int, default=1, help="Processes (one per GPU); 3 for the three-card box.")
    p.add_argument("--ds_config", help="DeepSpeed JSON for zero2/zero3/zero3_offload.")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "none"],
                   help="Trainer mixed precision: bf16/fp16 autocast, or none (weights' own dtype).")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3, help="Optimizer steps left out of the numbers.")
    p.add_argument("--steps", type=int, default=5, help="Optimizer steps measured.")
    p.add_argument("--profile_steps", type=int, default=1, help="Steps profiled after the measured ones (0: none).")
    p.add_argument("--mem_cap_gib", type=float, default=24.0, help="Per-rank allocator cap; 0 for none.")
    p.add_argument("--alloc_conf", default="expandable_segments:True", help="PYTORCH_CUDA_ALLOC_CONF ('' to leave).")
    p.add_argument("--data", default=str(REPO / ".benchdata" / "alpaca_sample.json"))
    p.add_argument("--repeat_data", type=int, default=2, help="Pass the data file this many times (more rows).")
    p.add_argument("--tokenizer", default=str(REPO / ".benchdata" / "tokenizer"))
    p.add_argument("--scaling_of", help="Name of the 1-GPU row of this run_id to compute `scaling` against.")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--out", default=str(REPO / "output" / "bench"))
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--notes", default="")
    args = p.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        split = argv.index("--")
        return worker(json.loads(argv[1]), argv[split + 1:])
    split = argv.index("--") if "--" in argv else len(argv)
    args = parse(argv[:split])
    args.train_args_text = shlex.join(argv[split + 1:])
    return parent(args, argv[split + 1:])


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
