"""The memory model: a Workload's GPU memory per card (as the allocator and nvidia-smi count it) and host RAM
(predict, a Prediction), in bytes.

The training state from the strategy table (sft/parallel/strategies.py: weights, gradients, optimizer, masters,
DDP buckets), plus activations (checkpointed layer inputs, the layers kept whole, the backward working set of one
layer, the logits unless Liger's fused loss is used), plus the sharded strategies' transient buffers (all-gathered
layers and their gradients); what PyTorch's allocator keeps cached on top (fitted), and the CUDA context and NCCL
buffers that nvidia-smi adds (fitted); the fast paths' own share of the activations (fitted on their rows, read from
the snapshot: fast_path_bytes; a resident plan's compiled layers, of its dequantized experts). Long rows take their
levers' counts from sft/plan/long_rows.py, the resident, expert-parallel and SP plans their own bytes from
sft/plan/resident.py, expert_parallel.py and sequence_parallel.py. LoRA and QLoRA under FSDP (the 67B/70B plans on
3 x 24 GB) count their gathered buffers from accelerate's units and the NF4 base's bytes (fsdp_adapter_buffers), and
every rank's bf16 load of the base in host RAM (nf4_load_host_bytes). The fitted constants and the rows they come
from are in CALIBRATION below and in the snapshot; `--check` (sft/plan/bench_check.py) prints predicted against
measured for every row with a measured peak.

Above the sub-plans whose bytes it adds up, below the plans (sft/plan/plans.py) and the fit of the fast paths'
share (sft/plan/refit.py), which predict with it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from sft.machine import GIB
from sft.model.nf4_layout import dequantize_peak_bytes
from sft.parallel.strategies import NF4_BYTES, STRATEGIES, StateBytes
from sft.plan import expert_parallel, long_rows, resident, sequence_parallel, snapshot
from sft.plan.long_rows import tile_tokens
from sft.plan.shapes import Shape
from sft.plan.workload import Workload


# Calibration: the few constants fitted against bench/results.jsonl (see RESULTS.md, "Planner").
CALIBRATION = {
    # nvidia-smi minus the allocator's peak reserved (CUDA context, NCCL buffers): mean over the rows that have
    # both numbers, by launcher: single: mean of the 4 one-GPU rows; nccl: median of the 20 DDP/FSDP/TP rows (their
    # mean, 2.09, is pulled down by 3 FSDP rows at the allocator cap, where NVML's 0.5 s sampling missed the peak);
    # deepspeed: mean of the 6 ZeRO-2 / ZeRO-3-offload rows.
    "context_gib": {"single": 1.35, "nccl": 2.17, "deepspeed": 2.45},
    # peak reserved minus peak allocated: what PyTorch's caching allocator holds on top, by kind of strategy.
    # unsharded: LoRA rows (single/DDP/ZeRO-2); fsdp/tp: the 1.3B rows with a fused loss; zero3: the 4 ZeRO-3
    # offload rows (DeepSpeed's buffers on a side stream); plus a share of the unfused logits for sharded plans.
    "cache_gib": {"none": 0.35, "tp": 0.7},
    # sharded plans: the cache grows with the gathered buffers (FSDP's all-gather stream, DeepSpeed's side
    # streams), as a multiple of the transient gathered weights and gradients: fsdp from the two fused-loss
    # 1.3B rows (fsdp-1.3b-flex: 1.02 GiB over 0.62 GiB gathered), zero3 from the 4 ZeRO-3 offload rows.
    # zero3_moe: an MoE block is a ZeRO-3 leaf, gathered and freed whole (one large block the allocator reuses):
    # from the two DeepSeek-V2-Lite rows (recipe-v2-lite-lora 0940Z: 2.86 GiB, moe-lora-offload-1 1015Z: 2.80 GiB
    # over 2.14 GiB gathered).
    "cache_per_gathered": {"fsdp": 1.64, "zero3": 2.5, "zero3_moe": 1.3},
    # host RAM per byte offloaded: CPU Adam's fp32 state (masters, moments, gradients) and the offloaded 16-bit
    # weights, fitted together on the 4 dense full-fine-tune offload rows (16P/world and 2P/world bytes per card:
    # 215.7-215.9 GiB) and moe-lora-offload-1 (weights only: 48.2 GiB), with 8 GiB + 4 GiB per process on top.
    # (--offload_activations' pinned copies are counted in whole blocks instead: pinned_block)
    "host_per_offloaded": {"optimizer": 1.79, "weights": 1.24},
    "cache_logits_share": 0.5,
    # the activations autograd keeps per layer (and the backward working set), against the count in
    # Shape.layer_activation_bytes (which counts Liger's in-layer kernels where they run: Workload.liger_layers): the
    # scale with the least worst error over every measured row, reserved and nvidia-smi (--check: 7.3% and 7.3%;
    # below 0.935 lora-best-sdpa's reserved is worse, above 0.94 long-llm-32k's nvidia-smi), refitting
    # dequantized_copies and the fast paths' shares (--write_snapshot) at each scale tried. On a CPU, autograd's
    # saved tensors of a frozen deepseek-llm-7b layer are 0.78 x the count without Liger, a V2-Lite MoE layer's
    # about 0.79 x (with the GPU's attention tensors in place of CPU sdpa's math path).
    "activation_scale": 0.94,
    # --quantize_experts fp8: bf16 copies of one MoE layer's experts alive in its recomputation and backward (the
    # dequantized weights the forward reads, and what the grouped matmuls' backward makes of them), in units of
    # resident.dequantized_layer_bytes: fitted on moe-lora-resident-1 (20261204T2105Z-resident, micro-batch 8:
    # 23.3 GiB allocated, 2.27 GiB over the rest of the memory model at activation_scale 0.94; the same run held to
    # 22.25 GiB ran out of memory at micro-batch 8). A count per layer, not per token: at smaller micro-batches it
    # errs on the safe side.
    "dequantized_copies": 2.2,
    # --compile_layers beside --offload_activations: what a compiled checkpointed layer keeps for its backward (and
    # the offload sends to host RAM), in units of the eager layer's checkpoint (its input, 2 x hidden bytes a token):
    # fitted on long-r1-32k-default once the offload left the model's own tensors on the GPU (host RAM 19.6 GiB in
    # run 20261205T1315Z-long-h100 against long-r1-32k's 18.4 in run 20261205T1120Z-long-h100, the same row without
    # FP8 and compiled layers, the same GPU kind and cap): 0.16 more. Before that fix the same row took 31.1 GiB
    # (the compiled layer saved --fp8's transposed e4m3 weights, which the hooks copied to host and back).
    "compiled_checkpoint_scale": 1.16,
}


@dataclass
class Prediction:
    workload: Workload
    allocated_gib: float
    reserved_gib: float           # what torch.cuda.max_memory_reserved() would report (no cap)
    smi_gib: float                # what nvidia-smi would show per card
    need_gib: float               # what the card must hold (allocated + minimal cache + context)
    host_gib: float
    parts: dict[str, float] = field(default_factory=dict)

    def capped(self, cap_gib: float) -> tuple[float, float]:
        """(reserved, nvidia-smi) under an allocator cap of `cap_gib` (the bench rows' 24 GiB emulation):
        the allocator gives cached blocks back before it refuses, so reserved stops at the cap."""
        reserved = min(self.reserved_gib, cap_gib)
        strategy = STRATEGIES[self.workload.strategy]
        return reserved, reserved + CALIBRATION["context_gib"][strategy.launcher]


def mean_layer_activation_bytes(shape: Shape, liger: bool = False) -> float:
    """What autograd keeps per token of one decoder layer, on average over the layers (fitted scale); `liger`:
    Liger's in-layer kernels on (Workload.liger_layers)."""
    per_layer = (shape.layer_activation_bytes(i, liger) for i in range(shape.layers))
    return CALIBRATION["activation_scale"] * sum(per_layer) / shape.layers


def whole_layer_activations(shape: Shape, w: Workload) -> float:
    """Bytes of the activations of the layers autograd holds whole at the start of backward: every layer without
    checkpointing; with it, the layers kept whole (--activation_checkpointing_skip_layers) and the one recomputed.
    What the fast paths' memory is counted in (fast_path_bytes)."""
    whole = shape.layers if not w.checkpointing else min(w.skip_layers + 1, shape.layers)
    return w.micro_batch * w.seq_len * whole * mean_layer_activation_bytes(shape, w.liger_layers)


def fast_path_bytes(shape: Shape, w: Workload) -> float:
    """What the plan's fast paths add to its peak (negative: what they save), per the snapshot's fit
    (fast_path_memory): for each path on, a share of its kind's unit (fast_path_unit), by kind of plan. The compiled
    layers keep inductor's own saved tensors and workspaces; LoRA's FP8 base adds its quantized activations and
    scales; torchao's float8 training saves its matmul inputs in FP8, half of bf16's bytes, so a full fine-tune's
    share is negative. A resident plan's compiled layers change what its MoE layers' dequantized experts hold (one
    layer's bf16 copies, not its activations: measured less memory than eager): its own fit where a resident row
    ran with them beside its eager twin, else LoRA's."""
    if not (w.fp8 or w.compiled):
        return 0.0
    memory, total = snapshot.fitted()["fast_path_memory"], 0.0
    for name in [n for n, on in (("compiled", w.compiled), ("fp8", w.fp8)) if on]:
        kind = fast_path_kind(w)
        if name not in memory.get(kind, {}):  # no row of this kind ran with the path: LoRA's share (resident, long)
            kind = "lora"
        total += memory[kind][name][0] * fast_path_unit(shape, w, kind)
    return total


def fast_path_kind(w: Workload) -> str:
    """Which fit of fast_path_memory speaks for a plan (or a row): a resident plan's own (--quantize_experts fp8),
    a full fine-tune's, a LoRA plan's on long rows (one checkpointed layer's activations at up to 32k tokens, the
    MLP tiled: the compiled layers add more to them than to short rows', +2.56 to +2.79 GiB at 32k in runs
    20261205T1120Z-long-h100 and 20261205T1315Z-long-h100), else LoRA's (QLoRA's too)."""
    return ("resident" if w.resident else "full" if w.setup.method == "full" else
            "long" if long_rows.is_long(w.seq_len) else "lora")


def fast_path_unit(shape: Shape, w: Workload, kind: str) -> float:
    """What a kind's fast-path shares are shares of: one MoE layer's dequantized experts for the resident kind
    (resident.dequantized_layer_bytes), else the whole layers' activations (whole_layer_activations)."""
    return resident.dequantized_layer_bytes(shape) if kind == "resident" else whole_layer_activations(shape, w)


def pinned_block(nbytes: float) -> float:
    """The pinned host RAM one offloaded tensor of `nbytes` takes: torch's caching host allocator hands out blocks
    rounded up to a power of two (R1-Distill-Qwen-7B's 224 MiB checkpoint of 32,768 tokens takes 256 MiB,
    deepseek-llm-7b's 256 MiB just that). It reads the long rows' host RAM: long-r1-32k and long-llm-32k (run
    20261203T1918Z-long) held 20.5 and 20.0 GiB with 6.6 and 8.0 GiB offloaded, 7.5 and 8.0 GiB in blocks."""
    return 2.0 ** math.ceil(math.log2(nbytes)) if nbytes > 0 else 0.0


def predict(shape: Shape, w: Workload, with_fast_paths: bool = True) -> Prediction:
    """The plan's memory; without its fast paths' own term (fast_path_bytes) where `with_fast_paths` is false: what
    the rest of the model says, as fast_path_memory fits that term against."""
    strategy = STRATEGIES[w.strategy]
    params = shape.params()
    lora = w.setup.method in ("lora", "qlora")
    trainable = shape.lora_params(w.lora_r) if lora else params
    state: StateBytes = strategy.state_bytes(params, trainable, w.setup, w.world, shape.linear_params())
    if w.resident:  # the routed experts in e4m3 with their row scales, the rest of the base in bf16
        state = dataclasses.replace(state, weights=state.weights - resident.bytes_saved(shape))
    if w.strategy == expert_parallel.STRATEGY:  # AutoEP: this card's share of the routed experts only
        state = dataclasses.replace(state, weights=state.weights - expert_parallel.experts_elsewhere(shape))
    tokens = w.micro_batch * w.slice_len  # this card's: under --sequence_parallel, its slices
    h, layers = shape.hidden, shape.layers
    # activations (bytes)
    k = CALIBRATION["activation_scale"]
    a_mean = mean_layer_activation_bytes(shape, w.liger_layers)
    if lora and w.peft_input_cast:  # peft's fp32 round trip (sft before 51be3c5): bf16 re-casts of the inputs
        a_mean += shape.lora_cast_bytes()
    # --mlp_tile_tokens: a layer keeps its MLP's input only (counted in its bytes); the MLP's intermediates exist
    # for the one tile the backward recomputes
    tile = tile_tokens(w)
    mlp = k * sum(shape.mlp_activation_bytes(i, w.liger_layers) for i in range(layers)) / layers \
        if tile < tokens else 0.0
    per_layer, one_tile = tokens * (a_mean - mlp), tile * mlp
    if w.checkpointing:
        kept = min(w.skip_layers, layers)
        checkpoints, whole_layers = (layers - kept) * 2 * h * tokens, kept * per_layer
        recompute = per_layer if kept == 0 else 0.0
    else:
        checkpoints, whole_layers, recompute = 0.0, layers * per_layer, 0.0
    # --activation_checkpointing_keep_attention: each checkpointed layer's attention output too
    attention_layer = long_rows.kept_attention_bytes(shape, tokens) if w.keep_attention and w.checkpointing else 0.0
    attention_kept = (layers - min(w.skip_layers, layers)) * attention_layer
    offloaded = pinned_host = 0.0  # the bytes offloaded, and the pinned host RAM they take (whole blocks)
    if w.offload_activations:  # all of it waits in host RAM; the backward brings back one layer's at a time, and
        scale = CALIBRATION["compiled_checkpoint_scale"] if w.compiled else 1.0  # the next checkpoint ahead of its
        offloaded = checkpoints * scale + whole_layers  # asking
        pinned_host = checkpoints / (2 * h * tokens) * pinned_block(2 * h * tokens) * scale + whole_layers
        checkpoints = long_rows.CHECKPOINTS_ON_GPU * 2 * h * tokens if checkpoints else 0.0
        whole_layers = per_layer if whole_layers else 0.0
        if w.compiled:  # the compiled layer saves them with its checkpoint: offloaded, and brought back, with it
            offloaded += attention_kept
            pinned_host += attention_kept and attention_kept / attention_layer * sum(
                pinned_block(n) for n in long_rows.kept_attention_tensors(shape, tokens))
            attention_kept = long_rows.CHECKPOINTS_ON_GPU * attention_layer
    # MoE LoRA as it ran before ca1f7e7: the W + BA weights of the layers whose forward is kept (the recomputed one's
    # under checkpointing); low-rank since, none
    deltas = [shape.parameter_lora_bytes(i) for i in range(shape.layers)] if lora and w.merged_mlp_lora else [0.0]
    whole = min(w.skip_layers, len(deltas))  # --activation_checkpointing_skip_layers keeps the LAST layers whole
    kept_deltas = sum(deltas[len(deltas) - whole:]) + max(deltas) if w.checkpointing else sum(deltas)
    logits = 0.0 if w.fused_loss or w.chunked_loss else 12.0 * shape.vocab  # log_softmax output + two fp32 grads
    loss_chunk = resident.loss_chunk_bytes(shape.vocab) if w.chunked_loss else 0.0
    # --quantize_experts: one MoE layer's experts in bf16 while the backward recomputes that layer
    dequantized = CALIBRATION["dequantized_copies"] * resident.dequantized_layer_bytes(shape) if w.resident else 0.0
    if strategy.sharded_kind == "tp":
        logits += 2.0 * shape.vocab if not w.fused_loss else 0.0  # the gathered (replicated) bf16 logits
    backward = k * (tokens * shape.backward_working_bytes() - (tokens - tile) * shape.mlp_working_bytes())
    if w.strategy == expert_parallel.STRATEGY:  # the all-to-all buffers of the layer in its backward
        backward += expert_parallel.dispatch_bytes(shape, tokens)
    ulysses = 0.0  # --sequence_parallel: the layer's attention over the whole row, heads / N, and its all-to-alls
    if w.sequence_parallel > 1:
        ulysses = sum(f(shape, w.seq_len, w.sequence_parallel, w.micro_batch)
                      for f in (sequence_parallel.attention_bytes, sequence_parallel.all_to_all_bytes))
    working = max(tokens * logits, loss_chunk, recompute + one_tile + backward + dequantized + ulysses)
    extras = 8 * h  # final norm (fp32 input + output) and the loss's input
    if w.offload_activations:  # what the norm and the fused loss save waits in host RAM too: the GPU holds the
        extras = 4 * h         # gradient into the last layer and the saved tensor brought back for it (2h each)
        offloaded += tokens * 4 * h
        pinned_host += 2 * pinned_block(tokens * 2 * h)
    fast = fast_path_bytes(shape, w) if with_fast_paths else 0.0
    activations = checkpoints + attention_kept + whole_layers + working + tokens * extras + kept_deltas + fast
    # transient buffers of the sharded strategies
    transient = 0.0
    grad_bytes = 2 if (lora or w.setup.precision != "fp32_master") else 4
    layer = max(shape.layer_params(i) for i in range(shape.layers))
    end_transient = 0.0
    own_grad = 0 if lora else grad_bytes
    gathered = None  # of the transient, what FSDP's all-gathers hold (the allocator's cache grows with it)
    if strategy.sharded_kind == "fsdp" and lora:
        transient, gathered = fsdp_adapter_buffers(shape, w)
        end_transient = gathered
    elif strategy.sharded_kind == "fsdp":
        root = shape.embedding_params() + (0 if shape.tied else shape.embedding_params())
        # the root unit (embeddings, lm_head) stays gathered in bf16 through forward and backward, and its
        # gradients stay unsharded until the end of backward; two layers gathered (prefetch), one layer's gradient
        # (the full fine-tune's count, as fitted on its rows: cache_per_gathered)
        transient = root * 2 + layer * (2 * 2 + own_grad)
        end_transient = root * (2 + own_grad)
    elif strategy.sharded_kind == "zero3":
        big = shape.largest_module_params()
        own_grad = 0 if lora else 2  # 16-bit gradients before the reduce-scatter into fp32 partitions
        transient = big * (2 + own_grad) + layer * 2
        end_transient = big * (2 + own_grad)
    gpu_state = state.gpu
    grads_live = state.gradients if (w.grad_accum > 1 or lora) else 0.0
    # three moments: the start of backward (every stored activation, no gradient yet unless accumulated), the end of
    # backward (all gradients, the sharded plans' root/largest module still gathered with its gradient), the step
    phase_backward = gpu_state - state.gradients + grads_live + activations + transient
    phase_end = gpu_state + end_transient
    allocated = max(phase_backward, phase_end)
    kind = "zero3_moe" if strategy.sharded_kind == "zero3" and shape.routed_experts else strategy.sharded_kind
    if kind in CALIBRATION["cache_per_gathered"]:
        cache = CALIBRATION["cache_per_gathered"][kind] * (transient if gathered is None else gathered)
    else:
        cache = CALIBRATION["cache_gib"]["none" if kind == "none" else kind] * GIB
    if kind in ("fsdp", "tp") and not w.fused_loss:
        cache += CALIBRATION["cache_logits_share"] * tokens * logits
    context = CALIBRATION["context_gib"][strategy.launcher] * GIB
    reserved = allocated + cache
    need = allocated + min(cache, CALIBRATION["cache_gib"]["none"] * GIB) + context
    pinned = CALIBRATION["host_per_offloaded"]  # processes + offloaded state with DeepSpeed's pinned buffers
    host = (8 + 4 * w.world) * GIB + w.world * (pinned["optimizer"] * (state.host - state.host_weights)
                                                 + pinned["weights"] * state.host_weights
                                                 + pinned_host)
    if strategy.sharded_kind == "fsdp" and w.setup.method == "qlora":
        host = max(host, (8 + 4 * w.world) * GIB + w.world * nf4_load_host_bytes(shape))
    if w.resident:  # each process quantizes its own copy of the experts as it reads the checkpoint, before its
        # training-time share (CUDA's host side, compile workers, pinned buffers) exists: the first rows that loaded
        # a checkpoint this way held 12.2-12.8 GiB at their peak, training's (run 20261206T0903Z-resident-varlen-h100)
        host = max(host, 8 * GIB + w.world * resident.load_host_bytes(shape))
    parts = {"weights": state.weights, "gradients": state.gradients, "optimizer": state.optimizer,
             "masters": state.masters, "buckets": state.buckets, "activations": activations,
             "lora_weights": kept_deltas, "kept_attention": attention_kept, "fast_paths": fast,
             "transient": transient, "cache": cache,
             "dequantized_experts": dequantized, "sequence_parallel_attention": ulysses,
             "context": context, "offloaded_activations": offloaded}
    return Prediction(w, allocated / GIB, reserved / GIB, (reserved + context) / GIB, need / GIB, host / GIB,
                      {k: v / GIB for k, v in parts.items()})


def nf4_load_host_bytes(shape: Shape) -> float:
    """Host RAM one rank holds at its peak while it loads the --qlora base under FSDP, from the code
    (sft/model/nf4_loading.py), not measured: the decoder layers' linear weights read one at a time and quantized to
    NF4 as they are read (on the GPU), so the NF4 base, the unquantized weights (embeddings, lm_head, norms) in bf16,
    and the largest linear weight in flight in bf16 (the file's mapped pages, released with it). Every rank loads its
    own copy (FSDP2 shards it afterwards; no RAM-efficient loading under --qlora: sft/parallel/fsdp.py)."""
    linears = shape.linear_params()
    largest = max(out * inp for i in range(shape.layers) for out, inp in shape.linear_shapes(i))
    return linears * NF4_BYTES + (shape.params() - linears) * 2 + largest * 2


def fsdp_adapter_buffers(shape: Shape, w: Workload) -> tuple[float, float]:
    """(transient bytes at the peak, of which all-gathered) of a LoRA or QLoRA plan under FSDP2, from the units
    accelerate 1.16 builds (fsdp2_prepare_model) and what our run does with them, not from a measured row (no FSDP
    LoRA or QLoRA row yet: the cache on top is the full fine-tune's cache_per_gathered, over the gathered bytes):
    - the input embedding is a unit of its own, gathered for the forward only (sft/parallel/fsdp.py skips its
      backward's gather): at the start of the step, when no activation is kept yet; not at the peak;
    - the tail (final norm, lm_head; the embedding too when tied) stays gathered in bf16 from the end of the
      forward to the loss's backward (reshard_after_forward=False): beside every checkpoint;
    - two decoder layers gathered (the one computing, the next prefetched), in the bytes FSDP2 moves: bf16 for
      LoRA, NF4 for QLoRA (sft/model/nf4_base.py; norms in bf16, the adapter in fp32: no cast in the all-gather);
    - QLoRA: one linear dequantized at a time, in pieces (sft/model/nf4_layout.py: its bf16 weight and one piece of
      torchao's working set), in the forward, the recomputation and the backward, beside the gathered layers.
    The peak is the larger of the tail's moment and a layer's."""
    h, qlora = shape.hidden, w.setup.method == "qlora"
    tail = 2 * (shape.vocab * h + h)
    adapter = shape.lora_params(w.lora_r) / shape.layers * (4 if qlora else 2)
    layer_bytes, dequantized = [], 0.0
    for i in range(shape.layers):
        linears = shape.layer_params(i) - 2 * h
        layer_bytes.append((linears * NF4_BYTES if qlora else 2 * linears) + 2 * 2 * h + adapter)
        if qlora:
            dequantized = max(dequantized, *(dequantize_peak_bytes(out, inp, w.world) for out, inp in shape.linear_shapes(i)))
    layers = 2 * max(layer_bytes)
    return max(tail, layers + dequantized), max(tail, layers)
