"""What the planner knows of `--quantize_experts fp8` (sft/model/quantized_experts.py): the resident plan.

In a LoRA run of a DeepSeek-V2/V3 MoE model the frozen routed experts stay on each GPU in e4m3 (1 byte a weight, one
fp32 scale per output row) instead of bf16, the rest of the base in bf16; each MoE layer's experts are dequantized to
bf16 for that layer's forward only, and again in its recomputation: activation checkpointing is required, and one
layer's bf16 experts are the plan's own transient. The experts stay whole on every GPU: one GPU or DDP
(sft/options/checks.py quantized_experts_combinations). MLA models have no Liger (plans.kernels), so the plan
computes its loss in chunks (--chunked_loss, their run's default), as its bench rows ran: the whole logits of
micro-batch 8 would take more than the card.

Under --compile_layers the plan held less than eager at the same micro-batch (moe-lora-resident-1-mb4-compile,
run 20261205T0515Z-next: 19.96 against 20.82 GiB reserved), where a dense LoRA's compiled layers hold more: the
planner's fit of the compiled layers' memory for resident plans is their own, in units of dequantized_layer_bytes
(refit.fast_path_memory, kind "resident").

Its speed is read from the bench rows that ran with --quantize_experts fp8 only (the dequantization is work no other
row does), their MFU counted in the planner's FLOPs (the routed experts at their measured cost), so that a plan of
the measured configuration predicts the measured tok/s.

Without torch: the planner's command line reads no GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sft.plan.shapes import Shape

OPTION = "--quantize_experts fp8"
# The strategies it runs under: the quantized experts stay whole on each GPU (no FSDP, DeepSpeed or TP).
STRATEGIES = ("single_gpu", "ddp")
# sft/speed/chunked_loss.py CHUNK_TOKENS (that module imports torch; a test keeps the two equal): the tokens whose
# logits exist at once under --chunked_loss.
LOSS_CHUNK_TOKENS = 1024
# Bench rows whose speed is not what the code runs today, {(run_id, name): why}: their memory is still checked.
SLOWER_THAN_TODAY = {
    ("20261204T2040Z-resident", "moe-lora-resident-1"):
        "experts dequantized eagerly (a cast, a copy and a multiply per layer) before 725a8f1's compiled kernel",
}


# Bench rows whose host RAM is not what the code holds today, {(run_id, name): why}: they loaded the whole bf16 base
# into host RAM before quantizing its experts (RSS: the checkpoint's mapped pages and the fused bf16 experts), so the
# host-RAM check leaves them out, and nothing is fitted to them.
LOADED_WHOLE = {
    (run, name): "loaded the whole bf16 base into host RAM, then quantized (before sft/model/experts_on_load.py)"
    for run, name in (("20261204T2040Z-resident", "moe-lora-resident-1"),
                      ("20261204T2105Z-resident", "moe-lora-resident-1"),
                      ("20261205T0235Z-next", "moe-lora-resident-1-mb4"),
                      ("20261205T0515Z-next", "moe-lora-resident-1-mb4-compile"),
                      ("20261205T0515Z-next", "moe-lora-resident-1-mb6"))}


# Bench rows whose host RAM is not a user's loading path, {(run_id, name): why}: left out of the host-RAM check
# like LOADED_WHOLE, but they held less than the planner counts for reading a checkpoint.
NOT_FROM_A_CHECKPOINT = {
    ("20261206T0447Z-moe-h100", "moe-lora-compile-fp8-experts"):
        "random weights built on the GPU by the bench (no checkpoint read): 12.0 GiB where reading one is counted",
}


def offered(shape: "Shape", strategy: str, method: str, checkpointing: bool) -> bool:
    """The resident plan exists for LoRA (not QLoRA: its base is 4-bit already) of a model with routed experts,
    with activation checkpointing, on one GPU or under DDP."""
    return method == "lora" and shape.routed_experts > 0 and checkpointing and strategy in STRATEGIES


def expert_params(shape: "Shape") -> int:
    """Weights of the routed experts of every MoE layer (gate_up_proj and down_proj)."""
    moe_layers = shape.layers - shape.first_dense if shape.moe else 0
    return moe_layers * shape.routed_experts * 3 * shape.hidden * shape.moe_intermediate


def scale_bytes(shape: "Shape") -> float:
    """One fp32 scale per output row: gate_up_proj's 2 x moe_intermediate rows and down_proj's hidden rows, per
    expert of every MoE layer."""
    moe_layers = shape.layers - shape.first_dense if shape.moe else 0
    return 4.0 * moe_layers * shape.routed_experts * (2 * shape.moe_intermediate + shape.hidden)


def bytes_saved(shape: "Shape") -> float:
    """What holding the experts in e4m3 saves against the bf16 base: 2 bytes a weight less 1 byte and the scales."""
    return 2.0 * expert_params(shape) - (expert_params(shape) + scale_bytes(shape))


def dequantized_layer_bytes(shape: "Shape") -> float:
    """One MoE layer's experts in bf16 (2 bytes a weight): alive through that layer's forward, and through its
    recomputation and backward (autograd keeps the weights its matmuls read)."""
    return 2.0 * shape.routed_experts * 3 * shape.hidden * shape.moe_intermediate


def load_host_bytes(shape: "Shape", experts_on_host: bool = False) -> float:
    """Host RAM one process holds at its peak while it loads the base, from the code (sft/model/experts_on_load.py:
    the experts quantized as the checkpoint is read; below the training's peak in the rows that measured it): the rest of the base in bf16, one
    MoE layer's fused gate_up_proj in flight three times over in bf16 (the per-expert pages read, until they are
    dropped after the layer; the stacked gate and up halves; their concatenation), and the e4m3 experts with their
    scales only where no GPU holds them (`experts_on_host`; a GPU run quantizes on its GPU and keeps them there).
    The rest's pages are read as the model moves to the GPU, after the last layer: counting both at once errs by
    the smaller of the two on the safe side. Under DDP every process loads its own copy: the planner counts this
    per process."""
    rest = 2.0 * (shape.params() - expert_params(shape))
    in_flight = 3 * 2.0 * shape.routed_experts * 2 * shape.moe_intermediate * shape.hidden if shape.moe else 0.0
    quantized = expert_params(shape) + scale_bytes(shape) if experts_on_host else 0.0
    return rest + in_flight + quantized


def loss_chunk_bytes(vocab: int) -> float:
    """--chunked_loss: one chunk's logits at a time, as the planner counts whole logits per token (12 bytes a
    vocabulary entry): a trained lm_head's chunk in its backward (recomputed bf16, fp32 log-softmax and its gradient);
    a frozen one's in the forward takes less (bf16 logits and their bf16 gradient on a GPU), counted the same."""
    return LOSS_CHUNK_TOKENS * 12.0 * vocab


def flags(chunked_loss: bool) -> list[str]:
    """What a resident plan's command passes: the option, the checkpointing it needs said explicitly (the run refuses
    the option without it), and `chunked_loss`: --chunked_loss where the plan has no Liger and the run's `auto` would
    not take it (its bench rows ran with it; an MLA model's run takes it by default: plans.Plan.chunked_loss_asked)."""
    return [OPTION, "--activation_checkpointing true"] + ["--chunked_loss"] * chunked_loss


def is_resident_row(options: list[str]) -> bool:
    """A bench row (its sft/train.py options) that ran with the experts in e4m3."""
    given = [options[i + 1] for i, a in enumerate(options[:-1]) if a == "--quantize_experts"]
    return bool(given) and given[-1] == "fp8"
