"""sft/lowbit.py: torchao's 4-bit AdamW under FSDP2 (raw fully_shard on two gloo ranks: the FSDP that accelerate
sets up on GPUs, which on CPU silently becomes DDP), compared with torchao's own non-FSDP update."""

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

FSDP_4BIT_WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torchao.optim import AdamW4bit, AdamW8bit
    from sft.lowbit import prepare_optimizer

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)

    def build():
        torch.manual_seed(0)
        return torch.nn.Linear(256, 512, bias=False).to(torch.bfloat16)  # each rank's shard: 256 x 256

    def train(optimizer_class, sharded, steps, stochastic_round):
        model = build()
        if sharded:
            fully_shard(model)
        optimizer = optimizer_class(model.parameters(), lr=1e-2, bf16_stochastic_round=stochastic_round)
        for step in range(steps):  # the same gradients in every run
            grad = torch.randn(512, 256, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            model.weight.grad = distribute_tensor(grad, model.weight.device_mesh, [Shard(0)]) if sharded else grad
            optimizer.step()
        return model.weight.full_tensor() if sharded else model.weight.detach()

    # torchao's own 4-bit update (plain tensors, no FSDP, no patches): 3 steps rounding to nearest, 1 stochastic.
    nearest, stochastic = train(AdamW4bit, False, 3, False), train(AdamW4bit, False, 1, True)
    prepare_optimizer("adamw_torch_4bit")
    train(AdamW8bit, True, 1, True)  # an 8-bit run first: its compiled update lands in the on-disk compile cache
    fsdp_nearest, fsdp_stochastic = train(AdamW4bit, True, 3, False), train(AdamW4bit, True, 1, True)
    # Two stochastic roundings of one fp32 value are the same or neighbouring bf16 values: at most 1 ulp apart.
    smaller = torch.minimum(fsdp_stochastic.abs(), stochastic.abs()).float()
    ulp = torch.finfo(torch.bfloat16).eps * smaller.log2().floor().exp2()
    if dist.get_rank() == 0:
        print(json.dumps({"nearest_equal": torch.equal(fsdp_nearest, nearest),
                          "stochastic_max_ulps": ((fsdp_stochastic.float() - stochastic.float()).abs() / ulp).max().item(),
                          "moved": (fsdp_nearest != build().weight).float().mean().item()}))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_4bit_adamw_under_fsdp2_after_an_8bit_run_matches_torchaos_own_update(tmp_path):
    """The 4-bit crash under FSDP2 ("wrong number of dimensions", seen on 2 x H200) is a false hit in torch's
    AOTAutograd cache: DTensor's key ignores what it wraps, so the 4-bit update loads the graph compiled for an
    8-bit state of the same parameter (any earlier 8-bit run on the machine). Without patch_dtensor_cache_key this
    test fails with that error. With it, the sharded 4-bit update equals torchao's own non-FSDP update exactly
    (rounding to nearest: shards of whole 128-value blocks quantize identically), and with stochastic rounding each
    weight is within 1 bf16 ulp of it (the random bits differ). ~40 s on 2 cores (torch.compile)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    workers = [subprocess.Popen([sys.executable, "-c", FSDP_4BIT_WORKER, str(tmp_path / "rendezvous"), str(rank)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in (0, 1)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [out[-3000:] for out in outputs]
    found = json.loads(next(line for line in outputs[0].splitlines() if line.startswith("{")))
    assert found["nearest_equal"] and found["stochastic_max_ulps"] <= 1.0 and found["moved"] > 0.9, found


def test_dtensor_cache_key_tells_4bit_from_8bit_states_and_devices():
    """The part of the key that DTensor's own leaves out: the wrapped tensor's type, layout and device."""
    import torch
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    from sft.lowbit import local_tensor_key, patch_dtensor_cache_key

    shape = (256, 256)
    four, eight = (OptimState4bit.zeros(shape, True, 128, "cpu", dtype=torch.float32),
                   OptimState8bit.zeros(shape, True, 256, "cpu", dtype=torch.float32))
    assert four.shape == eight.shape and four.dtype == eight.dtype  # what DTensor's own key sees: the same
    assert local_tensor_key(four) != local_tensor_key(eight)
    assert local_tensor_key(four) == local_tensor_key(OptimState4bit.zeros(shape, True, 128, "cpu",
                                                                           dtype=torch.float32))  # stable
    assert local_tensor_key(torch.zeros(shape)) != local_tensor_key(torch.zeros(shape, device="meta"))
    patch_dtensor_cache_key()
    assert patch_dtensor_cache_key() is False  # idempotent
