"""What the planner knows of long rows (issue 27): the levers `--mlp_tile_tokens` and `--offload_activations`
(sft/speed/tiled_mlp.py, sft/trainer.py), what they do to a plan's memory, and the FLOPs a long row costs.

- A row of more than LONG_ROW_TOKENS tokens is a long row: planned as ONE conversation filling it (a reasoning
  trace), whose causal attention costs FLOPs that grow with its length; a packed row of short documents attends
  within each document and costs far less (its speed is the short rows'). The speed of a long plan is read from the
  bench rows made of long documents only (bench/throughput.py, rows named long-*).
- `--mlp_tile_tokens N`: each dense MLP's [tokens x intermediate] tensors exist for one tile of N tokens at a time
  (the backward recomputes them per tile: one more forward of the MLP, counted as FLOPs the row pays for where
  the layers are not checkpointed; under their checkpoints the tiles' recompute is the layer's).
- `--offload_activations`: what the forward saves outside the checkpointed layers (each layer's input, and the
  layers kept whole) waits in pinned host RAM; in the backward the GPU holds one layer's worth and the next
  checkpoint, brought back ahead.

Without torch: the planner's command line reads no GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sft.plan.workload import Levers

if TYPE_CHECKING:
    from sft.plan.shapes import Shape
    from sft.plan.workload import Workload

# The tile the planner plans (bench rows long-*-32k ran it; docs/speed.md): a row of at most one tile is not tiled.
TILE_TOKENS = 4096
# Rows longer than this are long rows: the longest short-row bench rows (packed, and long-*-4k's one conversation)
# are 4,096 tokens, and a row that fits one MLP tile gains nothing from tiling.
LONG_ROW_TOKENS = 4096
# --offload_activations: the checkpoints on the GPU during a layer's backward, its own and the next one's, brought
# back while it computes (sft/speed/activation_offload.py: 1 + PREFETCH; a test keeps the two equal).
CHECKPOINTS_ON_GPU = 2
# The bench rows made of one long conversation each (bench/throughput.py: group `long`, long_docs=True).
LONG_ROW_PREFIX = "long-"
# Bench rows whose host RAM is not what the code holds today, {(run_id, name): why}: the host-RAM check leaves them
# out (sft/plan/bench_check.py), and nothing is fitted to them.
OFFLOADED_MODEL_TENSORS = {
    ("20261205T1120Z-long-h100", "long-r1-32k-default"):
        "its compiled layers saved --fp8's transposed weights, which the offload copied to host RAM and back (before "
        "sft/speed/activation_offload.py left the model's own tensors on the GPU)"}


def is_long(seq_len: int) -> bool:
    return seq_len > LONG_ROW_TOKENS


def ladder(shape: "Shape", seq_len: int, checkpointing: bool) -> list[Levers]:
    """The levers a plan may take, cheapest first; the planner keeps the first that leaves the card its margin.
    Short rows take none. Offloading adds no FLOPs (its copies' cost is not measured apart from the tile's: the
    speed model takes it as none), so it comes before the tile, which recomputes the MLP where the layers are not
    checkpointed and runs its tiles as small matmuls where they are; it moves checkpoints, so it needs
    checkpointing. MoE blocks are not tiled (sft/speed/tiled_mlp.py): no tile for MoE shapes."""
    if not is_long(seq_len):
        return [Levers()]
    tiles = [0] if shape.moe else [0, TILE_TOKENS]
    offloads = [False, True] if checkpointing else [False]
    return sorted((Levers(t, o) for t in tiles for o in offloads), key=lambda lv: (bool(lv.mlp_tile_tokens),
                                                                                     lv.offload_activations))


def kept_attention_bytes(shape: "Shape", tokens: int) -> float:
    """--activation_checkpointing_keep_attention: what one checkpointed layer keeps of its attention for the
    backward (sft/speed/kept_attention.py): sdpa's output (bf16, every head's value width) and its log-sum-exp
    (fp32, one per head), per token. Not a lever the planner takes: its speed is not measured yet (bench row
    long-r1-32k-sdpa-keep); a run that asks for it is predicted with it (sft/plan/this_run.py)."""
    return sum(kept_attention_tensors(shape, tokens))


def kept_attention_tensors(shape: "Shape", tokens: int) -> tuple[float, float]:
    """The bytes of the two tensors kept_attention_bytes counts: sdpa's output, its log-sum-exp."""
    v = shape.v_head if shape.kv_lora_rank else shape.hd
    return tokens * shape.heads * 2 * v, tokens * shape.heads * 4.0


def tile_tokens(w: "Workload") -> int:
    """Tokens of one MLP tile (the micro-batch's rows are split along the sequence), or all of the micro-batch's
    tokens on this card where the MLP runs whole (no tile, or a row no longer than one). Under --sequence_parallel a
    card's rows are its slices (Workload.slice_len)."""
    tokens = w.micro_batch * w.slice_len
    tile = w.mlp_tile_tokens
    return w.micro_batch * tile if 0 < tile < w.slice_len else tokens


def attention_flops_per_token(shape: "Shape", seq_len: int) -> float:
    """FLOPs of the attention scores and their product with the values, per token of a causal row of `seq_len`
    tokens that is one conversation, forward and backward (the backward is twice the forward; there are no weights,
    so LoRA and a full fine-tune pay the same): a token attends to seq_len / 2 others on average, 2 FLOPs per
    multiply-add, over the query-key and value widths of every head and layer. Not counted in the bench's MFU
    (6N/4N); counted for long rows, where at 32k tokens it is about 70% of a 7B LoRA's 4N."""
    qk = (shape.qk_nope + shape.qk_rope) if shape.kv_lora_rank else shape.hd
    v = shape.v_head if shape.kv_lora_rank else shape.hd
    forward = 2 * (seq_len / 2) * shape.heads * (qk + v) * shape.layers
    return 3 * forward


def tiled_mlp_flops_per_token(shape: "Shape", w: "Workload") -> float:
    """The tiled MLP's own recomputation: one more forward of every dense MLP (2 FLOPs per weight), where the
    layers are not checkpointed. Under the layers' checkpoints the tiles' recompute takes the place of the layer's,
    which the 6N/4N count leaves out as it does every checkpoint's: two MLP forwards a step, eager or compiled
    (sft/speed/tiled_mlp.py). Rows measured before that (Workload.tiles_in_layer_recompute) ran all tiles but the
    last once more in the eager layer's recompute: (tiles - 1) / tiles of a forward."""
    if tile_tokens(w) >= w.micro_batch * w.slice_len:
        return 0.0
    dense = sum(1 for i in range(shape.layers) if not (shape.moe and i >= shape.first_dense))
    forward = 2.0 * dense * shape.dense_mlp_params()
    if not w.checkpointing:
        return forward
    if not w.tiles_in_layer_recompute:
        return 0.0
    tiles = -(-w.slice_len // w.mlp_tile_tokens)
    return forward * (tiles - 1) / tiles


def long_row_flops_per_token(shape: "Shape", w: "Workload") -> float:
    """What a row of one conversation costs beyond the bench's 6N/4N per token: its attention and the tiled MLP's
    recomputation. Long plans' MFU is counted on 6N/4N plus this, and so is that of the long-document rows it is
    read from. Under --sequence_parallel the attention is the whole row's (its N ranks attend over all of it, each
    with 1/N of the heads)."""
    return attention_flops_per_token(shape, w.seq_len) + tiled_mlp_flops_per_token(shape, w)


def is_long_document_row(row: dict) -> bool:
    """A bench row made of one conversation per row (bench/throughput.py's long-* rows): its attention is the long
    plans', not the short packed rows'."""
    return str(row.get("name", "")).startswith(LONG_ROW_PREFIX)
