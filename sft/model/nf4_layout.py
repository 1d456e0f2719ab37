"""The NF4 base's layout under FSDP as arithmetic, without torch: what sft/model/nf4_base.py stores and how it
dequantizes, so that the planner (sft/plan/memory.py, which imports no torch) counts the same bytes the run holds.

A weight is stored as (rows, ROW) NF4 values, its rows padded to a multiple of the shard count. NF4Linear
dequantizes it piece by piece (a whole number of rows each) into one bf16 buffer: torchao's get_original_weight
holds about DEQUANTIZE_BYTES per value of what it dequantizes at once (two int64 index tensors of half the values,
the two bf16 halves, their scaled copies, the interleaved bf16 result: 8 + 2 + 2 + 2), 7x the bf16 weight; in
pieces of at most PIECE_ROWS rows, one piece's working set sits beside the bf16 weight instead.
"""

from __future__ import annotations

BLOCK = 64  # values per NF4 scale (QLoRA's, as bitsandbytes')
SCALER_BLOCK = 256  # scales per double-quantization block
ROW = BLOCK * SCALER_BLOCK  # the smallest piece NF4Tensor splits at: one row of the stored matrix
DEQUANTIZE_BYTES = 14  # bytes per value torchao's get_original_weight holds at its peak (from its code, above)
PIECE_ROWS = 1024  # rows dequantized at once: 16.8M values, a 235 MB working set
MAX_PIECES = 64  # NF4Tensor splits into equal pieces only: at most this many (each a few kernels)


def stored_rows(numel: int, shards: int) -> int:
    """Rows of ROW values that hold `numel` values and divide into `shards` equal shards."""
    rows = -(-numel // ROW)
    return -(-rows // shards) * shards


def dequantize_pieces(rows: int, piece_rows: int = PIECE_ROWS) -> int:
    """Equal pieces a weight of `rows` stored rows is dequantized in: the fewest, up to MAX_PIECES, that hold at most
    `piece_rows` rows each, else the most up to MAX_PIECES that divide it (a row count with no small divisor)."""
    divisors = [d for d in range(1, min(rows, MAX_PIECES) + 1) if rows % d == 0]
    return next((d for d in divisors if rows // d <= piece_rows), divisors[-1])


def dequantize_peak_bytes(out_features: int, in_features: int, shards: int) -> float:
    """Bytes one NF4Linear's dequantization holds at its peak: the bf16 weight (padding included) and one piece's
    working set."""
    rows = stored_rows(out_features * in_features, shards)
    return 2 * rows * ROW + DEQUANTIZE_BYTES * rows // dequantize_pieces(rows) * ROW
