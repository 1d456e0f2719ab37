"""What transformers' checkpoint of each decoder layer is given (TrainingArguments.activation_checkpointing_kwargs,
which the Trainer hands to torch.utils.checkpoint): the non-reentrant checkpoint, and a `context_fn` made of what
the run asks of the layer's forward and of its recompute:
- --activation_checkpointing_keep_attention: selective checkpointing, which saves sdpa's outputs
  (sft/speed/kept_attention.py);
- --mlp_tile_tokens on eager layers: the recompute says it is one, so the tiled MLP inside it saves its tiles'
  inputs and computes nothing that each tile's own checkpoint recomputes anyway (sft/speed/tiled_mlp.py).
Each combination is a named function: the loggers write the options as JSON, a function by its name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from sft.speed.kept_attention import keep_attention_contexts
from sft.speed.tiled_mlp import layer_recompute


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def tiled_mlp_contexts():
    """torch.utils.checkpoint's `context_fn`: nothing in the forward; the recompute marked for the tiled MLPs."""
    return contextlib.nullcontext(), layer_recompute()


def keep_attention_and_tiled_mlp_contexts():
    """Both: selective checkpointing's pair, its recompute context marked for the tiled MLPs too."""
    forward, recompute = keep_attention_contexts()
    return forward, _both(recompute, layer_recompute())


CONTEXTS: dict[tuple[bool, bool], Callable] = {  # (keep attention, tiled MLPs in eager layers) -> context_fn
    (True, False): keep_attention_contexts,
    (False, True): tiled_mlp_contexts,
    (True, True): keep_attention_and_tiled_mlp_contexts,
}


def checkpoint_kwargs(keep_attention: bool = False, tiled_mlps: bool = False) -> dict:
    """The checkpoint's kwargs for what the layers hold (both need the non-reentrant checkpoint: a reentrant one
    takes no `context_fn`)."""
    kwargs: dict = {"use_reentrant": False}
    if keep_attention or tiled_mlps:
        kwargs["context_fn"] = CONTEXTS[keep_attention, tiled_mlps]
    return kwargs
