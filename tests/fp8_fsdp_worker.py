"""Run by tests/test_fp8_training.py under `torch.distributed.run --nproc_per_node 2` (gloo, CPU): a tiny Llama's
decoder linear layers in FP8 (sft/speed/fp8_training.py), sharded by FSDP2 (`fully_shard` per decoder layer and
the root, as accelerate's FSDP2 plugin wraps them), trained 3 steps on a batch per rank, twice: with the weights
all-gathered in bf16 (torch's AdamW) and in FP8 (`fsdp_all_gather`, what a run under fsdp.yaml gets: adamw_bf16_sr
on the FP8-gathering weights, the scales refreshed by SFTTrainer's callback after each step). Rank 0 trains the same
model unsharded with the same optimizer on both ranks' batches (gradients summed, halved: what FSDP2's
reduce-scatter averages) and writes every run's losses and weights to the JSON file named by argv[1]. The verified save of such a run
(sft/safety/verify.py: weights bit for bit, the shards gathered on every rank) is run on a save of the trained
weights and on one with a weight changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from sft.safety.verify import SaveVerifier
from sft.speed.fp8_training import Float8ScalesAfterStep, use_fp8_training
from sft.speed.sr_adamw import AdamWBf16SR
from sft.speed.regional_compile import decoder_layers

STEPS, LR = 3, 1e-3


def tiny_model(fsdp_all_gather: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    use_fp8_training(model, "tensorwise", fsdp_all_gather=fsdp_all_gather)
    return model


def batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(100 + rank))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss


def optimizer_for(model, fsdp_all_gather: bool) -> torch.optim.Optimizer:
    """torch's AdamW; for the FP8-gathered run ours, as a full fine-tune under fsdp.yaml runs (its fp32 weights get
    plain fp32 AdamW, torch's within an fp32 rounding: which FP8's rounding of the next step's inputs can turn into
    an Adam step's difference, so each run is compared with the unsharded run of its own optimizer)."""
    if fsdp_all_gather:
        return AdamWBf16SR(model.parameters(), lr=LR, weight_decay=0.01)  # torch's AdamW's defaults
    return torch.optim.AdamW(model.parameters(), lr=LR)


def train_unsharded(world: int, fsdp_all_gather: bool):
    """-> (the model, its losses): trained on every rank's batch, the gradients averaged."""
    plain = tiny_model()
    optimizer = optimizer_for(plain, fsdp_all_gather)
    plain_losses = []
    for _ in range(STEPS):
        step = [loss_of(plain, batch(r)) for r in range(world)]
        for loss in step:
            (loss / world).backward()
        optimizer.step()
        optimizer.zero_grad()
        plain_losses.append(sum(loss.item() for loss in step) / world)
    return plain, plain_losses


def train_sharded(rank: int, world: int, fsdp_all_gather: bool):
    """-> (the sharded model, the mean loss over ranks of each step)."""
    sharded = tiny_model(fsdp_all_gather)
    for layer in decoder_layers(sharded):
        fully_shard(layer)
    fully_shard(sharded)
    optimizer = optimizer_for(sharded, fsdp_all_gather)
    losses = []
    for _ in range(STEPS):
        loss = loss_of(sharded, batch(rank))
        loss.backward()
        optimizer.step()
        if fsdp_all_gather:  # as SFTTrainer's callback runs it after the Trainer's optimizer step
            Float8ScalesAfterStep().on_optimizer_step(None, None, None, model=sharded)
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return sharded, losses


def gathered_in_fp8(model) -> dict:
    """How many weights FSDP2 gathers in FP8, and how many have their scale computed after the last step."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    locals_ = [p._local_tensor for p in model.parameters()]  # where torchao keeps the scale (to_local() is a view)
    fp8 = [t for t in locals_ if isinstance(t, WeightWithDynamicFloat8CastTensor)]
    return {"weights": len(fp8), "scales": sum(t._precomputed_scale is not None for t in fp8)}


def verified_saves(sharded, weights: dict, out: str, rank: int, name: str) -> dict:
    verified = {}
    for case, change in (("as_trained", 0.0), ("one_weight_changed", 1.0)):
        path = Path(out).with_name(f"{name}-{case}")
        if rank == 0:  # a plain model with the trained weights, saved as the Trainer saves a full model
            saved = LlamaForCausalLM(sharded.config)
            saved.load_state_dict({n: w.clone() for n, w in weights.items()})
            with torch.no_grad():
                saved.model.layers[0].mlp.up_proj.weight[0, 0] += change
            saved.save_pretrained(path)
        dist.barrier()
        verified[case] = SaveVerifier(base_model=str(path), lora=False, fp8_recipe="tensorwise").saved_weights_mismatch(
            sharded, path)  # every rank
    return verified


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {}
    for name, all_gather in (("bf16_gather", False), ("fp8_gather", True)):
        sharded, losses = train_sharded(rank, world, all_gather)
        weights = {n: torch.Tensor(p.full_tensor().detach()) for n, p in sharded.named_parameters()}
        runs[name] = {"losses": losses, "weights": weights, "gathered_in_fp8": gathered_in_fp8(sharded),
                      "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in sharded.modules()),
                      "verified": verified_saves(sharded, weights, out, rank, name)}
    if rank == 0:
        for all_gather, run in zip((False, True), runs.values()):
            plain, run["plain_losses"] = train_unsharded(world, all_gather)
            weights = run.pop("weights")
            run["max_weight_diff"] = max((weights[n] - p.detach()).abs().max().item() for n, p in plain.named_parameters())
        with open(out, "w") as f:
            json.dump(runs, f)
    # both ranks leave together: rank 1 tearing gloo down while rank 0 still trains the plain model aborted it now
    # and then ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
