"""Resuming the full fine-tune plan from a checkpoint: FSDP2 (SHARDED_STATE_DICT) + bf16 weights + torchao's 4-bit
and 8-bit AdamW with bf16 stochastic rounding and the sft/speed/lowbit.py patches. Two gloo ranks with raw fully_shard
(accelerate's FSDP becomes DDP on CPU); the checkpoint is written and read by accelerate's own save_fsdp_model /
save_fsdp_optimizer / load_fsdp_model / load_fsdp_optimizer (what the Trainer calls under FSDP), in a fresh pair
of processes, as `--resume_from_checkpoint` does."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is not installed (optional: the bf16 full fine-tune plan)")

# argv: rendezvous file, rank, checkpoint root, phase ("save": 4 steps uninterrupted, then 2 steps and a checkpoint;
# "resume": load it into fresh objects, 2 more steps, compare with the 4 uninterrupted ones).
RESUME_WORKER = textwrap.dedent("""
    import json, logging, os, sys, types, torch, torch.distributed as dist
    from torch.distributed.fsdp import (ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType,
                                        fully_shard)
    import accelerate.utils.fsdp_utils as fsdp_utils
    from torchao.optim import AdamW4bit, AdamW8bit
    import sft.speed.lowbit
    from sft.speed.lowbit import prepare_optimizer

    rank, root, phase = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
    fsdp_utils.logger = logging.getLogger("fsdp_utils")  # accelerate's own logger wants an Accelerator()
    sft.speed.lowbit.CHUNK_NUMEL = 2**15  # the first weight's shard is updated in 2 chunks, the second in one call
    prepare_optimizer("adamw_torch_4bit")
    # What accelerate's FSDP plugin holds for fsdp_version 2 + SHARDED_STATE_DICT (set_state_dict_type).
    plugin = types.SimpleNamespace(fsdp_version=2, state_dict_type=StateDictType.SHARDED_STATE_DICT,
                                   state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),
                                   optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True))
    accelerator = types.SimpleNamespace(process_index=rank, num_processes=2, is_fsdp2=True,
                                        is_main_process=rank == 0, wait_for_everyone=dist.barrier)

    def build(bits):  # a quantized state per weight (>= 4096 values per shard), a plain one for the bias
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 128, bias=False)).to(torch.bfloat16)
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        optimizer_class = AdamW4bit if bits == 4 else AdamW8bit  # block_size as SFTTrainer passes it (a number)
        return model, optimizer_class(model.parameters(), lr=1e-2, weight_decay=0.01, bf16_stochastic_round=True,
                                      block_size=128 if bits == 4 else 256)

    def train(model, optimizer, steps):
        for step in steps:
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 256, generator=g).bfloat16(), torch.randn(8, 128, generator=g).bfloat16()
            (model(x).float() - y.float()).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    def snapshot(model, optimizer):
        weights = [p.full_tensor() for p in model.parameters()]
        def local(value):  # a quantized state's codes and scales, else the tensor (this rank's shard)
            value = getattr(value, "_local_tensor", value)
            return [value.codes, value.scale] if hasattr(value, "codes") else value

        states = [{key: local(value) for key, value in optimizer.state[p].items()} for p in model.parameters()]
        kinds = [{key: [type(getattr(value, "_local_tensor", value)).__name__, str(value.dtype),
                        str(getattr(value, "_local_tensor", value).dtype)]
                  for key, value in optimizer.state[p].items()} for p in model.parameters()]
        return weights, states, kinds

    def flat(states):  # every state tensor in order: 2 weights x (step + codes and scales of m, v), bias: 3 tensors
        return [t for state in states for key in sorted(state)
                for t in (state[key] if isinstance(state[key], list) else [state[key]])]

    def resume(bits, restore_rng):
        model, optimizer = build(bits)
        folder = f"{root}/{bits}bit"
        fsdp_utils.load_fsdp_model(plugin, accelerator, model, folder)
        fsdp_utils.load_fsdp_optimizer(plugin, accelerator, optimizer, model, folder)
        if restore_rng:  # the Trainer's _load_rng_state, after the optimizer (whose loading takes a zero-lr step)
            torch.random.set_rng_state(torch.load(f"{folder}/rng_state_{rank}.pth"))
        train(model, optimizer, range(2, 4))
        return snapshot(model, optimizer)

    found = {}
    for bits in (4, 8):
        folder = f"{root}/{bits}bit"
        if phase == "save":
            torch.manual_seed(1234)
            model, optimizer = build(bits)
            train(model, optimizer, range(4))
            torch.save(snapshot(model, optimizer), f"{folder}-uninterrupted-{rank}.pt")
            torch.manual_seed(1234)
            model, optimizer = build(bits)
            train(model, optimizer, range(2))
            fsdp_utils.save_fsdp_model(plugin, accelerator, model, folder)
            fsdp_utils.save_fsdp_optimizer(plugin, accelerator, optimizer, model, folder)
            torch.save(torch.random.get_rng_state(), f"{folder}/rng_state_{rank}.pth")
            continue
        weights, states, kinds = torch.load(f"{folder}-uninterrupted-{rank}.pt", weights_only=False)
        got_weights, got_states, got_kinds = resume(bits, True)
        found[bits] = {"weights_equal": all(map(torch.equal, weights, got_weights)),
                       "states_equal": len(flat(states)) == len(flat(got_states)) == 13 and all(
                           map(torch.equal, flat(states), flat(got_states))),
                       "kinds": kinds, "resumed_kinds": got_kinds}
        if bits == 4:  # the same resume without the RNG state: stochastic rounding draws other bits
            found["4_without_rng_weights_equal"] = all(map(torch.equal, weights, resume(4, False)[0]))
    gathered = [None, None]
    dist.all_gather_object(gathered, found)
    if rank == 0 and phase == "resume":
        print(json.dumps(gathered))
    from sft.parallel.distributed import exit_process
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run
""")


def run_ranks(tmp_path: Path, phase: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    workers = [subprocess.Popen([sys.executable, "-c", RESUME_WORKER, str(tmp_path / f"rendezvous-{phase}"),
                                 str(rank), str(tmp_path / "checkpoint"), phase],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in (0, 1)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [out[-3000:] for out in outputs]
    return outputs[0]


@pytest.mark.slow
def test_resumed_lowbit_fsdp2_training_equals_uninterrupted_training(tmp_path):
    """4-bit and 8-bit AdamW, bf16 stochastic rounding: 2 steps, a sharded checkpoint (DCP saves torchao's
    quantized states inside their DTensors), new processes load it into new objects, 2 more steps: weights and
    every state (codes, scales, unquantized bias state, step) equal 4 uninterrupted steps bit for bit, given the
    RNG state the Trainer saves per rank (without it the stochastic rounding differs, which this test also
    checks). Without the load_state_dict part of patch_torchao_state_dtype the resumed quantized states report
    bf16 where the uninterrupted ones report float32 (torch's load_state_dict casts states to the parameter's
    dtype), and this test fails on that. ~40-70 s on 2 cores."""
    (tmp_path / "checkpoint").mkdir()
    run_ranks(tmp_path, "save")
    output = run_ranks(tmp_path, "resume")
    ranks = json.loads(next(line for line in output.splitlines() if line.startswith("[")))
    for found in ranks:
        assert found["4_without_rng_weights_equal"] is False, found  # the RNG state matters: the check can fail
        for bits in ("4", "8"):
            result = found[bits]
            assert result["weights_equal"] and result["states_equal"], (bits, result)
            quantized = [kind for state in result["kinds"] for kind in state.values() if kind[0].startswith("Optim")]
            assert len(quantized) == 4 and all(kind[1:] == ["torch.float32"] * 2 for kind in quantized), result
            assert result["resumed_kinds"] == result["kinds"], (bits, result)
