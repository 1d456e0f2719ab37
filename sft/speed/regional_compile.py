"""`--compile_layers true`: torch.compile each decoder layer in place (regional compilation).

Every decoder layer of a model has the same code, so dynamo traces one and the other layers reuse its graph (their
weights are inputs of it, not constants): a compile of one layer instead of the whole model, and no graph breaks at
the loss, the data collator or the Trainer's own code. Inductor then fuses what runs between the matmuls of a layer
(RMSNorm, RoPE, SwiGLU, the residual adds, LoRA's scaling and add) into a few kernels, in the forward and in the
backward. With --fp8 the FP8 matmuls are custom ops inside the graph (sft/speed/fp8.py), called as they are.

DeepSeek's MoE families put LoRA on the MLP weights through peft's `target_parameters`, whose forward dynamo cannot
trace: those wrappers get a traceable forward with the same numbers first (sft/speed/traced_param_lora.py).

In place (`module.compile()`, not `torch.compile(module)`): parameter names, state dicts, peft's adapter lookups
and the hooks FSDP2 adds later stay as they were, so saves, verified reloads and resumes see the model they know.

Liger's kernels for RMSNorm, RoPE and SwiGLU live inside the layers, and dynamo cannot trace them (a path many
times slower, seen on GPUs): under --compile_layers only Liger's fused linear cross-entropy, which runs outside the
layers, stays on (sft/options/resolve.py compiled_layers_keep_liger_loss_only sets liger_kernel_config; a config
of yours wins).
"""

from __future__ import annotations

import torch
from torch import nn

# Liger under --compile_layers: the loss only; inductor fuses the rest inside each compiled layer.
LIGER_WITH_COMPILED_LAYERS = {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False,
                              "fused_linear_cross_entropy": True}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: transformers 5 makes every decoder layer a GradientCheckpointingLayer."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def final_norm(model: nn.Module) -> nn.Module | None:
    """The decoder's norm after its last layer (what the lm_head reads), where the decoder names it `norm` (every
    DeepSeek family and its distills' Llama/Qwen bases do); None elsewhere."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(causal_lm.get_decoder(), "norm", None) if hasattr(causal_lm, "get_decoder") else None
    return norm if isinstance(norm, nn.Module) and next(norm.children(), None) is None else None


def compile_decoder_layers(model: nn.Module) -> int:
    """Compile every decoder layer of `model` (a transformers model, or a peft model around one) in place; -> how
    many. The compile itself happens at the first forward (the first step is slower; inductor caches the kernels
    on disk for later runs)."""
    from sft.machine import launch
    from sft.safety.private_names import (CUSTOM_GRAPH_PASS, INDUCTOR_MULTI_KERNEL, SKIP_SIDE_EFFECTS_IN_RECOMPUTE,
                                          expect)
    from sft.speed.traced_param_lora import trace_param_lora

    layers = decoder_layers(model)
    # Under activation checkpointing dynamo traces a layer's forward inside the checkpoint and refuses any Python
    # side effect there (a graph break: the layer runs eagerly), since it cannot replay it in the backward's
    # recompute as eager checkpointing does. The layers' side effects need no replay: kernels' wrapper around
    # transformers' attention classes (installed with transformers >= 5.25) sets a context variable and resets it
    # before the forward returns, and the MoE routers' capture hooks (sft/model/moe.py) record only in the forward.
    # torchtitan and transformers' own per-layer compile benchmarks set the same.
    expect(SKIP_SIDE_EFFECTS_IN_RECOMPUTE)
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    # Each layer kind is one graph for all its layers, plus one for the first call's shapes: room for a model's
    # dense and MoE layers, and for a last batch of another length without falling back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    # Inductor's multi-kernel reductions: a row reduction of up to 16,384 values (the FP8 quantization of an MLP's
    # 11,008) also gets a persistent kernel, which reads its inputs once, benchmarked against the looped one at its
    # first call and the faster kept: 1.017x the 7B LoRA step at both micro-batches of run
    # 20261206T1758Z-multi-kernel-h100 (bench/RESULTS.md); the first step up to ~6 s longer at 2,048 tokens, 17-25 s
    # at 4k-32k (run 20261206T1811Z-long-mk-h100). The user's TORCHINDUCTOR_MULTI_KERNEL wins (0 turns it off).
    if not launch().inductor_multi_kernel_set:
        expect(INDUCTOR_MULTI_KERNEL)
        torch._inductor.config.triton.multi_kernel = 1
    if launch().shared_input_adapters:
        expect(CUSTOM_GRAPH_PASS)  # before the import: it subclasses the class
        from sft.speed import shared_input_adapters

        shared_input_adapters.install()  # q/k/v's adapters (and gate/up's) down-project their one input in one matmul
    trace_param_lora(model)  # peft's parametrized LoRA on DeepSeek's MLP weights breaks the graph
    for layer in layers:
        layer.compile()  # shapes static at first; a second length makes them dynamic (one more compile)
    # The final norm too: eager, its fp32 copies of [tokens, hidden] (256 MB each at micro-batch 8 x 2,048 of a 7B
    # model) are made at the step's memory peak, the backward's start, where on a full card the allocator released
    # cached segments to find room (a host wait for the GPU: 8 ms of the profiled step of run
    # 20261207T1144Z-fused-h100); compiled, it is one kernel each way that keeps its fp32 values in registers.
    if (norm := final_norm(model)) is not None:
        norm.compile()
    return len(layers)
