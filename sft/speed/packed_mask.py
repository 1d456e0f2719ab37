"""Packed rows' attention mask built from the documents the collator already knows, instead of found by
transformers at every forward.

Given position_ids and no attention mask, transformers (masking_utils.create_causal_mask, 5.24) finds a packed row's
documents from where the positions restart, and decides whether any row is packed with
`(mask[:, -1] == 0).all()` inside an `if`: the host waits there for the GPU at the start of each forward, before it
can issue the first layer, which undoes the batch's copy without a wait. The collator (sft/data/packing.py
DOCUMENT_IDS) numbers each token's document on the host; here transformers' own public builder makes the same mask
from them (causal, and-ed with its `packed_sequence_mask_function`: what it and-s in when it finds the documents
itself), and the model receives it as a ready 4D mask (or flex attention's BlockMask), which create_causal_mask
hands on as it is. tests/test_packing.py checks the result against each document run alone.

For the attention implementations whose masks transformers builds from a mask function (sdpa, eager, flex
attention) and models whose every layer attends fully; otherwise (flash attention, sliding-window layers) the batch
goes to the model with its position_ids as before.

Under sdpa that mask is dense ([tokens x tokens]) and costs sdpa its fused causal kernel; from long rows on, the
first screen says how many packed rows need it (dense_mask_note).
"""

from __future__ import annotations

import torch

from sft.data.packing import rows_with_several_documents

MASKED_ATTENTIONS = ("sdpa", "eager", "flex_attention")
# From this row length a packed row's mask under sdpa is worth a word on the first screen: it is dense, length**2
# bytes a row (64 MiB at 8,192 tokens, 1 GiB at 32,768), and it costs sdpa its fused causal kernel, which a row of one
# document keeps (the 32k bench rows: sdpa 1.15x flex_attention with one trace a row; docs/speed.md, Long rows).
DENSE_MASK_NOTE_TOKENS = 8192


def builds_packed_mask(config) -> bool:
    """Whether the mask for `config`'s model is built here: a full-attention model under sdpa, eager or flex."""
    layer_types = getattr(config, "layer_types", None)
    full_attention = all(kind == "full_attention" for kind in layer_types) if layer_types else \
        getattr(config, "sliding_window", None) is None
    return getattr(config, "_attn_implementation", None) in MASKED_ATTENTIONS and full_attention


def packed_causal_mask(config, documents: torch.Tensor, dtype: torch.dtype):
    """The block-diagonal causal mask of rows whose tokens belong to `documents` (rows x length, on the model's
    device), as `config`'s attention takes it; `dtype`: the input embeddings' (the eager mask's fill value)."""
    from transformers.masking_utils import create_causal_mask, packed_sequence_mask_function

    rows, length = documents.shape
    # the builder reads only the embeddings' batch size, length, dtype and device
    embeddings_like = torch.empty((), dtype=dtype, device=documents.device).expand(rows, length, 1)
    return create_causal_mask(config, embeddings_like, None, None, position_ids=None,
                              and_mask_function=packed_sequence_mask_function(documents))


def dense_mask_note(attention: str, max_length: int, rows) -> str | None:
    """The first screen's note where sdpa meets long packed rows of several documents (`rows`: the packed
    training rows); None where it does not (another attention, short rows, or one document a row)."""
    if attention != "sdpa" or max_length < DENSE_MASK_NOTE_TOKENS:
        return None
    several = rows_with_several_documents(rows)
    if not several:
        return None
    return (f"note: {several:,} of {len(rows):,} packed rows hold two documents or more; under sdpa each attends "
            f"through a dense [tokens x tokens] mask ({_size(max_length ** 2)} a row at {max_length:,} "
            f"tokens) without sdpa's fused causal kernel. --attn_implementation flex_attention keeps their mask "
            f"sparse; sdpa is the faster where every row is one document (docs/speed.md, Long rows).")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.3g} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:,.0f} MiB"
