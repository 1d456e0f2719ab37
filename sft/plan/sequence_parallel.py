"""What the planner knows of `--sequence_parallel N` (sft/parallel/sequence_parallel.py): the SP plan.

A long row (one conversation, sft/plan/long_rows.py) of a dense model split over N ranks by DeepSpeed's Ulysses,
under ZeRO-3 (the frozen base sharded over the launched processes) or ZeRO-2 (the base whole on every card). The
launch is the largest multiple of N processes the box holds: on 3 cards, SP 2 launches 2 processes and the third card
is left out. Its memory is predicted from first principles and the fitted constants, no row being measured yet:
- outside attention each rank runs its slice, seq_len / N tokens of each row: the long-row activation model with the
  row length divided by N (Workload.slice_len), levers included (the MLP tile, offloaded checkpoints);
- at attention, two all-to-alls trade the slices for heads: each rank attends over the whole row with heads / N
  heads. Its working set, alive while a layer (or its recomputation) runs attention forward and backward: q, k, v
  and the output of the gathered row (4 x seq_len x heads / N x head_dim, bf16; k and v counted at the query's heads,
  as sdpa repeats grouped keys), and the all-to-all's send and receive buffers, about twice that;
- the loss in chunks (always under --sequence_parallel: sft/train.py): one chunk's logits at a time, never whole.
The run takes sdpa without Liger (sft/options/checks.py sequence_parallel_combinations: flex_attention is refused,
one conversation per row, no --packing under sdpa), as the bench row long-r1-64k-sp2 runs it.

Its speed is not measured: the bench row long-r1-64k-sp2 (bench/throughput.py, group issue30) waits for 2 GPUs.
Until it lands, the estimate is one card's long-row MFU (the rows of one long conversation each) with the whole
row's attention FLOPs counted, over the N cards; the all-to-alls' time is not in it. Such a plan reuses the AutoEP
plan's mark (Plan.speed_unmeasured): never recommended over a plan whose speed is measured and that fits; where no
such plan fits, the planner recommends it and says its speed is not measured (plans.best_plan, Plan.last_resort).
A measured row that ran with --sequence_parallel N (rows.split_size) is a kind of its own: its MFU is read by the
SP plans of its N, strategy family and method only (speed.split_mfu_rows, the snapshot's keys ending in `sp<N>`),
which are then measured plans like any other; it is never read for another plan's MFU nor for the fast paths' memory
(refit.fast_path_memory). `--check` compares its measured peak with the SP plan's prediction.

Without torch: the planner's command line reads no GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sft.parallel.sequence_parallel import MLA_MODEL_TYPES
from sft.plan.long_rows import is_long

if TYPE_CHECKING:
    from sft.plan.shapes import Shape

OPTION = "--sequence_parallel"
# The DeepSpeed strategies Ulysses runs under (sequence_parallel_combinations), and the methods each takes: a full
# fine-tune under ZeRO-3 cannot gather its trained lm_head for the loss in chunks (loss_in_chunks_under_zero3).
METHODS = {"zero2": ("lora", "full"), "zero3": ("lora",)}
MEASURING_ROW = "long-r1-64k-sp2"
UNMEASURED = (f"; sequence parallelism's speed is not measured yet (bench row {MEASURING_ROW}, group issue30): one "
              f"card's long-row MFU over the whole row's FLOPs, the all-to-alls and ZeRO's gathers not counted")
# The attention kernel its plans run (the bench row's; packed rows would need flash_attention_2)
KERNELS = {"attn_implementation": "sdpa", "use_liger_kernel": False}


def sizes(shape: "Shape", gpus: int) -> list[int]:
    """The N a dense model can be split over on `gpus` cards: whole attention heads on each rank, and key/value
    heads that divide by N or N by them (DeepSpeed's rule; sft/parallel/sequence_parallel.py check_model)."""
    if shape.model_type in MLA_MODEL_TYPES or shape.kv_lora_rank or shape.moe:
        return []
    return [n for n in range(2, gpus + 1)
            if shape.heads % n == 0 and (shape.kv_heads % n == 0 or n % shape.kv_heads == 0)]


def offered(strategy: str, method: str, seq_len: int) -> bool:
    """An SP plan exists for long rows under ZeRO-2 or ZeRO-3, for the methods the run takes there."""
    return is_long(seq_len) and method in METHODS.get(strategy, ())


def processes(gpus: int, size: int) -> int:
    """The processes launched: the largest multiple of `size` on `gpus` cards (3 cards, SP 2: 2 processes)."""
    return gpus // size * size


def attention_bytes(shape: "Shape", seq_len: int, size: int, micro_batch: int) -> float:
    """One layer's attention over the gathered rows on one rank: q, k, v and the output, heads / N heads wide, bf16."""
    return 4 * 2.0 * micro_batch * seq_len * (shape.heads // size) * shape.hd


def all_to_all_bytes(shape: "Shape", seq_len: int, size: int, micro_batch: int) -> float:
    """The all-to-alls' send and receive buffers of that layer: about twice its attention's working set."""
    return 2 * attention_bytes(shape, seq_len, size, micro_batch)


def flags(size: int) -> list[str]:
    """What an SP plan's command passes (the loss in chunks needs no option under it)."""
    return [f"{OPTION} {size}"]
