"""The GPU bench's CPU-checkable parts: FLOP accounting, the profiler arithmetic, the report, one real bench row
on the tiny model, and the bf16 full fine-tune plan's option checks and torchao fix."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import report  # noqa: E402
import train_throughput as bench  # noqa: E402


def test_matmul_params_is_the_model_minus_embeddings_and_norms():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = bench.MODELS["deepseek-llm-7b"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape))
    total = sum(p.numel() for p in model.parameters())
    embeddings = model.get_input_embeddings().weight.numel()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert total == 6_910_365_696  # deepseek-llm-7b's published size (6.9B)
    assert bench.matmul_params(shape) == total - embeddings - norms


def test_union_counts_overlapping_intervals_once():
    assert bench.union([]) == 0
    assert bench.union([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert bench.union([(3, 4), (0, 10)]) == 10


def test_report_gives_ratios_against_the_best_peer_row(tmp_path, capsys):
    rows = [dict(run_id="r", name=n, date="d", commit="c", gpu="g", n_gpus=2, mem_cap_gib=24, model="m",
                 method=m, strategy=s, peer=p, seq_len=2048, micro_batch=1, grad_accum=1, real_tok_s=t, mfu=0.1,
                 peak_mem_gib=20, host_ram_gib=30) for n, m, s, p, t in
            [("peer-mb1", "full", "zero3_offload", report.PEER, 1000.0),
             ("peer-mb2", "full", "zero3_offload", report.PEER, 2000.0),
             ("ours", "full", "fsdp", "ours", 7000.0)]]
    rows.append({**rows[0], "run_id": "other", "real_tok_s": 10.0})
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main(["--run_id", "r", "--results", str(path)]) == 0
    out = capsys.readouterr().out
    assert "x best peer (peer-mb2)" in out
    assert "| ours | full | fsdp | ours | 2 | 1 x 1 | 7,000 | 3.50 |" in out
    assert "other" not in out and "| 10 |" not in out


@pytest.mark.slow
def test_one_bench_row_on_cpu_appends_the_issue_fields(tmp_path):
    results, out = tmp_path / "results.jsonl", tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "train_throughput.py"), "--run_id", "t", "--name", "tiny-lora",
         "--model", "tiny", "--method", "lora", "--strategy", "single", "--n_gpus", "1", "--seq_len", "256",
         "--micro_batch", "2", "--warmup", "1", "--steps", "2", "--repeat_data", "1", "--results", str(results),
         "--out", str(out), "--data", str(REPO / "data" / "alpaca_demo.json"),
         "--tokenizer", str(_tiny_tokenizer())],
        cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads(results.read_text().splitlines()[-1])
    for field in ("run_id", "date", "commit", "gpu", "n_gpus", "mem_cap_gib", "model", "method", "strategy", "peer",
                  "seq_len", "micro_batch", "grad_accum", "real_tok_s", "mfu", "peak_mem_gib", "host_ram_gib"):
        assert field in row, field
    assert "scaling" not in row  # one GPU
    assert row["measured_steps"] == 2 and row["real_tok_s"] > 0 and row["host_ram_gib"] > 0
    assert row["tokens_per_step"] > 0.5 * 2 * 256  # packed rows are mostly real tokens


def test_tensor_parallel_rows_load_real_weights_with_tp_size(tmp_path):
    """TP rows cannot use the random-init stand-in (transformers shards a TP model while reading its files): the
    row's model directory holds random weights that sft's real loader reads, and sft gets --tp_size N."""
    from sft.config import ModelArguments, LoraArguments
    from sft.model import load_model

    args = bench.parse(["--run_id", "t", "--name", "tp", "--model", "tiny", "--strategy", "tp", "--n_gpus", "2",
                        "--method", "full", "--out", str(tmp_path), "--tokenizer", str(_tiny_tokenizer())])
    train = bench.worker_train_args(args, cpu=True)
    assert train[train.index("--tp_size") + 1] == "2"
    path = Path(train[train.index("--model") + 1])
    assert path.name == "tiny-weights" and any(path.glob("model*.safetensors"))
    model = load_model(ModelArguments(model=str(path)), LoraArguments())  # the real path (no TP on CPU)
    assert model.config.hidden_size == bench.MODELS["tiny"]["hidden_size"]
    assert bench.launch_flags("tp", 2, None, 1234, cpu=False)[1].endswith("accelerate_configs/tp.yaml")
    plain = bench.parse(["--run_id", "t", "--name", "x", "--model", "tiny", "--out", str(tmp_path),
                         "--tokenizer", str(_tiny_tokenizer())])
    assert "--tp_size" not in bench.worker_train_args(plain, cpu=True)
    assert not any(Path(bench.model_dir(plain)).glob("*.safetensors"))  # other rows: config only


def _tiny_tokenizer() -> Path:
    from sft.tiny import ensure_tiny_model

    return ensure_tiny_model()


def _parse(*extra: str):
    from sft.config import parse_args

    return parse_args(["--dataset", str(REPO / "data" / "alpaca_demo.json"), "--output_dir", "/tmp/sft-bench-test",
                       *extra])


def test_full_fine_tune_in_bf16_needs_a_stochastic_rounding_optimizer():
    from sft.config import ConfigError

    with pytest.raises(ConfigError, match="plain bf16 AdamW"):
        _parse("--dtype", "bfloat16")
    with pytest.raises(ConfigError, match="plain bf16 AdamW"):
        _parse("--dtype", "bfloat16", "--optim", "adamw_torch_8bit")
    with pytest.raises(ConfigError, match="fp32 master weights"):
        _parse("--dtype", "float16")
    _parse("--dtype", "bfloat16", "--lora", "true")  # LoRA: a bf16 frozen base is fine
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(ConfigError, match="needs torchao"):
            _parse("--dtype", "bfloat16", "--optim", "adamw_torch_8bit", "--optim_args", "bf16_stochastic_round=True")
    else:
        _parse("--dtype", "bfloat16", "--optim", "adamw_torch_8bit", "--optim_args", "bf16_stochastic_round=True")


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed (optional: "
                                                                          "the bf16 full fine-tune plan)")
def test_torchao_states_get_a_float32_appearance_and_still_update_bf16_weights():
    import torch
    from torchao.optim import AdamW8bit

    from sft.lowbit import patch_torchao_state_dtype

    patch_torchao_state_dtype()
    assert patch_torchao_state_dtype() == []  # idempotent
    p = torch.nn.Parameter(torch.randn(256, 256, dtype=torch.bfloat16))
    optimizer = AdamW8bit([p], lr=1e-2, bf16_stochastic_round=True)
    before = p.detach().clone()
    p.grad = torch.randn_like(p)
    optimizer.step()
    assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16 and (p != before).float().mean() > 0.5
