"""Trainer callbacks: throughput numbers added to the logs that TensorBoard (and every other `report_to` logger)
receives, and the run's first screen (RunOverview)."""

from __future__ import annotations

import math
import time

import torch
from transformers import TrainerCallback

from sft.model.saved_modules import frozen_originals, trained_copies
from sft.report.console import run_overview, tensorboard_dir
from sft.report.placement import held_text, holdings, worth_saying
from sft.machine import GIB, GPU_KINDS, Machine, is_first_process, machine

# Dense bf16 matmul peak per GPU, FLOP/s, by what the GPU's name contains (sft/machine.py GPU_KINDS says where each
# figure comes from).
PEAK_FLOPS = {name: kind.peak_flops for name, kind in GPU_KINDS.items()}


def peak_flops(override_tflops: float | None = None, m: Machine | None = None) -> float | None:
    """The bf16 peak of the GPU this process trains on (a local rank trains on cuda:local_rank), by its name."""
    if override_tflops:
        return override_tflops * 1e12
    m = m or machine()
    if not m.cuda:
        return None
    name = m.gpu_names[min(m.launch.local_rank, m.gpus - 1)]
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(model, lora: bool) -> float:
    """Model FLOPs per trained token: 6N for full fine-tuning, 4N under LoRA (the frozen weights get no weight
    gradient), N = parameters of the matmuls a token passes through (all but the input embeddings; of an MoE
    layer's routed experts only the num_experts_per_tok of n_routed_experts it is sent to: MFU on ACTIVE
    parameters, as bench/train_throughput.py and the planner count it). Attention scores are not counted.

    A module trained whole beside LoRA (--lora_modules_to_save) runs once, in place of its frozen original (kept
    beside it, never run: not counted), and gets a weight gradient: 2 more FLOPs per weight, 6 in all, as in a full
    fine-tune. The input embedding stays out either way: its forward is a lookup and its weight gradient a scatter
    of the incoming gradient's rows, no matmul."""
    embeddings = model.get_input_embeddings()
    skipped = {id(p) for p in embeddings.parameters()} if embeddings is not None else set()  # peft's wrapper: both
    whole: set[int] = set()
    if lora:
        skipped |= frozen_originals(model)
        whole = {id(p) for copy in trained_copies(model).values() for p in copy.parameters()}
    share = routed_share(model.config)
    return float(sum(full_numel(p) * (share if ".mlp.experts." in name else 1)
                     * (4 if lora and id(p) not in whole else 6)
                     for name, p in model.named_parameters() if id(p) not in skipped))


def routed_share(config) -> float:
    """The fraction of an MoE layer's routed experts (transformers' fused `mlp.experts` parameters) one token
    runs through: 6 of 64 for DeepSeek-V2-Lite; 1 for dense models."""
    routed, per_token = getattr(config, "n_routed_experts", None), getattr(config, "num_experts_per_tok", None)
    return per_token / routed if routed and per_token else 1.0


def full_numel(p) -> int:
    """Elements of the whole parameter, also when ZeRO-3 has partitioned it (its local numel is then 0) or
    bitsandbytes packed it into 4 bits (its storage holds 2 or 4 values per element)."""
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None:
        return math.prod(quant_state.shape)
    return getattr(p, "ds_numel", None) or p.numel()


class ThroughputCallback(TrainerCallback):
    """Real (non-padding) tokens per second, MFU and peak GPU memory, over the steps since the last log.

    Time spent evaluating or saving is left out, so the numbers describe training steps. Tokens come from the
    Trainer's own count (`include_num_input_tokens_seen="non_padding"`), summed over ranks; under tensor
    parallelism the ranks of one model copy see the same batch, so that sum counts each token tp_size times.

    The Trainer's final train metrics (the log holding `train_loss`, which all_results.json is made of) get the
    run's numbers: total_real_tokens (the whole run, resumes included), train_real_tokens_per_second and train_mfu
    (this session's training steps), effective_tokens_per_sec (LLaMA-Factory's figure: this session's tokens over
    its train_runtime, evaluation and saves included, per process) and peak_memory_gib.
    """

    def __init__(self, flops_per_token: float, peak_flops_per_gpu: float | None):
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_gpu
        self.busy = 0.0
        self.mark = time.perf_counter()
        self.tokens_at_last_log = 0
        self.logged_tokens = 0.0
        self.tokens_at_begin = 0  # this session's start (a resumed run counts on from its checkpoint)
        self.session_busy = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.mark = time.perf_counter()
        self.tokens_at_last_log = self.tokens_at_begin = state.num_input_tokens_seen
        self.session_busy = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.busy += now - self.mark
        self.session_busy += now - self.mark
        self.mark = now

    def _pause_ended(self, args, state, control, **kwargs):
        self.mark = time.perf_counter()

    on_evaluate = on_save = _pause_ended

    def on_log(self, args, state, control, logs=None, **kwargs):
        same_batch = getattr(kwargs.get("model"), "tp_size", None) or 1  # ranks that share one batch (TP)
        if logs is not None and "train_loss" in logs:  # not train_runtime: token counting adds it to every log
            self._final_numbers(args, state, logs, same_batch)
        if logs is None or "loss" not in logs or self.busy <= 0:
            return
        tokens = (state.num_input_tokens_seen - self.tokens_at_last_log) / same_batch
        self.logged_tokens = tokens  # over the window just logged (bench/train_throughput.py reads it)
        rate = tokens / self.busy
        logs["real_tokens_per_second"] = round(rate, 1)
        if self.peak:
            logs["mfu"] = round(rate * self.flops_per_token / (self.peak * max(1, args.world_size)), 4)
        if torch.cuda.is_available():
            logs["peak_memory_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
        self.tokens_at_last_log = state.num_input_tokens_seen
        self.busy = 0.0

    def _final_numbers(self, args, state, logs, same_batch: int):
        tokens = (state.num_input_tokens_seen - self.tokens_at_begin) / same_batch  # this session's
        if state.num_input_tokens_seen:  # 0: the Trainer was not counting (include_num_input_tokens_seen "no")
            logs["total_real_tokens"] = round(state.num_input_tokens_seen / same_batch)
        if tokens > 0 and self.session_busy > 0:
            rate = tokens / self.session_busy
            logs["train_real_tokens_per_second"] = round(rate, 1)
            if self.peak:
                logs["train_mfu"] = round(rate * self.flops_per_token / (self.peak * max(1, args.world_size)), 4)
        if tokens > 0 and logs.get("train_runtime", 0) > 0:
            logs["effective_tokens_per_sec"] = round(tokens / logs["train_runtime"] / max(1, args.world_size), 2)
        if torch.cuda.is_available():
            logs["peak_memory_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)


def offloads_parameters(policy) -> bool:
    """accelerate's FSDP plugin holds FSDP2's `OffloadPolicy()` (truthy: an object) when nothing is offloaded, and
    `CPUOffloadPolicy` when parameters are; FSDP1's `CPUOffload(offload_params=...)` says it in a field."""
    if policy is None or isinstance(policy, bool):
        return bool(policy)
    if hasattr(policy, "offload_params"):
        return bool(policy.offload_params)
    return type(policy).__name__ == "CPUOffloadPolicy"


def describe_strategy(args, tp_size: int = 1) -> tuple[str, str]:
    """(strategy, devices) of the running Trainer, e.g. ("DeepSpeed ZeRO-3, optimizer offloaded to CPU", "2 GPUs").
    Read from accelerate's state, which the Trainer's Accelerator has set up by train begin: it is what runs (a
    launcher config or the Trainer flags), not what was asked for."""
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import DistributedType

    state = AcceleratorState() if is_initialized() else None
    kind = state.distributed_type if state else DistributedType.NO
    if kind == DistributedType.DEEPSPEED:
        plugin = state.deepspeed_plugin
        zero = plugin.deepspeed_config.get("zero_optimization") or {}
        offloaded = [part for part, key in (("optimizer", "offload_optimizer"), ("parameters", "offload_param"))
                     if str((zero.get(key) or {}).get("device", "none")).lower() == "cpu"]
        strategy = f"DeepSpeed ZeRO-{zero.get('stage', plugin.zero_stage)}"
        strategy += f", {' and '.join(offloaded)} offloaded to CPU" if offloaded else ""
    elif kind == DistributedType.FSDP:
        plugin = state.fsdp_plugin
        strategy = f"FSDP{getattr(plugin, 'fsdp_version', 1)}"
        strategy += ", parameters offloaded to CPU" if offloads_parameters(getattr(plugin, "cpu_offload", None)) else ""
    elif tp_size > 1:
        dp = args.world_size // tp_size
        strategy = f"tensor parallel over {tp_size}" + (f" x {dp} data-parallel" if dp > 1 else "")
    elif kind == DistributedType.NO:
        strategy = "no parallelism"
    else:
        strategy = f"DDP, {getattr(state, 'backend', None) or args.ddp_backend or 'default'} backend"
    device = args.device.type
    if device == "cpu":
        return strategy, "CPU"
    name = "GPU" if device == "cuda" else device
    return strategy, f"{args.world_size} {name}{'s' if args.world_size > 1 else ''}"  # one device per process


def mean_tokens_per_row(dataset) -> float | None:
    """Mean length of `input_ids` over the rows, from the Arrow column (no Python list per row)."""
    try:
        import pyarrow.compute as pc

        column = dataset.data.column("input_ids")
        return pc.sum(pc.list_value_length(column)).as_py() / len(column)
    except (AttributeError, KeyError, TypeError, ZeroDivisionError):  # an iterable or non-Arrow dataset
        return None


class RunOverview(TrainerCallback):
    """Prints the run's first screen (sft/report/console.py's run_overview) on rank 0 when training begins, the first
    moment the Trainer knows the number of optimizer steps (state.max_steps: --max_steps, or epochs x batches per
    epoch, as the Trainer computed it, resume included) and accelerate knows the strategy.

    Parameters are counted here, before the Trainer wraps the model: FSDP1 would leave this rank's flat shard only.
    ZeRO-3 (partitioned at creation) and DTensor parameters (FSDP2, TP) report their full size through full_numel."""

    def __init__(self, model, train_dataset, model_name: str, speed: tuple[str, ...] = (), memory: str | None = None):
        params = list(model.parameters())
        # peft keeps the frozen original of each module trained whole (--lora_modules_to_save) beside its trained
        # copy: counted once, as the model's own, not twice
        originals = frozen_originals(model) if hasattr(model, "peft_config") else set()
        self.total = sum(full_numel(p) for p in params if id(p) not in originals)
        self.trainable = sum(full_numel(p) for p in params if p.requires_grad)
        copies = trained_copies(model) if originals else {}
        self.whole = (sorted({path.rsplit(".", 1)[-1] for path in copies}),  # their names, and their parameters
                      sum(full_numel(p) for p in {id(p): p for c in copies.values() for p in c.parameters()}.values()))
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model
        self.architecture = type(base).__name__
        self.dtype = str(getattr(base, "dtype", params[0].dtype)).removeprefix("torch.")
        adapter = next((p.dtype for p in params if p.requires_grad), None)
        self.adapter_dtype = str(adapter).removeprefix("torch.") if adapter is not None else self.dtype
        adapters = getattr(model, "peft_config", None) or {}  # peft: {adapter name: LoraConfig}
        adapter_config = next(iter(adapters.values()), None)
        self.lora_rank = getattr(adapter_config, "r", None)
        self.rslora = bool(getattr(adapter_config, "use_rslora", False))  # scaled by alpha / sqrt(r)
        self.tp_size = getattr(model, "tp_size", None) or 1
        self.mean_row_tokens = mean_tokens_per_row(train_dataset)
        self.model_name = model_name
        self.speed = speed  # the fast paths chosen by default (ModelArguments.speed_choices)
        self.memory = memory  # the planner's peak for this run, or why there is none (sft/plan/this_run.py)
        self.held: str | None = None  # what is held where, said for MoE and quantized-base runs (placement.py)
        self.text: str | None = None  # what was printed (tests read it)

    def on_train_begin(self, args, state, control, **kwargs):
        if not is_first_process():
            return
        strategy, devices = describe_strategy(args, self.tp_size)
        model = kwargs.get("model")  # as the Trainer placed it: on its GPU, sharded or offloaded
        held = holdings(model) if model is not None else {}
        self.held = held_text(held) if held and worth_saying(held) else None
        save = str(getattr(args.save_strategy, "value", args.save_strategy))
        steps = state.save_steps or args.save_steps  # a float in transformers 5 (a ratio below 1)
        steps = int(steps) if float(steps).is_integer() else steps
        saves = {"no": "none (--save_strategy no)", "epoch": "every epoch", "best": "the best one"}.get(
            save, "every step" if steps == 1 else f"every {steps:,} steps")
        if save != "no" and args.checkpoints_to_keep:  # --save_total_limit, which our rotation keeps
            best = " and the best" if args.load_best_model_at_end else ""  # rotation keeps best_model_checkpoint
            saves += f" (the last {args.checkpoints_to_keep}{best} kept)"
        self.text = run_overview(
            model=self.model_name, architecture=self.architecture, total_params=self.total,
            trainable_params=self.trainable, dtype=self.dtype, lora_rank=self.lora_rank, rslora=self.rslora,
            trained_whole=self.whole,
            adapter_dtype=self.adapter_dtype if self.lora_rank and self.adapter_dtype != self.dtype else None,
            mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else None,
            processes=args.world_size, strategy=strategy, devices=devices,
            per_device_batch=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
            data_parallel=max(1, args.world_size // self.tp_size), mean_row_tokens=self.mean_row_tokens,
            max_steps=state.max_steps, epochs=None if args.max_steps > 0 else args.num_train_epochs,
            resume_step=state.global_step, output_dir=args.output_dir, saves=saves,
            tensorboard=tensorboard_dir(args.output_dir, args.report_to), speed=self.speed, held=self.held,
            memory=self.memory if self.held else None)
        print(self.text, flush=True)
