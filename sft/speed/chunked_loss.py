"""--chunked_loss: the causal-LM loss from the last hidden states, a chunk of tokens at a time, without the whole
logits tensor.

A model's own loss projects every token onto the vocabulary at once: for a micro-batch of 4 x 2048 tokens and
DeepSeek's 102,400-token vocabulary that is 1.7 GB of bf16 logits, 3.4 GB more in fp32 for the cross-entropy and
its gradient as large again (DeepSeek-V2-Lite at micro-batch 4 ran out of memory on a 24 GiB card asking for those
3.1 GiB). Liger's fused loss avoids it where Liger patches the model; MLA models (DeepSeek-V2/V3) run without it
(sft/plan/plans.py kernels). Here only the labelled tokens are projected, CHUNK_TOKENS at a time: at most one chunk's
logits exist. Same loss as the model's own (tests/test_chunked_loss.py): the labels shifted by one, -100 left out,
the sum divided by the Trainer's `num_items_in_batch` (the accumulated batch's label count) or by this batch's count.

A frozen lm_head (LoRA, QLoRA: every run but a full fine-tune's) needs no gradient of its own, so each chunk's
gradient with respect to its hidden states is computed in the forward, while its logits exist, and kept for the
backward (`FrozenHeadCrossEntropy`, as Liger's fused loss does): two lm_head matmuls a chunk, and on a GPU the
cross-entropy and its logits' gradient one compiled kernel. A trained lm_head keeps each chunk's logits recomputed in
the backward (torch.utils.checkpoint): four matmuls a chunk with its weight's gradient. On an H100 the recomputation and
cross-entropy's separate fp32 passes made the loss ~28 ms of a 0.67 s LoRA step slower than Liger's (run
20261206T1436Z-dense-default-h100, bench/RESULTS.md).

The last chunk is padded (`padded_chunks`) to a quarter, half, three quarters or all of CHUNK_TOKENS rows, its padding
labelled IGNORE, which adds no loss and no gradient. cuBLAS picks its kernel by the matrices' shapes, and a GPU loads
a kernel at its first launch (CUDA's lazy loading), which waits for all the work queued before it: with the last
chunk any size from 1 to 1,024 rows, the steps kept meeting new shapes. In the H200 trace of run
20261207T1309Z-norm-h200 (its 19th step), the last chunk's lm_head matmul held the host 88 ms in such a load while the
GPU ran out of queued work.

Under --use_liger_kernel the same forward computes the loss with Liger's fused linear cross-entropy, also on the
labelled tokens only (`liger_causal_lm_loss`; sft/options/resolve.py liger_loss_on_labels switches Liger's own fused
loss off, which projects every token): a prompt's tokens carry no label, and in the bench's Alpaca packs that is most
of them: the lm_head's three matmuls took 33 ms of a 0.61 s step of a 7B full fine-tune on an H200 where TRL's
SFTTrainer, which projects only the labelled tokens, spent 11 ms (run 20261202T0245Z-E, bench/RESULTS.md).

SFTTrainer.compute_loss (sft/trainer.py) calls these in training forwards only, with the last hidden states of a
forward that keeps one position's logits; evaluation, generation and the verified saves' forwards take the model's
own path and get logits.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sft.data.tokenization import IGNORE
from sft.machine import machine
from sft.speed.fp8 import call_compiled

TRITON_MIN_CAPABILITY = (7, 0)  # the GPUs Triton generates kernels for

CHUNK_TOKENS = 1024  # one chunk's fp32 logits: 0.4 GB at a 102,400-token vocabulary


# (hidden, lm_head, labels, num_items_in_batch, shifted=False, positions=None) -> loss; `shifted`: the labels are
# already each position's next-token target (sequence parallelism's `shift_labels`: a slice's last target is the next
# slice's first); `positions`: where those targets are labelled, as the collator found them on the host
# (sft/data/packing.py LABELLED_POSITIONS)
LossFn = Callable[..., torch.Tensor]


def labelled_tokens(hidden: torch.Tensor, labels: torch.Tensor, shifted: bool = False,
                    positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states whose next token has a label, and those labels (labels shifted by one unless `shifted`,
    -100 left out). With the collator's `positions` they are picked by index_select, whose size the host knows;
    without, by a boolean mask, whose result's size the host must read from the GPU (a wait per micro-batch)."""
    targets = labels if shifted else F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    targets = targets.reshape(-1).to(hidden.device)
    states = hidden.reshape(-1, hidden.shape[-1])
    if positions is not None:
        positions = positions.to(hidden.device)
        return states.index_select(0, positions), targets.index_select(0, positions)
    keep = targets != IGNORE
    return states[keep], targets[keep]


def per_item(total: torch.Tensor, count: int, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    """The summed loss over the Trainer's `num_items_in_batch` (the accumulated batch's label count), else over this
    batch's own count."""
    if num_items_in_batch is None:
        return total / max(count, 1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def no_label_loss(hidden: torch.Tensor) -> torch.Tensor:
    """A batch without labels: a zero loss that still has a graph, so its backward runs (and gives zeros)."""
    return hidden.sum() * 0.0


def chunked_causal_lm_loss(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor,
                           num_items_in_batch: torch.Tensor | int | None = None,
                           chunk_tokens: int = CHUNK_TOKENS, shifted: bool = False,
                           zero3_frozen_head: bool = False, positions: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ForCausalLMLoss (shift, ignore -100, sum / num_items_in_batch or mean) without whole logits.
    `zero3_frozen_head`: the lm_head is a frozen ZeRO-3 partitioned module (LoRA under ZeRO-3 on several
    processes); its weight is gathered once for the whole loss instead of by the module's hooks at every chunk and
    at every chunk's recomputation, which the processes would run different numbers of times (their labelled tokens
    differ: seen hanging on 2 CPU ranks) and which a recomputation in the backward finds partitioned (shape [0])."""
    states, targets = labelled_tokens(hidden, labels, shifted, positions)
    # (under ZeRO-3 every process gathers, labels or not: the gather is collective)
    with gathered_head(lm_head) if zero3_frozen_head else contextlib.nullcontext(frozen_head(lm_head)) as frozen:
        if targets.numel() == 0:
            return no_label_loss(hidden)
        if frozen is not None:
            total = FrozenHeadCrossEntropy.apply(states, *frozen, targets, chunk_tokens)
        else:
            total = hidden.new_zeros((), dtype=torch.float32)
            for *_, chunk_states, chunk_targets in padded_chunks(states, targets, chunk_tokens):
                total = total + checkpoint(_chunk_loss, lm_head, chunk_states, chunk_targets, use_reentrant=False)
    return per_item(total, targets.numel(), num_items_in_batch)


def frozen_head(lm_head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of an lm_head that is a plain, frozen nn.Linear, whose matmul this module may run itself;
    None for any other (a trained head, peft's wrapper of a targeted one, a sharded DTensor weight under FSDP2 or
    tensor parallelism): those keep the module's own call and the checkpointed chunks."""
    from torch.distributed.tensor import DTensor

    if not isinstance(lm_head, torch.nn.Linear):
        return None
    params = [p for p in (lm_head.weight, lm_head.bias) if p is not None]
    if any(p.requires_grad or isinstance(p, DTensor) for p in params):
        return None
    return lm_head.weight, lm_head.bias


@contextlib.contextmanager
def gathered_head(lm_head: torch.nn.Module):
    """A frozen ZeRO-3 lm_head's whole weight and bias, gathered from every process for the loss's forward, which
    is the only pass that reads them (FrozenHeadCrossEntropy keeps the hidden states' gradient, not the weight)."""
    import deepspeed

    params = [p for p in (lm_head.weight, lm_head.bias) if p is not None]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield lm_head.weight.detach(), None if lm_head.bias is None else lm_head.bias.detach()


def padded_chunks(states: torch.Tensor, targets: torch.Tensor, chunk_tokens: int):
    """-> (start, rows, states, targets) of each chunk of `chunk_tokens` rows, the last one padded with zero states
    and IGNORE targets to the next quarter of `chunk_tokens` (the few shapes cuBLAS then sees: module docstring);
    `start`, `rows`: where the chunk's real rows (its first ones) begin in `states`, and how many."""
    step = max(chunk_tokens // 4, 1)
    for start in range(0, targets.numel(), chunk_tokens):
        chunk_states, chunk_targets = states[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        rows = chunk_targets.numel()
        padding = min(-(-rows // step) * step, chunk_tokens) - rows
        if padding:
            chunk_states = F.pad(chunk_states, (0, 0, 0, padding))
            chunk_targets = F.pad(chunk_targets, (0, padding), value=IGNORE)
        yield start, rows, chunk_states, chunk_targets


def _chunk_loss(lm_head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(lm_head(states).float(), targets, reduction="sum", ignore_index=IGNORE)


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of `states @ weight^T + bias` against `targets`, chunk by chunk, for a frozen weight:
    each chunk's gradient with respect to its states is computed in the forward and kept (the states' size, in
    their dtype), so the backward only scales it."""

    @staticmethod
    def forward(ctx, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
        total = states.new_zeros((), dtype=torch.float32)
        grad_states = torch.empty_like(states)
        for start, rows, chunk_states, chunk_targets in padded_chunks(states, targets, chunk_tokens):
            loss, grad_logits = cross_entropy_and_grad(F.linear(chunk_states, weight, bias), chunk_targets)
            total = total + loss
            # what autograd computes for the same ops: the logits' gradient in their dtype times the weight (under
            # autocast the weight's cast), then cast to the states' dtype; the padding's rows (zeros) left out
            grad_states[start:start + rows] = (grad_logits @ weight.to(grad_logits.dtype))[:rows].to(states.dtype)
        ctx.save_for_backward(grad_states)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_states, = ctx.saved_tensors
        return (grad_states.float() * grad_total).to(grad_states.dtype), None, None, None, None


def cross_entropy_and_grad_eager(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of the rows in fp32 (as F.cross_entropy on `logits.float()`), and its gradient with
    respect to the logits, softmax minus the target's one-hot, computed in fp32 and returned in the logits' dtype.
    Rows whose target is IGNORE (a padded chunk's) add nothing and get a zero gradient."""
    wide = logits.float()
    labelled = (targets != IGNORE)[:, None]
    targets = targets.clamp_min(0)[:, None]
    log_normalizer = torch.logsumexp(wide, dim=-1, keepdim=True)
    loss = torch.where(labelled, log_normalizer - wide.gather(1, targets), 0.0).sum()
    probabilities = torch.exp(wide - log_normalizer)
    is_target = torch.arange(wide.shape[1], device=wide.device) == targets
    grad = torch.where(is_target, probabilities - 1.0, probabilities)
    return loss, torch.where(labelled, grad, 0.0).to(logits.dtype)


def cross_entropy_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_and_grad_eager; on a GPU Triton runs (7.0+) one kernel compiled from it (reads of the bf16 logits
    and a write of their gradient, against eager's fp32 copies)."""
    if logits.is_cuda and min(machine().gpu_capabilities) >= TRITON_MIN_CAPABILITY:
        return call_compiled(_compiled_cross_entropy_and_grad(), logits, targets)
    return cross_entropy_and_grad_eager(logits, targets)


@functools.lru_cache(maxsize=None)
def _compiled_cross_entropy_and_grad():
    return torch.compile(cross_entropy_and_grad_eager, dynamic=True, fullgraph=True)


def liger_causal_lm_loss(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor,
                         num_items_in_batch: torch.Tensor | int | None = None, shifted: bool = False,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
    """The same loss through Liger's fused linear cross-entropy (its Triton kernels: GPU only), which projects the
    labelled tokens a chunk at a time and computes their gradient in the forward. Liger reads a count back from the
    GPU itself (`.item()` in its forward, liger-kernel 0.8.5): `positions` spare the wait of the labelled tokens'
    mask, not that one."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    states, targets = labelled_tokens(hidden, labels, shifted, positions)
    if targets.numel() == 0:
        return no_label_loss(hidden)
    chunks = liger_chunk_mem_const(targets.numel(), *lm_head.weight.shape[::-1])
    total = liger_fused_linear_cross_entropy(states, lm_head.weight, targets, bias=lm_head.bias, reduction="sum",
                                             chunk_mem_const=chunks)
    return per_item(total, targets.numel(), num_items_in_batch)


def liger_chunk_mem_const(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's `chunk_mem_const` for the fewest chunks of at most CHUNK_TOKENS rows. Liger cuts the tokens into
    ceil(vocab / (chunk_mem_const x hidden)) parts, each rounded up to a power of two rows (`liger_chunk_rows`); its
    default of 1 cuts DeepSeek's 102,400-token vocabulary at hidden 4,096 into 25: chunks of 256 rows for a 7B full
    fine-tune's ~4,000 labelled tokens, where the weight gradient's matmul (inner dimension = the chunk's rows)
    runs far below the GPU's rate. One chunk's bf16 logits at 1,024 rows: 0.2 GB."""
    for constant in range(math.ceil(vocab / hidden), 1, -1):
        if liger_chunk_rows(tokens, hidden, vocab, constant) <= CHUNK_TOKENS:
            return constant
    return 1


def liger_chunk_rows(tokens: int, hidden: int, vocab: int, chunk_mem_const: int) -> int:
    """The rows of one chunk of Liger's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py,
    0.8.5: the tokens over ceil(vocab / (chunk_mem_const x hidden)), rounded up to a power of two, at most all)."""
    parts = math.ceil(vocab / (chunk_mem_const * hidden))
    return min(1 << (math.ceil(tokens / parts) - 1).bit_length(), tokens)
