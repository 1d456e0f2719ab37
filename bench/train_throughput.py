"""Measure ONE training configuration, ours or TRL's, and append one JSON line to bench/results.jsonl.
bench/throughput.py runs its table of rows through this, one row after the other; alone:

    python bench/train_throughput.py --run_id R --name lora-ddp-2 --strategy ddp --n_gpus 2 --method lora \
        --micro_batch 1 --grad_accum 4 -- --use_liger_kernel true          # sft/train.py options after --
    python bench/train_throughput.py --run_id R --name trl-lora --peer trl --method lora --micro_batch 8 \
        -- --activation_checkpointing false --use_liger_kernel true        # TRL SFTConfig options after --

The parent process launches `accelerate launch ... bench/train_throughput.py --worker ...` (one process per
GPU), samples GPU memory as `nvidia-smi` counts it (NVML, every GPU of the machine, by UUID: the row quotes the
GPUs its ranks report, whatever CUDA_VISIBLE_DEVICES renumbered) and host RAM (psutil: RSS summed over the
launcher's process tree) every 0.5 s, then joins what each rank wrote and appends the row.

`--peer ours` (default): each rank runs `sft.train.main` with our real options, data path (read -> template ->
tokenize -> pack to --seq_len) and Trainer callbacks, through main's seams (no module name is replaced):
  * model_factory=random_init: the model is built from the directory's config (random init) instead of loaded:
    directly on the rank's GPU, or partitioned at creation under ZeRO-3 (transformers' zero.Init path). Tensor
    parallel and QLoRA rows load random weights written to disk (transformers shards / quantizes while loading);
  * callbacks=[the bench clock]: keeps each step's real tokens and seconds, profiles a few steps after the
    measured ones (share of step time NCCL kernels run: torch.profiler, CUDA activity), writes rank<N>.json;
  * save=False: no final save (saving is proven by the strategy checks, not timed here).
`--peer trl`: each rank builds TRL 1.16's SFTTrainer from the options after `--` (HfArgumentParser(SFTConfig)) on
the same data file, tokenizer (its chat template with TRL's `{% generation %}` markers: the same text) and model
(random_init of the same config, with SFTConfig's model_init_kwargs: attn_implementation, dtype); LoRA rows get
our LoRA (r 16, alpha 32, dropout 0, our targets for the family: sft.model.loading.lora_targets), and the same clock.
Every rank's PyTorch allocator is capped (torch.cuda.set_per_process_memory_fraction) to emulate 24 GB cards.

Numbers, the same for both peers: real tokens/s = the Trainer's non-padding token count (summed over ranks) over
the measured optimizer steps' time (after --warmup steps; step end to step end); MFU = real tok/s x F /
(peak x GPUs) with F = 6N (full) or 4N (LoRA, QLoRA), N = the matmul parameters one token passes through, from the
config (matmul_params: lm_head included, input embeddings not; for MoE the active experts only), peak 790 TFLOP/s
per H200 (sft.report.callbacks.PEAK_FLOPS). Attention-score FLOPs and recomputation are not counted. TRL rows get this
same formula: TRL 1.16's SFTTrainer logs no MFU, and the FLOP count in trl/trainer/utils.py (compute_flops_per_token,
used by its experimental trainers only) differs: 3x the forward for LoRA too, attention scores over the full
length (for the 7B shape at 2048 tokens 1.078 x 6N), 989 TFLOP/s for an H200, and a DeepSeek-V2 config makes it
raise (no num_local_experts). TRL's fused LM head also skips the lm_head matmul of prompt tokens: work it does not
do, which this formula (per real token, like ours) still credits it.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import gc
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results.jsonl"
GIB = 2**30

MODELS = {
    # deepseek-llm-7b's shape (LlamaForCausalLM)
    "deepseek-llm-7b": dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30,
                            num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0,
                            max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # deepseek-coder-1.3b's shape: small enough that a full fine-tune with fp32 master weights fits two 24 GB cards
    # sharded (FSDP or tensor parallel) but not one replica per card: the size where TP and FSDP compete.
    "deepseek-coder-1.3b": dict(vocab_size=32256, hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                                num_attention_heads=16, num_key_value_heads=16, rope_theta=100000.0,
                                max_position_embeddings=16384, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # deepseek-coder-6.7b's shape (LlamaForCausalLM); its linear RoPE scaling x4 is left out (random weights, 2048
    # tokens: the same FLOPs and memory)
    "deepseek-coder-6.7b": dict(vocab_size=32256, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, rope_theta=100000.0,
                                max_position_embeddings=16384, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # DeepSeek-R1-Distill-Qwen-7B's shape (Qwen2ForCausalLM: grouped-query attention, 4 KV heads, 152k vocabulary)
    "r1-distill-qwen-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                               rope_theta=10000.0, max_position_embeddings=131072, rms_norm_eps=1e-6,
                               use_sliding_window=False, tie_word_embeddings=False),
    # DeepSeek-V2-Lite's shape (DeepseekV2ForCausalLM, 15.7B): MLA attention, layer 0 dense, then 64 routed experts
    # (6 per token) and 2 shared ones per layer. Its YaRN RoPE scaling is left out (random weights, 2048 tokens).
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
                             first_k_dense_replace=1, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
                             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy",
                             n_group=1, topk_group=1, norm_topk_prob=False, rope_theta=10000.0,
                             max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # the deepseek-llm architecture at a size a CPU trains in seconds (the DeepSeek-Coder tokenizer's vocabulary)
    "tiny": dict(vocab_size=32256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0, max_position_embeddings=4096,
                 tie_word_embeddings=False),
    # DeepSeek-V2-Lite's architecture (MLA, a dense first layer, routed and shared experts) at a CPU's size
    "tiny-moe": dict(model_type="deepseek_v2", vocab_size=32256, hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                     routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                     qk_nope_head_dim=8, v_head_dim=16, topk_method="greedy", n_group=1, topk_group=1,
                     norm_topk_prob=False, rope_theta=10000.0, max_position_embeddings=4096,
                     tie_word_embeddings=False),
}


def model_config(name: str, **extra):
    """The transformers config of a MODELS shape; `extra` overrides or adds fields (fewer layers, token ids)."""
    from transformers import AutoConfig

    shape = {**MODELS[name], **extra}
    return AutoConfig.for_model(shape.pop("model_type", "llama"), **shape)


def save_random_model(name: str, tokenizer_dir: str | Path, path: str | Path, weights: bool = True,
                      **overrides) -> None:
    """A model directory for a MODELS shape with the tokenizer's special tokens: random bf16 weights written with
    save_pretrained (built on the GPU where there is one: seconds; fp32 on a CPU, which trains in fp32), or only
    config.json (weights=False: the runs build them with random_init). The benchmarks then load it through the
    real path, like any model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = model_config(name, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, **overrides)
    assert len(tokenizer) <= config.vocab_size, (len(tokenizer), config.vocab_size)
    if weights:
        cuda = torch.cuda.is_available()
        torch.manual_seed(0)
        with torch.device("cuda" if cuda else "cpu"):
            built = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
        built.save_pretrained(path)
        print(f"model {name}: {sum(p.numel() for p in built.parameters()) / 1e9:.2f}B parameters -> {path}",
              flush=True)
        del built
    else:
        config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def matmul_params(shape: dict) -> int:
    """Parameters of the matmuls one token passes through (lm_head included, input embeddings and norms not), as
    our MFU counts them. For a DeepSeek MoE shape only the ACTIVE ones: the MLA projections, the dense first
    layers' MLP, and in every MoE layer the router, num_experts_per_tok routed experts and the shared experts."""
    h, v, layers = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    heads = shape["num_attention_heads"]
    if "n_routed_experts" not in shape:
        kv = shape["num_key_value_heads"] * (h // heads)
        return layers * (2 * h * h + 2 * h * kv + 3 * h * shape["intermediate_size"]) + v * h
    nope, rope, v_dim = shape["qk_nope_head_dim"], shape["qk_rope_head_dim"], shape["v_head_dim"]
    kv_rank, q_rank = shape["kv_lora_rank"], shape.get("q_lora_rank")
    q = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
    attention = q + h * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * h
    dense = shape["first_k_dense_replace"]
    experts = shape["num_experts_per_tok"] + shape["n_shared_experts"]
    moe = h * shape["n_routed_experts"] + experts * 3 * h * shape["moe_intermediate_size"]
    return layers * attention + dense * 3 * h * shape["intermediate_size"] + (layers - dense) * moe + v * h


# Each strategy is launched with the repository's own accelerate config (what users run), with the number of
# processes given here. DeepSpeed rows may name another JSON (the peers' recipe) with --ds_config.
CONFIGS = {"single": "single_gpu.yaml", "ddp": "ddp.yaml", "fsdp": "fsdp.yaml", "zero2": "zero2.yaml",
           "zero3": "zero3.yaml", "zero3_offload": "zero3_offload.yaml", "tp": "tp.yaml", "autoep": "autoep.yaml"}


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
    """Peak host RAM (RSS summed over a process tree) and the peak memory of every GPU of the machine as nvidia-smi
    counts it (NVML), keyed by UUID. NVML numbers all of the machine's GPUs while the ranks see CUDA_VISIBLE_DEVICES
    renumbered: the row picks the peaks of the UUIDs its ranks report (used_gpus)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.host_peak = 0
        self.gpu_peak: dict[str, int] = {}  # UUID -> bytes
        self.index: dict[str, int] = {}  # UUID -> NVML index (what nvidia-smi shows)
        self.stop = threading.Event()
        self.handles = {}
        from sft.report.telemetry import memory_used  # nvidia-smi's count (NVML v2)

        self.memory_used = memory_used
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                self.handles[uuid], self.index[uuid] = handle, i
        except Exception:  # no NVIDIA driver (a CPU machine) or no nvidia-ml-py
            self.nvml = None

    def run(self):
        import psutil

        root = psutil.Process(self.pid)
        while not self.stop.is_set():
            try:
                total = 0
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.host_peak = max(self.host_peak, total)
            except psutil.Error:
                pass
            for uuid, handle in self.handles.items():
                self.gpu_peak[uuid] = max(self.gpu_peak.get(uuid, 0), self.memory_used(self.nvml, handle))
            self.stop.wait(0.5)

    def used_gpus(self, ranks: list[dict]) -> tuple[list[int], float | None]:
        """(NVML indices, peak GiB of the busiest) of the GPUs the ranks ran on."""
        uuids = sorted({r["gpu_uuid"] for r in ranks if r.get("gpu_uuid") in self.gpu_peak},
                       key=lambda u: self.index[u])
        peak = max((self.gpu_peak[u] for u in uuids), default=None)
        return [self.index[u] for u in uuids], round(peak / GIB, 2) if peak is not None else None


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


def compile_cache_dirs(env: dict) -> list[Path]:
    """Where compiled kernels persist between processes: inductor's cache (FX graphs, AOTAutograd, and its Triton
    kernels unless TRITON_CACHE_DIR is set) and Triton's own (Liger's kernels, torchao's)."""
    inductor = env.get("TORCHINDUCTOR_CACHE_DIR")
    if not inductor:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            inductor = default_cache_dir()
        except ImportError:  # a torch that moved it: its documented default
            import getpass
            import tempfile

            inductor = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    triton = env.get("TRITON_CACHE_DIR") or os.path.join(env.get("TRITON_HOME") or Path.home(), ".triton", "cache")
    return [Path(inductor), Path(triton)]


def caches_empty(dirs: list[Path]) -> bool:
    return not any(f.is_file() for d in dirs if d.is_dir() for f in d.rglob("*"))


def run_row(args, train_args: list[str], env_extra: dict[str, str] | None = None) -> dict | None:
    """Launch the row (with `env_extra` in its environment), watch it, append its JSON line to args.results;
    -> the row, or None when it failed."""
    import torch

    cpu = not torch.cuda.is_available()
    out = Path(args.out).resolve() / args.name
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    model = model_dir(args)
    spec = {k: getattr(args, k) for k in ("name", "peer", "model", "method", "strategy", "seq_len", "micro_batch",
                                           "grad_accum", "warmup", "steps", "profile_steps", "mem_cap_gib",
                                           "repeat_data")}
    spec.update(out=str(out), model_dir=str(model), data=str(Path(args.data).resolve()), weights=needs_weights(args))
    training = (trl_train_args(args, cpu) if args.peer == "trl"
                else worker_train_args(args, model, cpu, recipe="--config" in train_args)) + train_args
    command = [sys.executable, "-m", "accelerate.commands.launch",  # this interpreter's accelerate
               *launch_flags(args.strategy, args.n_gpus, args.ds_config, free_port(), cpu),
               str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--", *training]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           # torchrun/accelerate would set 1 thread per process, which starves DeepSpeed's CPU Adam.
           "OMP_NUM_THREADS": (os.environ.get("OMP_NUM_THREADS")
                               or str(max(1, (os.cpu_count() or 2) // max(1, args.n_gpus)))),
           **(env_extra or {})}
    if args.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    if os.environ.get("SFT_BENCH_HOST_RAM_GIB"):  # the GPU VMs report a MemTotal that grows as memory is used
        env.setdefault("SFT_HOST_RAM_GIB", os.environ["SFT_BENCH_HOST_RAM_GIB"])
    fresh = out / "compile-cache" if args.fresh_cache else None
    if fresh:  # the first run on a fresh machine: nothing compiled yet
        shutil.rmtree(fresh, ignore_errors=True)
        env.update(TORCHINDUCTOR_CACHE_DIR=str(fresh / "inductor"), TRITON_CACHE_DIR=str(fresh / "triton"))
    cold = caches_empty(compile_cache_dirs(env))
    print(f"[bench] {args.name}: {'cold' if cold else 'warm'} compile cache; {shlex.join(command)}", flush=True)
    start = time.time()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        monitor = Monitor(proc.pid)
        monitor.start()
        rc = wait_or_stop(proc, args.timeout)
        monitor.stop.set()
        monitor.join()
    wall = time.time() - start
    if fresh:
        shutil.rmtree(fresh, ignore_errors=True)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if rc != 0 or not ranks:
        tail = (out / "log.txt").read_text(errors="replace")[-3000:]
        print(f"[bench] {args.name}: FAILED (exit {rc}) after {wall:.0f}s: {error_line(tail)} (log: "
              f"{out / 'log.txt'})", flush=True)
        failure = {"run_id": args.run_id, "name": args.name, "status": "failed", "exit": rc,
                   "error": error_line(tail)}
        with open(out.parent / "failures.jsonl", "a") as f:
            f.write(json.dumps(failure) + "\n")
        return None
    row = make_row(args, ranks, monitor, wall, cpu)
    row["cold_cache"] = cold
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a") as f:  # shared file: append only
        f.write(json.dumps(row) + "\n")
    print(f"[bench] {args.name}: {row['real_tok_s']} tok/s, MFU {row['mfu']}, peak reserved {row['peak_mem_gib']} "
          f"GiB, nvidia-smi {row['nvidia_smi_mem_gib']} GiB, host {row['host_ram_gib']} GiB, comm "
          f"{row['comm_share']}, {wall:.0f}s", flush=True)
    return row


def wait_or_stop(proc: subprocess.Popen, timeout: float):
    """-> the exit code, or "timeout" after stopping the launcher's whole process group."""
    import signal

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        return "timeout"


def error_line(tail: str) -> str:
    lines = [x for x in tail.splitlines() if ("Error" in x or "error" in x) and "CalledProcessError" not in x
             and "launch.py" not in x]
    return (lines[-1] if lines else tail.strip().splitlines()[-1] if tail.strip() else "")[:300]


def make_row(args, ranks: list[dict], monitor: Monitor, wall: float, cpu: bool) -> dict:
    from sft.report.callbacks import PEAK_FLOPS

    r0 = next(r for r in ranks if r["rank"] == 0)
    flops = (6 if args.method == "full" else 4) * matmul_params(MODELS[args.model])
    name = "cpu" if cpu else r0.get("gpu_name")
    peak = next((v for k, v in PEAK_FLOPS.items() if name and k in name), None)
    tok_s = r0["real_tok_s"]
    scaling = None
    if args.scaling_of:
        base = [json.loads(x) for x in Path(args.results).read_text().splitlines() if x.strip()] \
            if Path(args.results).exists() else []
        base = [b for b in base if b.get("run_id") == args.run_id and b.get("name") == args.scaling_of]
        if base and base[-1].get("real_tok_s"):
            scaling = round(tok_s / base[-1]["real_tok_s"], 3)
    indices, smi = monitor.used_gpus(ranks)
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
        "vs": getattr(args, "vs", None),  # the peer row of the same run this row's ratio is against
        "gpu_indices": indices,  # as nvidia-smi numbers them
        "peak_allocated_gib": round(max(r["max_allocated_gib"] for r in ranks), 2) if not cpu else None,
        "nvidia_smi_mem_gib": smi,
        "comm_share": r0.get("comm_share"),
        "copy_share": r0.get("copy_share"),
        "compute_share": r0.get("compute_share"),
        "top_kernels": r0.get("top_kernels"),
        "kernel_ms": r0.get("kernel_ms"),
        "kernel_ms_total": r0.get("kernel_ms_total"),
        "idle_ms": r0.get("idle_ms"),  # where the GPU waited on the host, by host op (profiled steps)
        "gc_ms": r0.get("gc_ms"), "gc_longest": r0.get("gc_longest"), "step_seconds": r0.get("step_seconds"),
        # a log makes the host wait for the GPU (LOGGING_STEPS); None: a row another script trained (qlora_check)
        "logging_steps": logging_steps(args) if hasattr(args, "warmup") else None,
        "step_s": r0.get("step_s"),
        # the rate at the median measured step: a one-off in the window (a Triton kernel compiled for a new
        # specialization: Liger's loss at a batch whose labelled-token count is a multiple of 16) left out
        "steady_tok_s": steady_tok_s(r0.get("step_seconds"), tok_s, r0.get("step_s")),
        "tokens_per_step": r0.get("tokens_per_step"),
        "first_step_s": r0.get("first_step_s"),
        "callback_mfu": r0.get("callback_mfu"),
        # what the row ran with, read off the model: `auto` (a recipe's, or --fp8/--compile_layers auto) settles
        # by the GPU, so the options alone do not say (sft/plan/rows.py fast_of_row)
        "fp8_layers": r0.get("fp8_layers"),
        "compiled_layers": r0.get("compiled_layers"),
        # ... and its loss, read off the trainer: --chunked_loss auto settles by the model (sft/plan/rows.py)
        "loss_in_chunks": r0.get("loss_in_chunks"),
        "attention": r0.get("attention"),
        "measured_steps": r0.get("measured_steps"),
        "loss_first_last": r0.get("loss_first_last"),
        "wall_s": round(wall, 1),
        "train_args": args.train_args_text,
        "notes": args.notes,
    })
    moe = expert_load(Path(args.out).resolve() / args.name / "output" / "trainer_log.jsonl")
    if moe:
        row["moe"] = moe
    return row


def steady_tok_s(step_seconds: list[float] | None, tok_s: float, mean_step_s: float | None) -> float | None:
    """The row's tok/s had every measured step taken the median step's time (the measured tokens over the
    measured time, rescaled by mean over median step)."""
    if not step_seconds or not mean_step_s:
        return None
    return round(tok_s * mean_step_s / statistics.median(step_seconds), 1)


def expert_load(log: Path) -> dict | None:
    """MoE rows: the routers' numbers of the last step that logged them (sft/model/moe.py's MoeLoadLogger writes them to
    the run's trainer_log.jsonl after the callbacks that a bench clock could read them from)."""
    if not log.is_file():
        return None
    logged = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    last = next((x for x in reversed(logged) if any(k.startswith("moe/") for k in x)), None)
    return {k: v for k, v in last.items() if k.startswith("moe/")} if last else None


def needs_weights(args) -> bool:
    """Tensor parallel, QLoRA and quantized-experts rows load real (random) weights from disk: transformers shards
    a TP model and bitsandbytes quantizes a QLoRA base while reading its files, and V2-Lite's bf16 base (31 GB) is
    larger than the card whose experts --quantize_experts holds in e4m3: it loads in host RAM, as from_pretrained
    loads it for a user (building it there at random took over 200 s on 16 cores)."""
    return args.strategy == "tp" or args.method == "qlora" or \
        "--quantize_experts" in shlex.split(getattr(args, "train_args_text", "") or "")


def model_dir(args) -> Path:
    """A model directory holding config.json and the tokenizer: random_init builds the weights from it (sft's model
    loading, the host-RAM check and the LoRA target lookup read it like any model directory); random bf16 weights
    on disk for the rows that load them (needs_weights)."""
    weights = needs_weights(args)
    path = Path(args.out).resolve() / "models" / (args.model + ("-weights" if weights else ""))
    if weights and not (path / "config.json").exists():
        # in a child process: a CUDA context and cache held here would count in every row's nvidia-smi peak
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from train_throughput import save_random_model; "
                "save_random_model(sys.argv[2], sys.argv[3], sys.argv[4], use_cache=False)")
        subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), args.model, str(args.tokenizer),
                        str(path)], check=True)
    elif not (path / "config.json").exists():
        save_random_model(args.model, args.tokenizer, path, weights=False, use_cache=False)
    return path


# Both peers log as their users do by default (sft/train.py and TRL's SFTConfig: every 10 steps), and at least at a
# row's last step. A log reads the loss on the host, so the host waits there for the step's GPU work and the GPU
# then idles while the logs are written: logging every step measured that wait each step, which a user's run has
# once in ten. (Rows before 2026-12-05 06:30 UTC logged every step.)
LOGGING_STEPS = 10


def logging_steps(args) -> int:
    return min(LOGGING_STEPS, args.warmup + args.steps + args.profile_steps)


def common_train_args(args, cpu: bool) -> list[str]:
    """The Trainer options both peers get (sft/train.py and SFTConfig spell them alike)."""
    steps = args.warmup + args.steps + args.profile_steps
    precision = [] if cpu else (["--fp16", "true"] if args.precision == "fp16" else
                                ["--bf16", "true"] if args.precision == "bf16" else [])
    return ["--max_length", str(args.seq_len), "--per_device_train_batch_size", str(args.micro_batch),
            "--gradient_accumulation_steps", str(args.grad_accum), "--max_steps", str(steps),
            "--logging_steps", str(logging_steps(args)), "--save_strategy", "no", "--report_to", "none",
            "--eval_strategy", "no",
            "--learning_rate", "1e-5", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
            "--output_dir", str(Path(args.out).resolve() / args.name / "output"),
            "--dataloader_num_workers", "2", "--seed", "0", *precision]


def worker_train_args(args, model: Path, cpu: bool, recipe: bool = False) -> list[str]:
    """Options of sft/train.py every bench row shares; a row's own options come after and win. A `recipe` row
    (--config recipes/...) keeps the recipe's fast paths: the command line would override the recipe's values."""
    data = Path(args.data).resolve()
    # --fp8/--compile_layers default to auto (on where the GPU allows): a row names the fast paths it measures
    return [*(() if recipe else ("--fp8", "false", "--compile_layers", "false")),
            "--model", str(model), "--dataset", *[str(data)] * args.repeat_data, "--packing", "true",
            *common_train_args(args, cpu),
            "--dataset_cache_dir", str(Path(args.out).resolve() / "dataset-cache"), "--verify_saves", "no",
            *(["--lora", "true"] if args.method in ("lora", "qlora") else []),
            *(["--qlora", "true"] if args.method == "qlora" else []),
            *(["--tp_size", str(args.n_gpus)] if args.strategy == "tp" else [])]


def trl_train_args(args, cpu: bool) -> list[str]:
    """SFTConfig options every TRL row shares: TRL's packing as its docs recommend (best-fit decreasing, which makes
    batches padding-free: one flattened row per device batch), loss on the assistant's tokens as ours."""
    return [*common_train_args(args, cpu), "--packing", "true", "--packing_strategy", "bfd", "--padding_free", "true",
            "--assistant_only_loss", "true", "--dataset_num_proc", "2",
            *(["--bf16", "false"] if cpu or args.precision == "none" else [])]  # TRL's default is bf16, even on CPU


# ---------------------------------------------------------------------------------------------------------------
# Worker: one rank of the run.

def worker(spec: dict, train_argv: list[str]) -> int:
    import torch

    import sft.parallel.distributed

    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        if spec["mem_cap_gib"]:  # emulate a 24 GB card: the allocator refuses beyond the cap
            total = torch.cuda.get_device_properties(local).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["mem_cap_gib"] * GIB / total), local)
    clock = _bench_callback(spec, rank)()
    if spec["peer"] == "trl":
        code = trl_train(spec, train_argv, clock)
    else:
        import sft.train

        factory = None if spec["weights"] else random_init
        code = sft.train.main(train_argv, callbacks=[clock], model_factory=factory, save=False,
                              on_trainer=clock.count_with)
    sft.parallel.distributed.end_process_group()
    return code


def random_init(path, dtype=None, attn_implementation=None, **ignored):
    """The model of the directory's config.json with random weights, called as AutoModelForCausalLM.from_pretrained
    (sft's load_model passes its arguments; those about reading weights do not apply)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

    from sft.parallel.expert_parallel import autoep_block

    from sft.model.rope_scaling import ROPE_KEYS

    config = AutoConfig.from_pretrained(path, **{k: v for k, v in ignored.items() if k in ROPE_KEYS})  # --rope_scaling
    dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    build = dict(dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32,
                 attn_implementation=attn_implementation)
    torch.manual_seed(0)
    if is_deepspeed_zero3_enabled() or autoep_block(deepspeed_config()) or not torch.cuda.is_available():
        # zero.Init partitions at creation (on GPU, or on CPU under offload_param): no full copy per rank. AutoEP
        # keeps its share of the experts as the engine starts, on the host, and then moves it to the GPU (as a
        # model loaded from disk: sft/model/loading.py loads to host RAM)
        return AutoModelForCausalLM.from_config(config, **build)
    with torch.device("cuda", torch.cuda.current_device()):
        return AutoModelForCausalLM.from_config(config, **build)


def trl_train(spec: dict, argv: list[str], clock) -> int:
    """One rank of a TRL row: SFTTrainer on the row's data, tokenizer and model (see the module's docstring)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, HfArgumentParser
    from trl import SFTConfig, SFTTrainer

    from data_prep import trl_messages, with_generation_markers

    (config,) = HfArgumentParser(SFTConfig).parse_args_into_dataclasses(argv)
    init, config.model_init_kwargs = dict(config.model_init_kwargs or {}), None  # the model is built here
    config.include_num_input_tokens_seen = "non_padding"  # the clock's count, as ours (its CLI takes a bool only)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.chat_template = with_generation_markers(tokenizer.chat_template)
    records = json.loads(Path(spec["data"]).read_text()) * spec["repeat_data"]
    model = random_init(spec["model_dir"], **init)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(trl_messages(records)),
                         processing_class=tokenizer, peft_config=trl_lora(model) if spec["method"] == "lora" else None,
                         callbacks=[clock])
    trainer.train()
    return 0


def trl_lora(model):
    """Our LoRA (sft's defaults: rank 16, alpha 32; dropout 0 as in our fast rows; the family's targets) as a peft
    config for TRL."""
    from peft import LoraConfig

    from sft.options.arguments import LoraArguments
    from sft.model.loading import lora_targets

    ours = LoraArguments(lora=True, lora_dropout=0.0)
    modules, parameters = lora_targets(model, ours)
    return LoraConfig(r=ours.lora_r, lora_alpha=ours.lora_alpha, lora_dropout=0.0, target_modules=modules,
                      target_parameters=parameters or None, task_type="CAUSAL_LM")


def fast_paths_ran(model) -> dict[str, int]:
    """The fast paths a run's model holds: layers computing in FP8 (--fp8's Fp8Linear for a frozen base, torchao's
    Float8Linear for a full fine-tune) and decoder layers compiled in place (--compile_layers: nn.Module.compile
    keeps the compiled call on the module, a private name checked first; the final norm it also compiles is not
    counted, as in rows before it was; TRL's rows have neither)."""
    from sft.safety.private_names import COMPILED_CALL, expect
    from sft.speed.regional_compile import decoder_layers

    expect(COMPILED_CALL)
    return {"fp8_layers": sum(type(m).__name__ in ("Fp8Linear", "Float8Linear") for m in model.modules()),
            "compiled_layers": sum(m._compiled_call_impl is not None for m in decoder_layers(model))}


def attention_ran(model) -> str | None:
    """The attention the model's layers call (its config's, as transformers set it at load): a row that names none
    runs the default of its day (sft/options/resolve.py packed_documents_attend_alone), which the options alone do
    not say."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def loss_in_chunks(trainer) -> bool | None:
    """Whether our trainer computes its loss in chunks (--chunked_loss, `auto` settled by the model, and always
    under --sequence_parallel: sft/train.py); None for TRL's."""
    from sft.speed.chunked_loss import chunked_causal_lm_loss

    if trainer is None or not hasattr(trainer, "labelled_token_loss"):
        return None
    return getattr(trainer.labelled_token_loss, "func", None) is chunked_causal_lm_loss


def _bench_callback(spec: dict, rank: int):
    """-> the bench clock's class: per optimizer step, real tokens (the Trainer's non-padding count, summed over
    ranks) and seconds (step end to step end; pauses for evaluation and saving left out), the same for both peers;
    profiles a few steps after the measured ones; writes rank<N>.json at train end."""
    import torch
    from transformers import TrainerCallback

    warmup, steps, profile_steps = spec["warmup"], spec["steps"], spec["profile_steps"]

    class BenchClock(TrainerCallback):
        def __init__(self):
            self.steps: list[tuple[int, float, float]] = []  # (global step, real tokens, seconds)
            self.logged_losses: list[float] = []
            self.callback_mfu = None  # what our ThroughputCallback logged last (ours only)
            self.mark = time.perf_counter()
            self.seen = 0
            self.prof = None
            self.prof_t0 = 0.0
            self.comm = None
            self.trainer = None  # ours: each rank's host count, summed over ranks once at the end
            self.fast_paths: dict[str, int | bool | None] = {}

        def count_with(self, trainer) -> None:
            self.trainer = trainer

        def tokens_now(self, state) -> tuple[int, bool]:
            """-> (the count, whether it is this rank's only). Our SFTTrainer sums its ranks' counts into the state
            only when a log or a checkpoint reads it (between them the state holds the last log's count): the
            clock takes this rank's own count each step instead. TRL's Trainer sums them each micro-batch."""
            local = getattr(self.trainer, "tokens_on_this_rank", None)
            return (local, True) if local is not None else (state.num_input_tokens_seen, False)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.fast_paths = {**(fast_paths_ran(model) if model is not None else {}),
                               "loss_in_chunks": loss_in_chunks(self.trainer), "attention": attention_ran(model)}
            self.mark, self.seen = time.perf_counter(), self.tokens_now(state)[0]
            self.gc_pauses: list[tuple[int, int, float]] = []  # (step under way, generation, ms) of each collection
            self.gc_started = 0.0
            gc.callbacks.append(self._gc_timer)

        def _gc_timer(self, phase: str, info: dict) -> None:
            if phase == "start":
                self.gc_started = time.perf_counter()
            else:
                self.gc_pauses.append((len(self.steps) + 1, info["generation"],
                                       (time.perf_counter() - self.gc_started) * 1e3))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.perf_counter()
            same_batch = getattr(model, "tp_size", None) or 1  # TP ranks count one batch tp_size times
            seen = self.tokens_now(state)[0]
            self.steps.append((state.global_step, (seen - self.seen) / same_batch, now - self.mark))
            self.seen, self.mark = seen, now
            if profile_steps and rank == 0 and state.global_step == warmup + steps:
                self._start_profile()
            elif self.prof is not None and state.global_step == warmup + steps + profile_steps:
                self._stop_profile()
                self.mark = time.perf_counter()

        def _pause_ended(self, args, state, control, **kwargs):
            self.mark = time.perf_counter()

        on_evaluate = on_save = _pause_ended

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logged_losses.append(logs["loss"])
            if logs and "mfu" in logs:
                self.callback_mfu = logs["mfu"]

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
            export_trace(self.prof, spec["name"])
            self.prof = None

        def on_train_end(self, args, state, control, **kwargs):
            gc.callbacks.remove(self._gc_timer)
            measured = [(tokens, seconds) for step, tokens, seconds in self.steps if warmup < step <= warmup + steps]
            in_measured = [(step, gen, ms) for step, gen, ms in self.gc_pauses if warmup < step <= warmup + steps]
            tokens, seconds = sum(t for t, _ in measured), sum(s for _, s in measured)
            if self.tokens_now(state)[1]:  # this rank's: every rank's, as the Trainer's count gives them
                tokens = summed_over_ranks(tokens)
            cuda = torch.cuda.is_available()
            result = {"rank": rank, "measured_steps": len(measured),
                      "real_tok_s": tokens / seconds if seconds else 0.0,
                      "step_s": round(seconds / len(measured), 3) if measured else None,
                      "tokens_per_step": round(tokens / len(measured)) if measured else None,
                      # the first step's seconds: its compile (cold or warm cache) and the first batch, what a
                      # user's first run waits for before the steady rate
                      "first_step_s": round(self.steps[0][2], 1) if self.steps else None,
                      "callback_mfu": self.callback_mfu,
                      **self.fast_paths,
                      # the garbage collector's pauses in the measured steps: total ms, and the longest (step, gen, ms)
                      "gc_ms": round(sum(ms for *_, ms in in_measured), 1),
                      "gc_longest": max(in_measured, key=lambda p: p[2], default=None),
                      # each measured step's seconds: a slow one stands out
                      "step_seconds": [round(s, 3) for step, _, s in self.steps if warmup < step <= warmup + steps],
                      "loss_first_last": ([self.logged_losses[0], self.logged_losses[-1]] if self.logged_losses
                                          else None),
                      "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
                      "max_allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
                      **(gpu_identity() if cuda else {}), **(self.comm or {})}
            Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))

    return BenchClock


def export_trace(prof, row: str) -> None:
    """The profiled step's timeline as a gzipped Chrome trace (chrome://tracing, Perfetto) in $BENCH_TRACE_DIR, for
    the rows that $BENCH_TRACE_ROWS names (comma-separated): what idle_ms sums by host op, laid out in time."""
    import gzip

    where, rows = os.environ.get("BENCH_TRACE_DIR"), os.environ.get("BENCH_TRACE_ROWS", "").split(",")
    if not where or row not in rows:
        return
    plain = Path(where, f"{row}.trace.json")
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as src, gzip.open(f"{plain}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()


def summed_over_ranks(value: float) -> float:
    """`value` summed over the processes (every rank calls it: at train end, after the measured steps)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    total = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total)


def gpu_identity() -> dict:
    """This rank's GPU: its name, and its UUID as NVML spells it (torch leaves out the "GPU-" prefix)."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = str(props.uuid)
    return {"gpu_name": props.name, "gpu_uuid": uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"}


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
            "top_kernels": [f"{share(us)} {name[:70]}" for name, us in top],
            # where a step's GPU time goes beyond the matmuls (the optimizer, norms, fused elementwise kernels)
            "kernel_ms": top_kernel_ms(kernel_us, 32),
            "kernel_ms_total": round(sum(kernel_us.values()) / 1e3, 1),
            "idle_ms": idle_by_host_op(prof, compute + copies + nccl)}


def idle_by_host_op(prof, busy: list[tuple[float, float]], n: int = 12) -> dict[str, float]:
    """Where the GPU waited: every gap of 50 us or more between kernels (any stream) in the profiled steps, its time
    given to what the host was doing in the middle of it (the outermost and the innermost host op there, or
    "(python)" where no op ran), in ms, costliest first. A host-bound stretch shows up as the op that issues it."""
    gaps, end = [], None
    for s, e in sorted(busy):
        if end is not None and s - end >= 50:
            gaps.append((end, s))
        end = e if end is None else max(end, e)
    host = sorted(((e.time_range.start, e.time_range.end, e.name, e.cpu_parent is None) for e in prof.events()
                   if str(getattr(e, "device_type", "")) == "DeviceType.CPU"), key=lambda t: t[0])
    starts = [h[0] for h in host]
    by: dict[str, float] = {}
    for s, e in gaps:
        mid = (s + e) / 2
        begun = bisect.bisect_right(starts, mid)
        around = [h for h in host[max(0, begun - 4000):begun] if h[1] >= mid]  # the latest 4,000 begun
        outer = next((h[2] for h in around if h[3]), "(python)")
        inner = min(around, key=lambda h: h[1] - h[0])[2] if around else "(python)"
        key = outer if inner == outer else f"{outer} > {inner}"
        by[key[:90]] = by.get(key[:90], 0.0) + (e - s)
    top = sorted(by.items(), key=lambda kv: -kv[1])[:n]
    return {"total": round(sum(e - s for s, e in gaps) / 1e3, 1), "gaps": len(gaps),
            **{name: round(us / 1e3, 2) for name, us in top}}


def top_kernel_ms(kernel_us: dict[str, float], n: int) -> dict[str, float]:
    """The n costliest kernels by name cut to 80 characters (templated names share long prefixes: their times add
    up under the cut name), in ms, costliest first."""
    cut: dict[str, float] = {}
    for name, us in kernel_us.items():
        cut[name[:80]] = cut.get(name[:80], 0.0) + us
    return {name: round(us / 1e3, 2) for name, us in sorted(cut.items(), key=lambda kv: -kv[1])[:n]}


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


# ---------------------------------------------------------------------------------------------------------------

def bench_model(name: str) -> str:
    """--model in either spelling (sft/names.py: `deepseek-r1-distill-qwen-7b` is `r1-distill-qwen-7b`), as MODELS
    names it, so that a row's model has one name."""
    from sft.names import known_as

    return known_as(name, MODELS) or name  # argparse's choices refuse it, naming the shapes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run_id", required=True, help="One id per bench invocation, shared by the rows compared.")
    p.add_argument("--name", required=True, help="Row name, unique within the run (used by --scaling_of).")
    p.add_argument("--model", default="deepseek-llm-7b", choices=sorted(MODELS), type=bench_model,
                   help="a shape of MODELS; the `deepseek-` prefix is optional (rows keep MODELS' spelling)")
    p.add_argument("--method", default="lora", choices=["lora", "full", "qlora"])
    p.add_argument("--strategy", default="single", choices=sorted(CONFIGS))
    p.add_argument("--peer", default="ours", help="ours, trl (TRL's SFTTrainer), or the name of a recipe run "
                                                  "through our trainer (zero3-offload-recipe)")
    p.add_argument("--vs", help="The peer row of this run that this row's ratio is against (bench/report.py).")
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
    p.add_argument("--alloc_conf", default="expandable_segments:True",
                   help="PYTORCH_CUDA_ALLOC_CONF for every row, ours and the peers' ('': none given; sft/train.py then "
                        "sets expandable segments itself, and the peers run torch's default).")
    p.add_argument("--fresh_cache", action="store_true",
                   help="Compile caches (inductor, Triton) in a new empty folder: the first run on a fresh machine.")
    p.add_argument("--data", required=True, help="Alpaca JSON (bench/throughput.py finds ../shared's).")
    p.add_argument("--repeat_data", type=int, default=2, help="Pass the data file this many times (more rows).")
    p.add_argument("--tokenizer", required=True, help="Tokenizer directory (the DeepSeek-Coder one).")
    p.add_argument("--scaling_of", help="Name of the 1-GPU row of this run_id to compute `scaling` against.")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--out", default=str(REPO / "output" / "bench"))
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--notes", default="")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":
        split = argv.index("--")
        return worker(json.loads(argv[1]), argv[split + 1:])
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:split])
    args.train_args_text = shlex.join(argv[split + 1:])
    return 0 if run_row(args, argv[split + 1:]) else 1


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "bench")]
    sys.exit(main())
