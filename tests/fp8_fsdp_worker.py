"""Run by tests/test_fp8_training.py under `torch.distributed.run --nproc_per_node 2` (gloo, CPU): a tiny Llama's
decoder linear layers in FP8 (sft/speed/fp8_training.py), sharded by FSDP2 (`fully_shard` per decoder layer and
the root, as accelerate's FSDP2 plugin wraps them), trained 3 steps on a batch per rank; rank 0 trains the same
model unsharded on both ranks' batches (gradients summed, halved: what FSDP2's reduce-scatter averages) and writes
both runs' losses and weights to the JSON file named by argv[1]. The verified save of such a run (sft/safety/verify.py:
weights bit for bit, the shards gathered on every rank) is run on a save of the trained weights and on one with a
weight changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from sft.safety.verify import SaveVerifier
from sft.speed.fp8_training import use_fp8_training
from sft.speed.regional_compile import decoder_layers

STEPS, LR = 3, 1e-3


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    use_fp8_training(model, "tensorwise")
    return model


def batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(100 + rank))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = tiny_model()
    for layer in decoder_layers(sharded):
        fully_shard(layer)
    fully_shard(sharded)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = loss_of(sharded, batch(rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    weights = {n: p.full_tensor().detach() for n, p in sharded.named_parameters()}
    verified = {}
    for case, change in (("as_trained", 0.0), ("one_weight_changed", 1.0)):
        path = Path(out).with_name(case)
        if rank == 0:  # a plain model with the trained weights, saved as the Trainer saves a full model
            saved = LlamaForCausalLM(sharded.config)
            saved.load_state_dict({n: w.clone() for n, w in weights.items()})
            with torch.no_grad():
                saved.model.layers[0].mlp.up_proj.weight[0, 0] += change
            saved.save_pretrained(path)
        dist.barrier()
        verified[case] = SaveVerifier(base_model=str(path), lora=False, fp8_recipe="tensorwise").saved_weights_mismatch(
            sharded, path)  # every rank
    if rank == 0:
        plain = tiny_model()
        optimizer = torch.optim.AdamW(plain.parameters(), lr=LR)
        plain_losses = []
        for _ in range(STEPS):
            step = [loss_of(plain, batch(r)) for r in range(world)]
            for loss in step:
                (loss / world).backward()
            optimizer.step()
            optimizer.zero_grad()
            plain_losses.append(sum(loss.item() for loss in step) / world)
        converted = sum(type(m).__name__ == "Float8Linear" for m in sharded.modules())
        diff = max((weights[n] - p.detach()).abs().max().item() for n, p in plain.named_parameters())
        with open(out, "w") as f:
            json.dump({"losses": losses, "plain_losses": plain_losses, "max_weight_diff": diff,
                       "float8_layers": converted, "verified": verified}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
