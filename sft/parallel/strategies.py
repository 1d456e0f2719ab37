"""The strategy table: one entry per way of spreading a fine-tune over the GPUs, each holding its accelerate
config, its DeepSpeed JSON, what it shards and offloads, its memory model and the checks that apply to it.

The planner (sft/plan/memory.py) predicts each strategy's memory from `Strategy.state_bytes` (weights, gradients,
optimizer state and fp32 master weights per card, and what goes to host RAM) plus activations and the
strategy's transient buffers; the constants it fits against bench/results.jsonl live in sft/plan/memory.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sft.configs import CONFIGS
from sft.machine import Launch
from sft.options import checks

REPO = Path(__file__).resolve().parents[2]  # a checkout's root (bench/, recipes/); a wheel has none


@dataclass(frozen=True)
class StateBytes:
    """Bytes per card on the GPU (and in host RAM) of the training state, by part."""

    weights: float = 0.0          # the weights the forward reads (bf16 base, fp32 model, or this card's shard)
    gradients: float = 0.0
    optimizer: float = 0.0        # Adam's moments (fp32, or torchao's 8/4-bit states)
    masters: float = 0.0          # fp32 master copy kept apart from 16-bit working weights (DeepSpeed)
    buckets: float = 0.0          # DDP's gradient buckets (a second copy of the gradients)
    host: float = 0.0             # offloaded to host RAM (per card)
    host_weights: float = 0.0     # of which the offloaded 16-bit weights (the rest: CPU Adam's fp32 state)

    @property
    def gpu(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.masters + self.buckets


@dataclass(frozen=True)
class Setup:
    """What is trained and in which precision: `method` lora | qlora | full; `precision` (full only, see
    PRECISION_OPTIONS) fp32_master (fp32 weights + bf16/fp16 autocast, AdamW), bf16_sr (bf16 weights and Adam
    states, the update rounded stochastically: sft/speed/sr_adamw.py) or lowbit4 / lowbit8 (bf16 weights, torchao 4/8-bit
    AdamW with bf16 stochastic rounding)."""

    method: str = "lora"
    precision: str = "fp32_master"
    half: bool = True             # bf16/fp16 autocast (every GPU plan)


# The training options of each full fine-tune precision (sft/options/checks.py: full_fine_tune_keeps_small_updates).
PRECISION_OPTIONS: dict[str, dict[str, str]] = {
    "fp32_master": {},
    "bf16_sr": {"dtype": "bfloat16", "optim": "adamw_bf16_sr"},
    "lowbit8": {"dtype": "bfloat16", "optim": "adamw_torch_8bit", "optim_args": "bf16_stochastic_round=True"},
    "lowbit4": {"dtype": "bfloat16", "optim": "adamw_torch_4bit",
                "optim_args": "bf16_stochastic_round=True,block_size=128"},
}


# QLoRA's 4-bit base, bytes per value: NF4 (0.5) with one int8 scale per 64 values and a float factor per 256 scales
# (double quantization; torchao's NF4Tensor under FSDP as bitsandbytes' layout on one GPU or DDP): ~4.13 bits.
NF4_BYTES = 0.516


def _optimizer_bytes(precision: str) -> float:
    """Adam's two moments per trained parameter: fp32 (8 B), bf16 (4 B), torchao 8-bit (2 B + a fp32 scale per
    256 values each) or 4-bit (1 B + a fp32 scale per 128 values each)."""
    return {"bf16_sr": 4.0, "lowbit8": 2 + 2 * 4 / 256, "lowbit4": 1 + 2 * 4 / 128}.get(precision, 8.0)


@dataclass(frozen=True)
class Strategy:
    name: str
    accelerate_config: str               # relative to the repository root
    deepspeed_config: str | None
    shards: frozenset[str]               # of "weights", "gradients", "optimizer"
    offload: frozenset[str]              # of "optimizer", "weights" (to host RAM)
    launcher: str                        # "single", "nccl" (DDP/FSDP/TP) or "deepspeed": its CUDA context + NCCL cost
    min_gpus: int = 1
    max_gpus: int | None = None
    recommended: bool = True
    note: str = ""
    methods: tuple[str, ...] = ("lora", "qlora", "full")
    # In this order a tie in speed goes to the first: bf16 states where they fit, low-bit states where needed.
    precisions: tuple[str, ...] = ("bf16_sr", "fp32_master", "lowbit8", "lowbit4")
    checks: tuple[Callable, ...] = ()    # the named checks of sft/options/checks.py that decide for this strategy
    sharded_kind: str = "none"           # "none", "fsdp", "zero3", "tp": which transient buffers it has
    zero_stage: str | None = None        # DeepSpeed's ZeRO stage (its accelerate config's)

    @property
    def accelerate_path(self) -> Path:
        return CONFIGS / self.accelerate_config  # the shipped copy: the same path under sft/configs/

    @property
    def deepspeed_path(self) -> Path | None:
        return CONFIGS / self.deepspeed_config if self.deepspeed_config else None

    def launch(self, world: int) -> Launch:
        """What `accelerate launch --config_file <its config>` sets up for `world` processes, as sft.machine reads it
        from the environment: the launch a run of this strategy checks its options against (the planner asks the
        run's own rules of a plan through it: sft/plan/fast_paths.py)."""
        offload = tuple(sorted({"weights": "param"}.get(part, part) for part in self.offload))
        return Launch(world_size=world, local_world_size=world, launched=True, fsdp=self.sharded_kind == "fsdp",
                      zero_stage=self.zero_stage, offload=offload)

    def gpus_for(self, gpus: int) -> int:
        """Processes this strategy starts on a machine of `gpus` GPUs (TP: the largest even split, here 2)."""
        if self.max_gpus is not None:
            return min(gpus, self.max_gpus)
        return gpus

    def state_bytes(self, params: int, trainable: int, setup: Setup, world: int,
                    quantizable: int = 0) -> StateBytes:
        """The memory model of the training state, per card. `params`: all parameters; `trainable`: those the
        optimizer updates (the adapter under LoRA); `quantizable`: the parameters of the linear layers that QLoRA
        stores in 4 bits (the rest stays bf16)."""
        shard_w = world if "weights" in self.shards else 1
        shard_g = world if "gradients" in self.shards else 1
        shard_o = world if "optimizer" in self.shards else 1
        host = 0.0
        if setup.method in ("lora", "qlora"):
            if setup.method == "qlora":  # NF4 with double quantization; the embeddings, lm_head and norms in bf16
                base = quantizable * NF4_BYTES + (params - quantizable) * 2
            else:
                base = params * 2  # frozen bf16/fp16 base
            adapter_w, adapter_g, adapter_o = trainable * 4, trainable * 4, trainable * 8
            masters = 0.0
            if self.deepspeed_config:  # DeepSpeed holds the adapter in 16 bits and an fp32 master copy
                adapter_w, adapter_g, masters = trainable * 2, trainable * 2, trainable * 4
            weights = base / shard_w + adapter_w / shard_w
            grads, opt, masters = adapter_g / shard_g, adapter_o / shard_o, masters / shard_o
            buckets = adapter_g if self.name == "ddp" else 0.0
        else:
            opt_bytes = _optimizer_bytes(setup.precision)
            if setup.precision == "fp32_master":
                if self.deepspeed_config:  # 16-bit working weights + fp32 master, fp32 gradient partitions
                    weights, masters = params * 2 / shard_w, params * 4 / shard_o
                    grads = params * 4 / shard_g
                else:  # fp32 weights under autocast
                    weights, masters, grads = params * 4 / shard_w, 0.0, params * 4 / shard_g
            else:  # bf16 weights and gradients, Adam states in bf16 or torchao's low-bit ones
                weights, masters, grads = params * 2 / shard_w, 0.0, params * 2 / shard_g
            opt = params * opt_bytes / shard_o
            buckets = grads if self.name == "ddp" else 0.0
        if "optimizer" in self.offload:  # DeepSpeed CPU Adam: fp32 master, moments and gradients on the host
            host += masters + opt + trainable * 4 / world
            masters, opt = 0.0, 0.0
            grads = 0.0  # reduce-scattered straight into the host's fp32 partition
        host_weights = 0.0
        if "weights" in self.offload:
            host, host_weights, weights = host + weights, weights, 0.0
        return StateBytes(weights, grads, opt, masters, buckets, host, host_weights)


def _c(*names: str) -> tuple[Callable, ...]:
    return tuple(getattr(checks, n) for n in names)


COMMON = ("precision_the_hardware_has", "full_fine_tune_keeps_small_updates", "attention_kernel_available",
          "processes_fit_gpus", "launcher_agrees", "partial_checkpointing")

STRATEGIES: dict[str, Strategy] = {s.name: s for s in [
    Strategy("single_gpu", "accelerate_configs/single_gpu.yaml", None, frozenset(), frozenset(), "single",
             max_gpus=1, note="one process on the first GPU", checks=_c(*COMMON)),
    Strategy("ddp", "accelerate_configs/ddp.yaml", None, frozenset(), frozenset(), "nccl", min_gpus=2,
             note="a full replica per GPU; only gradients are all-reduced", checks=_c(*COMMON)),
    Strategy("zero2", "accelerate_configs/zero2.yaml", "ds_configs/zero2.json",
             frozenset({"gradients", "optimizer"}), frozenset(), "deepspeed", min_gpus=2, methods=("lora", "full"),
             precisions=("fp32_master",), note="optimizer state and gradients sharded (no QLoRA: sft/options/checks.py)",
             checks=_c(*COMMON, "deepspeed_json_agrees"), zero_stage="2"),
    Strategy("fsdp", "accelerate_configs/fsdp.yaml", None, frozenset({"weights", "gradients", "optimizer"}),
             frozenset(), "nccl", min_gpus=2, note="FSDP2, one shard unit per decoder layer",
             checks=_c(*COMMON, "sharding_needs_gpus"), sharded_kind="fsdp"),
    Strategy("zero3", "accelerate_configs/zero3.yaml", "ds_configs/zero3.json",
             frozenset({"weights", "gradients", "optimizer"}), frozenset(), "deepspeed", min_gpus=2,
             methods=("lora", "full"), precisions=("fp32_master",), note="created partitioned (zero.Init)",
             checks=_c(*COMMON, "quantized_base_not_under_zero3", "deepspeed_json_agrees"), sharded_kind="zero3",
             zero_stage="3"),
    Strategy("zero3_offload", "accelerate_configs/zero3_offload.yaml", "ds_configs/zero3_offload.json",
             frozenset({"weights", "gradients", "optimizer"}), frozenset({"optimizer", "weights"}), "deepspeed",
             min_gpus=1, methods=("lora", "full"), precisions=("fp32_master",),
             note="optimizer state and weights in host RAM (DeepSpeed CPU Adam): slow",
             checks=_c(*COMMON, "quantized_base_not_under_zero3", "sharding_needs_gpus", "deepspeed_json_agrees"),
             sharded_kind="zero3", zero_stage="3"),
    Strategy("autoep", "accelerate_configs/autoep.yaml", "ds_configs/autoep.json", frozenset(), frozenset(),
             "deepspeed", min_gpus=2, max_gpus=2, methods=("lora",), precisions=("fp32_master",),
             note="DeepSeek-V2 LoRA: each GPU holds half the routed experts in bf16 (DeepSpeed AutoEP, ZeRO-0); speed "
                  "not measured yet (sft/plan/expert_parallel.py)",
             checks=_c(*COMMON, "expert_parallel_combinations", "deepspeed_json_agrees"), zero_stage="0"),
    Strategy("tp", "accelerate_configs/tp.yaml", None, frozenset({"weights", "gradients", "optimizer"}),
             frozenset(), "nccl", min_gpus=2, max_gpus=2, recommended=False, methods=("full",),
             precisions=("fp32_master",),
             note="not recommended: measured 0.3-1.1x FSDP and no memory saved (bench/RESULTS.md)",
             checks=_c(*COMMON, "tensor_parallel_combinations"), sharded_kind="tp"),
]}
