"""The loss is the mean over all trained tokens across gradient accumulation and ranks.

How (transformers 5.24): the Trainer counts `labels[..., 1:] != -100` over all micro-batches of an optimizer step
(`num_items_in_batch`), sums it over ranks (`average_tokens_across_devices`, default True), the model divides its
summed token loss by it, and the Trainer multiplies by the number of processes to undo DDP's gradient averaging.
Our labels fit that count exactly: the shift happens inside the model's loss, and each packed document's first
label is -100, so no target crosses a document boundary and every counted label is a target.

Measured here: one SGD step with lr 1 and no clipping, so the weight change is minus the gradient; batch 4
versus batch 1 x accumulation 4 versus 2 ranks x batch 1 x accumulation 2, with and without packing, on rows whose
numbers of trained tokens differ (so a mean of per-batch means would not agree).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO

pytestmark = pytest.mark.slow

WORDS = "the model learns to answer questions about data and code with short clear replies".split()
TOLERANCE = 1e-5


def answer(n: int) -> str:
    return " ".join((WORDS * 5)[:n])


def write_data(path: Path, answer_words: list[int]) -> Path:
    with open(path, "w") as f:
        for i, n in enumerate(answer_words):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                             {"role": "assistant", "content": answer(n)}]}) + "\n")
    return path


def step_args(model: Path, data: Path, out: Path, cache: Path, packing: bool, batch: int, accumulation: int):
    return ["--model", str(model), "--dataset", str(data), "--max_length", "112" if packing else "128",
            "--packing", str(packing).lower(), "--per_device_train_batch_size", str(batch),
            "--gradient_accumulation_steps", str(accumulation), "--max_steps", "1", "--optim", "sgd",
            "--learning_rate", "1.0", "--lr_scheduler_type", "constant", "--max_grad_norm", "0",
            "--weight_decay", "0", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
            "--verify_saves", "no", "--seed", "0", "--dataset_cache_dir", str(cache), "--output_dir", str(out)]


def gradient(initial: dict, out: Path) -> dict:
    """-(weight change) of one SGD step with lr 1: the gradient the Trainer applied."""
    final = load_file(out / "model.safetensors")
    return {k: initial[k] - final[k] for k in initial}


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


TWO_RANKS = """
import sys, json
from sft.parallel.distributed import exit_process
from sft.train import main
for args in json.loads(sys.argv[1]):
    if main(args) != 0:
        exit_process(1)
exit_process(0)
"""


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss-data")
    # Trained tokens per row differ a lot: a mean of per-micro-batch (or per-rank) means would be off.
    plain = write_data(root / "plain.jsonl", [2, 6, 14, 30])
    packed = write_data(root / "packed.jsonl", [10, 12, 14, 16, 3, 3, 4, 5])  # 4 rows of one long + one short
    return {False: plain, True: packed}


def test_accumulation_and_ranks_equal_one_big_batch(tmp_path, tiny_llama, datasets, capsys):
    from sft.train import main

    initial = load_file(tiny_llama / "model.safetensors")
    cache = tmp_path / "cache"
    results, runs_for_ranks = {}, []
    for packing in (False, True):
        for batch, accumulation in ((4, 1), (1, 4)):
            out = tmp_path / f"p{int(packing)}-b{batch}-a{accumulation}"
            assert main(step_args(tiny_llama, datasets[packing], out, cache, packing, batch, accumulation)) == 0
            results[packing, batch, accumulation] = gradient(initial, out)
        summary = capsys.readouterr().out
        if packing:
            assert "8 conversations kept" in summary and "into 4 rows" in summary, summary  # every step sees all 4 rows
        runs_for_ranks.append(step_args(tiny_llama, datasets[packing], tmp_path / f"p{int(packing)}-ranks2", cache,
                                        packing, 1, 2) + ["--use_cpu", "true"])  # else accelerate: 1 rank

    # Two gloo ranks on CPU, each batch 1 x accumulation 2 (`--multi_gpu` starts two real processes on a CPU box).
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", "29533", str(script), json.dumps(runs_for_ranks)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "Training on 2 process(es)" in done.stdout, done.stdout

    report = []
    for packing in (False, True):
        big = results[packing, 4, 1]
        assert max(v.abs().max().item() for v in big.values()) > 1e-2  # a real step happened
        for name, other in (("batch 1 x accumulation 4", results[packing, 1, 4]),
                            ("2 ranks x batch 1 x accumulation 2", gradient(initial, tmp_path / f"p{int(packing)}-ranks2"))):
            diff = max_difference(big, other)
            report.append(f"packing={packing} {name}: max |grad difference| {diff:.2e}")
            assert diff <= TOLERANCE, report[-1]
    print("\n".join(report))
