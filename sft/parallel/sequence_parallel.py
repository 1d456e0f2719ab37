"""`--sequence_parallel N`: each row's tokens split over N GPUs, through DeepSpeed's Ulysses sequence parallelism
(ALST) as accelerate and the Trainer run it (accelerate's `ParallelismConfig(sp_size=N, sp_backend="deepspeed")`).

What the libraries do (accelerate 1.16, transformers 5.24, deepspeed 0.19): the Trainer's dataloader hands each of
the N ranks its own row, and DeepSpeed's dataloader adapter cuts every row into N consecutive slices, one per rank,
the rows taken in turn. Each rank runs the decoder on its slice; at attention an all-to-all trades the slices for
heads (each rank attends over the whole row with 1/N of the heads), and a second one trades them back. So a
65k-token row costs each card the activations of 65k/N tokens outside attention. The adapter turns `labels` into
`shift_labels` (each slice's next-token targets, the slice boundary included) and the Trainer's loss under SP
weights each rank's mean by its labelled tokens.

What this module adds:
- the checks a model must pass before it loads (heads divisible, no MLA: Ulysses splits one head size);
- (the `ParallelismConfig` the Trainer is handed, and the attention kernels it runs: sft/options/resolve.py
  sequence_parallel_slices_rows and sft/options/checks.py sequence_parallel_combinations);
- the training loss under SP from this rank's slice of hidden states, the labelled tokens only (--chunked_loss's
  chunks, or Liger's fused loss where it runs: no rank projects its slice's whole logits, 9.7 GB in fp32 for a
  16k-token slice of R1-Distill-Qwen's vocabulary), weighted as the Trainer's own SP loss weighs the slices, with
  the gradient of one GPU's (sft/speed/sequence_parallel_loss.py; sft/trainer.py).

Packed rows: DeepSpeed's attention wrapper drops the attention mask (it was built for the slice) and calls the
attention with the gathered position_ids, so only kernels that separate documents by position_ids alone
(flash_attention_2/3, varlen) keep packed conversations apart; under sdpa and flex_attention a row must hold one
conversation (sft/options/checks.py sequence_parallel_combinations).
"""

from __future__ import annotations

from sft.errors import ConfigError
from sft.model.model_type import MLA_MODEL_TYPES


def check_model(config, size: int) -> None:
    """Before any model loads (its `config`): what Ulysses needs of the model. DeepSpeed itself says so only after
    the model has loaded and the engine starts (or, for MLA, with a shape error in the first forward)."""
    if size <= 1:
        return
    config = config.get_text_config()
    if config.model_type in MLA_MODEL_TYPES:
        raise ConfigError(f"--sequence_parallel with {config.model_type} (MLA attention): DeepSpeed's Ulysses "
                          f"splits queries, keys and values of one head size, and MLA's differ (192 and 128). Drop "
                          f"--sequence_parallel; long rows of this model: --mlp_tile_tokens, --offload_activations "
                          f"(docs/speed.md, Long rows).")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    if heads % size:
        raise ConfigError(f"--sequence_parallel {size}: the model's {heads} attention heads must divide by it (each "
                          f"GPU attends with whole heads). Use a size that divides {heads}, e.g. 2.")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(f"--sequence_parallel {size}: the model's {kv_heads} key/value heads must divide by it, "
                          f"or it by them. Use a size that divides {kv_heads}.")
