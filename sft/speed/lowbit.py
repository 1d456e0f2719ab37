"""torchao's low-bit AdamW (`--optim adamw_torch_8bit` or `adamw_torch_4bit`, with `--optim_args
bf16_stochastic_round=True`): the optimizer of the bf16 full fine-tune plan (bench/RESULTS.md), made to work under
FSDP2 and lean enough for 24 GB cards. Three patches (the first in two parts), all applied by `prepare_optimizer`,
each after checking that its target is what it was written for (sft/safety/private_names.py), and one fix in
SFTTrainer.get_optimizer_cls_and_kwargs (the fourth below):

1. State dtype (`patch_torchao_state_dtype`). torchao 0.18 gives each quantized optimizer state the parameter's
   dtype as an "appearance" dtype (bf16 for bf16 weights). Its compiled update then calls `state.float()`, which
   under FSDP2 (DTensor states) and torch.compile dies on the first step: "OptimState8bit dispatch: attempting to
   run unimplemented operator ... aten.view.dtype" (seen on torch 2.11 on H200s and torch 2.13 on CPU with 2 gloo
   ranks; pytorch/ao PR #4216 is the open upstream report). Registering view.dtype alone is not enough (the
   traced view then fails dynamo's metadata check), and eager mode fails too ("expected dtype torch.bfloat16 for
   `end`"). Giving the states a float32 appearance dtype, as torchao did before, makes `.float()` a no-op: the
   states are stored the same way (uint8 codes + fp32 block scales), only their reported dtype differs.
   Resuming a checkpoint brought the bf16 dtype back (the patch's second part): torch's
   `Optimizer.load_state_dict` casts every loaded state to its parameter's dtype (`value.to(dtype=param.dtype)`),
   and torchao's `_to_copy` takes that as the new appearance dtype, so after `--resume_from_checkpoint` (FSDP2:
   accelerate's load_fsdp_optimizer -> set_optimizer_state_dict) every quantized state reports bf16, a form that a
   fresh run never has. On CPU (torch 2.13, 2 gloo ranks) the resumed update still equals the uninterrupted one
   bit for bit, but the GPU runs only ever proved float32-appearance states: the patch casts them back after
   loading (appearance only: the same codes and scales, no copy).

2. Compile-cache key (`patch_dtensor_cache_key`). The 4-bit crash under FSDP2 ("AssertionError: wrong number of
   dimensions1 for op: input", inside inductor's compiled `single_param_adam`) is not a 4-bit bug: it is a false
   hit in torch's on-disk AOTAutograd cache. torchao compiles one update per parameter shape. DTensor's cache key
   (`DTensor._stable_hash_for_caching`, here torch 2.13) hashes only its spec: mesh, placements, GLOBAL
   shape/stride/dtype. It leaves out what the DTensor wraps, so a DTensor holding an 8-bit state (uint8 codes
   shaped like the parameter, one scale per 256 values) and one holding a 4-bit state (codes packed in a flat
   buffer, one scale per 128 values) of the same parameter get the same key. Once an 8-bit run has compiled
   (any earlier run on the machine: /tmp/torchinductor_$USER persists), a 4-bit run loads the 8-bit graph and
   inductor's input check rejects the 1-D codes. Reproduced on CPU (2 gloo ranks, torch 2.13): 4-bit alone
   in a fresh cache trains; 8-bit then 4-bit crashes, in one process or two; either cache switched off
   (TORCHINDUCTOR_AUTOGRAD_CACHE=0) avoids it; eager mode never crashes. (On the H200s, torch 2.11, the 4-bit row
   crashed right after the 8-bit row on the same machine.) The patch adds the local tensor's
   device, and for a wrapped tensor subclass its type, metadata and inner tensors' shapes, to DTensor's key. The
   device also keeps rank 1 from loading the kernel rank 0 compiled for cuda:0 (pytorch #188390; fixed upstream
   by #188401, not in torch 2.13). A different key only ever means a recompile, never a wrong graph.

3. Update in chunks (`patch_torchao_chunked_update`). torchao updates each parameter shard in ONE compiled call,
   and the compiled update materializes temporaries proportional to the shard: ~8 bytes per value for 8-bit
   states (the fp32 scaled m and v before quantization) and ~27 for 4-bit (those, plus int64 codes before packing
   and the unpacked old codes), measured on CPU (inductor's C++ code; the generated graph keeps those buffers).
   7B on 2 GPUs: the embedding and lm_head shards hold 210M values each, so one call needs ~1.6 GiB (8-bit) or
   ~5.3 GiB (4-bit) on top of all weights, gradients and states: more than the 3.1 GiB that 4-bit states save.
   Shards above CHUNK_NUMEL values are updated in row chunks aligned to the quantization blocks instead: the
   same arithmetic on the same blocks (the update is elementwise and each block is quantized alone), so the
   result is bit-identical with round-to-nearest, and the temporaries stay below ~0.9 GiB (4-bit).

4. `--optim_args block_size=N` (SFTTrainer, sft/trainer.py). transformers passes optim_args values as strings
   and forwards `block_size` as given ("128"); torchao then fails at the first step ("unsupported operand
   type(s) for %: 'int' and 'str'"). Without it transformers uses 256 for both optimizers, where torchao's own
   4-bit default (after the 4-bit states paper, Li et al. 2023) is 128: the string is made an int.
"""

from __future__ import annotations

import hashlib
import math

from sft.safety.private_names import (DTENSOR_CACHE_KEY, TORCHAO_ADAM_LOAD, TORCHAO_SINGLE_PARAM_ADAM,
                                      TORCHAO_SUBCLASS_ZEROS, expect, replaces)

LOW_BIT_OPTIMIZERS = ("adamw_torch_8bit", "adamw_torch_4bit")
SR_ADAMW = "adamw_bf16_sr"  # sft/speed/sr_adamw.py: bf16 AdamW with stochastic rounding
# Values per compiled update call: 2**25 bounds its temporaries to ~0.25 GiB (8-bit) / ~0.85 GiB (4-bit); on 7B
# over 2 GPUs it splits only the embedding and lm_head shards (7 calls each), so the per-call overhead is small.
CHUNK_NUMEL = 2**25


def prepare_optimizer(optim: str) -> None:
    """Called before the Trainer builds its optimizer: patch torchao when `--optim` is one of its low-bit AdamWs
    (ours, adamw_bf16_sr, is built by SFTTrainer.get_optimizer_cls_and_kwargs)."""
    if optim in LOW_BIT_OPTIMIZERS:
        patch_torchao_state_dtype()
        patch_dtensor_cache_key()
        patch_torchao_chunked_update()


def rounds_stochastically(optim: str, optim_args: str | None) -> bool:
    """Whether `--optim` (with `--optim_args`) writes bf16 weights back with stochastic rounding, so that a full
    fine-tune of bf16 weights keeps its small updates: ours always, torchao's low-bit AdamWs with
    bf16_stochastic_round=True. (For sft/options/checks.py's full_fine_tune_keeps_small_updates.)"""
    if optim == SR_ADAMW:
        return True
    return optim in LOW_BIT_OPTIMIZERS and "bf16_stochastic_round=true" in (optim_args or "").replace(" ", "").lower()


def patch_torchao_state_dtype() -> list[str]:
    """Make torchao's 8/4-bit Adam(W) create optimizer states with a float32 appearance dtype, and keep it through
    `load_state_dict` (a resumed checkpoint). -> what was patched now: optimizer classes, "load_state_dict"."""
    import torch

    try:
        from torchao.optim import adam
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        return []
    expect(TORCHAO_SUBCLASS_ZEROS)
    expect(TORCHAO_ADAM_LOAD)
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

    load = adam._AdamBase.load_state_dict
    if not getattr(load, "_sft_float32_states", False):
        def load_state_dict(self, state_dict) -> None:
            load(self, state_dict)  # casts every state to its parameter's dtype (torch's Optimizer.load_state_dict)
            for state in self.state.values():
                for key, value in state.items():
                    local = getattr(value, "_local_tensor", value)  # a DTensor under FSDP2
                    if isinstance(local, (OptimState4bit, OptimState8bit)) and value.dtype != torch.float32:
                        state[key] = value.to(torch.float32)  # torchao's _to_copy: new dtype, same codes/scales

        load_state_dict._sft_float32_states = True
        adam._AdamBase.load_state_dict = load_state_dict
        patched.append("load_state_dict")
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
    expect(DTENSOR_CACHE_KEY)

    def _stable_hash_for_caching(self) -> str:
        key = original(self) + local_tensor_key(self._local_tensor)
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    _stable_hash_for_caching._sft_local_tensor_key = True
    DTensor._stable_hash_for_caching = _stable_hash_for_caching
    return True


def chunk_rows(local, states, chunk_numel: int) -> int | None:
    """Rows of `local` (a parameter shard) per update call, or None to update it in one call. A chunk boundary
    must fall on a quantization block boundary of every quantized state (torchao slices states along dim 0), and
    on a multiple of 64 values, so that every chunk starts 16-byte aligned (what inductor's kernels assume)."""
    if local.dim() == 0 or local.numel() <= chunk_numel:
        return None
    row = math.prod(local.shape[1:])
    step = 1
    for block in [64] + [getattr(state, "block_size", None) for state in states]:
        if block:
            need = block // math.gcd(row, block)
            step = step * need // math.gcd(step, need)
    rows = max(step, chunk_numel // row // step * step)
    return rows if rows < local.shape[0] else None


def patch_torchao_chunked_update() -> bool:
    """Make torchao's Adam(W) update shards of more than CHUNK_NUMEL values in chunks (see the module docstring).
    -> patched now. CHUNK_NUMEL is read at every update (tests lower it).

    torchao's step calls `torch.compile(single_param_adam, fullgraph=True, ...)(...)`, looking the function up in
    its module at every call: it gets a wrapper that runs eagerly and calls the compiled original once per chunk
    of this rank's rows. Smaller shards go to the compiled original unchanged (DTensors and all)."""
    import torch
    from torch._dynamo.decorators import skip
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    try:
        from torchao.optim import adam
    except ImportError:
        return False
    if getattr(adam.single_param_adam, "_sft_chunked", False):
        return False
    original = expect(TORCHAO_SINGLE_PARAM_ADAM)
    compiled = torch.compile(original, fullgraph=True, dynamic=False)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard (a view)

    def alias(t):
        """The same memory as a new tensor that is not a view. Given a view, torch.compile passes its whole base
        into the graph and functionalizes the in-place update over the base (measured: 34 bytes per value of the
        base for 8-bit states, more than no chunking); given an alias it updates the chunk in place."""
        if is_traceable_wrapper_subclass(t):  # torchao's quantized state: alias its codes and scales
            names, meta = t.__tensor_flatten__()
            return type(t).__tensor_unflatten__({n: alias(getattr(t, n)) for n in names}, meta, t.shape, t.stride())
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                    t.shape, t.stride())

    @torch._dynamo.disable  # everything in here runs eagerly, except the compiled calls
    def update(p, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq, *rest):
        tensors = [local(t) if t is not None else None for t in (p, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)]
        rows = chunk_rows(tensors[0], [t for t in tensors[2:] if t is not None], CHUNK_NUMEL)
        if rows is None:
            return compiled(p, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq, *rest)
        total = tensors[0].shape[0]
        for start in range(0, total, rows):
            end = min(start + rows, total)
            p_, g_, m_, v_, vmax_ = (alias(t[start:end]) if t is not None else None for t in tensors)
            compiled(p_, g_, step, m_, v_, vmax_, *rest)
        return None

    # torchao compiles whatever it finds under this name (fullgraph). torch.compile unwraps a disable() wrapper and
    # would trace `update` (the chunk loop, unrolled into one graph over the whole tensors): hand it a plain
    # function whose frame dynamo skips, which calls the disabled `update`.
    def single_param_adam(*args):
        return update(*args)

    skip(single_param_adam)
    replaces(single_param_adam, original)
    single_param_adam._sft_chunked = True
    adam.single_param_adam = single_param_adam
    return True
