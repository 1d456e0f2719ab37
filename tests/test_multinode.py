"""Multi-node: the shipped accelerate configs with num_machines > 1, as two "machines" of one process each on
loopback (two `accelerate launch --num_machines 2 --machine_rank {0,1}` processes, gloo on CPU): ddp.yaml, and
multi_node.yaml as shipped (ZeRO-3). The DDP run's checkpoint, resumed under single-machine DDP, ends with
bit-identical weights (CPU, fixed seed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, train_here

pytestmark = pytest.mark.slow
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
PORT = 29641


def train_args(model: Path, output: Path, *extra: str, cpu: tuple[str, ...] = ("--use_cpu", "true")) -> list[str]:
    return [str(REPO / "sft" / "train.py"), "--model", str(model), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
            "--max_samples", "64", "--max_length", "128", "--packing", "true", "--per_device_train_batch_size", "2",
            "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
            "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--report_to", "none", "--seed", "0",
            # On CPU: without --use_cpu accelerate picks no backend and DDP is never set up (each rank trains alone);
            # DeepSpeed configs take --ddp_backend gloo instead (see tests/test_distributed.py).
            *cpu, "--output_dir", str(output), *extra]


def env() -> dict:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def test_two_machines_on_loopback_then_resume_on_one(tmp_path, tiny_llama):
    import torch
    from safetensors.torch import load_file

    output = tmp_path / "two-machines"
    machines = [subprocess.Popen(
        [ACCELERATE, "launch", "--config_file", str(REPO / "accelerate_configs" / "ddp.yaml"),
         "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", str(PORT), *train_args(tiny_llama, output)],
        cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = []
    for machine in machines:
        try:
            logs.append(machine.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:  # one machine died and the other waits for it: stop both
            for m in machines:
                m.kill()
            raise
    assert [m.returncode for m in machines] == [0, 0], "\n=====\n".join(log[-3000:] for log in logs)
    assert "Training on 2 process(es)" in logs[0]  # machine 0 holds rank 0, which prints the summary
    state = json.loads((output / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    # Both ranks wrote their RNG state into the shared checkpoint: two processes really took part.
    assert sorted(p.name for p in (output / "checkpoint-2").glob("rng_state_*.pth")) == ["rng_state_0.pth",
                                                                                          "rng_state_1.pth"]

    resumed = tmp_path / "resumed"
    result = subprocess.run(
        [ACCELERATE, "launch", "--config_file", str(REPO / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2",
         "--main_process_port", str(PORT + 2),
         *train_args(tiny_llama, resumed, "--resume_from_checkpoint", str(output / "checkpoint-2"))],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "Training on 2 process(es)" in result.stdout
    first, second = load_file(output / "model.safetensors"), load_file(resumed / "model.safetensors")
    initial = load_file(tiny_llama / "model.safetensors")
    assert first.keys() == second.keys() == initial.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key}: resumed run differs from the uninterrupted one"
        assert not torch.equal(first[key], initial[key]), f"{key} did not train"

    # The two machines really averaged their gradients: one process with the same global batch (4) ends at the
    # same weights, up to the order of floating-point sums. A rank training alone on its half lands far away.
    single = tmp_path / "single"
    args = train_args(tiny_llama, single, "--per_device_train_batch_size", "4", "--save_strategy", "no")
    result = train_here(args[1:])  # args[0] is sft/train.py: the one process is this one
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    alone = load_file(single / "model.safetensors")
    gap = sum(float(((first[k] - alone[k]) ** 2).sum()) for k in first) ** 0.5
    travelled = sum(float(((alone[k] - initial[k]) ** 2).sum()) for k in first) ** 0.5
    assert gap < 0.02 * travelled, f"2 machines vs 1 process with the same global batch: {gap:.3g} apart, " \
                                   f"training moved the weights {travelled:.3g}"


def test_shipped_multi_node_config_on_loopback(tmp_path, tiny_llama):
    """accelerate_configs/multi_node.yaml as shipped (ZeRO-3), with only the address, the rank and the process
    count overridden: two machines of one process, the model partitioned across them, a consolidated save."""
    output = tmp_path / "zero3-two-machines"
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    machines = [subprocess.Popen(
        [ACCELERATE, "launch", "--config_file", str(REPO / "accelerate_configs" / "multi_node.yaml"),
         "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
         "--main_process_port", str(PORT + 4),
         *train_args(tiny_llama, output, cpu=("--ddp_backend", "gloo"))],
        cwd=REPO, env={**env(), "TORCH_EXTENSIONS_DIR": extensions}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = []
    for machine in machines:
        try:
            logs.append(machine.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for m in machines:
                m.kill()
            raise
    assert [m.returncode for m in machines] == [0, 0], "\n=====\n".join(log[-3000:] for log in logs)
    assert "Training on 2 process(es)" in logs[0]
    from safetensors.torch import load_file

    n = sum(v.numel() for v in load_file(tiny_llama / "model.safetensors").values())
    assert f"ZeRO-3: model loaded partitioned (zero.Init): {n // 2:,} of {n:,} parameters" in logs[0]
    assert (output / "model.safetensors").is_file()
