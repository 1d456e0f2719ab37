"""sft/speed/lowbit.py: torchao's 4-bit AdamW under FSDP2 (raw fully_shard on two gloo ranks: the FSDP that accelerate
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
    import sft.speed.lowbit
    from sft.speed.lowbit import prepare_optimizer

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)

    def build():  # per rank: a 256 x 256 shard (updated in 2 chunks, below) and a 64 x 512 one (in one call)
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False),
                                   torch.nn.Linear(512, 128, bias=False)).to(torch.bfloat16)

    def train(optimizer_class, sharded, steps, stochastic_round):
        model = build()
        if sharded:
            fully_shard(model)
        optimizer = optimizer_class(model.parameters(), lr=1e-2, bf16_stochastic_round=stochastic_round)
        for step in range(steps):  # the same gradients in every run
            for i, p in enumerate(model.parameters()):
                grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(torch.bfloat16)
                p.grad = distribute_tensor(grad, p.device_mesh, [Shard(0)]) if sharded else grad
            optimizer.step()
        return [p.full_tensor() if sharded else p.detach() for p in model.parameters()]

    # torchao's own 4-bit update (plain tensors, no FSDP, no patches): 3 steps rounding to nearest, 1 stochastic;
    # on rank 0 only, which compares (compiled on both ranks it cost a fifth of the test's CPU: 144 s against 114).
    if dist.get_rank() == 0:
        nearest, stochastic = train(AdamW4bit, False, 3, False), train(AdamW4bit, False, 1, True)
    sft.speed.lowbit.CHUNK_NUMEL = 2**15  # small chunks for small test tensors
    prepare_optimizer("adamw_torch_4bit")
    train(AdamW8bit, True, 1, True)  # an 8-bit run first: its compiled update lands in the on-disk compile cache
    fsdp_nearest, fsdp_stochastic = train(AdamW4bit, True, 3, False), train(AdamW4bit, True, 1, True)
    if dist.get_rank() == 0:
        # Two stochastic roundings of one fp32 value are the same or neighbouring bf16 values: at most 1 ulp apart.
        ulps = []
        for got, want in zip(fsdp_stochastic, stochastic):
            smaller = torch.minimum(got.abs(), want.abs()).float()
            ulps.append(((got.float() - want.float()).abs() / (torch.finfo(torch.bfloat16).eps * smaller.log2().floor().exp2())).max().item())
        print(json.dumps({"nearest_equal": [torch.equal(a, b) for a, b in zip(fsdp_nearest, nearest)],
                          "stochastic_max_ulps": max(ulps),
                          "moved": min((a != b).float().mean().item() for a, b in zip(fsdp_nearest, build().parameters()))}))
    from sft.parallel.distributed import exit_process
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run
""")


def two_gloo_ranks(worker: str, tmp_path: Path, **env: str) -> dict:
    """Run `worker` (Python source; argv: a rendezvous file, the rank) as ranks 0 and 1 of a gloo group; -> the
    JSON line rank 0 printed. Both must exit 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    workers = [subprocess.Popen([sys.executable, "-c", worker, str(tmp_path / "rendezvous"), str(rank)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in (0, 1)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [out[-3000:] for out in outputs]
    return json.loads(next(line for line in outputs[0].splitlines() if line.startswith("{")))


@pytest.mark.slow
def test_4bit_adamw_under_fsdp2_after_an_8bit_run_matches_torchaos_own_update(tmp_path):
    """The 4-bit crash under FSDP2 ("wrong number of dimensions", seen on 2 x H200) is a false hit in torch's
    AOTAutograd cache: DTensor's key ignores what it wraps, so the 4-bit update loads the graph compiled for an
    8-bit state of the same parameter (any earlier 8-bit run on the machine). Without patch_dtensor_cache_key this
    test fails with that error. With it, the sharded 4-bit update (one shard updated in chunks, one whole) equals
    torchao's own non-FSDP update exactly (rounding to nearest: shards and chunks of whole 128-value blocks
    quantize identically), and with stochastic rounding each weight is within 1 bf16 ulp of it (the random bits
    differ). 45-100 s on 2 cores (torch.compile of 10 graphs)."""
    found = two_gloo_ranks(FSDP_4BIT_WORKER, tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    assert found["nearest_equal"] == [True, True] and found["stochastic_max_ulps"] <= 1.0 and found["moved"] > 0.9, found


def test_dtensor_cache_key_tells_4bit_from_8bit_states_and_devices():
    """The part of the key that DTensor's own leaves out: the wrapped tensor's type, layout and device."""
    import torch
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    from sft.speed.lowbit import local_tensor_key, patch_dtensor_cache_key

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


def test_chunk_rows_fall_on_block_boundaries():
    import torch

    from sft.speed.lowbit import chunk_rows

    class State:  # what chunk_rows reads of a torchao state
        def __init__(self, block_size):
            self.block_size = block_size

    big = torch.empty(1000, 384)
    assert chunk_rows(big, [], 10**6) is None  # small enough for one call
    assert chunk_rows(big, [State(256)], 100_000) == 260  # 260 x 384 = 390 blocks of 256
    assert chunk_rows(big, [State(256), State(128)], 1_000) == 2  # one row is 1.5 blocks: two rows per chunk
    assert chunk_rows(big, [torch.empty(1000, 384)], 100_000) == 260  # unquantized state: any row
    assert chunk_rows(torch.empty(10**6), [State(128)], 2**16) == 2**16  # 1-D
    assert chunk_rows(torch.empty(3, 2**20), [State(128)], 2**16) == 1  # a row is more than a chunk: one each


@pytest.mark.slow
def test_chunked_update_is_bit_identical_and_needs_fewer_temporaries(monkeypatch):
    """torchao's compiled update materializes fp32/int64 temporaries of the whole shard (~8 bytes per value for
    8-bit states); in chunks of CHUNK_NUMEL values they are a chunk's, and the result is bit-identical (round to
    nearest). Memory: peak RSS of this process during a step, over a 16M-value parameter, chunks of 2M values.
    glibc's mmap threshold is fixed at 1 MiB for the measure, so that every temporary of a chunk or more is its
    own mapping, in the RSS while alive and out of it when freed: with the threshold moving as glibc likes, freed
    heap served some temporaries and the chunked reading ran from 16 to 84 MiB (against ~128 MiB for one call),
    over the half bound once in a clean CI run; fixed, it read 16 MiB in 4 of 4 runs after heap noise."""
    import ctypes
    import threading
    import time

    import psutil
    import torch
    from torchao.optim import AdamW8bit, adam

    import sft.speed.lowbit as lowbit

    lowbit.patch_torchao_state_dtype()
    lowbit.patch_torchao_chunked_update()
    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold = -3  # mallopt's parameter number (malloc.h); a set value also stops glibc moving it
    assert libc.mallopt(m_mmap_threshold, 2**20) == 1

    def run(chunk_numel):
        monkeypatch.setattr(lowbit, "CHUNK_NUMEL", chunk_numel)
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4096, 4096, dtype=torch.bfloat16))
        optimizer = AdamW8bit([p], lr=1e-2)
        process, peak, done = psutil.Process(), [0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.0005)

        for step in range(2):  # the first step compiles and creates the states; the second is measured
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            if step:
                # freed heap that earlier work in this worker left (glibc keeps it) would serve the step's
                # temporaries without growing the RSS: handed back first, so that the growth counts them
                libc.malloc_trim(0)
                base = process.memory_info().rss
                watcher = threading.Thread(target=watch)
                watcher.start()
            optimizer.step()
        done.set()
        watcher.join()
        return p.detach(), optimizer.state[p], peak[0] - base

    try:
        whole, whole_state, whole_extra = run(2**30)
        chunked, chunked_state, chunked_extra = run(2**21)
    finally:
        libc.mallopt(m_mmap_threshold, 128 * 2**10)  # glibc's starting value, for the tests after this one
    assert adam.single_param_adam._sft_chunked
    assert torch.equal(whole, chunked)
    assert torch.equal(whole_state["exp_avg"].codes, chunked_state["exp_avg"].codes)
    assert torch.equal(whole_state["exp_avg_sq"].scale, chunked_state["exp_avg_sq"].scale)
    assert whole_extra > 6 * 2**24 and chunked_extra < whole_extra / 2, (whole_extra, chunked_extra)


def test_block_size_from_optim_args_reaches_torchao_as_a_number():
    """transformers forwards `--optim_args block_size=128` as the string "128" (torchao failed on it at step 1);
    SFTTrainer hands torchao the number."""
    import torch
    from transformers import Trainer, TrainingArguments

    from sft.speed.lowbit import prepare_optimizer
    from sft.trainer import SFTTrainer

    prepare_optimizer("adamw_torch_4bit")
    args = TrainingArguments(output_dir="/tmp/sft-lowbit-test", optim="adamw_torch_4bit", use_cpu=True,
                             optim_args="bf16_stochastic_round=True,block_size=128")
    assert Trainer.get_optimizer_cls_and_kwargs(args)[1]["block_size"] == "128"  # what transformers passes
    optimizer_class, kwargs = SFTTrainer.get_optimizer_cls_and_kwargs(args)
    assert kwargs["block_size"] == 128
    p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    optimizer = optimizer_class([p], **kwargs)
    optimizer.step()
    assert optimizer.block_size == 128 and optimizer.state[p]["exp_avg"].block_size == 128
