"""MoE LoRA (tests/test_moe_lora.py's targets: MLA, the dense layer's MLP and the shared experts as peft
target_parameters, the fused routed experts) with the frozen base sharded, on 2 gloo ranks of a CPU box: DeepSpeed
ZeRO-3 through the real entry point, and raw torch FSDP2 (`fully_shard`, as accelerate applies it; accelerate's own
FSDP becomes DDP on a CPU). What DeepSeek-V2-Lite needs on 24 GB cards (recipes/deepseek-v2-lite-lora.yaml)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import DEEPSEEK_TOKENIZER, REPO, needs_shared, save_tiny_model
from test_distributed import run_deepspeed, short_run, tensors, zero_checkpoint
from test_moe_lora import adapted, expected, logits, saved_modules


def adapter_modules(config) -> set[str]:
    """What the saved file holds for `--lora_experts`: the promised paths, the fused experts as one module."""
    return {p.split(".experts.")[0] + ".experts" if ".experts." in p else p for p in expected(config, True)}


@needs_shared
@pytest.mark.slow
def test_zero3_moe_lora_trains_saves_reloads_and_merges(tmp_path):
    """accelerate_configs/zero3.yaml, 2 ranks, sft/train.py on a tiny DeepSeek-V2 with the real tokenizer, LoRA on
    every promised weight and the routed experts, activation checkpointing (the recipe's): the base is created
    partitioned, the MoE block is a ZeRO-3 leaf, the loss falls, the adapter holds exactly the promised modules with
    the values of the ZeRO shards, reloads with plain peft on the plain model and merges (sft.tools.merge) to its logits.
    (The run's own save check also compared the sharded model's logits with the reloaded adapter's.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft.tools.merge import main as merge

    base = save_tiny_model(tmp_path / "base", "deepseek_v2", tokenizer_dir=DEEPSEEK_TOKENIZER)
    output = tmp_path / "out"
    result = run_deepspeed("zero3.yaml", 29641, short_run(
        base, output, "--lora", "true", "--lora_experts", "true", "--lora_r", "4", "--lora_dropout", "0",
        "--activation_checkpointing", "true", "--template", "deepseek", "--save_steps", "4"))
    assert "ZeRO-3: model loaded partitioned" in result.stdout
    assert "ZeRO-3: 1 MoE blocks (DeepseekV2Moe) are leaf modules" in result.stdout, result.stdout[-2000:]

    log = [json.loads(line) for line in (output / "trainer_log.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in log if "loss" in row]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(row["moe/aux_loss"] > 0 for row in log if "loss" in row)  # the balance loss ran on the sharded model

    config = AutoModelForCausalLM.from_pretrained(base).config
    assert saved_modules(output) == adapter_modules(config)  # the non-sharded run's list (test_moe_lora)
    adapter = tensors(output / "adapter_model.safetensors")
    shards = zero_checkpoint(output / "checkpoint-4")
    for key, value in adapter.items():
        assert torch.equal(value, shards[key]), key
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: all trained

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), output)
    assert adapted(reloaded) == expected(config, True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    batch = tokenizer(["def add(a, b):\n    return a + b\n", "Name three colours."], padding=True,
                      return_tensors="pt")
    with_adapter = logits(reloaded, batch)
    with reloaded.disable_adapter():
        assert not torch.allclose(logits(reloaded, batch), with_adapter, atol=1e-3), "the adapter changes nothing"
    assert merge([str(output), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged, batch), with_adapter, rtol=1e-4, atol=1e-4)


FSDP_MOE_WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from sft.options.arguments import LoraArguments
    from sft.model.loading import attach_lora

    rendezvous, rank, bases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
    args = LoraArguments(lora=True, lora_r=4, lora_dropout=0.0, lora_experts=True)

    def build(base):
        torch.manual_seed(0)
        model = attach_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args, True)
        for name, p in model.named_parameters():  # B != 0, so that every A gets a gradient
            if "lora_B" in name:
                p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        return model

    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(rank))
    for base in bases:
        reference = build(base)
        reference_loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
        reference_loss.backward()
        model = build(base)
        model.activation_checkpointing_enable({"use_reentrant": False})  # LoRA under FSDP: transformers' (sft/parallel/fsdp.py)
        layers = set(model.get_base_model()._no_split_modules)  # what fsdp.yaml wraps: each decoder layer
        for module in list(model.modules()):
            if type(module).__name__ in layers:
                fully_shard(module)
        fully_shard(model)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        worst, sharded, references = 0.0, 0, dict(reference.named_parameters())
        for name, p in model.named_parameters():
            if p.requires_grad:
                sharded += hasattr(p, "full_tensor")
                mean = references[name].grad.clone()
                dist.all_reduce(mean)  # FSDP averages the ranks' gradients
                mean /= 2
                worst = max(worst, float((p.grad.full_tensor() - mean).abs().max() / mean.abs().max()))
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
        trained = {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(base + "-adapter", state_dict=state)
            saved = load_file(base + "-adapter/adapter_model.safetensors")
            equal = sum(torch.equal(saved[n.replace(".default", "")], p) for n, p in trained.items())
            print(json.dumps({"base": base, "layer": sorted(layers), "losses": [reference_loss.item(), loss.item()],
                              "worst": worst, "sharded": sharded, "trainable": len(trained), "saved": len(saved),
                              "equal": equal}), flush=True)
    dist.barrier()  # no rank leaves while another still works
    from sft.parallel.distributed import exit_process
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen in CI: -6)
""")


@needs_shared
@pytest.mark.slow
def test_fsdp2_moe_lora_forward_backward_and_adapter(tmp_path):
    """Raw FSDP2 over 2 gloo ranks, each decoder layer and the root sharded, transformers' activation checkpointing,
    tiny DeepSeek-V2 and V3: peft's target_parameters LoRA (dense MLP, shared experts, fused routed experts)
    computes the unsharded model's loss and gradients, and the full state dict saves an adapter with exactly the
    promised modules, equal to the trained (sharded) weights, which plain peft loads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    bases = [save_tiny_model(tmp_path / t, t, tokenizer_dir=DEEPSEEK_TOKENIZER) for t in ("deepseek_v2", "deepseek_v3")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    workers = [subprocess.Popen([sys.executable, "-c", FSDP_MOE_WORKER, str(tmp_path / "rendezvous"), str(rank),
                                 *map(str, bases)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for rank in (0, 1)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    results = [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]
    assert [r["layer"] for r in results] == [["DeepseekV2DecoderLayer"], ["DeepseekV3DecoderLayer"]]
    for base, found in zip(bases, results):
        torch.testing.assert_close(*found["losses"])  # FSDP's forward is the unsharded one
        assert found["worst"] < 1e-5, found  # and so are the gradients (relative to the largest)
        assert found["sharded"] == found["trainable"] > 0  # every LoRA weight was an FSDP shard (DTensor)
        assert found["saved"] == found["equal"] == found["trainable"]  # the file holds every trained weight
        config = AutoModelForCausalLM.from_pretrained(base).config
        adapter = f"{base}-adapter"
        assert saved_modules(Path(adapter)) == adapter_modules(config)
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
        assert adapted(reloaded) == expected(config, True)
