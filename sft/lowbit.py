"""torchao's low-bit AdamW (`--optim adamw_torch_8bit` or `adamw_torch_4bit`, with `--optim_args
bf16_stochastic_round=True`): the optimizer of the bf16 full fine-tune plan (bench/RESULTS.md), made to work under
FSDP2. Two patches, both applied by `prepare_optimizer`:

1. State dtype (`patch_torchao_state_dtype`). torchao 0.18 gives each quantized optimizer state the parameter's
   dtype as an "appearance" dtype (bf16 for bf16 weights). Its compiled update then calls `state.float()`, which
   under FSDP2 (DTensor states) and torch.compile dies on the first step: "OptimState8bit dispatch: attempting to
   run unimplemented operator ... aten.view.dtype" (seen on torch 2.11 on H200s and torch 2.13 on CPU with 2 gloo
   ranks; pytorch/ao PR #4216 is the open upstream report). Registering view.dtype alone is not enough (the
   traced view then fails dynamo's metadata check), and eager mode fails too ("expected dtype torch.bfloat16 for
   `end`"). Giving the states a float32 appearance dtype, as torchao did before, makes `.float()` a no-op: the
   states are stored the same way (uint8 codes + fp32 block scales), only their reported dtype differs.

2. Compile-cache key (`patch_dtensor_cache_key`). The 4-bit crash under FSDP2 ("AssertionError: wrong number of
   dimensions1 for op: input", inside inductor's compiled `single_param_adam`) is not a 4-bit bug: it is a false
   hit in torch's on-disk AOTAutograd cache. torchao compiles one update per parameter shape. DTensor's cache key
   (`DTensor._stable_hash_for_caching`, torch >= 2.11) hashes only its spec: mesh, placements, GLOBAL
   shape/stride/dtype. It leaves out what the DTensor wraps, so a DTensor holding an 8-bit state (uint8 codes
   shaped like the parameter, one scale per 256 values) and one holding a 4-bit state (codes packed in a flat
   buffer, one scale per 128 values) of the same parameter get the same key. Once an 8-bit run has compiled
   (any earlier run on the machine: /tmp/torchinductor_$USER persists), a 4-bit run loads the 8-bit graph and
   inductor's input check rejects the 1-D codes. Reproduced on CPU (2 gloo ranks, torch 2.13): 4-bit alone
   in a fresh cache trains; 8-bit then 4-bit crashes, in one process or two; either cache switched off
   (TORCHINDUCTOR_AUTOGRAD_CACHE=0) avoids it; eager mode never crashes. The patch adds the local tensor's
   device, and for a wrapped tensor subclass its type, metadata and inner tensors' shapes, to DTensor's key. The
   device also keeps rank 1 from loading the kernel rank 0 compiled for cuda:0 (pytorch #188390; fixed upstream
   by #188401, not in torch 2.13). A different key only ever means a recompile, never a wrong graph.
"""

from __future__ import annotations

import hashlib

LOW_BIT_OPTIMIZERS = ("adamw_torch_8bit", "adamw_torch_4bit")


def prepare_optimizer(optim: str) -> None:
    """Called before the Trainer builds its optimizer: patch torchao when `--optim` is one of its low-bit AdamWs."""
    if optim in LOW_BIT_OPTIMIZERS:
        patch_torchao_state_dtype()
        patch_dtensor_cache_key()


def patch_torchao_state_dtype() -> list[str]:
    """Make torchao's 8/4-bit Adam(W) create optimizer states with a float32 appearance dtype. -> classes patched."""
    import torch

    try:
        from torchao.optim import adam
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        return []
    patched = []
    for name, state in (("Adam8bit", OptimState8bit), ("AdamW8bit", OptimState8bit),
                        ("Adam4bit", OptimState4bit), ("AdamW4bit", OptimState4bit)):
        cls = getattr(adam, name, None)
        if cls is None or getattr(cls, "_sft_float32_states", False):
            continue

        def zeros(p, signed: bool, block_size: int, _state=state):
            return _state.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

        cls._subclass_zeros = staticmethod(zeros)
        cls._sft_float32_states = True
        patched.append(name)
    return patched


def local_tensor_key(local) -> str:
    """What a DTensor's cache key needs about the tensor it wraps: its device and, for a tensor subclass (torchao's
    optimizer states), its type, its metadata and its inner tensors' shapes and dtypes. Stable across processes."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    parts: list = [str(local.device)]
    if is_traceable_wrapper_subclass(local):
        names, meta = local.__tensor_flatten__()
        parts += [f"{type(local).__module__}.{type(local).__qualname__}", repr(meta),
                  [(name, tuple(getattr(local, name).shape), str(getattr(local, name).dtype)) for name in names]]
    return repr(parts)


def patch_dtensor_cache_key() -> bool:
    """Make DTensor's AOTAutograd cache key depend on the tensor it wraps (see the module docstring). -> patched now.
    A no-op on torch versions whose DTensor has no `_stable_hash_for_caching` (their cache key is not shared)."""
    from torch.distributed.tensor import DTensor

    original = getattr(DTensor, "_stable_hash_for_caching", None)
    if original is None or getattr(original, "_sft_local_tensor_key", False):
        return False

    def _stable_hash_for_caching(self) -> str:
        key = original(self) + local_tensor_key(self._local_tensor)
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    _stable_hash_for_caching._sft_local_tensor_key = True
    DTensor._stable_hash_for_caching = _stable_hash_for_caching
    return True
