"""The GPU bench's CPU-checkable parts: FLOP accounting (dense and MoE), the profiler arithmetic, the report and
its ratios, the seams of sft/train.py it drives, the row table, the compile-cache and GPU-memory bookkeeping, one
end-to-end CPU run of ours and TRL's rows, and the bf16 full fine-tune plan's option checks and torchao fix."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ALPACA_SAMPLE, DEEPSEEK_TOKENIZER, needs_shared

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import report  # noqa: E402
import throughput  # noqa: E402
import train_throughput as bench  # noqa: E402


def _active_matmul_params(model, config) -> int:
    """Counted from the model itself: every matrix but the input embeddings, the routed experts at k of E."""
    embeddings = model.get_input_embeddings().weight
    total = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or p is embeddings:
            continue  # norms, biases; the embedding lookup is no matmul
        share = config.num_experts_per_tok / config.n_routed_experts if ".mlp.experts." in name else 1
        total += p.numel() * share
    return round(total)


def test_matmul_params_is_the_model_minus_embeddings_and_norms():
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(bench.model_config("deepseek-llm-7b"))
    total = sum(p.numel() for p in model.parameters())
    embeddings = model.get_input_embeddings().weight.numel()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert total == 6_910_365_696  # deepseek-llm-7b's published size (6.9B)
    assert bench.matmul_params(bench.MODELS["deepseek-llm-7b"]) == total - embeddings - norms


def test_moe_matmul_params_count_only_the_active_experts():
    """DeepSeek-V2-Lite (15.7B, of which 6 of 64 routed experts per token), and a V3-style shape with a low-rank q."""
    import torch
    from transformers import AutoModelForCausalLM

    config = bench.model_config("deepseek-v2-lite")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 15_706_484_224  # the published 15.7B
    active = bench.matmul_params(bench.MODELS["deepseek-v2-lite"])
    assert active == _active_matmul_params(model, config)

    v3 = dict(bench.MODELS["deepseek-v2-lite"], model_type="deepseek_v3", num_hidden_layers=3, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=96, first_k_dense_replace=2,
              vocab_size=1024)
    shape = dict(v3)
    from transformers import AutoConfig

    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert bench.matmul_params(v3) == _active_matmul_params(model, config)


def test_union_counts_overlapping_intervals_once():
    assert bench.union([]) == 0
    assert bench.union([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert bench.union([(3, 4), (0, 10)]) == 10


def _row(name, peer, tok_s, **extra):
    return {**dict(run_id="r", name=name, date="d", commit="c", gpu="g", n_gpus=2, mem_cap_gib=24, model="m",
                   method="full", strategy="fsdp", peer=peer, seq_len=2048, micro_batch=1, grad_accum=1,
                   real_tok_s=tok_s, mfu=0.1, peak_mem_gib=20, host_ram_gib=30), **extra}


def test_report_gives_ratios_against_the_best_peer_row_and_the_vs_row(tmp_path, capsys):
    rows = [_row("peer-mb1", report.PEER, 1000.0), _row("peer-mb2", report.PEER, 2000.0),
            _row("ours", "ours", 7000.0, vs="trl-x", cold_cache=True), _row("trl-x", "trl", 5000.0, mfu=0.08),
            _row("ours-alone", "ours", 10.0, vs="trl-not-run")]
    rows.append({**rows[0], "run_id": "other", "real_tok_s": 10.0})
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main(["--run_id", "r", "--results", str(path)]) == 0
    out = capsys.readouterr().out
    assert "x best peer (peer-mb2)" in out
    assert "| ours | full | fsdp | ours | 2 | 1 x 1 | 7,000 | 3.50 |" in out
    assert "| 1.40 (trl-x) | True |" in out
    assert "other" not in out
    assert report.ratios(rows[:5]) == ["ours / trl-x: 1.40x (7,000 vs 5,000 real tok/s, MFU 10.0% vs 8.0%)"]
    steady = [{**rows[2], "steady_tok_s": 7600.0}, {**rows[3], "steady_tok_s": 5000.0}]
    assert report.ratios(steady) == ["ours / trl-x: 1.40x (7,000 vs 5,000 real tok/s, MFU 10.0% vs 8.0%); "
                                     "at the median step 1.52x"]


def test_the_seams_of_sft_train_build_the_model_add_callbacks_and_skip_the_save(tmp_path, capsys):
    """The bench's way in: a model factory (random weights from a config-only directory), an extra callback, no
    final save; sft.train's and sft.model.loading's own names stay as they are."""
    import sft.model.loading
    import sft.train
    from transformers import TrainerCallback

    original = sft.model.loading.AutoModelForCausalLM.from_pretrained
    model = bench.model_dir(bench.parser().parse_args(
        ["--run_id", "t", "--name", "seam", "--model", "tiny", "--out", str(tmp_path), "--data", "-",
         "--tokenizer", str(_tiny_tokenizer())]))
    assert not any(model.glob("*.safetensors"))  # nothing to load: only the factory can build it
    calls = []

    def factory(path, **kwargs):
        calls.append((path, kwargs["dtype"]))
        return bench.random_init(path, **kwargs)

    class Steps(TrainerCallback):
        seen: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.append(state.global_step)

    out = tmp_path / "out"
    code = sft.train.main(["--model", str(model), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
                           "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "2",
                           "--max_length", "128", "--report_to", "none", "--save_strategy", "no", "--lora", "true",
                           "--dataset_cache_dir", str(tmp_path / "cache")],
                          callbacks=[Steps()], model_factory=factory, save=False)
    assert code == 0, capsys.readouterr().err[-2000:]
    assert calls and calls[0][0] == str(model) and str(calls[0][1]) == "torch.float32"  # LoRA on CPU: fp32 base
    assert Steps.seen == [1, 2]
    assert not any(out.glob("*.safetensors")) and "Saved" not in capsys.readouterr().out
    assert sft.model.loading.AutoModelForCausalLM.from_pretrained == original


def test_monitor_quotes_the_gpus_the_ranks_ran_on_not_the_first_n(monkeypatch):
    """CUDA_VISIBLE_DEVICES=2 makes the machine's third GPU a rank's cuda:0: its UUID says which one it is."""
    monitor = bench.Monitor(pid=1)
    monitor.gpu_peak = {"GPU-a": 80 * bench.GIB, "GPU-b": 5 * bench.GIB, "GPU-c": 23.5 * bench.GIB}
    monitor.index = {"GPU-a": 0, "GPU-b": 1, "GPU-c": 2}
    assert monitor.used_gpus([{"rank": 0, "gpu_uuid": "GPU-c"}]) == ([2], 23.5)
    assert monitor.used_gpus([{"rank": 0, "gpu_uuid": "GPU-c"}, {"rank": 1, "gpu_uuid": "GPU-b"}]) == ([1, 2], 23.5)
    assert monitor.used_gpus([{"rank": 0}]) == ([], None)  # a CPU row


def test_cold_cache_is_an_empty_inductor_and_triton_cache(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    dirs = bench.compile_cache_dirs(env)
    assert dirs == [tmp_path / "inductor", tmp_path / "triton"]
    assert bench.caches_empty(dirs)  # not there yet
    (tmp_path / "triton" / "ab").mkdir(parents=True)
    assert bench.caches_empty(dirs)  # folders without a compiled file
    (tmp_path / "triton" / "ab" / "kernel.cubin").write_bytes(b"x")
    assert not bench.caches_empty(dirs)
    assert bench.compile_cache_dirs({"TRITON_HOME": str(tmp_path)})[1] == tmp_path / ".triton" / "cache"


def test_row_selection_and_what_a_machine_cannot_run(monkeypatch, capsys):
    assert [r.name for r in throughput.select("h200, lora-1 smoke")] == [
        "lora-best", "trl-lora-best", "full-sr", "trl-full", "lora-1", "tiny-lora", "trl-tiny-lora", "tiny-full",
        "trl-tiny-full"]
    with pytest.raises(SystemExit) as stop:
        throughput.select("lora-fastest")
    assert stop.value.code == 2 and "error: --rows: no row or group named 'lora-fastest'" in capsys.readouterr().err
    rows = throughput.ROWS
    for row in rows.values():  # every ratio is against a TRL row of the table
        assert row.vs is None or rows[row.vs].peer == "trl", row.name
    assert throughput.needs(rows["trl-full"]) == ["trl", "liger_kernel"]
    assert throughput.needs(rows["full-sr"]) == ["liger_kernel", "torchao"]
    monkeypatch.setattr(throughput, "find_spec", lambda name: None)
    assert throughput.why_not(rows["trl-tiny-lora"], 0) == "not installed: trl"
    monkeypatch.setattr(throughput, "find_spec", lambda name: object())
    assert throughput.why_not(rows["lora-best"], 0) == "the deepseek-llm-7b shape needs a GPU"
    assert throughput.why_not(rows["fsdp-1.3b"], 1) == "needs 2 GPUs, 1 visible"
    assert throughput.why_not(rows["lora-ddp"], 1) is None  # every visible GPU, however many
    # TRL's best took 95 GiB on an H200: an 80 GB H100 skips it (run 20261205T1525Z-lora2x spent 241 s on its OOM)
    assert throughput.why_not(rows["trl-lora-best"], 1, 79.2) == \
        "took 95 GiB of GPU memory where it ran, this GPU has 79.2"
    assert throughput.why_not(rows["trl-lora-best"], 1, 139.8) is None
    assert throughput.why_not(rows["trl-lora-best-mb4"], 1, 79.2) is None  # its H100 twin


def test_the_expert_parallel_row_runs_beside_the_resident_plan_in_the_two_gpu_group():
    """Issue 26 item 2: V2-Lite with DeepSpeed AutoEP on 2 cards held to 24 GiB, the resident plan's micro-batch and
    options but its e4m3 experts, in the group the two-GPU issue runs; launched with the shipped autoep.yaml."""
    autoep, resident = throughput.ROWS["moe-lora-autoep-ddp"], throughput.ROWS["moe-lora-resident-ddp"]
    group = throughput.GROUPS["issue30"]
    assert autoep.name in group and resident.name in group and autoep.n_gpus == 2 and autoep.mem_cap_gib == 24
    assert (autoep.model, autoep.micro_batch, autoep.grad_accum) == (resident.model, resident.micro_batch,
                                                                     resident.grad_accum)
    assert [a for a in resident.args if a not in autoep.args] == ["--quantize_experts", "fp8", *throughput.NO_UNUSED]
    assert throughput.needs(autoep) == ["deepspeed"]
    flags = bench.launch_flags("autoep", 2, None, 29500, cpu=False)
    assert flags[:4] == ["--config_file", str(REPO / "accelerate_configs" / "autoep.yaml"), "--num_processes", "2"]
    assert (REPO / "accelerate_configs" / "autoep.yaml").is_file()


def test_the_32k_row_runs_again_with_the_fast_paths_the_planner_and_the_recipe_leave_on(tmp_path):
    """Issue 27: long-r1-32k as users run it, --fp8 and --compile_layers at auto on one card (the bench's rows turn
    them off unless they name them), and the 32k recipe against the 4k one as users run them (--config, the
    recipes' own fast paths), in the long-row group and in the next GPU session's."""
    from sft.options.recipe import load_recipe

    plain, default = throughput.ROWS["long-r1-32k"], throughput.ROWS["long-r1-32k-default"]
    assert default.args == (*plain.args, "--fp8", "auto", "--compile_layers", "auto")
    assert (default.model, default.seq_len, default.micro_batch, default.long_docs, default.mem_cap_gib) == \
        (plain.model, plain.seq_len, plain.micro_batch, plain.long_docs, plain.mem_cap_gib)
    long_recipe = dict(zip(*[iter(load_recipe(str(REPO / "recipes" / "r1-distill-qwen-7b-long.yaml")))] * 2))
    for option in ("--mlp_tile_tokens", "--offload_activations", "--use_liger_kernel"):
        assert default.args[default.args.index(option) + 1] == long_recipe[option], option
    # the recipe's attention since 2026-12-07 (varlen; flex_attention before, long-r1-32k-default's): its own row
    varlen = throughput.ROWS["long-r1-32k-varlen-default"].args
    assert varlen[varlen.index("--attn_implementation") + 1] == long_recipe["--attn_implementation"]
    tokens_per_step = set()
    for name, recipe_file in (("long-r1-32k-recipe", "r1-distill-qwen-7b-long.yaml"),
                              ("long-r1-4k-recipe", "r1-distill-qwen-7b-lora.yaml")):
        row = throughput.ROWS[name]
        assert row.args == ("--config", str(REPO / "recipes" / recipe_file)) and row.long_docs
        recipe = dict(zip(*[iter(load_recipe(row.args[1]))] * 2))
        # the bench's own length, micro-batch and accumulation options are the recipe's values: its plan
        assert (row.seq_len, row.micro_batch, row.grad_accum) == (
            int(recipe["--max_length"]), int(recipe["--per_device_train_batch_size"]),
            int(recipe["--gradient_accumulation_steps"])), name
        tokens_per_step.add(row.seq_len * row.micro_batch * row.grad_accum)
        assert name in throughput.GROUPS["long"]
    assert tokens_per_step == {65536}
    # a recipe row keeps the recipe's fast paths: the bench's "off unless named" would override them
    args = bench.parser().parse_args(["--run_id", "t", "--model", "tiny", "--out", str(tmp_path), "--data", "d.json",
                                      "--tokenizer", "tok", "--name", "x"])
    assert "--fp8" in bench.worker_train_args(args, tmp_path, cpu=True)
    assert "--fp8" not in bench.worker_train_args(args, tmp_path, cpu=True, recipe=True)


def test_a_row_becomes_the_one_row_command_with_its_optimizer(tmp_path):
    args = throughput.parse(["--run_id", "r", "--out", str(tmp_path), "--mem_cap_gib", "22", "--fresh_cache"])
    row = throughput.ROWS["full-sr"]
    flags = throughput.row_flags(row, args, 1, Path("d.json"), Path("tok"), 120.5)
    one = bench.parser().parse_args(flags)
    assert (one.name, one.method, one.precision, one.mem_cap_gib, one.vs, one.timeout) == (
        "full-sr", "full", "none", 22.0, "trl-full", 120)
    assert one.fresh_cache and one.micro_batch == 4 and one.peer == "ours"
    assert row.optim[:2] == ("--optim", "adamw_torch_8bit")  # a row argument: another optimizer is another row
    assert one.profile_steps == row.profile_steps == 1
    # --profile_steps: every row's profiled steps (steady steps after the first, which follows a synchronize)
    args = throughput.parse(["--run_id", "r", "--out", str(tmp_path), "--profile_steps", "3"])
    flags = throughput.row_flags(row, args, 1, Path("d.json"), Path("tok"), 60)
    assert bench.parser().parse_args(flags).profile_steps == 3


def test_data_comes_from_shared_else_the_prepared_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(throughput, "SHARED_DATA", tmp_path / "none.json")
    monkeypatch.setattr(throughput, "SHARED_TOKENIZER", tmp_path / "none")
    args = throughput.parse(["--data_dir", str(tmp_path / "prepared")])
    with pytest.raises(SystemExit):
        throughput.resolve_data(args)
    assert "error: no bench data" in capsys.readouterr().err
    (tmp_path / "prepared" / "tokenizer").mkdir(parents=True)
    (tmp_path / "prepared" / "alpaca_sample.json").write_text("[]")
    (tmp_path / "prepared" / "tokenizer" / "tokenizer.json").write_text("{}")
    assert throughput.resolve_data(args) == (tmp_path / "prepared" / "alpaca_sample.json",
                                             tmp_path / "prepared" / "tokenizer")


@needs_shared
def test_prepare_copies_the_data_and_tokenizer_and_prints_the_gpu_command(tmp_path, capsys):
    assert throughput.main(["--prepare", str(tmp_path / "carry")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "carry" / "alpaca_sample.json").read_bytes() == ALPACA_SAMPLE.read_bytes()
    assert (tmp_path / "carry" / "tokenizer" / "tokenizer.json").is_file()
    assert f"--data_dir {tmp_path / 'carry'}" in out and "bench/throughput.py --rows h200" in out


@pytest.mark.slow
@needs_shared
@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="trl is not installed (the `bench` extra; CI does not install it)")
def test_cpu_smoke_runs_ours_and_trl_end_to_end(tmp_path):
    results = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "throughput.py"), "--rows", "tiny-lora,trl-tiny-lora", "--run_id", "t",
         "--results", str(results), "--out", str(tmp_path / "out"), "--data", str(ALPACA_SAMPLE),
         "--tokenizer", str(DEEPSEEK_TOKENIZER)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert [rows[n]["peer"] for n in ("tiny-lora", "trl-tiny-lora")] == ["ours", "trl"]
    for row in rows.values():
        for field in ("run_id", "date", "commit", "gpu", "n_gpus", "mem_cap_gib", "model", "method", "strategy",
                      "seq_len", "micro_batch", "grad_accum", "real_tok_s", "mfu", "peak_mem_gib", "host_ram_gib",
                      "cold_cache", "nvidia_smi_mem_gib"):
            assert field in row, field
        assert row["measured_steps"] == 2 and row["real_tok_s"] > 0 and row["host_ram_gib"] > 0
        assert row["tokens_per_step"] > 0.5 * 2 * 256  # packed rows are mostly real tokens, on both sides
        assert row["loss_first_last"][0] > 5  # a random model on a 32k vocabulary
        assert 0 < row["first_step_s"] < 600  # the first step's wait (compile and first batch) is in the row
        assert (row["fp8_layers"], row["compiled_layers"]) == (0, 0)  # neither on a CPU, nor in TRL
        assert row["steady_tok_s"] > 0
    assert "tiny-lora / trl-tiny-lora: " in proc.stdout


@pytest.mark.slow
@needs_shared
def test_qlora_check_cpu_smoke_writes_its_row_and_checks_the_adapter(tmp_path):
    """bench/qlora_check.py's plumbing (train, row, adapter reload and merge) on a CPU: its GPU run must not fail
    on the script itself (a row field it lacked once lost the DDP+QLoRA row of a GPU call)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "qlora_check.py"), "--cpu_smoke", "--workdir", str(tmp_path / "w"),
         "--out", str(tmp_path / "out"), "--data", str(ALPACA_SAMPLE), "--tokenizer", str(DEEPSEEK_TOKENIZER)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "w" / "results.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["tiny-lora-1"] and rows[0]["real_tok_s"] > 0
    assert "0 failed" in proc.stdout


def test_tensor_parallel_rows_load_real_weights_with_tp_size(tmp_path):
    """TP rows cannot use the random-init factory (transformers shards a TP model while reading its files): the
    row's model directory holds random weights that sft's real loader reads, and sft gets --tp_size N."""
    from sft.options.arguments import ModelArguments, LoraArguments
    from sft.model.loading import load_model

    common = ["--run_id", "t", "--model", "tiny", "--out", str(tmp_path), "--data", "d.json",
              "--tokenizer", str(_tiny_tokenizer())]
    args = bench.parser().parse_args([*common, "--name", "tp", "--strategy", "tp", "--n_gpus", "2",
                                      "--method", "full"])
    path = bench.model_dir(args)
    train = bench.worker_train_args(args, path, cpu=True)
    assert train[train.index("--tp_size") + 1] == "2"
    assert path.name == "tiny-weights" and any(path.glob("model*.safetensors"))
    model = load_model(ModelArguments(model=str(path)), LoraArguments())  # the real path (no TP on CPU)
    assert model.config.hidden_size == bench.MODELS["tiny"]["hidden_size"]
    assert bench.launch_flags("tp", 2, None, 1234, cpu=False)[1].endswith("accelerate_configs/tp.yaml")
    plain = bench.parser().parse_args([*common, "--name", "x"])
    assert "--tp_size" not in bench.worker_train_args(plain, bench.model_dir(plain), cpu=True)
    assert not any(Path(bench.model_dir(plain)).glob("*.safetensors"))  # other rows: config only


def _tiny_tokenizer() -> Path:
    from sft.model.tiny import ensure_tiny_model

    return ensure_tiny_model()


def _parse(*extra: str):
    from sft.options.arguments import parse_args

    return parse_args(["--dataset", str(REPO / "data" / "alpaca_demo.json"), "--output_dir", "/tmp/sft-bench-test",
                       *extra])


def test_full_fine_tune_in_bf16_needs_a_stochastic_rounding_optimizer():
    from sft.options.arguments import ConfigError

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

    from sft.speed.lowbit import patch_torchao_state_dtype

    patch_torchao_state_dtype()
    assert patch_torchao_state_dtype() == []  # idempotent
    p = torch.nn.Parameter(torch.randn(256, 256, dtype=torch.bfloat16))
    optimizer = AdamW8bit([p], lr=1e-2, bf16_stochastic_round=True)
    before = p.detach().clone()
    p.grad = torch.randn_like(p)
    optimizer.step()
    assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16 and (p != before).float().mean() > 0.5


def test_moe_rows_carry_the_routers_numbers_of_the_last_step_that_logged_them(tmp_path):
    import train_throughput

    log = tmp_path / "trainer_log.jsonl"
    log.write_text('{"step": 1, "loss": 9.0, "moe/idle_experts": 3}\n{"step": 2, "moe/idle_experts": 1, '
                   '"moe/load_imbalance_max": 2.5}\n{"step": 2, "train_runtime": 5.0}\n')
    assert train_throughput.expert_load(log) == {"moe/idle_experts": 1, "moe/load_imbalance_max": 2.5}
    assert train_throughput.expert_load(tmp_path / "missing.jsonl") is None


def test_kernel_table_adds_up_kernels_whose_cut_names_agree():
    """Templated kernel names share their first 80 characters: their times add up under the cut name (a dict
    comprehension would keep only the last one, as the first version of this table did)."""
    from train_throughput import top_kernel_ms

    long = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    table = top_kernel_ms({long + "A": 30_000.0, long + "B": 5_000.0, "gemm": 20_000.0, "small": 1.0}, 2)
    assert table == {long[:80]: 35.0, "gemm": 20.0}


RUN_ID = r"\d{8}T\d{4}Z[-\w]*"
EARLIER = re.compile(rf"({RUN_ID}): ([\d,]+) against ([\d,]+), (\d+\.\d+)x")


def _section_table(markdown: str, heading: str) -> list[list[str]]:
    """The body rows (cells, stripped) of the first table under `heading`."""
    section = markdown.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def _tok_s(text: str) -> int:
    return int(text.replace(",", ""))


def _half_up(value: float) -> int:
    return math.floor(value + 0.5)


def test_the_readme_speed_table_quotes_rows_of_results_jsonl():
    """Every tok/s figure and ratio of the README's speed table is a row of bench/results.jsonl of the run the table
    names: ours (peer ours) against TRL's row of the same run (peer trl, the one ours names in `vs`), the same
    model, row length, method and rows per optimizer step, the ratio theirs, each with its cold_cache and
    nvidia-smi memory (a row said to be a cold first run has cold_cache true); and each run is in RESULTS.md's table
    of the docs' numbers, named for the README. TRL's row may split those rows otherwise (on an 80 GB H100 its best
    fits 4 x 2 where ours runs 8 x 1)."""
    rows = [json.loads(line) for line in (REPO / "bench" / "results.jsonl").read_text().splitlines() if line.strip()]
    docs_runs = [row for row in _section_table((REPO / "bench" / "RESULTS.md").read_text(),
                                               "## The docs' numbers and their runs") if "README.md" in row[1]]
    table = _section_table((REPO / "README.md").read_text(), "## Speed")
    assert len(table) >= 2
    for what, ours_cell, trl_cell, ratio_cell, run_cell in table:
        quotes = [(re.match(RUN_ID, run_cell).group(0), re.match(r"[\d,]+", ours_cell).group(0),
                   re.match(r"[\d,]+", trl_cell).group(0), re.fullmatch(r"(\d+\.\d+)x", ratio_cell).group(1))]
        quotes += EARLIER.findall(run_cell)
        row_text = " ".join((ours_cell, trl_cell, ratio_cell, run_cell))
        assert sorted(re.findall(r"\d{1,3}(?:,\d{3})+", row_text)) == sorted(n for q in quotes for n in q[1:3])
        assert sorted(re.findall(r"(\d+\.\d+)x", row_text)) == sorted(q[3] for q in quotes)  # no number unquoted
        method = "lora" if what.startswith("LoRA") else "full"
        micro_batch = int(re.search(r"micro-batch (\d+)", what).group(1))
        for run_id, ours_tok_s, trl_tok_s, ratio in quotes:
            of_run = [r for r in rows if r.get("run_id") == run_id and r.get("model") == "deepseek-llm-7b"
                      and r.get("seq_len") == 2048 and r.get("method") == method]
            ours = [r for r in of_run if r["peer"] == "ours" and r.get("micro_batch") == micro_batch
                    and _half_up(r["real_tok_s"]) == _tok_s(ours_tok_s)]
            trl = [r for r in of_run if r["peer"] == "trl" and _half_up(r["real_tok_s"]) == _tok_s(trl_tok_s)]
            assert len(ours) == 1 and len(trl) == 1, (run_id, ours_tok_s, trl_tok_s)
            rows_a_step = [r["micro_batch"] * r.get("grad_accum", 1) for r in ours + trl]
            assert rows_a_step[0] == rows_a_step[1], (run_id, rows_a_step)
            assert ours[0]["vs"] == trl[0]["name"]
            assert f"{ours[0]['real_tok_s'] / trl[0]['real_tok_s']:.2f}" == ratio
            for row in ours + trl:
                assert "cold_cache" in row and row["nvidia_smi_mem_gib"] > 0, row["name"]
                assert row["cold_cache"] or "cold" not in what, row["name"]
            assert any(run_id in runs for _, _, runs in docs_runs), f"{run_id} not in RESULTS.md's docs table"


def test_the_fsdp_qlora_checks_run_in_their_gpu_sessions(tmp_path, monkeypatch):
    """Issue 26 item 4: `bench/gpu_session.sh RUN BUDGET --rows issue30` runs bench/qlora_check.py --fsdp two (the
    check that lifts the FSDP QLoRA refusal) on its two GPUs, and group `qlora-bytes` the one-GPU byte check,
    bench/fsdp_qlora_bytes.py: each a script of its group, its command what that script's own parser reads."""
    import fsdp_qlora_bytes
    import qlora_check

    check, byte_check = throughput.SCRIPTS["fsdp-qlora-check"], throughput.SCRIPTS["fsdp-qlora-bytes"]
    assert check in throughput.select("issue30") and byte_check in throughput.select("qlora-bytes")
    assert throughput.select("fsdp-qlora-check") == [check]
    fields = dict(run_id="R", results=str(tmp_path / "results.jsonl"), out=str(tmp_path / "bench"), data="d.json",
                  tokenizer="tok")
    command = check.command(**fields)
    assert command[:2] == [sys.executable, "bench/qlora_check.py"] and (REPO / command[1]).is_file()
    args = qlora_check.parser().parse_args(command[2:])
    assert (args.run_id, args.fsdp, args.skip_single, str(args.results)) == ("R", "two", True, fields["results"])
    assert str(args.workdir).startswith(fields["out"]) and str(args.data) == "d.json"
    command = byte_check.command(**fields)
    assert command[1] == "bench/fsdp_qlora_bytes.py" and (REPO / command[1]).is_file()
    args = fsdp_qlora_bytes.parser().parse_args(command[2:])
    assert (args.run_id, str(args.results), args.worker) == ("R", fields["results"], False)
    monkeypatch.setattr(throughput, "find_spec", lambda name: object())  # no bitsandbytes asked: the FSDP run's own
    assert throughput.why_not(check, 1) == "needs 2 GPUs, 1 visible" and throughput.why_not(check, 2) is None
    assert throughput.why_not(byte_check, 0) == "needs a GPU" and throughput.why_not(byte_check, 1) is None
    assert check.needs == byte_check.needs == ("torchao",)


def test_a_group_script_says_its_pass_and_fail_lines_and_is_stopped_at_its_time(tmp_path, capsys):
    code = "print('PASS a: fine'); print('noise'); print('FAIL b: broken'); raise SystemExit(1)"
    script = throughput.Script("probe", ("-c", code))
    assert not throughput.run_script(script, script.command(), tmp_path, timeout=60)
    out = capsys.readouterr().out
    assert "[throughput] probe: PASS a: fine" in out and "[throughput] probe: FAIL b: broken" in out
    assert "probe: noise" not in out and "[throughput] probe: exit 1 after" in out  # only its PASS/FAIL lines
    assert (tmp_path / "probe.log").read_text().splitlines()[1] == "noise"
    sleeper = throughput.Script("sleeper", ("-c", "import time; print('PASS started', flush=True); time.sleep(60)"))
    assert not throughput.run_script(sleeper, sleeper.command(), tmp_path, timeout=3)
    assert "[throughput] sleeper: exit timeout after" in capsys.readouterr().out


@pytest.mark.slow
def test_qlora_check_reloads_an_fsdp_adapter_on_the_nf4_base_it_trained_on(tmp_path):
    """bench/qlora_check.py's adapter checks of its FSDP run, on a CPU: the adapter trained on the NF4 base (laid out
    for 2 ranks) reloads with plain peft on that NF4 base, on the unquantized base, and merges; no bitsandbytes."""
    import torch
    from transformers import AutoConfig

    import qlora_check
    from conftest import save_tiny_model
    from gpu_strategy_checks import RESULTS
    from sft.model.loading import attach_lora
    from sft.model.nf4_loading import load_nf4_model
    from sft.options.arguments import LoraArguments

    base = save_tiny_model(tmp_path / "base", "llama")
    model = load_nf4_model(str(base), AutoConfig.from_pretrained(base), torch.float32, 2)
    torch.manual_seed(0)
    model = attach_lora(model, LoraArguments(lora=True, lora_r=4, lora_dropout=0.0), False)
    for name, p in model.named_parameters():  # B != 0: the adapter changes the logits
        if "lora_B" in name:
            p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(tmp_path / "adapter")
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": "Say hello", "input": "", "output": "Hello there, friend."}] * 2))
    args = qlora_check.parser().parse_args(["--data", str(data), "--tokenizer", str(base), "--workdir",
                                            str(tmp_path / "w")])
    RESULTS.clear()
    found = qlora_check.adapter_checks(args, "nf4", tmp_path / "adapter", base, quantized=True, nf4_shards=2)
    checks = {r["check"]: r["ok"] for r in RESULTS}
    assert checks == {"nf4/reload_4bit_base": True, "nf4/reload_unquantized_base": True, "nf4/merge": True,
                      "nf4/merged_equals_adapter_on_unquantized_base": True}, RESULTS
    assert 0 < found["unquantized_vs_4bit_rel"] < found["adapter_effect_rel"], found


def test_the_row_records_the_fast_paths_its_model_held():
    """fp8_layers and compiled_layers are read off the model (sft/plan/rows.py fast_of_row plans a row by them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from sft.speed.fp8 import use_fp8_base
    from sft.speed.regional_compile import compile_decoder_layers

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2)).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert bench.fast_paths_ran(model) == {"fp8_layers": 0, "compiled_layers": 0}
    converted, _ = use_fp8_base(model)
    assert compile_decoder_layers(model) == 2
    assert bench.fast_paths_ran(model) == {"fp8_layers": converted, "compiled_layers": 2} and converted == 14


def test_the_steady_rate_leaves_a_one_off_slow_step_out():
    """Run 20261205T1525Z-lora2x's lora-best-default: one step of six took 0.89 s against 0.60-0.63 (its batch's
    labelled-token count a multiple of 16, a new specialization of Liger's loss kernel to compile)."""
    steps = [0.624, 0.618, 0.623, 0.893, 0.595, 0.634]
    mean = sum(steps) / len(steps)
    tokens = 16233
    steady = bench.steady_tok_s(steps, tokens / mean, mean)
    assert steady == pytest.approx(tokens / 0.6235, rel=1e-3)  # the median of the six
    assert bench.steady_tok_s(steps[:3] + steps[4:], tokens / 0.6188, 0.6188) == pytest.approx(tokens / 0.623, rel=1e-3)
    assert bench.steady_tok_s(None, 1000.0, None) is None and bench.steady_tok_s([], 1000.0, 1.0) is None


def test_a_named_rows_profiled_step_comes_back_as_a_gzipped_trace(tmp_path, monkeypatch):
    """BENCH_TRACE_ROWS names the rows whose profiled step is exported (bench/gpu_session.sh sets the folder)."""
    import gzip

    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).add(1)
    monkeypatch.setenv("BENCH_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("BENCH_TRACE_ROWS", "a,b")
    bench.export_trace(prof, "c")
    assert list(tmp_path.iterdir()) == []
    bench.export_trace(prof, "b")
    assert [p.name for p in tmp_path.iterdir()] == ["b.trace.json.gz"]
    names = {event.get("name") for event in json.loads(gzip.open(tmp_path / "b.trace.json.gz").read())["traceEvents"]}
    assert "aten::add" in names


def test_trace_gaps_says_what_the_host_did_while_the_gpu_waited():
    """bench/trace_gaps.py on a made-up trace: a kernel launched late (the host's own time) and one launched early
    behind a blocking copy."""
    import trace_gaps

    op = lambda name, ts, dur: {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    run = lambda name, ts, dur, c: {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                    "args": {"correlation": c}}
    kernel = lambda name, ts, dur, c: {"cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                       "args": {"correlation": c}}
    events = [kernel("a", 0, 100, 1), run("cudaLaunchKernel", 5, 2, 1),
              op("aten::mul", 400, 20, ), run("cudaLaunchKernel", 410, 2, 2), kernel("b", 420, 10, 2),
              run("cudaMemcpyAsync", 440, 1, 3), run("cudaStreamSynchronize", 441, 300, 4),
              kernel("c", 430, 10, 5), run("cudaLaunchKernel", 450, 2, 5), kernel("d", 900, 10, 6),
              run("cudaLaunchKernel", 445, 2, 6)]
    found = trace_gaps.gaps(events, 50)
    assert [(g["kernel"], g["gap_us"]) for g in found] == [("b", 320), ("d", 460)]
    assert found[0]["launched_after_us"] == 310 and found[0]["launched_by"] == "aten::mul"
    assert found[1]["blocking"] == ["cudaStreamSynchronize 300us"]


def test_trace_gaps_splits_the_profiled_steps_at_their_optimizer_steps():
    """--steps: a step ends where the kernels launched inside `Optimizer.step#...` end; its busy time is the union of
    its kernels, the rest idle; the host's lead at its first and last kernel."""
    import trace_gaps

    def launched(name: str, launch: float, start: float, dur: float, c: int) -> list[dict]:
        return [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch, "dur": 1, "args": {"correlation": c}},
                {"cat": "kernel", "name": name, "ts": start, "dur": dur, "args": {"correlation": c}}]

    step = lambda ts, dur: {"cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": ts, "dur": dur}  # noqa
    events = [*launched("fwd", 0, 10, 100, 1), *launched("adam", 50, 150, 20, 2), step(45, 10),
              *launched("fwd", 60, 170, 50, 3), *launched("bwd", 65, 200, 40, 4), *launched("adam", 70, 300, 10, 5),
              step(68, 5)]
    found = trace_gaps.steps(events)
    assert [(s["wall_us"], s["busy_us"], s["idle_us"], s["kernels"]) for s in found] == [
        (160, 120, 40, 2), (140, 80, 60, 3)]
    assert found[0]["lead_us"] == [10, 100] and found[1]["lead_us"] == [110, 230]
