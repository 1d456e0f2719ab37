"""The machine and the launch, read once: GPUs, bf16, host RAM, processes and what the launcher set up.

Checks (sft/options/checks.py) and plans take a `Machine` as plain data, so a test describes a 3 x 24 GB box, or a CPU
laptop, without patching torch or the environment. `launch()` reads only the environment (cheap, usable before
torch is imported); `machine()` adds what torch and psutil say.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

GIB = 2**30  # the one definition: every module that counts GiB imports it from here
# Packages that options need and the install may lack: checks ask the Machine (tests describe them as data).
OPTIONAL_PACKAGES = ("liger_kernel", "bitsandbytes", "torchao", "flash_attn", "flash_attn_interface")
# Variables that send the hub's https requests through a proxy (its HTTP client reads them from the environment).
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
# What several processes on a CPU machine need so that they form one run (said where they turn out not to).
CPU_BACKEND_ADVICE = "On a machine without GPUs add --use_cpu true (DDP) or --ddp_backend gloo (DeepSpeed configs)."


@dataclass(frozen=True)
class GpuKind:
    """A GPU model: what the planner needs of a box of them (sft/plan/planner.py --gpu), and what MFU is counted
    against (sft/report/callbacks.py)."""

    capability: tuple[int, int]  # CUDA compute capability: FP8 matmuls from 8.9 (Machine.fp8_problem)
    memory_gb: float             # per card, as sold
    peak_flops: float            # dense bf16 matmul peak, FLOP/s


# Keyed by what the GPU's name contains ("NVIDIA GeForce RTX 4090" is an RTX 4090). Peaks: H200 measured on our lent
# machines (the ceiling MFU is quoted against); the others vendor datasheet figures (RTX 4090: tensor cores with fp32
# accumulation).
GPU_KINDS: dict[str, GpuKind] = {
    "H200": GpuKind((9, 0), 141, 790e12), "H100": GpuKind((9, 0), 80, 790e12), "A100": GpuKind((8, 0), 80, 312e12),
    "RTX 4090": GpuKind((8, 9), 24, 165e12), "RTX 3090": GpuKind((8, 6), 24, 71e12),
    "L40S": GpuKind((8, 9), 48, 362e12), "A6000": GpuKind((8, 6), 48, 155e12),
}


def gpu_kind(name: str) -> tuple[str, GpuKind] | None:
    """The catalogue's entry for a GPU's name (any case; "NVIDIA GeForce RTX 4090" and "rtx 4090" alike), or None."""
    return next(((k, v) for k, v in GPU_KINDS.items() if k.lower() in name.lower()), None)


# --fp8's forward matmuls accumulate as the tensor cores do natively (no periodic promotion to fp32) from this
# compute capability on: Hopper, where the 50-step loss check passed (run 20261205T1325Z-fp8check-h100); Ada's is
# not measured, so it keeps the promotion there unless asked.
FAST_ACCUM_FROM = (9, 0)


# torch's FP8 grouped matmul (torch._scaled_grouped_mm, the routed experts' under --fp8: sft/speed/fp8_experts.py)
# runs on these compute capabilities only; an RTX 4090 (8.9) has FP8 matmuls but no grouped one in torch
FP8_GROUPED_CAPABILITIES = ((9, 0), (10, 0))


def fp8_fast_accum_on(asked: bool | None, capability: tuple[int, int]) -> bool:
    """Whether --fp8's forward matmuls accumulate fast on a GPU of `capability`: SFT_FP8_FAST_ACCUM's 1 or 0 when
    set (`asked`), else from FAST_ACCUM_FROM on."""
    return asked if asked is not None else tuple(capability) >= FAST_ACCUM_FROM


def _true(value: str | None) -> bool:
    return (value or "false").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Launch:
    """The processes and what the launcher set up: torchrun sets the ranks, accelerate exports its config file's
    settings as ACCELERATE_* variables (and sets ACCELERATE_DYNAMO_BACKEND even for one process). Also the other
    variables the toolkit reads, so that no module reads the environment itself and tests describe them as data."""

    world_size: int = 1
    local_world_size: int | None = None           # LOCAL_WORLD_SIZE; None: not said (DeepSpeed's launcher sets none)
    rank: int = 0
    local_rank: int = 0
    launched: bool = False                        # by accelerate launch / torchrun, not the user's shell
    fsdp: bool = False                            # ACCELERATE_USE_FSDP
    fsdp_qlora_check: bool = False                # SFT_FSDP_QLORA_CHECK=1: bench/qlora_check.py's FSDP+QLoRA runs
    zero_stage: str | None = None                 # ACCELERATE_DEEPSPEED_ZERO_STAGE
    offload: tuple[str, ...] = ()                 # "optimizer"/"param" offloaded to cpu/nvme by the accelerate config
    deepspeed_config_file: str | None = None      # ACCELERATE_DEEPSPEED_CONFIG_FILE
    mixed_precision: str = "no"                   # ACCELERATE_MIXED_PRECISION
    gradient_accumulation_steps: int | None = None
    cuda_visible_devices: str | None = None       # CUDA_VISIBLE_DEVICES as the process was started with it
    nccl: tuple[tuple[str, str], ...] = ()         # the NCCL_* variables the user set (sft/parallel/distributed.py NCCL_VARS)
    tensorboard_logging_dir: str | None = None    # TENSORBOARD_LOGGING_DIR: where the Trainer's TensorBoard logs go
    fp8_compile: bool = True                      # SFT_FP8_COMPILE; "0": --fp8 quantizes eagerly on CUDA too
    inductor_multi_kernel_set: bool = False       # TORCHINDUCTOR_MULTI_KERNEL: the user's, which --compile_layers keeps
    fp8_fast_accum: bool | None = None            # SFT_FP8_FAST_ACCUM=1/0; unset: fp8_fast_accum_on decides
    peft_input_cast: bool = False                 # SFT_PEFT_INPUT_CAST=1: keep peft's input casts (bench rows)
    # SFT_SHARED_INPUT_ADAPTERS=0: compiled layers keep one down-projection matmul per adapter (bench rows)
    shared_input_adapters: bool = True
    # SFT_TILED_MLP_LAYER_RECOMPUTE=1: a checkpointed eager layer's recompute runs its tiled MLP too (bench rows)
    tiled_mlp_layer_recompute: bool = False
    fp8_on_cpu: bool = False                      # SFT_FP8_ON_CPU=1: --fp8 on torch's CPU FP8 matmul (slow; tests)
    # FSDP_CPU_RAM_EFFICIENT_LOADING (accelerate launch, from its config): the weights loaded on rank 0 only and
    # broadcast into the sharded model (--qlora turns it off later: sft/parallel/fsdp.py hand_over_to_fsdp)
    fsdp_ram_efficient_loading: bool = False
    # HTTPS_PROXY, https_proxy, ALL_PROXY or all_proxy is set (only whether: a proxy URL may hold a password)
    hub_proxied: bool = False
    xdg_cache_home: str | None = None             # XDG_CACHE_HOME (unset: ~/.cache): where the tiny model is built
    # When the launcher (this process's parent: accelerate launch, deepseek-sft train, torchrun) started, in seconds
    # since the epoch: the same for every process it started, so they name one new run directory. None: not
    # launched, or not known here (no /proc).
    launcher_started: float | None = None

    @property
    def first(self) -> bool:
        """Global rank 0 by the launcher; code that holds no Launch asks is_first_process() below."""
        return self.rank == 0

    def processes_here(self, unknown: int) -> int:
        """The processes on this machine: LOCAL_WORLD_SIZE, or `unknown` when the launcher did not say."""
        return self.local_world_size or unknown


@dataclass(frozen=True)
class Machine:
    gpu_names: tuple[str, ...] = ()
    gpu_memory_gib: tuple[float, ...] = ()
    gpu_uuids: tuple[str, ...] = ()               # NVML's names of the visible GPUs, in torch's order (telemetry)
    gpu_capabilities: tuple[tuple[int, int], ...] = ()  # CUDA compute capability of each visible GPU
    fp8_probe_error: str | None = None            # why a rowwise-scaled FP8 matmul failed on GPU 0 (None: it ran)
    bf16: bool = False                            # every visible GPU computes in bf16 (Ampere or newer)
    host_ram_gib: float = 0.0                     # total, as host_ram_gib() reads it; 0: unknown
    host_ram_available_gib: float = 0.0
    launch: Launch = field(default_factory=Launch)
    # The optional packages importable here (OPTIONAL_PACKAGES); None: not described, so looked up when asked.
    packages: frozenset[str] | None = None

    # The Trainer's reporting integrations installed here (transformers' get_available_reporting_integrations);
    # None: not described, so looked up when asked.
    reporting: frozenset[str] | None = None

    def has(self, package: str) -> bool:
        if self.packages is not None:
            return package in self.packages
        return importlib.util.find_spec(package) is not None

    def reports_to(self, integration: str) -> bool:
        """Whether --report_to INTEGRATION can run here (`flyte`, which transformers' list never names: its
        package imports)."""
        if integration == "flyte":
            return self.has("flytekit")
        if self.reporting is not None:
            return integration in self.reporting
        from transformers.integrations import get_available_reporting_integrations

        return integration in get_available_reporting_integrations()

    @property
    def gpus(self) -> int:
        return len(self.gpu_names)

    @property
    def cuda(self) -> bool:
        return self.gpus > 0

    def fp8_problem(self) -> str | None:
        """Why --fp8 cannot run here (None when it can): every visible GPU needs FP8 tensor cores, compute
        capability 8.9+ (RTX 4090, L40, H100, H200), and torch's FP8 matmul must run on it."""
        if not self.cuda:
            return None if self.launch.fp8_on_cpu else "no CUDA GPU here"
        if len(self.gpu_capabilities) != self.gpus:
            return "the GPUs' compute capability is not known"
        for i, (major, minor) in enumerate(self.gpu_capabilities):
            if (major, minor) < (8, 9):
                return (f"GPU {i} ({self.gpu_names[i]}) has compute capability {major}.{minor}; FP8 matmuls need "
                        f"8.9 or newer (RTX 4090, L40, H100, H200)")
        return self.fp8_probe_error

    def fp8_grouped_problem(self) -> str | None:
        """Why the routed experts' grouped matmuls cannot compute in FP8 here (None when they can): every visible
        GPU of FP8_GROUPED_CAPABILITIES, or the CPU's emulation (SFT_FP8_ON_CPU=1, tests)."""
        if not self.cuda:
            return None if self.launch.fp8_on_cpu else "no CUDA GPU here"
        if len(self.gpu_capabilities) != self.gpus:
            return "the GPUs' compute capability is not known"
        for i, (major, minor) in enumerate(self.gpu_capabilities):
            if (major, minor) not in FP8_GROUPED_CAPABILITIES:
                return (f"GPU {i} ({self.gpu_names[i]}) has compute capability {major}.{minor}; torch's FP8 grouped "
                        f"matmul runs on 9.0 and 10.0 (H100, H200, B200)")
        return self.fp8_problem()


def current_environment(env: Mapping[str, str] | None) -> Mapping[str, str]:
    """`env`, or the process environment as it is NOW: not a default argument bound at import, since datasets'
    multi-process map rebinds `os.environ` to a copy (a stale default then misses later settings)."""
    return os.environ if env is None else env


def read_launch(env: Mapping[str, str] | None = None) -> Launch:
    env = current_environment(env)
    world = int(env.get("WORLD_SIZE", "1"))
    offload = tuple(k.lower() for k in ("OPTIMIZER", "PARAM")
                    if env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{k}_DEVICE", "none") in ("cpu", "nvme"))
    accumulation = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    local = env.get("LOCAL_WORLD_SIZE")
    return Launch(world_size=world, local_world_size=int(local) if local else None,
                  rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
                  launched="LOCAL_RANK" in env or "ACCELERATE_DYNAMO_BACKEND" in env,
                  fsdp=_true(env.get("ACCELERATE_USE_FSDP")),
                  fsdp_ram_efficient_loading=_true(env.get("FSDP_CPU_RAM_EFFICIENT_LOADING")),
                  zero_stage=env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") or zero_stage_in(
                      env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")),
                  offload=offload, deepspeed_config_file=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
                  mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "no"),
                  gradient_accumulation_steps=int(accumulation) if accumulation else None,
                  cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
                  nccl=tuple((k, v) for k, v in sorted(env.items()) if k.startswith("NCCL_")),
                  tensorboard_logging_dir=env.get("TENSORBOARD_LOGGING_DIR") or None,
                  fp8_compile=env.get("SFT_FP8_COMPILE", "1") != "0",
                  inductor_multi_kernel_set="TORCHINDUCTOR_MULTI_KERNEL" in env,
                  fp8_fast_accum={"1": True, "0": False}.get(env.get("SFT_FP8_FAST_ACCUM", "")),
                  peft_input_cast=env.get("SFT_PEFT_INPUT_CAST") == "1",
                  shared_input_adapters=env.get("SFT_SHARED_INPUT_ADAPTERS", "1") != "0",
                  tiled_mlp_layer_recompute=env.get("SFT_TILED_MLP_LAYER_RECOMPUTE") == "1",
                  fp8_on_cpu=env.get("SFT_FP8_ON_CPU") == "1",
                  fsdp_qlora_check=env.get("SFT_FSDP_QLORA_CHECK") == "1",
                  hub_proxied=any(env.get(v) for v in PROXY_VARS),
                  xdg_cache_home=env.get("XDG_CACHE_HOME") or None)


def zero_stage_in(deepspeed_config_file: str | None) -> str | None:
    """The ZeRO stage a DeepSpeed JSON names: accelerate exports ACCELERATE_DEEPSPEED_ZERO_STAGE only for a config
    that holds its DeepSpeed settings itself, not for one that names a JSON file (ours all do). Relative paths are
    read from the working directory, as accelerate reads them; a file that cannot be read says nothing."""
    if not deepspeed_config_file:
        return None
    try:
        stage = json.loads(Path(deepspeed_config_file).read_text()).get("zero_optimization", {}).get("stage")
    except (OSError, ValueError, AttributeError):
        return None
    return None if stage is None else str(stage)


def nvml_uuid(uuid: str) -> str:
    """torch drops NVML's GPU- prefix on some versions; MIG instances keep theirs."""
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def process_start_ticks(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (Linux), which tells a reused pid from the original."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_started(pid: int) -> float | None:
    """When a process started, in seconds since the epoch (Linux: boot time + its start ticks); None elsewhere."""
    ticks = process_start_ticks(pid)
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(ticks) / os.sysconf("SC_CLK_TCK") if ticks else None
    except (OSError, StopIteration, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def launch() -> Launch:
    """This process's launch facts (the environment, and when its launcher started)."""
    facts = read_launch()
    return replace(facts, launcher_started=process_started(os.getppid())) if facts.launched else facts


def is_first_process() -> bool:
    """Whether this is global rank 0 (world process zero): the one process that prints the run's notes and writes
    its output directory. The toolkit's one spelling of it: the process group's rank once it exists (the rank the
    Trainer's `process_index` and `state.is_world_process_zero` are), else the launcher's RANK, which is what that
    rank will be, so it also answers before torch is imported. Checkpoint files follow the Trainer's own
    `args.should_save` instead, which is per machine under --save_on_each_node."""
    dist = sys.modules.get("torch.distributed")  # not imported: no process group, and no need to import torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return launch().first


def note(text: str) -> None:
    """A `note:` line on stderr from the first process only (every rank reads the same options and data): the
    options' and the data's notes, before any model loads."""
    if is_first_process():
        print(f"note: {text}", file=sys.stderr, flush=True)


def host_ram_gib(env: Mapping[str, str] | None = None, meminfo: str = "/proc/meminfo") -> float | None:
    """This machine's RAM in GiB without importing torch: SFT_HOST_RAM_GIB when set (VMs whose RAM grows on demand),
    else psutil's total, else /proc/meminfo's MemTotal; None where neither can be read (unknown, never assumed)."""
    env = current_environment(env)
    if env.get("SFT_HOST_RAM_GIB"):
        return float(env["SFT_HOST_RAM_GIB"])
    try:
        import psutil

        return psutil.virtual_memory().total / GIB
    except (ImportError, OSError, RuntimeError):  # no psutil, or it cannot read this system
        pass
    try:
        with open(meminfo) as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return kib * 1024 / GIB
    except (OSError, StopIteration, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def machine() -> Machine:
    """This machine, read once per process (CUDA is initialised here if it is not already)."""
    import psutil
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    properties = [torch.cuda.get_device_properties(i) for i in range(count)]
    total = host_ram_gib() or 0.0
    available = total if os.environ.get("SFT_HOST_RAM_GIB") else psutil.virtual_memory().available / GIB
    return Machine(gpu_names=tuple(p.name for p in properties),
                   gpu_memory_gib=tuple(p.total_memory / GIB for p in properties),
                   gpu_uuids=tuple(nvml_uuid(str(p.uuid)) for p in properties),
                   gpu_capabilities=tuple((p.major, p.minor) for p in properties),
                   fp8_probe_error=fp8_probe_error(properties),
                   bf16=bool(count) and torch.cuda.is_bf16_supported(), host_ram_gib=total,
                   host_ram_available_gib=available, launch=launch(),
                   packages=frozenset(p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is not None))


def fp8_probe_error(properties) -> str | None:
    """Run one 16 x 16 rowwise-scaled FP8 matmul on GPU 0 where every GPU has FP8 tensor cores (some torch/GPU
    pairs lack the kernel); -> its error, or None."""
    import torch

    if not properties or min((p.major, p.minor) for p in properties) < (8, 9):
        return None  # Machine.fp8_problem names the capability instead
    try:
        a = torch.ones(16, 16, device="cuda").to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device="cuda"), scale_b=torch.ones(1, 16, device="cuda"),
                         out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return f"torch {torch.__version__} cannot run a rowwise-scaled FP8 matmul on this GPU ({e})"
    return None
