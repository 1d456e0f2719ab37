"""ThroughputCallback: real tokens per second and MFU from the Trainer's token count and the step time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sft.report.callbacks import ThroughputCallback


def logged(model, tokens_counted: int, busy_s: float, world_size: int) -> dict:
    callback = ThroughputCallback(flops_per_token=6e9, peak_flops_per_gpu=1e15)
    args, state = SimpleNamespace(world_size=world_size), SimpleNamespace(num_input_tokens_seen=0)
    callback.on_train_begin(args, state, None)
    state.num_input_tokens_seen = tokens_counted
    callback.busy = busy_s
    logs = {"loss": 1.0}
    callback.on_log(args, state, None, logs=logs, model=model)
    return logs


def test_tokens_per_second_and_mfu():
    logs = logged(SimpleNamespace(), tokens_counted=20_000, busy_s=2.0, world_size=2)
    assert logs["real_tokens_per_second"] == 10_000
    assert logs["mfu"] == pytest.approx(10_000 * 6e9 / (1e15 * 2), abs=1e-4)


def test_tensor_parallel_ranks_share_a_batch_so_it_is_counted_once():
    """The Trainer sums every rank's tokens; the 2 ranks of a TP model process the same batch."""
    plain = logged(SimpleNamespace(tp_size=None), tokens_counted=20_000, busy_s=2.0, world_size=2)
    tp = logged(SimpleNamespace(tp_size=2), tokens_counted=20_000, busy_s=2.0, world_size=2)
    assert tp["real_tokens_per_second"] == plain["real_tokens_per_second"] / 2
    assert tp["mfu"] == pytest.approx(plain["mfu"] / 2, abs=1e-4)


def test_fsdp2_without_offload_is_not_described_as_offloading():
    """accelerate's FSDP plugin holds FSDP2's `OffloadPolicy()` (a truthy object) when nothing is offloaded: the
    first screen said "parameters offloaded to CPU" for every FSDP2 run (seen on an H200)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from sft.report.callbacks import offloads_parameters

    assert not offloads_parameters(OffloadPolicy()) and not offloads_parameters(None)
    assert offloads_parameters(CPUOffloadPolicy()) and offloads_parameters(True)


def test_the_peak_is_that_of_the_gpu_this_rank_trains_on():
    """A machine described as data: local rank r trains on its node's GPU r; no GPU, no peak (no MFU)."""
    from sft.report.callbacks import peak_flops
    from sft.machine import Launch, Machine

    mixed = ("NVIDIA H200", "NVIDIA GeForce RTX 4090")
    node = lambda rank: Machine(gpu_names=mixed, gpu_memory_gib=(139.8, 23.5), launch=Launch(world_size=2,  # noqa
                                                                                             local_rank=rank))
    assert peak_flops(m=node(0)) == 790e12 and peak_flops(m=node(1)) == 165e12
    assert peak_flops(m=Machine()) is None
    assert peak_flops(312, m=Machine()) == 312e12  # the user's figure wins
    assert peak_flops(m=Machine(gpu_names=("Some Future GPU",), gpu_memory_gib=(80.0,))) is None
