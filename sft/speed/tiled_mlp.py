"""`--mlp_tile_tokens N`: each decoder layer's MLP runs over the sequence N tokens at a time, each tile under its
own activation checkpoint (DeepSpeed ALST's TiledMLP, as Arctic and Axolotl use it for long rows).

An MLP acts on every token alone, so tiling it changes no number but the matmuls' blocking. What it changes is
memory: at 32,768 tokens one MLP's intermediate tensors (gate, up, their product, and their gradients:
[tokens x intermediate] each, 1.2 GB apiece for R1-Distill-Qwen-7B's 18,944) are the largest a layer makes, and
activation checkpointing recomputes them whole in the backward. Tiled, only one tile's exist at a time; the
price is one more forward of the MLP per tile in the backward (the checkpoint's recomputation).

Inside a checkpointed layer the tiles' checkpoints nest in the layer's, and torch recomputes the layer before any
tile (a tile's input is a tensor the layer saved): eagerly, that recompute ran all tiles but the last once more,
only to be thrown away (each tile's own recompute runs it again), 2.875 forwards of the MLP a step at 8 tiles
instead of 2. So the layer's recompute says that it is one (`layer_recompute`, the context transformers' checkpoint
enters through sft/speed/layer_checkpoint.py), and the tiles then save their inputs as before and run nothing:
torch stops a recompute once the last tensor it saved is back (its early stop), here the last tile's input. Where
the layer saves something after its MLP (a norm of its output), the recompute goes on, and the tiles' real output
is computed for it, saving nothing. Compiled layers need none of it: inductor recomputes the tiles once already.

The MLP module keeps its name, parameters and state dict: its class becomes a subclass of its own whose forward
tiles and calls the original forward per tile (the way torch's FSDP2 gives a module its FSDP class), so saves,
peft's adapter names and reloads see the model they know. Dense MLPs only: an MoE block routes each token and
adds a balance loss over the sequence, which tiles would split.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sft.machine import is_first_process


_recompute = threading.local()  # autograd runs a recompute on the thread that unpacks: one flag per thread


@contextlib.contextmanager
def layer_recompute() -> Iterator[None]:
    """Entered by a checkpointed layer's recompute (the second context of its checkpoint's `context_fn`)."""
    outer = getattr(_recompute, "layer", False)
    _recompute.layer = True
    try:
        yield
    finally:
        _recompute.layer = outer


def in_layer_recompute() -> bool:
    return getattr(_recompute, "layer", False)


def tile_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The MLP's own forward, `mlp_tile_tokens` tokens of the sequence (dimension -2) at a time; each tile
    checkpointed where gradients are taken. Its own forward is the instance's where one was bound to it (Liger's
    SwiGLU kernel, which the Trainer binds after loading), else its class's."""
    forward = self.__dict__.get("forward") or super(type(self), self).forward
    tokens = hidden_states.shape[-2]
    if hidden_states.dim() < 2 or tokens <= self.mlp_tile_tokens:
        return forward(hidden_states, *args, **kwargs)
    tiles = hidden_states.split(self.mlp_tile_tokens, dim=-2)
    if not torch.is_grad_enabled():
        return torch.cat([forward(tile, *args, **kwargs) for tile in tiles], dim=-2)
    if in_layer_recompute():
        return inputs_saved_only(self, forward, tiles, args, kwargs)
    return torch.cat([checkpoint(forward, tile, *args, use_reentrant=False, **kwargs) for tile in tiles], dim=-2)


def _nothing(tile: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tile  # no op at all: selective checkpointing's recompute refuses ops its forward did not see


def inputs_saved_only(mlp: nn.Module, forward, tiles: tuple[torch.Tensor, ...], args: tuple, kwargs: dict
                      ) -> torch.Tensor:
    """The tiled MLP in its layer's recompute: each tile's checkpoint saves its input as in the forward (the same
    tensors in the same order: the layer's recompute hands them back by position) around no work. torch stops the
    recompute at the last tile's input when nothing after the MLP was saved; where something was (a norm of the
    MLP's output), the recompute goes on and gets the real output, computed without saving anything (the layer's
    backward never reads this graph: it only needs the saved values)."""
    for tile in tiles:
        checkpoint(_nothing, tile, *args, use_reentrant=False, **kwargs)
    with torch.no_grad():
        out = torch.cat([forward(tile, *args, **kwargs) for tile in tiles], dim=-2)
    takes_grad = any(t.requires_grad for t in tiles) or any(p.requires_grad for p in mlp.parameters())
    return out.requires_grad_(takes_grad)


class TilingForward:
    """The tiled class's `forward`: a data descriptor, so it wins over a forward bound into the instance's
    __dict__ afterwards (Liger's `_bind_method_to_module` binds its SwiGLU that way, after we tile: a plain method
    would then be shadowed and the MLP run whole), and tile_forward runs that bound forward per tile.

    It hands out `functools.partial(tile_forward, module)`, not a bound method: dynamo cannot trace the call of
    `types.MethodType` (a graph break, "Unsupported function call"): under activation checkpointing, as long rows
    run, a graph break runs the whole decoder layer eagerly, so --compile_layers compiled nothing beside
    --mlp_tile_tokens (without checkpointing, the layer in pieces around the MLP). A partial traces
    (tests/test_activation_offload.py)."""

    def __get__(self, module, owner=None):
        return self if module is None else functools.partial(tile_forward, module)

    def __set__(self, module, forward) -> None:  # `module.forward = f`: kept for tile_forward to run per tile
        module.__dict__["forward"] = forward


@functools.lru_cache(maxsize=None)
def tiled_class(cls: type) -> type:
    """`cls` with a tiling forward (one subclass per MLP class)."""
    return type(f"Tiled{cls.__name__}", (cls,), {"forward": TilingForward(), "__module__": cls.__module__})


def is_dense_mlp(module: nn.Module) -> bool:
    """A decoder layer's dense MLP (LlamaMLP, Qwen2MLP, DeepseekV2MLP/V3MLP, ...): not an MoE block, whose class
    names it "MoE" and which routes tokens."""
    name = type(module).__name__
    return name.endswith("MLP") and "MoE" not in name and not name.startswith("Tiled")


def tile_mlps(model: nn.Module, tile_tokens: int) -> tuple[int, int]:
    """Give every dense MLP of the decoder layers the tiling forward; -> (tiled, MoE blocks left whole)."""
    from sft.speed.regional_compile import decoder_layers

    tiled = moe = 0
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        if not is_dense_mlp(mlp):
            moe += 1
            continue
        mlp.__class__ = tiled_class(type(mlp))
        mlp.mlp_tile_tokens = tile_tokens
        tiled += 1
    return tiled, moe


def apply_tiled_mlp(model: nn.Module, tile_tokens: int) -> None:
    """The hook sft/model/loading.py calls under --mlp_tile_tokens: tile, and say what was tiled."""
    tiled, moe = tile_mlps(model, tile_tokens)
    if is_first_process():
        print(f"Tiled MLP: {tiled} decoder MLPs run {tile_tokens:,} tokens at a time"
              f"{f'; {moe} MoE blocks left whole (their routing and balance loss span the sequence)' if moe else ''}",
              flush=True)
