"""Tensor-parallel checkpoints resume (sft/parallel/tensor_parallel.py).

The end-to-end test trains a TP-sharded tiny Llama with TensorParallelTrainer on two CPU processes over gloo.
accelerate refuses tensor parallelism on CPU (its ParallelismConfig accepts only GPU device types), so the worker
switches that one check off: the Trainer, DTensor sharding and DCP paths it then runs are the GPU ones
(bench/gpu_strategy_checks.py runs the real thing, `tp/full/resume*`, on GPUs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, train_here

from sft.safety.checkpoints import mark_complete
from sft.options.arguments import ConfigError
from sft.parallel.tensor_parallel import check_resumable, check_tensor_parallel
from sft.safety.run_dir import TP_STATE_DIR, TP_STATE_INFO

WORKER = r"""
import json, sys
import accelerate.parallelism_config
accelerate.parallelism_config.ParallelismConfig._validate_accelerator = lambda self, accelerator: None  # CPU: see top

import torch
from transformers import AutoModelForCausalLM, TrainingArguments
from transformers.distributed import DistributedConfig
from sft.parallel.tensor_parallel import TensorParallelTrainer

model_dir, output_dir, resume = sys.argv[1], sys.argv[2], sys.argv[3] or None
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             distributed_config=DistributedConfig(tp_size=2))
assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
rows = torch.randint(0, model.config.vocab_size, (24, 32), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": r, "labels": r} for r in rows]
args = TrainingArguments(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=2, max_steps=4,
                         save_steps=2, save_only_model=True, learning_rate=3e-3, warmup_steps=1, weight_decay=0.1,
                         logging_steps=1, report_to=[], seed=7, disable_tqdm=True)
trainer = TensorParallelTrainer(model=model, args=args, train_dataset=data)
trainer.train(resume_from_checkpoint=resume)
if trainer.args.process_index == 0:
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    with open(output_dir + "/losses.json", "w") as f:
        json.dump(losses, f)
from sft.parallel.distributed import exit_process
exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen under load)
"""


def tp_train(tmp_path: Path, model: Path, output_dir: Path, resume: Path | None = None) -> dict[int, float]:
    script = tmp_path / "tp_worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(script), str(model), str(output_dir), str(resume or "")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {int(k): v for k, v in json.loads((output_dir / "losses.json").read_text()).items()}


@pytest.mark.slow
def test_a_tensor_parallel_run_resumes_where_it_stopped(tmp_path, tiny_llama):
    """Resumed from step 2, steps 3-4 give the uninterrupted run's losses and weights to the last bit: weights,
    AdamW moments, the learning-rate schedule and the step all come back (the Trainer alone fails here, copying
    full tensors into DTensor parameters)."""
    from safetensors.torch import load_file

    whole = tp_train(tmp_path, tiny_llama, tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    held = {p.name for p in checkpoint.iterdir()}
    assert {TP_STATE_DIR, TP_STATE_INFO, "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
            "model.safetensors"} <= held
    assert json.loads((checkpoint / TP_STATE_INFO).read_text()) == {"tp_size": 2}

    resumed = tp_train(tmp_path, tiny_llama, tmp_path / "resumed", resume=checkpoint)
    assert sorted(whole) == sorted(resumed) == [1, 2, 3, 4]  # steps 1-2 come from the checkpoint's log history
    assert [resumed[s] for s in (3, 4)] == [whole[s] for s in (3, 4)]
    a = load_file(tmp_path / "whole" / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoint-4" / "model.safetensors")
    start = load_file(checkpoint / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)
    assert not all(a[k].equal(start[k]) for k in a)  # steps 3-4 did train


def fake_checkpoint(path: Path, tp_size: int | None) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"")
    if tp_size:
        (path / TP_STATE_DIR).mkdir()
        (path / TP_STATE_INFO).write_text(json.dumps({"tp_size": tp_size}))
    return path


def test_a_tensor_parallel_checkpoint_resumes_under_its_own_tp_size(tmp_path):
    tp2 = fake_checkpoint(tmp_path / "tp2" / "checkpoint-2", 2)
    plain = fake_checkpoint(tmp_path / "ddp" / "checkpoint-2", None)
    check_resumable(tp2, 2)
    check_resumable(plain, 1)
    check_resumable(None, 2)
    for tp_size in (1, 3):
        with pytest.raises(ConfigError, match="resume it with --tp_size 2"):
            check_resumable(tp2, tp_size)
    with pytest.raises(ConfigError, match="holds no tensor-parallel training state") as e:
        check_resumable(plain, 2)
    assert f"--model {plain}" in str(e.value)


def test_resuming_a_tensor_parallel_checkpoint_without_tp_is_refused_before_loading(tmp_path, tiny_llama):
    """Without --tp_size the Trainer would load the weights, find no optimizer.pt and silently restart AdamW."""
    checkpoint = fake_checkpoint(tmp_path / "run" / "checkpoint-2", 2)
    mark_complete(checkpoint)
    done = train_here(["--model", str(tiny_llama), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
                       "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(checkpoint)])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "resume it with --tp_size 2" in done.stderr
    assert "Loading model:" not in done.stdout  # refused before any model loads


def test_what_tensor_parallel_needs_is_checked_before_loading(tmp_path):
    """transformers itself fails only at the first forward, with a shape error (seen with 3 ranks and 4 heads)."""
    from types import SimpleNamespace

    from conftest import tiny_config

    def model_dir(name: str, **overrides) -> str:
        tiny_config("llama", **overrides).save_pretrained(tmp_path / name)  # a config is all the check reads
        return str(tmp_path / name)

    def check(model: str, tp_size: int, world_size: int | None = None):
        args = SimpleNamespace(model=model, tp_size=tp_size, trust_remote_code=False)
        check_tensor_parallel(args, world_size or tp_size, None)

    llama = model_dir("llama", num_attention_heads=4, num_key_value_heads=2)
    check(llama, 2)
    check(llama, 1, world_size=3)  # no TP: nothing to check
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) must divide"):
        check(llama, 3)
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\) must divide"):
        check(model_dir("gqa", num_attention_heads=8, num_key_value_heads=2), 4)
    with pytest.raises(ConfigError, match="launch exactly 2"):
        check(llama, 2, world_size=4)
    no_plan = model_dir("no-plan")
    config = json.loads((Path(no_plan) / "config.json").read_text())
    (Path(no_plan) / "config.json").write_text(json.dumps({**config, "base_model_tp_plan": None}))
    with pytest.raises(ConfigError, match="no tensor-parallel plan"):
        check(no_plan, 2)
