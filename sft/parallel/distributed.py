"""Multi-GPU pre-flight: consumer-card NCCL settings, an all-reduce correctness check, and the host-RAM check of
ZeRO-3 offload plans. Each runs before the model is loaded, so a box that cannot train says so in seconds.

Why: GeForce cards (RTX 40xx and later) have no GPU peer-to-peer; with some drivers NCCL still takes the P2P
path and an all-reduce silently returns zeros, so training "works" and learns nothing. And ZeRO-3 with CPU
offload keeps ~18 bytes per parameter in host RAM: a 7B plan on a 64 GiB machine dies to the OOM killer an
hour in, after loading, unless it is checked first.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from sft.errors import ConfigError, DistributedCheckError
from sft.machine import CPU_BACKEND_ADVICE, GIB, Launch, Machine, is_first_process, launch as this_launch

NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")
# GeForce and TITAN cards have no (working) peer-to-peer; workstation and data-centre cards (RTX A6000, RTX 6000
# Ada, L40S, A100, H100...) do. "RTX 40"/"RTX 50" also catches names without the GeForce brand.
CONSUMER_GPU = re.compile(r"geforce|titan|\brtx\s*[45]0\d0", re.IGNORECASE)


@dataclass
class NcclDecision:
    env: dict[str, str] = field(default_factory=dict)  # variables to set (not already set by the user)
    reasons: list[str] = field(default_factory=list)   # one line each, for the log


# How long a rank other than the first waits before it leaves with an error of its own (see report_error).
OTHER_RANK_WAIT_S = 10.0


def report_error(error, first: bool | None = None) -> None:
    """Say a UserFacingError once. Every rank of a launch usually raises the same one (the options, the data), and
    the first process prints it; the others wait before they leave, since a launcher stops every rank as soon as one
    fails, and a rank that left first could take the first process's line with it (seen in CI: a refusal under
    accelerate launch with no `error:` line). When the first process did not fail, the launcher does not stop this
    rank during the wait, and it prints its own error after it."""
    from sft.errors import NothingToDo

    text = str(error) if isinstance(error, NothingToDo) else f"error: {error}"
    if is_first_process() if first is None else first:
        print(text, file=sys.stderr, flush=True)
        return
    if error.exit_code == 0:  # nothing to do: a launcher waits for every rank, none stops the others
        return
    import time

    try:
        time.sleep(OTHER_RANK_WAIT_S)
    except KeyboardInterrupt:  # the launcher stopping this rank after the first one left: its line is out
        return
    print(f"{text} (rank {this_launch().rank})", file=sys.stderr, flush=True)


def end_process_group() -> bool:
    """Destroy the process group before the interpreter exits: a live one is torn down by destructors at exit,
    which can abort a finished run ("terminate called without an active exception", seen with gloo).
    -> whether there was one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


def exit_process(code: int) -> NoReturn:
    """Leave with `code`. After a multi-process run: destroy the process group, run the atexit handlers (loggers
    such as wandb finish there) while the interpreter is whole, then exit without its final teardown. Even with
    the group destroyed, Gloo's C++ threads can abort that teardown of a run that finished and saved
    ("terminate called without an active exception": twice in about a dozen CI runs; pytorch #179291,
    #190489)."""
    if not end_process_group():
        sys.exit(code)
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def on_main_process(decide):
    """Run `decide()` in the main process only; every process returns its answer or raises its error (so that
    no rank goes on alone, and only one process touches the output directory)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    from sft.errors import UserFacingError

    state = PartialState()
    answer, error = None, None
    if is_first_process():
        try:
            answer = decide()
        except UserFacingError as e:
            error = e
    if state.num_processes > 1:
        answer, error = broadcast_object_list([answer, error])
    if error is not None:
        raise error
    return answer


def is_consumer_gpu(name: str) -> bool:
    return bool(CONSUMER_GPU.search(name))


def decide_nccl_env(gpu_names: Sequence[str], peer_access: bool | None, env: Mapping[str, str]) -> NcclDecision:
    """What to set before the process group starts. `peer_access`: False if some GPU pair cannot reach each
    other (torch.cuda.can_device_access_peer), None if unknown. Values the user set are kept, never overridden."""
    decision = NcclDecision()
    if len(gpu_names) < 2:
        return decision  # one GPU per machine: no peer-to-peer path to get wrong
    consumer = sorted({n for n in gpu_names if is_consumer_gpu(n)})
    if not consumer and peer_access is not False:
        return decision
    why = (f"consumer GPUs ({', '.join(consumer)}) have no peer-to-peer" if consumer
           else "these GPUs cannot access each other's memory (no peer-to-peer)")
    for var in NCCL_VARS:
        if var in env:
            decision.reasons.append(f"{why}; keeping your {var}={env[var]}")
        else:
            decision.env[var] = "1"
            decision.reasons.append(f"{why}: setting {var}=1")
    return decision


def visible_gpu_names(launch: Launch | None = None) -> list[str]:
    """GPU names from nvidia-smi (accelerate's helper: no CUDA initialisation), limited to CUDA_VISIBLE_DEVICES."""
    try:
        from accelerate.utils.environment import get_gpu_info

        names, _ = get_gpu_info()
    except Exception:  # no nvidia-smi, no driver: a CPU machine
        return []
    visible = (launch or this_launch()).cuda_visible_devices
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        names = [names[int(v)] for v in visible.split(",") if int(v) < len(names)]
    return names


def gpus_have_peer_access() -> bool | None:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    n = torch.cuda.device_count()
    return all(torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j)


def nccl_decision(launch: Launch) -> NcclDecision:
    """What this launch needs set for NCCL on the GPUs it sees (nothing for one process or one GPU)."""
    names = visible_gpu_names(launch)
    if len(names) < 2 or launch.world_size < 2:
        return NcclDecision()
    # Named consumer cards decide it already; otherwise ask CUDA whether every pair reaches each other.
    peer_access = None if any(is_consumer_gpu(n) for n in names) else gpus_have_peer_access()
    return decide_nccl_env(names, peer_access, dict(launch.nccl))


def nccl_given(launch: Launch) -> dict[str, str]:
    """The NCCL variables as NCCL got them: the user's (read at launch) and those configure_nccl_env added (decided
    again here: the same launch on the same GPUs decides the same)."""
    return {**dict(launch.nccl), **nccl_decision(launch).env}


def configure_nccl_env(launch: Launch | None = None) -> NcclDecision:
    """Set NCCL_P2P_DISABLE / NCCL_IB_DISABLE for consumer cards. Call before TrainingArguments is built: that
    starts the process group, and NCCL reads these when its communicators are created."""
    launch = launch or this_launch()
    decision = nccl_decision(launch)
    os.environ.update(decision.env)  # written for NCCL, which reads them when its communicators are created
    if decision.reasons and launch.first:
        for line in decision.reasons:
            print(f"NCCL: {line}", file=sys.stderr, flush=True)
    return decision


def check_allreduce(numels: Sequence[int] = (1024, 4 * 1024 * 1024), launch: Launch | None = None) -> None:
    """Sum known tensors over all ranks and compare with the exact answer (small integers: exact in fp32).

    The large size makes NCCL take its bulk (ring/P2P) path, which is where broken peer-to-peer shows. `launch`:
    this process's when None (its GPUs and NCCL settings go into the error)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    # "nccl", or "cuda:nccl,cpu:gloo" (accelerate's choice for FSDP with CPU state dicts): test the GPU path.
    on_gpu = "nccl" in str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    for numel in numels:
        pattern = torch.arange(numel, device=device, dtype=torch.float32).remainder_(251)
        tensor = pattern + (rank + 1)
        dist.all_reduce(tensor)
        expected = pattern * world + world * (world + 1) / 2
        wrong = (tensor != expected).nonzero()
        if len(wrong):
            i = int(wrong[0])
            raise DistributedCheckError(
                f"the all-reduce check failed on rank {rank} of {world}: {len(wrong)} of {numel} values wrong "
                f"(e.g. index {i}: got {tensor[i].item():g}, expected {expected[i].item():g}). "
                f"{nccl_advice(launch or this_launch())}")
        if device.type == "cuda":
            torch.cuda.synchronize()


def nccl_advice(launch: Launch) -> str:
    names = visible_gpu_names(launch)
    given = nccl_given(launch)
    state = ", ".join(f"{v}={given.get(v, 'unset')}" for v in NCCL_VARS)
    return (f"GPUs: {', '.join(names) or 'none seen by nvidia-smi'}; {state}. Communication between the GPUs "
            "returns wrong data, so training would silently learn nothing. On GeForce cards without peer-to-peer, "
            "launch with `NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1 accelerate launch ...`, update the NVIDIA driver "
            "(>= 550.40.07 for RTX 40xx), and check `nvidia-smi topo -m`; `NCCL_DEBUG=INFO` shows the path NCCL "
            "takes.")


# ---------------------------------------------------------------------------------------------------------------
# Host RAM of ZeRO-3 offload plans

@dataclass
class OffloadEstimate:
    params: int             # all parameters of the model
    trainable: int          # those the optimizer updates (all, or the LoRA adapter)
    optimizer_on_cpu: bool
    params_on_cpu: bool
    param_bytes: int        # 2 under bf16/fp16, else 4
    node_share: float       # fraction of the ZeRO partitions held on this machine (local ranks / world size)

    def parts(self) -> list[tuple[str, float]]:
        """(what, bytes on this machine). DeepSpeed's CPU offload keeps, per trainable parameter, an fp32 master
        copy (4 B), Adam's two fp32 moments (8 B) and an fp32 gradient (4 B); parameter offload keeps the
        16-bit (or fp32) working weights of every parameter (2 or 4 B)."""
        parts = []
        if self.optimizer_on_cpu:
            parts += [("fp32 master weights", 4 * self.trainable), ("Adam moments (fp32 m, v)", 8 * self.trainable),
                      ("fp32 gradients", 4 * self.trainable)]
        if self.params_on_cpu:
            parts.append((f"{8 * self.param_bytes}-bit working weights", self.param_bytes * self.params))
        return [(what, n * self.node_share) for what, n in parts]

    def total(self) -> float:
        return sum(n for _, n in self.parts())


def offload_targets(ds_config: Mapping) -> tuple[bool, bool]:
    zero = ds_config.get("zero_optimization", {}) or {}

    def on_cpu(key: str) -> bool:
        return str((zero.get(key) or {}).get("device", "none")).lower() == "cpu"

    return on_cpu("offload_optimizer"), on_cpu("offload_param")


def count_parameters(model_args, lora_args) -> tuple[int, int]:
    """(all, trainable) parameters, from the config alone: the model is built on the meta device (no memory, no
    weights read), through the class directly so that ZeRO-3's zero.Init does not intercept it; under LoRA the
    adapter is attached the way training attaches it (sft/model/loading.py), so the count follows its targets."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from sft.model.loading import attach_lora, load_config, planned_lora_config

    config = load_config(model_args)
    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
        total = sum(p.numel() for p in model.parameters())
        if not lora_args.lora:
            return total, total
        if lora_args.lora_from:  # the saved adapter's shape, its weights left unread
            from peft import get_peft_model

            model = get_peft_model(model, planned_lora_config(model_args, lora_args))
        else:
            model = attach_lora(model, lora_args, False)
    return total, sum(p.numel() for p in model.parameters() if p.requires_grad)


def estimate_offload(model_args, lora_args, training_args, launch: Launch | None = None) -> OffloadEstimate | None:
    """The host-RAM needs of the DeepSpeed plan in effect, or None when nothing is offloaded to the CPU."""
    plugin = getattr(training_args, "deepspeed_plugin", None)
    if plugin is None:
        return None
    ds_config = plugin.deepspeed_config
    optimizer_on_cpu, params_on_cpu = offload_targets(ds_config)
    if not (optimizer_on_cpu or params_on_cpu):
        return None
    params, trainable = count_parameters(model_args, lora_args)
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    world = max(1, training_args.world_size)
    local = (launch or this_launch()).processes_here(world)
    # ZeRO-3 partitions everything over all ranks; stages 1-2 offload a partition of the optimizer only, and
    # under stage 2 the (fp16) parameters are not offloaded at all.
    share = min(1.0, local / world) if stage >= 1 else 1.0
    half = training_args.bf16 or training_args.fp16
    return OffloadEstimate(params, trainable, optimizer_on_cpu, params_on_cpu and stage == 3, 2 if half else 4, share)


def check_offload_ram(model_args, lora_args, training_args, machine: Machine | None = None) -> OffloadEstimate | None:
    """Stop before loading when the offload plan cannot fit this machine's RAM (`machine`: this one when None; its
    RAM is SFT_HOST_RAM_GIB where set); warn when it is tight."""
    from sft.machine import machine as this_machine

    m = machine or this_machine()
    estimate = estimate_offload(model_args, lora_args, training_args, m.launch)
    if estimate is None:
        return None
    available, total = m.host_ram_available_gib * GIB, m.host_ram_gib * GIB
    need = estimate.total()
    detail = " + ".join(f"{n / GIB:.1f} GiB {what}" for what, n in estimate.parts())
    message = (f"the DeepSpeed CPU-offload plan needs at least {need / GIB:.1f} GiB of host RAM on this machine "
               f"({detail}; {estimate.params / 1e9:.2f}B parameters, {estimate.trainable / 1e9:.3g}B trained, "
               f"{estimate.node_share:.0%} of the ZeRO partitions here), not counting the processes themselves "
               f"and loading buffers; this machine has {total / GIB:.1f} GiB, {available / GIB:.1f} GiB available.")
    advice = (" Use fewer offloaded parts (ds_configs/zero3.json: no offload; or offload the optimizer only), "
              "LoRA (--lora), more machines, or a machine with more RAM.")
    if need > total:
        raise ConfigError(message + advice + " If this machine's RAM grows on demand (some VMs start with a small "
                          "MemTotal), give its real size: SFT_HOST_RAM_GIB=<GiB>.")
    if m.launch.first:  # one report per run, not one per process
        if need > available:
            print(f"warning: {message} It may be killed for lack of memory.{advice}", file=sys.stderr, flush=True)
        else:
            print(f"Host RAM: {message}", flush=True)
    return estimate


def check_cpu_training_ram(model_args, lora_args, training_args, machine: Machine | None = None) -> float | None:
    """Without a GPU every process holds the model in host RAM: its weights in the dtype they load in (fp32 where
    the CPU has no bf16), and for what is trained a gradient and AdamW's two moments in the same dtype. A model
    larger than the RAM was killed by the kernel part-way through loading, with no word on why: stop before loading
    instead, and warn when it needs more than is free. -> GiB needed on this machine; None when a GPU trains."""
    from sft.machine import machine as this_machine
    from sft.model.loading import weights_dtype

    m = machine or this_machine()
    if str(getattr(training_args, "device", "cpu")).split(":")[0] != "cpu" or not m.host_ram_gib:
        return None
    params, trainable = count_parameters(model_args, lora_args)
    width = weights_dtype(model_args, lora_args.lora, m).itemsize
    processes = m.launch.processes_here(max(1, training_args.world_size))
    need = (params + 3 * trainable) * width * processes / GIB
    count = lambda n: f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"  # noqa: E731
    message = (f"training on the CPU holds the model in host RAM: about {need:.1f} GiB ({count(params)} "
               f"parameters in {8 * width}-bit, {count(trainable)} trained with their gradients and AdamW's "
               f"moments{f', in each of {processes} processes' if processes > 1 else ''}), not counting activations; "
               f"this machine has {m.host_ram_gib:.1f} GiB, {m.host_ram_available_gib:.1f} GiB available.")
    advice = f" Train on a GPU, or choose a smaller model{'' if lora_args.lora else ', --lora'} or fewer processes."
    if need > m.host_ram_gib:
        raise ConfigError(message + advice + " If this machine's RAM grows on demand, give its real size: "
                          "SFT_HOST_RAM_GIB=<GiB>.")
    if need > m.host_ram_available_gib and m.launch.first:
        print(f"warning: {message} It may be killed for lack of memory.{advice}", file=sys.stderr, flush=True)
    return need


def check_data_parallel(training_args, launch: Launch | None = None) -> None:
    """Several processes but no distributed backend: accelerate then wraps nothing, and each process trains alone
    on its share of the data (on a CPU machine, without --use_cpu or --ddp_backend)."""
    launched = (launch or this_launch()).world_size
    state = getattr(training_args, "distributed_state", None)
    unwrapped = state is not None and str(state.distributed_type) == "DistributedType.NO"
    if launched < 2 or (training_args.world_size == launched and not unwrapped):
        return
    raise ConfigError(f"{launched} processes were started but no distributed backend was set up, "
                      f"so each would train alone on its share of the data. {CPU_BACKEND_ADVICE}")


def one_gpu_per_process(training_args) -> None:
    """Say that one process that sees several GPUs trains on the first: SFTTrainingArguments.n_gpu, which the
    Trainer reads, is at most one (nn.DataParallel over all of them would be slower than DDP, make the global batch
    per-device x GPUs, and the world-size-based numbers (MFU) wrong). Several GPUs are used through a launcher
    config (ddp.yaml, fsdp.yaml...)."""
    gpus = training_args.gpus_seen  # (sets the devices up first)
    if gpus > 1 and is_first_process():
        print(f"One process sees {gpus} GPUs: training on {training_args.device} only. To use them all: "
              f"accelerate launch --config_file accelerate_configs/ddp.yaml (or fsdp.yaml, zero3.yaml) "
              f"--num_processes {gpus} ...", flush=True)


def preflight(model_args, lora_args, training_args, machine: Machine | None = None) -> None:
    """Run once the process group exists (TrainingArguments built) and before the model loads. `machine`: this
    one when None (read here: CUDA is initialised by now)."""
    from sft.machine import machine as this_machine

    m = machine or this_machine()
    check_data_parallel(training_args, m.launch)
    one_gpu_per_process(training_args)
    check_offload_ram(model_args, lora_args, training_args, m)
    check_cpu_training_ram(model_args, lora_args, training_args, m)
    check_allreduce(launch=m.launch)
