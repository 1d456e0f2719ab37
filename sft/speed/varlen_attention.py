"""`--attn_implementation varlen`: packed rows' attention computed per document with torch's own FlashAttention-2
(`torch.nn.attention.varlen.varlen_attn`, in torch's wheel: no flash-attn package to build).

A packed row of short documents needs attention only inside each document. sdpa takes the packed row's
block-diagonal mask as a dense [tokens x tokens] mask, computes every pair of the row and masks most of them away
(and loses its fused causal kernel); flex_attention skips the masked blocks but compiles per row length and, at
MLA's query size of 192, stepped slower than sdpa on V2-Lite (bench/RESULTS.md, run 20261206T0504Z-flex-h100). The varlen kernel takes the documents as one
sequence of tokens and their start offsets (`cu_seq_lens`, which the collator makes on the host:
sft/data/packing.py CU_SEQ_LENS) and computes each document's causal attention alone: Alpaca-sized documents
packed into 2,048-token rows need about a fifteenth of the row's pairs. This is what TRL's padding-free batches
and transformers' flash_attention_2 do with the flash-attn package.

transformers hands the kernel's arguments through: the batch's `cu_seq_lens_q/k` and `max_length_q/k` are keyword
arguments every model forwards down to its attention function (TransformersKwargs), and an attention name without
a mask function gets no mask built (masking_utils: "custom attention without equivalent mask creation").
`max_length` is the row's length, an upper bound of any document's: constant under --compile_layers, whose packed
rows all take --max_length (sft/options/checks.py packed_rows_length), so nothing compiles again per batch.

Where the value's head size differs from the query's (DeepSeek's MLA: 192 and 128) the values are padded with
zeros to the query's size and the output cut back, as transformers does for flash-attn: the padded columns add
nothing to the output. Grouped-query models' key/value heads are shared across query heads (`enable_gqa`, or
repeated where this torch lacks it).

A batch whose rows are one document each (long conversations, unpacked rows) comes without offsets and runs
transformers' sdpa attention with the causal order alone: its fused kernel (cuDNN's on Hopper) beats this
FlashAttention-2 on long sequences, and such rows need no per-document bound.

Without CUDA there is no FlashAttention kernel: the same attention runs through sdpa with the documents'
block-diagonal causal mask over the batch's tokens (dense, fine for the tiny models CPU runs train), so the CPU
tests exercise everything but the kernel (tests/test_varlen_attention.py), and `bench/varlen_check.py` compares
the kernel with sdpa on a GPU.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

NAME = "varlen"
# FlashAttention-2's GPUs (torch's bundled kernel: sm_80 and later)
MIN_CAPABILITY = (8, 0)


@functools.cache
def kernel():
    """torch's varlen attention, or None where this torch has none (before 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def kernel_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(kernel()).parameters)


def register() -> None:
    """Make `varlen` an attention transformers loads models with (idempotent). No mask function is registered:
    transformers then builds no mask for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)


def batch_kwargs(cu_seq_lens: torch.Tensor, row_length: int) -> dict:
    """The model's keyword arguments for one batch: the documents' start offsets over the batch's flattened tokens,
    and the row length as every document's bound. The offsets' count changes from batch to batch: marked dynamic so
    that compiled layers take every count with the graph of the first."""
    torch._dynamo.maybe_mark_dynamic(cu_seq_lens, 0)
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": row_length, "max_length_k": row_length}


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [batch, heads, tokens, d], key/value [batch, kv heads, tokens, d_k/
    d_v] -> ([batch, tokens, heads, d_v], None). Without `cu_seq_lens_q` every row is one sequence (unpacked rows,
    their padding after the tokens, which causal attention keeps them from reading; packed rows of one document
    each, sft/data/packing.py): transformers' sdpa attention with the causal order alone, whose fused kernel
    (cuDNN's on Hopper) is faster than this FlashAttention-2 on a long sequence (1.7x at 32,768 tokens)."""
    if dropout:
        raise ValueError("--attn_implementation varlen: attention dropout is not supported (set it to 0).")
    if cu_seq_lens_q is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, scaling=scaling, is_causal=True)
    rows, heads, length, size = query.shape
    value_size = value.shape[-1]
    scale = size ** -0.5 if scaling is None else scaling
    q, k, v = (t.transpose(1, 2).reshape(rows * length, t.shape[1], t.shape[-1]) for t in (query, key, value))
    if value_size < size:  # MLA: the kernel takes one head size; the zero columns add nothing
        v = F.pad(v, (0, size - value_size))
    attend = documents_attention if q.is_cuda else masked_documents_attention
    out = attend(q, k, v, cu_seq_lens_q.to(torch.int32), int(max_length_q), scale)
    return out[..., :value_size].reshape(rows, length, heads, value_size), None


def documents_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                        scale: float) -> torch.Tensor:
    """The FlashAttention kernel over [tokens, heads, d], causal within each document. torch 2.9-2.11 spell it
    `is_causal` and take no scale (the query is scaled instead: the kernel divides by sqrt(d) itself) and no shared
    key heads; later releases `window_size=(-1, 0)`, `scale`, `enable_gqa`."""
    params = kernel_parameters()
    kwargs = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        raise RuntimeError(f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal: "
                           f"--attn_implementation varlen does not know this release (sft/speed/varlen_attention.py)")
    return kernel()(q, k, v, cu, cu, longest, longest, **kwargs)


def masked_documents_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                               scale: float) -> torch.Tensor:
    """The same attention without the kernel (CPU): sdpa over all the batch's tokens with the documents'
    block-diagonal causal mask."""
    tokens = q.shape[0]
    document = torch.searchsorted(cu[1:-1].to(torch.long), torch.arange(tokens, device=q.device), right=True)
    order = torch.arange(tokens, device=q.device)
    mask = (document[:, None] == document[None, :]) & (order[None, :] <= order[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(0, 1)

