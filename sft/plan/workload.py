"""One configuration of a run as the planner counts it, planned or read from a bench row (Workload: strategy,
method and precision, processes, micro-batch, row length, checkpointing, loss, fast paths, long-row levers,
resident experts, sequence parallelism), its long-row options (Levers) and its strategy as the tables name it.

Below every module that reads a Workload: the sub-plans (sft/plan/long_rows.py counts a long row's tile and FLOPs of
one) and the memory, speed and plan modules above them. Levers is here, not in sft/plan/long_rows.py, because a
Workload gives its own (Workload.levers) and long_rows.py reads Workloads: the two live below both.
"""

from __future__ import annotations

from dataclasses import dataclass

from sft.parallel.strategies import Setup
from sft.plan.fast_paths import FastPaths


@dataclass(frozen=True)
class Levers:
    """The long-row options of a plan: the MLP tile (0: whole) and whether checkpoints wait in host RAM
    (sft/plan/long_rows.py: what they do to a plan, and which a plan takes)."""

    mlp_tile_tokens: int = 0
    offload_activations: bool = False

    @property
    def label(self) -> str:
        """The plan table's name for them: tile+offload, tile, offload or "" (neither)."""
        return "+".join(n for n, on in (("tile", self.mlp_tile_tokens), ("offload", self.offload_activations)) if on)

    def flags(self) -> list[str]:
        """What a plan's command passes for them (sft/train.py's options)."""
        return [f"--mlp_tile_tokens {self.mlp_tile_tokens}"] * bool(self.mlp_tile_tokens) \
            + ["--offload_activations"] * self.offload_activations


@dataclass(frozen=True)
class Workload:
    """One planned (or measured) configuration."""

    strategy: str
    setup: Setup
    world: int
    micro_batch: int
    seq_len: int
    checkpointing: bool
    skip_layers: int = 0
    fused_loss: bool = True        # --use_liger_kernel: Liger's fused linear cross-entropy, no logits tensor
    lora_r: int = 16
    grad_accum: int = 1
    peft_input_cast: bool = False  # peft's own fp32 casts of the LoRA inputs (sft before 51be3c5)
    fp8: bool = False              # --fp8: LoRA's FP8 base (sft/speed/fp8.py), torchao's float8 training for full
    compiled: bool = False         # --compile_layers (sft/speed/regional_compile.py)
    mlp_tile_tokens: int = 0       # --mlp_tile_tokens (sft/speed/tiled_mlp.py); 0: the MLP runs whole
    tiles_in_layer_recompute: bool = False  # the eager layer's recompute ran its tiles too (rows before 162167b)
    merged_mlp_lora: bool = False  # MoE LoRA on MLP weights kept peft's W + B @ A per layer (rows before ca1f7e7)
    offload_activations: bool = False  # --offload_activations: checkpoints wait in host RAM (sft/trainer.py)
    keep_attention: bool = False   # --activation_checkpointing_keep_attention (sft/speed/kept_attention.py)
    chunked_loss: bool = False     # --chunked_loss: one chunk's logits at a time (sft/speed/chunked_loss.py)
    resident: bool = False         # --quantize_experts fp8: the routed experts in e4m3 (sft/plan/resident.py)
    sequence_parallel: int = 1     # --sequence_parallel N: each row split over N ranks (sft/plan/sequence_parallel.py)

    @property
    def slice_len(self) -> int:
        """Tokens of each row on one card: the row's, or under --sequence_parallel N its slice (rows padded to a
        multiple of N: sft/options/resolve.py sequence_parallel_slices_rows)."""
        return -(-self.seq_len // self.sequence_parallel)

    @property
    def levers(self) -> Levers:
        """Its long-row options (sft/plan/long_rows.py)."""
        return Levers(self.mlp_tile_tokens, self.offload_activations)

    @property
    def liger_layers(self) -> bool:
        """Whether Liger's in-layer kernels (RMSNorm, SwiGLU) run, not its loss only: --use_liger_kernel without
        --compile_layers, beside which Liger keeps only its fused loss (sft/options/resolve.py
        compiled_layers_keep_liger_loss_only). What the layers keep depends on it (Shape.layer_activation_bytes)."""
        return self.fused_loss and not self.compiled

    @property
    def fast(self) -> str:
        """Its fast paths as the snapshot names them (FastPaths.label): fp8+compiled, compiled, fp8 or ""."""
        return FastPaths(self.fp8, self.compiled).label


def strategy_label(strategy: str, sequence_parallel_size: int = 1) -> str:
    """A plan's strategy as the table names it: an SP plan's with its size (zero3+sp2)."""
    return strategy + (f"+sp{sequence_parallel_size}" if sequence_parallel_size > 1 else "")
