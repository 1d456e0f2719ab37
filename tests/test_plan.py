"""The planner (sft/plan/planner.py) and the strategy table (sft/parallel/strategies.py): plans for a described 3 x 24 GB box,
a local config.json, predicted against every measured bench row, and the command line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from sft.plan import planner, snapshot
from sft.configs import RECIPES
from sft.machine import GIB, GPU_KINDS
from sft.names import RELEASES, hub_id
from sft.parallel.strategies import REPO
from sft.plan.bench_check import check_rows, check_table
from sft.plan.kernels import kernels
from sft.plan.long_rows import is_long, long_row_flops_per_token, tiled_mlp_flops_per_token
from sft.plan.memory import CALIBRATION, fast_path_bytes, fsdp_adapter_buffers, predict, whole_layer_activations
from sft.plan.plan_text import command, fast_paths_said, kernels_text
from sft.plan.planner import (NOT_PLANNED, loss_here, main, nothing_planned_line, options_of, planned_options,
                              prediction_line)
from sft.plan.plans import (AWAITED_CHECK, HEADROOM, MARGIN_GIB, Box, awaiting_plan, best_plan, enumerate_plans,
                            judged_plan,
                            ranked, recommended, safe, shown_gib, split_plan, with_loss)
from sft.plan.refit import fitted_numbers
from sft.plan.rows import RESULTS, measured_rows, option_value, row_shape, workload_of_row
from sft.plan.shapes import SHAPES, resolve_shape
from sft.plan.snapshot import fitted
from sft.plan.speed import mfu_reference, routed_expert_cost, tokens_per_second
from sft.plan.workload import Levers, Workload
from sft.parallel.strategies import STRATEGIES, Setup

BOX = Box(gpus=3, gpu_mem_gib=24)


def test_strategy_table_entries_point_at_real_files():
    assert set(STRATEGIES) == {"single_gpu", "ddp", "zero2", "fsdp", "zero3", "zero3_offload", "tp", "autoep"}
    for s in STRATEGIES.values():
        assert s.accelerate_path.is_file(), s.name
        assert s.deepspeed_path is None or s.deepspeed_path.is_file(), s.name
        assert s.checks and all(callable(c) for c in s.checks)
    assert not STRATEGIES["tp"].recommended


def test_state_bytes_full_fine_tune_fp32_masters():
    n = 1_000_000
    fsdp = STRATEGIES["fsdp"].state_bytes(n, n, Setup("full", "fp32_master"), world=2)
    assert fsdp.gpu == pytest.approx(16 * n / 2)  # fp32 weights + gradients + Adam, sharded
    offload = STRATEGIES["zero3_offload"].state_bytes(n, n, Setup("full", "fp32_master"), world=2)
    assert offload.gpu == 0 and offload.host > 0


def test_7b_lora_on_three_24gb_cards_ddp_with_checkpointing():
    shape = resolve_shape("deepseek-ai/deepseek-llm-7b-base")
    plans = enumerate_plans(shape, BOX, "lora", 2048)
    ddp_ckpt = {p.w.micro_batch: p for p in plans if p.w.strategy == "ddp" and p.w.checkpointing}
    assert all(ddp_ckpt[mb].fits for mb in (2, 4))
    best = best_plan(plans)
    assert best.w.strategy == "ddp" and best.w.checkpointing and best.w.micro_batch in (2, 4)
    cmd = command(best, "deepseek-ai/deepseek-llm-7b-base", BOX)
    assert cmd.startswith("accelerate launch -q --config_file accelerate_configs/ddp.yaml sft/train.py")
    assert "--lora" in cmd and "--activation_checkpointing" in cmd


def test_7b_full_fp32_masters_fits_only_with_offload():
    shape = resolve_shape("deepseek-llm-7b")
    plans = [p for p in enumerate_plans(shape, BOX, "full", 2048) if p.w.setup.precision == "fp32_master"]
    fitting = {p.w.strategy for p in plans if p.fits}
    assert fitting == {"zero3_offload"}
    why = next(p for p in plans if p.w.strategy == "fsdp").why_not
    assert "GiB per card" in why
    small_host = enumerate_plans(shape, Box(3, 24, host_ram_gib=64), "full", 2048)
    assert not any(p.fits for p in small_host if p.w.strategy == "zero3_offload")


def test_local_config_dir(tiny_llama):
    shape = resolve_shape(str(tiny_llama))
    assert shape.layers == 2 and shape.hidden == 64 and shape.checked == "config.json"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama))
    assert shape.params() == sum(p.numel() for p in model.parameters())
    best = best_plan(enumerate_plans(shape, BOX, "full", 256))
    assert best is not None and best.fits


def test_builtin_shapes_match_a_meta_model():
    """The built-in parameter counts agree with transformers' own models of those shapes (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("deepseek-coder-1.3b", "deepseek-v2-lite", "deepseek-r1-0528-qwen3-8b"):
        s = SHAPES[name]
        kw = dict(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                  num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                  tie_word_embeddings=s.tied, **({"head_dim": s.head_dim} if s.head_dim else {}))
        if s.moe:
            kw.update(kv_lora_rank=s.kv_lora_rank, q_lora_rank=s.q_lora_rank, qk_nope_head_dim=s.qk_nope,
                      qk_rope_head_dim=s.qk_rope, v_head_dim=s.v_head, n_routed_experts=s.routed_experts,
                      n_shared_experts=s.shared_experts, num_experts_per_tok=s.experts_per_token,
                      moe_intermediate_size=s.moe_intermediate, first_k_dense_replace=s.first_dense)
        config = AutoConfig.for_model(s.model_type, **kw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert s.params() == pytest.approx(sum(p.numel() for p in model.parameters()), rel=1e-3), name


def test_every_measured_row_within_10_percent():
    """Predicted against measured peak GPU memory for every bench row (so the table cannot rot)."""
    results = check_rows()
    assert len(results) >= 30
    for x in results:
        assert abs(x["err_reserved"]) <= 0.10, (x["name"], x["run_id"], x["pred_reserved"], x["reserved"])
        if x["err_smi"] is not None:
            assert abs(x["err_smi"]) <= 0.10, (x["name"], x["run_id"], x["pred_smi"], x["smi"])


def test_planned_options_leave_given_options_alone(tiny_llama):
    from sft.machine import Launch, Machine
    from sft.options.checks import Options
    from sft.options.resolve import with_planned

    m = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                host_ram_gib=128, launch=Launch(world_size=3, local_world_size=3, launched=True))
    model = SimpleNamespace(model="deepseek-llm-7b", dtype="auto", attn_implementation="sdpa")
    lora = SimpleNamespace(lora=True, qlora=False, lora_r=16, lora_dropout=0.05)
    data = SimpleNamespace(max_length=2048)
    training = SimpleNamespace(per_device_train_batch_size=1, activation_checkpointing=False,
                               use_liger_kernel=False)
    done, chosen = planned_options(model, lora, data, training, m, given={"attn_implementation"})
    assert chosen.w.strategy == "ddp"
    assert (model.attn_implementation, training.activation_checkpointing) == ("sdpa", False)  # the planner sets none
    with_planned(Options(model, data, lora, training), done)  # train.py's step after planning
    assert "attn_implementation" not in done and model.attn_implementation == "sdpa"
    assert training.activation_checkpointing is True and done["per_device_train_batch_size"] in (2, 4)
    assert lora.lora_dropout == 0.0


def test_plan_auto_is_applied_after_parsing_and_checked_like_the_users_options():
    """train.py's steps on a described 3 x 24 GB box: parse, plan, resolve, check; the plan is its own value."""
    from sft.machine import Launch, Machine
    from sft.train import final_options

    box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                  host_ram_gib=128, launch=Launch(world_size=3, local_world_size=3, launched=True),
                  packages=frozenset({"liger_kernel"}))
    data = str(REPO / "data" / "alpaca_demo.json")
    options, planned = final_options(["--model", "deepseek-llm-7b", "--dataset", data, "--output_dir",
                                      "/nonexistent/out", "--lora", "--lora_dropout", "0.1", "--plan", "auto"], box)
    assert planned.plan.w.strategy == "ddp" and "lora_dropout" not in planned.options  # given: the user's wins
    assert options.lora.lora_dropout == 0.1
    for name, value in planned.options.items():
        assert getattr(next(g for g in options.groups() if hasattr(g, name)), name) == value
    assert options.training.ddp_find_unused_parameters is False  # resolved after the plan, before the checks
    assert options.training.liger_loss_on_labels == bool(planned.options.get("use_liger_kernel"))  # the plan's Liger


def test_plan_auto_sizes_its_plan_with_the_loss_the_user_typed():
    """--use_liger_kernel false and --chunked_loss true/false are the user's: the plan is sized with them and sets
    neither. Before, a typed --chunked_loss true met the plan's Liger and the run was refused ("keep one of the
    two"), and --use_liger_kernel false --chunked_loss false ran micro-batch 4 sized for Liger's loss: predicted
    27.4 GiB with the whole logits, over a 24 GB card."""
    from sft.machine import Launch, Machine
    from sft.train import final_options

    box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                  gpu_capabilities=((8, 9),) * 3, host_ram_gib=128,
                  launch=Launch(world_size=3, local_world_size=3, launched=True),
                  packages=frozenset({"liger_kernel", "torchao"}))
    base = ["--model", "deepseek-llm-7b", "--dataset", str(REPO / "data" / "alpaca_demo.json"), "--output_dir",
            "/nonexistent/out", "--lora", "--plan", "auto"]
    _, liger = final_options(base, box)
    assert liger.options["use_liger_kernel"] is True and liger.plan.w.fused_loss
    options, chunked = final_options([*base, "--chunked_loss", "true"], box)
    assert chunked.options["use_liger_kernel"] is False and "chunked_loss" not in chunked.options
    assert options.model.chunked_loss_on and chunked.plan.w.chunked_loss and not chunked.plan.w.fused_loss
    # without Liger the run's --chunked_loss auto takes the loss in chunks: as lean as Liger's, the same micro-batch
    options, no_liger = final_options([*base, "--use_liger_kernel", "false"], box)
    assert "use_liger_kernel" not in no_liger.options and not options.training.use_liger_kernel
    assert options.model.chunked_loss_on and no_liger.plan.w.chunked_loss and not no_liger.plan.w.fused_loss
    assert no_liger.plan.w.micro_batch == liger.plan.w.micro_batch
    options, whole = final_options([*base, "--use_liger_kernel", "false", "--chunked_loss", "false"], box)
    assert not whole.plan.w.fused_loss and not whole.plan.w.chunked_loss  # the whole logits, counted
    assert whole.plan.w.micro_batch < liger.plan.w.micro_batch and whole.plan.roomy
    too_big = with_loss(liger.plan, Box(3, 23.99, 128), fused_loss=False, chunked_loss=False)  # the whole logits
    assert too_big.prediction.smi_gib > 24 and not too_big.fits
    # where Liger is not installed the plan takes the loss in torch chunks instead (as lean: Liger's micro-batch)
    options, bare = final_options(base, dataclasses.replace(box, packages=frozenset({"torchao"})))
    assert bare.options["use_liger_kernel"] is False and "chunked_loss" not in bare.options  # auto takes it
    assert options.model.chunked_loss_on and bare.plan.w.micro_batch == liger.plan.w.micro_batch
    # ... but not under ZeRO-3 for a full fine-tune, whose trained lm_head the run's loss in chunks refuses there
    zero3 = next(p for p in enumerate_plans(SHAPES["deepseek-llm-7b"], Box(3, 23.99, 128), "full")
                 if p.w.strategy == "zero3" and p.w.fused_loss)
    assert loss_here(zero3, (None, None), liger_installed=False) == (False, False)


def test_an_mla_plan_keeps_a_typed_chunked_loss_false():
    """An MLA model's plans take the loss in chunks (--chunked_loss auto's rule); a typed false is sized with the
    whole logits."""
    from sft.machine import Launch, Machine

    m = Machine(gpu_names=("NVIDIA H100 80GB HBM3",), gpu_memory_gib=(79.2,), bf16=True, host_ram_gib=128,
                gpu_capabilities=((9, 0),), launch=Launch(world_size=1, local_world_size=1, launched=True),
                packages=frozenset({"torch.nn.attention.varlen"}))
    model = SimpleNamespace(model="deepseek-v2-lite", dtype="auto", attn_implementation="sdpa", chunked_loss="false",
                            fp8="auto", compile_layers="auto")
    lora = SimpleNamespace(lora=True, qlora=False, lora_r=16, lora_dropout=0.0)
    training = SimpleNamespace(per_device_train_batch_size=4, activation_checkpointing=False, use_liger_kernel=False,
                               gradient_accumulation_steps=1)
    data = SimpleNamespace(max_length=2048)
    _, auto = planned_options(model, lora, data, training, m, given={"per_device_train_batch_size"})
    options, typed = planned_options(model, lora, data, training, m,
                                     given={"per_device_train_batch_size", "chunked_loss"})
    assert auto.w.chunked_loss and not typed.w.chunked_loss and "chunked_loss" not in options
    assert typed.prediction.reserved_gib > auto.prediction.reserved_gib


@pytest.mark.parametrize("packages, attention", [(frozenset({"torch.nn.attention.varlen"}), "varlen"),
                                                 (frozenset(), "sdpa")])
def test_an_mla_plan_takes_varlen_where_this_torch_has_it(packages, attention):
    """V2-Lite's plans run varlen (1.20-1.23x sdpa's step, bench/RESULTS.md); a torch without torch's varlen kernel
    (before 2.9) gets sdpa, the plan's other options as they were."""
    from sft.machine import Launch, Machine

    m = Machine(gpu_names=("NVIDIA GeForce RTX 4090",), gpu_memory_gib=(23.99,), bf16=True, host_ram_gib=128,
                launch=Launch(world_size=1, local_world_size=1, launched=True), packages=packages)
    model = SimpleNamespace(model="deepseek-v2-lite", dtype="auto", attn_implementation="sdpa",
                            quantize_experts="fp8")
    lora = SimpleNamespace(lora=True, qlora=False, lora_r=16, lora_dropout=0.0)
    training = SimpleNamespace(per_device_train_batch_size=1, activation_checkpointing=False, use_liger_kernel=False)
    done, chosen = planned_options(model, lora, SimpleNamespace(max_length=2048), training, m, given=set())
    assert chosen.w.resident and done["attn_implementation"] == attention and "use_liger_kernel" in done


def run_planner(*args: str, host_ram: str = "64") -> subprocess.CompletedProcess:
    """`python -m sft.plan.planner ...` on a machine of `host_ram` GiB (SFT_HOST_RAM_GIB: sft/machine.py reads it)."""
    env = {**os.environ, "SFT_HOST_RAM_GIB": host_ram}
    return subprocess.run([sys.executable, "-m", "sft.plan.planner", *args], capture_output=True, text=True, env=env)


def test_cli_help_is_one_screen_and_bad_options_one_line():
    run = run_planner
    out = run("--help")
    assert out.returncode == 0 and len(out.stdout.splitlines()) <= 40
    for bad in (["--bogus"], ["--model", "deepseek-llm-7b", "--gpus", "0"], ["--model", "no-such-model"],
                ["--model", "deepseek-llm-7b", "--lora", "--qlora"]):
        out = run(*bad)
        assert out.returncode == 2 and out.stderr.startswith("error:") and len(out.stderr.splitlines()) == 1, bad
    out = run("--modle", "deepseek-llm-7b", "--lroa")  # misspelt: the closest options, as train.py says them
    assert "did you mean --model (for --modle), --lora (for --lroa)?" in out.stderr, out.stderr
    out = run("--model", "deepseek-llm-7b", "--lora")
    assert out.returncode == 0 and "Recommended: accelerate launch" in out.stdout


def test_the_planner_imports_neither_torch_nor_transformers():
    """A plan is arithmetic on shapes and rows: `deepseek-sft plan` answers in a fraction of a second. Importing
    transformers' trainer_utils (torch, peft, ...) made every plan, --help and bad option take ~7 s of CPU."""
    code = ("import runpy, sys\nsys.argv = ['planner', '--model', 'deepseek-llm-7b', '--gpus', '3', '--lora']\n"
            "try:\n    runpy.run_module('sft.plan.planner', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\n")
    code += "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'peft', 'datasets'}))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "Recommended: accelerate launch" in out.stdout, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "[]", out.stdout.splitlines()[-1]


def test_plan_auto_through_the_command_line():
    """`--plan auto` is parsed, fills only what the user left out, and on a machine without GPUs sets nothing."""
    from sft.machine import machine
    from sft.options.arguments import parse_args
    from sft.train import final_options

    data = str(REPO / "data" / "alpaca_demo.json")
    options, planned = final_options(["--model", "m", "--dataset", data, "--plan", "auto"])
    assert planned == ({}, None)  # this CPU machine: nothing to plan
    assert not machine().cuda and not hasattr(options.training, "planned")  # the plan is its own value
    with pytest.raises(Exception, match="--plan 'sometimes'"):
        parse_args(["--model", "m", "--dataset", data, "--plan", "sometimes"])


def test_plan_auto_that_sets_nothing_says_why():
    """No GPU, or no plan that fits: one line on the first screen instead of silence."""
    from sft.machine import Machine

    cpu = Machine(gpu_names=(), gpu_memory_gib=(), bf16=False, host_ram_gib=32, host_ram_available_gib=30)
    assert "no CUDA GPU" in nothing_planned_line("deepseek-llm-7b", False, cpu)
    small = Machine(gpu_names=("NVIDIA GeForce GTX 1080",) * 3, gpu_memory_gib=(8.0,) * 3, bf16=False, host_ram_gib=16,
                    host_ram_available_gib=12)
    line = nothing_planned_line("deepseek-llm-7b", True, small)
    assert "no plan fits 3 x 8 GiB" in line and "python -m sft.plan.planner --model deepseek-llm-7b --gpus 3 --gpu_mem 8 --lora" in line


def test_host_ram_of_the_offload_and_resident_rows_within_10_percent():
    """Host RAM (RSS summed over the launch's processes) predicted against measured where the planner's estimate
    decides something: the offload plans, and the resident plans (--quantize_experts fp8: every process loads the
    base). The resident rows measured before the experts were quantized as they load held the whole bf16 base in
    host RAM (resident.LOADED_WHOLE): they are left out, not fitted to; each of them held more than the new loading
    is predicted to. Other rows are not checked (bench_check.host_checked says why)."""
    from sft.plan import resident

    rows = check_rows()
    checked = [x for x in rows if x["host_checked"]]
    assert len([x for x in checked if x["offload"]]) >= 3
    for x in checked:
        assert abs(x["err_host"]) <= 0.10, (x["name"], x["run_id"], x["pred_host"], x["host"])
    resident_rows = [x for x in rows if x["resident"]]
    assert resident_rows and all(x["host_checked"] or x["host_note"] for x in resident_rows)
    old = [x for x in resident_rows if not x["host_checked"]
           and (x["run_id"], x["name"]) not in resident.NOT_FROM_A_CHECKPOINT
           and "where the planner plans" not in x["host_note"]]  # a twin of another attention: not the plan's
    assert {(x["run_id"], x["name"]) for x in old} <= set(resident.LOADED_WHOLE)
    assert all(x["host"] > x["pred_host"] for x in old), [(x["name"], x["pred_host"], x["host"]) for x in old]


def test_the_resident_plans_count_each_process_loading_its_base():
    """A resident plan's host RAM is the per-process load (sft/plan/resident.py load_host_bytes: the rest of the base
    in bf16 and one MoE layer's fused gate_up_proj three times over; the e4m3 experts on the GPU) times the processes
    on the host, beside the planner's per-process overhead: V2-Lite's by hand."""
    from sft.plan import resident

    v2 = SHAPES["deepseek-v2-lite"]
    experts = 26 * 64 * 3 * 2048 * 1408  # MoE layers x routed experts x (gate, up, down) x hidden x moe_intermediate
    in_flight = 3 * 2 * 64 * 2 * 1408 * 2048
    assert resident.load_host_bytes(v2) == 2 * (v2.params() - experts) + in_flight
    assert resident.load_host_bytes(v2, experts_on_host=True) == \
        resident.load_host_bytes(v2) + experts + 4 * 26 * 64 * (2 * 1408 + 2048)
    assert 4 < resident.load_host_bytes(v2) / GIB < 5  # against 29 GiB for the whole bf16 base
    for gpus in (1, 2, 3):
        plans = [p for p in enumerate_plans(v2, Box(gpus, 24, host_ram_gib=512), "lora", 2048)
                 if p.w.resident]
        assert plans and max(p.w.world for p in plans) == gpus  # DDP: one process per GPU
        for p in plans:
            want = max(8 + 4 * p.w.world, 8 + p.w.world * resident.load_host_bytes(v2) / GIB)
            assert p.prediction.host_gib == pytest.approx(want), (gpus, p.w.strategy)


def test_deepseek_v2_lite_shape():
    """V2-Lite (MLA, 64 routed + 2 shared experts, 6 per token, layer 0 dense): 15.7B parameters, 2.4B active per
    token (the matmuls' parameters, lm_head included)."""
    s = resolve_shape("deepseek-ai/DeepSeek-V2-Lite-Chat")
    assert (s.hidden, s.layers, s.heads, s.kv_lora_rank, s.q_lora_rank, s.qk_nope, s.qk_rope, s.v_head) == \
        (2048, 27, 16, 512, None, 128, 64, 128)
    assert (s.routed_experts, s.shared_experts, s.experts_per_token, s.moe_intermediate, s.intermediate,
            s.first_dense, s.vocab) == (64, 2, 6, 1408, 10944, 1, 102400)
    assert round(s.params() / 1e8) == 157 and round(s.matmul_params() / 1e8) in (24, 25)
    assert s.routed_active_params() == 26 * 6 * 3 * 2048 * 1408


def test_deepseek_v2_lite_lora_count_is_what_training_attaches(tmp_path):
    """The planner's LoRA count is what training attaches (sft/model/families.py's targets, on a weightless copy)."""
    from transformers import DeepseekV2Config

    from sft.options.arguments import LoraArguments, ModelArguments
    from sft.parallel.distributed import count_parameters

    s = SHAPES["deepseek-v2-lite"]
    DeepseekV2Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                     moe_intermediate_size=s.moe_intermediate, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                     num_key_value_heads=s.kv_heads, n_shared_experts=s.shared_experts,
                     n_routed_experts=s.routed_experts, num_experts_per_tok=s.experts_per_token,
                     first_k_dense_replace=s.first_dense, kv_lora_rank=s.kv_lora_rank, q_lora_rank=s.q_lora_rank,
                     qk_nope_head_dim=s.qk_nope, qk_rope_head_dim=s.qk_rope, v_head_dim=s.v_head,
                     tie_word_embeddings=False).save_pretrained(tmp_path)
    total, trainable = count_parameters(ModelArguments(model=str(tmp_path)), LoraArguments(lora=True, lora_r=16))
    assert total == s.params() and trainable == s.lora_params(16)


@pytest.mark.parametrize("gpus, fitting", [
    (1, {"zero3_offload"}),                                  # 29 GiB of bf16 base: only with the weights in RAM
    (2, {"fsdp", "zero3", "zero3_offload", "autoep"}),       # the frozen base sharded (or offloaded), or its experts
    (3, {"fsdp", "zero3", "zero3_offload", "autoep"}),       # (AutoEP: on 2 of the 3 cards, 64 experts)
])
def test_deepseek_v2_lite_lora_on_24gb_cards(gpus, fitting):
    """Its bf16 base (the resident plans, experts in e4m3, are tested below)."""
    shape = SHAPES["deepseek-v2-lite"]
    plans = [p for p in enumerate_plans(shape, Box(gpus, 24, host_ram_gib=128), "lora", 2048)
             if not p.w.resident]
    assert {p.w.strategy for p in plans if p.fits} == fitting
    assert not any(p.fits for p in plans if p.w.strategy in ("ddp", "zero2", "single_gpu"))  # a whole base per card
    best = best_plan(plans)
    assert best.w.strategy in fitting and best.w.strategy != "autoep"  # its speed is not measured
    # tok/s on ACTIVE parameters (4 x 2.45B per token), the routed experts at their measured cost against dense
    cost, why = routed_expert_cost(shape)
    assert cost > 1 and "bench/moe_layer.py" in why and cost - 1 < 1  # 1.79 on the H200 (bench/RESULTS.md)
    mfu, _ = mfu_reference(best.w.strategy, "lora", best.w.checkpointing, model=shape.name)
    active = shape.matmul_params() + (cost - 1) * shape.routed_active_params()
    assert best.tok_s == pytest.approx(mfu * 165e12 * gpus / (4 * active))
    assert active < shape.params() / 4


def test_resident_plan_is_recommended_for_v2_lite_lora_on_one_24gb_card():
    """--quantize_experts fp8 (sft/plan/resident.py): the routed experts in e4m3 plus their row scales, the rest of the
    base in bf16, one MoE layer's experts dequantized at a time: V2-Lite's base on one 24 GB card, far faster than
    streaming it from host RAM (ZeRO-3 offload), so recommended where it fits."""
    shape = SHAPES["deepseek-v2-lite"]
    box = Box(1, 24, host_ram_gib=128)
    plans = enumerate_plans(shape, box, "lora", 2048)
    resident = [p for p in plans if p.w.resident]
    assert resident and all((p.w.strategy, p.w.checkpointing, p.w.chunked_loss) == ("single_gpu", True, True)
                            for p in resident)
    assert any(p.roomy for p in resident)
    best = best_plan(plans)
    offload = best_plan([p for p in plans if p.w.strategy == "zero3_offload"])
    assert best.w.resident and offload is not None and best.tok_s > 5 * offload.tok_s
    cmd = command(best, "deepseek-v2-lite", box)
    assert cmd.startswith("accelerate launch -q --config_file accelerate_configs/single_gpu.yaml sft/train.py")
    # its loss in chunks is the run's default for an MLA model (--chunked_loss auto): the command does not ask
    assert "--lora" in cmd and cmd.endswith("--quantize_experts fp8 --activation_checkpointing true")
    assert options_of(best)["quantize_experts"] == "fp8" and options_of(best)["activation_checkpointing"]
    assert "chunked_loss" not in options_of(best)
    # weights: the bf16 base less 1 byte a routed expert weight, plus 4 bytes a row; the transient: one layer's
    experts = 26 * 64 * 3 * 2048 * 1408
    bf16 = predict(shape, dataclasses.replace(best.w, resident=False)).parts["weights"]
    assert bf16 - best.prediction.parts["weights"] == pytest.approx(
        (experts - 4 * 26 * 64 * (2 * 1408 + 2048)) / GIB)
    assert best.prediction.parts["dequantized_experts"] == pytest.approx(
        CALIBRATION["dequantized_copies"] * 2 * experts / 26 / GIB)
    # DDP: one replica per card, never a sharded strategy
    three = enumerate_plans(shape, Box(3, 24, host_ram_gib=128), "lora", 2048)
    assert {p.w.strategy for p in three if p.w.resident} == {"single_gpu", "ddp"}
    assert (best_plan(three).w.strategy, best_plan(three).w.resident) == ("ddp", True)


def test_resident_plan_only_for_lora_of_routed_experts_with_checkpointing():
    v2, box = SHAPES["deepseek-v2-lite"], Box(2, 24, host_ram_gib=512)
    assert not any(p.w.resident for p in enumerate_plans(SHAPES["deepseek-llm-7b"], box, "lora", 2048))
    for method in ("full", "qlora"):
        assert not any(p.w.resident for p in enumerate_plans(v2, box, method, 2048)), method
    no_experts = dataclasses.replace(v2, routed_experts=0)
    assert not any(p.w.resident for p in enumerate_plans(no_experts, box, "lora", 2048))
    lora = enumerate_plans(v2, box, "lora", 2048)
    resident = [p for p in lora if p.w.resident]
    assert resident and all(p.w.checkpointing and p.w.strategy in ("single_gpu", "ddp") for p in resident)


def test_resident_row_is_predicted_within_the_memory_models_error():
    """moe-lora-resident-1 (one H200 held to 24 GiB, micro-batch 8): 23.3 GiB allocated, 24.68 by nvidia-smi; the
    same run held to 22.25 GiB ran out of memory at micro-batch 8."""
    rows = [x for x in check_rows() if x["run_id"] == "20261204T2105Z-resident"]
    assert len(rows) == 1 and rows[0]["resident"]
    x = rows[0]
    assert abs(x["pred_allocated"] / x["allocated"] - 1) <= HEADROOM and x["pred_allocated"] > 22.25
    assert abs(x["err_smi"]) <= 0.065 and abs(x["err_reserved"]) <= HEADROOM


def test_compiled_layers_of_a_resident_plan_are_fitted_on_its_eager_twin():
    """--compile_layers in the resident plan held less than its eager twin (moe-lora-resident-1-mb4-compile, run
    20261205T0515Z-next, against moe-lora-resident-1-mb4 of 0235Z: 19.96 against 20.82 GiB reserved), where a dense
    LoRA's compiled layers hold more: the resident kind has its own fit, counted in one MoE layer's dequantized
    experts, which the dense rows' share does not read; the row is predicted within the memory model's error."""
    results = {(x["name"], x["run_id"]): x for x in check_rows()}
    compiled = results[("moe-lora-resident-1-mb4-compile", "20261205T0515Z-next")]
    eager = results[("moe-lora-resident-1-mb4", "20261205T0235Z-next")]
    assert (compiled["fast"], compiled["resident"]) == ("compiled", True)
    assert abs(compiled["err_reserved"]) <= HEADROOM and abs(compiled["err_smi"]) <= 0.065
    moved = compiled["pred_reserved"] - eager["pred_reserved"]
    assert moved == pytest.approx(compiled["reserved"] - eager["reserved"], abs=0.01) and moved < 0
    table = fitted()["fast_path_memory"]
    share, why = table["resident"]["compiled"]
    assert share < 0 and "moe-lora-resident-1-mb4-compile" in why and "dequantized experts" in why
    assert "resident" not in table["lora"]["compiled"][1] and "fp8" not in table["resident"]
    # a resident plan with FP8 (no resident row ran with it) takes LoRA's share of its activations
    shape = SHAPES["deepseek-v2-lite"]
    w = Workload("single_gpu", Setup("lora"), 1, 4, 2048, True, fused_loss=False, chunked_loss=True,
                      resident=True)
    fp8 = dataclasses.replace(w, fp8=True)
    assert fast_path_bytes(shape, fp8) == pytest.approx(
        table["lora"]["fp8"][0] * whole_layer_activations(shape, fp8))
    assert fast_path_bytes(shape, dataclasses.replace(w, compiled=True)) == pytest.approx(
        share * 2 * 64 * 3 * 2048 * 1408)


def test_resident_speed_is_read_from_its_own_rows():
    """The resident rows speak for resident plans only (the dequantization is their own work), at today's speed
    (the eager dequantization's row is left out), counted so that the measured configuration predicts its tok/s."""
    shape = SHAPES["deepseek-v2-lite"]
    mfu, why = mfu_reference("single_gpu", "lora", True, model=shape.name, resident_experts=True)
    assert "moe-lora-resident-1" in why and "--quantize_experts fp8" in why
    assert (mfu, why) == mfu_reference("single_gpu", "lora", True, RESULTS, shape.name,
                                            resident_experts=True)
    _, plain = mfu_reference("single_gpu", "lora", True, model=shape.name)
    assert "resident" not in plain
    # the median of the eager rows at today's speed predicts each measured configuration within 8% (2040Z's 10,694
    # had the eager dequantization): one MFU per kind of plan, and micro-batches 4 to 8 moved it by 7% either way;
    # the compiled layers' row of the planned attention (varlen) predicts itself (runs 20261204T2105Z-resident,
    # 20261205T0235Z-next, 0515Z-next; 20261206T0903Z-resident-varlen-h100, whose sdpa twin ran 17,407)
    for micro_batch, compiled, measured in ((8, False, 12273), (4, False, 11386), (6, False, 13182),
                                            (4, True, 21386)):
        w = Workload("single_gpu", Setup("lora"), 1, micro_batch, 2048, True, fused_loss=False,
                          chunked_loss=True, resident=True, compiled=compiled)
        tok_s, _ = tokens_per_second(shape, w, GPU_KINDS["H200"].peak_flops)
        assert tok_s == pytest.approx(measured, rel=0.08 if not compiled else 0.01), (micro_batch, compiled)


def test_resident_loss_chunk_is_the_chunked_loss():
    from sft.plan import resident
    from sft.speed.chunked_loss import CHUNK_TOKENS

    assert resident.LOSS_CHUNK_TOKENS == CHUNK_TOKENS


def test_moe_lora_kept_a_weight_per_layer_without_checkpointing_until_it_went_low_rank():
    """peft's parameter-targeted LoRA (the MoE MLP weights) materialised W + BA per layer in forward: all layers'
    without checkpointing, one recomputed layer's with it; dense models keep none. Since ca1f7e7 that LoRA is
    low-rank and keeps none: rows dated before it are read with the weights, today's plans without."""
    from sft.plan.rows import MLP_LORA_LOW_RANK_SINCE, workload_of_row

    v2, dense = SHAPES["deepseek-v2-lite"], SHAPES["deepseek-llm-7b"]

    def weights(shape, ckpt, merged=True):
        w = Workload("fsdp", Setup("lora"), 3, 1, 2048, ckpt, merged_mlp_lora=merged)
        return predict(shape, w).parts["lora_weights"]

    per_layer = [v2.parameter_lora_bytes(i) for i in range(v2.layers)]
    assert weights(v2, False) * GIB == sum(per_layer) and weights(v2, True) * GIB == max(per_layer)
    assert per_layer[0] == 2 * 3 * 2048 * 10944 and per_layer[1] == 2 * 3 * 2048 * 2 * 1408
    assert weights(dense, False) == weights(dense, True) == 0
    assert weights(v2, False, merged=False) == weights(v2, True, merged=False) == 0
    row = {"model": "deepseek-v2-lite", "method": "lora", "strategy": "single", "n_gpus": 1, "micro_batch": 4,
           "seq_len": 2048, "train_args": "--lora true"}
    assert workload_of_row({**row, "date": "2026-12-07T00:24:00Z"}).merged_mlp_lora
    assert not workload_of_row({**row, "date": MLP_LORA_LOW_RANK_SINCE}).merged_mlp_lora
    assert not workload_of_row(row).merged_mlp_lora  # a row without a date: today's code


def test_checkpointing_off_is_estimated_from_checkpointed_rows_by_the_recomputed_forward(tmp_path):
    """With rows measured only with checkpointing on, a plan without it does 4N (LoRA) / 6N (full) instead of 6N /
    8N per token in the same matmul time: its MFU is scaled up, not copied (which made `--plan auto` keep
    checkpointing on an H200 with 100 GiB to spare)."""
    import json

    rows = tmp_path / "results.jsonl"
    base = {"run_id": "r", "peer": "ours", "gpu": "NVIDIA H200", "n_gpus": 1, "strategy": "single",
            "model": "deepseek-llm-7b", "seq_len": 2048, "micro_batch": 2, "mfu": 0.3, "peak_mem_gib": 20.0,
            "train_args": "--activation_checkpointing true --attn_implementation flex_attention"}
    rows.write_text("\n".join(json.dumps({**base, "name": m, "method": m}) for m in ("lora", "full")) + "\n")
    for method, factor in (("lora", 6 / 4), ("full", 8 / 6)):
        on, _ = mfu_reference("single_gpu", method, True, path=rows)
        off, why = mfu_reference("single_gpu", method, False, path=rows)
        assert on == pytest.approx(0.3) and off == pytest.approx(0.3 * factor) and "recomputation" in why


def test_mla_plans_count_the_logits_they_materialise():
    """MLA models get no Liger (kernels): with the whole logits (--chunked_loss false), measured on two H200s held to
    24 GiB, DeepSeek-V2-Lite LoRA under ZeRO-3 at micro-batch 4 ran out of memory in its first backward (3.1 GiB of
    logits asked for), where a plan counting Liger's fused loss had it fit; at micro-batch 1 it trained. Their plans
    take the loss in chunks, as their runs' --chunked_loss auto does, except under TP (refused there)."""
    shape = SHAPES["deepseek-v2-lite"]
    box = Box(2, 24, host_ram_gib=128)
    plans = enumerate_plans(shape, box, "lora", 2048)
    assert not any(p.w.fused_loss for p in plans)
    assert all(p.w.chunked_loss for p in plans)
    zero3 = {(p.w.micro_batch, p.w.checkpointing): p for p in plans if p.w.strategy == "zero3"}
    whole = {key: judged_plan(shape, box, dataclasses.replace(p.w, chunked_loss=False), p.fast, p.asked).fits
             for key, p in zero3.items()}
    assert whole[(4, True)] is False and whole[(1, True)] is True and zero3[(4, True)].fits
    full = enumerate_plans(shape, box, "full", 2048, (1,))
    assert {p.w.strategy for p in full if not p.w.chunked_loss} >= {"tp", "zero3"}  # refused: TP; a trained
    assert all(p.w.chunked_loss for p in full if p.w.strategy in ("ddp", "fsdp"))  # lm_head under ZeRO-3
    dense = enumerate_plans(SHAPES["deepseek-llm-7b"], Box(2, 24), "lora", 2048)
    assert all(p.w.fused_loss for p in dense if p.w.strategy != "tp")


def test_an_unmeasured_sharded_plan_is_bounded_by_the_models_own_sharded_row(tmp_path):
    """V2-Lite's only row (its recipe, ZeRO-3, read through --config: checkpointing on) sets the MFU of its ZeRO-3
    plans, and bounds its offload plans, which the dense offload rows alone would put 4x higher."""
    import json

    row = dict(gpu="NVIDIA H200", peak_mem_gib=20.0, peer="ours", n_gpus=2, micro_batch=1, seq_len=2048)
    rows = [dict(row, name="dense-offload", model="deepseek-llm-7b", method="lora", strategy="zero3_offload",
                 mfu=0.043, train_args="--activation_checkpointing true"),
            dict(row, name="recipe-v2-lite-lora", model="deepseek-v2-lite", method="lora", strategy="zero3",
                 mfu=0.011, train_args="--config /elsewhere/recipes/deepseek-v2-lite-lora.yaml")]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    zero3, why = mfu_reference("zero3", "lora", True, results, model="deepseek-v2-lite")
    assert zero3 == pytest.approx(0.011) and "recipe-v2-lite-lora" in why and "no row with" not in why
    offload, why = mfu_reference("zero3_offload", "lora", True, results, model="deepseek-v2-lite")
    assert offload == pytest.approx(0.011) and "at most" in why
    dense, _ = mfu_reference("zero3_offload", "lora", True, results, model="deepseek-llm-7b")
    assert dense == pytest.approx(0.043)


# ---- issue 29: a plan keeps its margin, host RAM is the machine's, commands run as printed, the header says them

def test_a_plan_keeps_a_margin_and_equal_speed_goes_to_headroom():
    """7B full fine-tune on 3 x 24 GB: the 8-bit AdamW plan at micro-batch 8 (24.5 GiB by nvidia-smi on a 23.99 GiB
    card) is tight, never "yes" nor recommended; of the plans of one estimated speed, the one with room for the
    memory model's worst error (4-bit AdamW, 20.6 GiB) is."""
    shape = SHAPES["deepseek-llm-7b"]
    box = Box(3, 24, host_ram_gib=128)
    plans = enumerate_plans(shape, box, "full", 2048)
    best = best_plan(plans)
    assert best.prediction.smi_gib <= box.card_gib - MARGIN_GIB
    edge = next(p for p in plans if (p.w.setup.precision, p.w.micro_batch, p.w.checkpointing) == ("lowbit8", 8, True))
    assert edge.prediction.smi_gib > box.card_gib - 1 and edge.fits and not edge.roomy
    assert edge.mark().startswith("tight") and edge.tok_s == pytest.approx(best.tok_s)
    assert (best.w.strategy, best.w.setup.precision, best.w.checkpointing) == ("fsdp", "lowbit4", True)
    assert round(shown_gib(best), 1) == 20.6 and safe(best)
    for model, method in (("deepseek-llm-7b", "lora"), ("deepseek-coder-1.3b", "full"), ("deepseek-v2-lite", "lora"),
                          ("deepseek-r1-distill-qwen-14b", "lora"), ("deepseek-r1-distill-llama-8b", "full")):
        for gpus in (1, 2, 3):
            box = Box(gpus, 24, host_ram_gib=512)
            plans = enumerate_plans(SHAPES[model], box, method, 2048)
            assert all(p.prediction.smi_gib <= box.card_gib - 1 for p in plans if p.mark() == "yes"), (model, gpus)
            best = best_plan(plans)
            assert best is None or best.prediction.smi_gib <= box.card_gib - 1, (model, method, gpus)
    out = run_planner("--model", "deepseek-llm-7b", "--gpus", "3", "--gpu_mem", "24")
    assert out.returncode == 0 and "--per_device_train_batch_size 4 " in out.stdout
    assert "--optim adamw_torch_4bit" in out.stdout and "predicted 20.6 GiB per GPU" in out.stdout


def test_nothing_at_the_edge_is_recommended():
    """A box where every plan is tight: nothing is recommended, and the closest plan says it is tight."""
    plans = enumerate_plans(SHAPES["deepseek-llm-7b"], Box(1, 24, host_ram_gib=64), "lora", 2048,
                                 micro_batches=(8,))
    ckpt_off = [p for p in plans if not p.w.checkpointing and p.w.strategy == "single_gpu"]
    assert best_plan([p for p in plans if p.w.strategy == "single_gpu"]) is not None  # checkpointing on fits
    assert ckpt_off and best_plan(ckpt_off) is None
    out = run_planner("--model", "deepseek-r1-distill-qwen-14b", "--lora", "--gpus", "2", "--micro_batch", "4",
                      host_ram="32")
    assert out.returncode == 1 and "Recommended" not in out.stdout and "Nothing fits with 1 GiB" in out.stdout


def test_host_ram_is_this_machines_or_unknown(monkeypatch, capsys):
    """Without --host_ram the plans are for this machine's RAM: V2-Lite's full fine-tune (475 GiB of host RAM for
    its offload) fits no 64 GiB machine; where the RAM cannot be read it is "unknown", never assumed."""
    out = run_planner("--model", "deepseek-v2-lite", "--gpus", "3", host_ram="64")
    assert out.returncode == 1 and "host RAM 64 GiB (this machine)" in out.stdout.splitlines()[0]
    assert "Recommended" not in out.stdout
    assert out.stdout.splitlines()[-1] == "With more host RAM: zero3_offload, micro-batch 4: needs 475 GiB host RAM > 64"
    out = run_planner("--model", "deepseek-v2-lite", "--gpus", "3", "--host_ram", "512", host_ram="64")
    assert out.returncode == 0 and "475 of 512 GiB host RAM" in out.stdout
    monkeypatch.setattr(planner, "this_host_ram", lambda: None)
    assert main(["--model", "deepseek-v2-lite", "--gpus", "3"]) == 0
    printed = capsys.readouterr().out
    assert "host RAM: unknown (give --host_ram)" in printed.splitlines()[0]
    offload = [line for line in printed.splitlines() if line.startswith("zero3_offload")]
    assert offload and all(line.endswith("host RAM: unknown, needs 475 GiB") for line in offload)
    assert "yes" not in " ".join(line.split("  ")[-1] for line in offload)
    assert "predicted 20.3 GiB per GPU (nvidia-smi), host RAM: unknown, needs 475 GiB" in printed


def test_host_ram_is_read_without_torch(tmp_path, monkeypatch):
    from sft.machine import GIB, host_ram_gib

    assert host_ram_gib({"SFT_HOST_RAM_GIB": "96"}) == 96.0
    import psutil

    assert host_ram_gib({}) == pytest.approx(psutil.virtual_memory().total / GIB)
    monkeypatch.setitem(sys.modules, "psutil", None)  # no psutil: /proc/meminfo's MemTotal
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemFree:        1 kB\n")
    assert host_ram_gib({}, str(meminfo)) == pytest.approx(65536000 * 1024 / GIB)
    assert host_ram_gib({}, str(tmp_path / "absent")) is None


def test_commands_name_the_models_hub_ids(tmp_path, capsys):
    """A family name trains its base model, a released name its own model (with deepseek-ai/, in its case), a hub id
    or directory itself; every hub id the planner names is a released model (sft/model/families.py)."""
    from sft.model.families import VARIANTS

    released = {m for v in VARIANTS for m in v.models}
    assert {hub for hubs in RELEASES.values() for hub in hubs} <= released
    assert set(RELEASES) == set(SHAPES)
    for typed, hub in [("deepseek-llm-7b", "deepseek-ai/deepseek-llm-7b-base"),
                       ("deepseek-coder-6.7b", "deepseek-ai/deepseek-coder-6.7b-base"),
                       ("deepseek-coder-1.3b", "deepseek-ai/deepseek-coder-1.3b-base"),
                       ("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite"),
                       ("DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite"),
                       ("deepseek-v2-lite-chat", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
                       ("deepseek-llm-7b-chat", "deepseek-ai/deepseek-llm-7b-chat"),
                       ("deepseek-coder-6.7b-instruct", "deepseek-ai/deepseek-coder-6.7b-instruct"),
                       ("deepseek-r1-distill-qwen-7b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"),
                       ("deepseek-r1-0528-qwen3-8b", "deepseek-ai/DeepSeek-R1-0528-Qwen3-8B"),
                       ("r1-0528-qwen3-8b", "deepseek-ai/DeepSeek-R1-0528-Qwen3-8B"),
                       ("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-ai/DeepSeek-V2-Lite-Chat"),
                       (str(tmp_path), str(tmp_path))]:
        assert hub_id(typed) == hub, typed
        assert resolve_shape(hub if typed != str(tmp_path) else "deepseek-llm-7b")  # the shape is known
    out = run_planner("--model", "DeepSeek-V2-Lite", "--lora", "--host_ram", "128")
    assert out.returncode == 0 and "--model deepseek-ai/DeepSeek-V2-Lite " in out.stdout
    capsys.readouterr()
    for typed in ("deepseek-r1-0528-qwen3-8b", "r1-0528-qwen3-8b"):  # a qwen3 model (sft/model/families.py)
        assert main(["--model", typed, "--lora", "--host_ram", "128"]) == 0
        assert "--model deepseek-ai/DeepSeek-R1-0528-Qwen3-8B " in capsys.readouterr().out


@pytest.mark.parametrize("model, method, gpus", [
    ("deepseek-llm-7b", "full", 3), ("deepseek-llm-7b", "lora", 3), ("deepseek-llm-7b", "qlora", 1),
    ("DeepSeek-V2-Lite", "full", 3), ("deepseek-v2-lite", "lora", 2), ("deepseek-coder-1.3b", "full", 2),
])
def test_the_recommended_command_runs_as_printed(model, method, gpus):
    """The recommended command's options parse and pass every check on the box it is for (described as data, as
    tests/test_recipes.py does), with the launch its accelerate config sets up; the header names its kernels."""
    import io
    import re
    import shlex
    from contextlib import redirect_stdout

    from sft.machine import Launch, Machine
    from sft.options.arguments import parse_args, validate_setup

    flags = {"full": [], "lora": ["--lora"], "qlora": ["--qlora"]}[method]
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert main(["--model", model, "--gpus", str(gpus), "--host_ram", "512", *flags]) == 0
    header, *_ = printed.getvalue().splitlines()
    line = re.search(r"^Recommended: (.+)$", printed.getvalue(), re.M).group(1)
    words = shlex.split(line)
    config = words[words.index("--config_file") + 1].rsplit("/", 1)[-1]
    attention = words[words.index("--attn_implementation") + 1]
    liger = "--use_liger_kernel" in words
    kernels = re.search(r"tokens(?: x \d+ micro-batches per step)?, (.+)$", header).group(1)
    assert kernels.startswith(attention + (" + Liger" if liger else ", no Liger")), header  # others: in brackets
    args = words[words.index("sft/train.py") + 1:]
    args[args.index("--dataset") + 1] = str(REPO / "data" / "alpaca_demo.json")
    # what this CPU machine refuses at parsing (--bf16 without bf16 hardware, Liger not installed, QLoRA without
    # CUDA): parsed off, then set back for the checks against the box
    gpu_only = {"--bf16", "--use_liger_kernel", "--qlora"}
    given = gpu_only & set(args)
    args = [a for a in args if a not in gpu_only] + (["--lora"] if "--qlora" in given and "--lora" not in args else [])
    args[args.index("--attn_implementation") + 1] = "sdpa"
    parsed = parse_args(args)
    model_args, _, lora_args, training_args = parsed
    model_args.attn_implementation = attention
    training_args.bf16, training_args.use_liger_kernel = "--bf16" in given, liger
    lora_args.qlora = "--qlora" in given
    if "--chunked_loss" not in args:  # settled again on the box's launch, as the run settles it
        model_args.chunked_loss = "auto"
    assert model_args.model.startswith("deepseek-ai/")
    launch = Launch(world_size=gpus, local_world_size=gpus, launched=True, fsdp=config == "fsdp.yaml",
                    launcher_started=1.8e9,  # names the run's new directory alike on every rank
                    zero_stage={"zero3.yaml": "3", "zero3_offload.yaml": "3", "zero2.yaml": "2"}.get(config),
                    offload=("optimizer", "param") if config == "zero3_offload.yaml" else ())
    box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * gpus, gpu_memory_gib=(23.99,) * gpus, bf16=True,
                  host_ram_gib=512, host_ram_available_gib=500, launch=launch,
                  packages=frozenset({"liger_kernel", "torchao", "bitsandbytes"}))
    validate_setup(*parsed, machine=box)


def test_qlora_rows_are_lora_rows_never_full_fine_tune_rows(tmp_path):
    """A QLoRA bench row (method qlora, its base quantized) speaks for LoRA plans: it set the full DDP plans' MFU
    (5.5%, from 1.3b-qlora-1, 1.3b-qlora-ddp-2 and 7b-qlora-1) before."""
    import json

    base = {"run_id": "r", "peer": "ours", "gpu": "NVIDIA H200", "n_gpus": 1, "strategy": "single",
            "model": "deepseek-coder-1.3b", "seq_len": 2048, "micro_batch": 2, "peak_mem_gib": 4.0,
            "train_args": "--activation_checkpointing true"}
    rows = [{**base, "name": "q", "method": "qlora", "mfu": 0.05, "quantization": "4-bit NF4"},
            {**base, "name": "f", "method": "full", "mfu": 0.3, "train_args": "--activation_checkpointing false"}]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    full, why = mfu_reference("ddp", "full", True, results)
    assert "q" not in why.split("(")[1].split(")")[0].split(", ") and full == pytest.approx(0.3 * 6 / 8)
    lora, why = mfu_reference("ddp", "lora", True, results)
    assert lora == pytest.approx(0.05) and "(q)" in why
    for table in fitted()["mfu"].values():  # the snapshot of bench/results.jsonl
        for key, (_, why) in table.items():
            assert " full " not in key or "qlora" not in why, (key, why)


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_recipe_is_the_planners_plan_for_its_micro_batch(recipe):
    """Asked for a recipe's micro-batch and accumulation on its box (3 x 24 GB), the planner recommends its
    strategy, precision, checkpointing and long-row levers (r1-distill-qwen-7b-long: the MLP tile and offloaded
    checkpoints), and the recipe itself keeps the margin; the resident plans (--quantize_experts) only for a recipe
    that asks for them, and the SP plans (--sequence_parallel: one trace per row, its speed not measured) only for a
    recipe that asks for them, with its size and processes. The full fine-tune's recipe says why its micro-batch is
    not the planner's own choice, with the planner's prediction for it."""
    import re

    import yaml

    from sft.parallel.strategies import PRECISION_OPTIONS

    text = recipe.read_text()
    options = yaml.safe_load(text)
    config = re.search(r"--config_file (accelerate_configs/\S+)", text).group(1)
    method = "qlora" if options.get("qlora") else "lora" if options.get("lora") else "full"
    mb, accumulation = options.get("per_device_train_batch_size", 1), options.get("gradient_accumulation_steps", 1)
    shape = resolve_shape(options["model"])
    # FSDP + QLoRA: every rank holds the NF4 base in host RAM as it loads (a 67B: 125 GiB for 3 processes)
    box = Box(3, 24, host_ram_gib=192 if method == "qlora" else 64)
    plans = enumerate_plans(shape, box, method, options.get("max_length", 2048), (mb,),
                                 options.get("lora_r", 16), accumulation)
    # a resident plan changes the model the adapter trains against: the plan of a recipe that asks for it (as
    # --plan auto plans), else of one that does not
    size = options.get("sequence_parallel", 1)
    kind = [p for p in plans if p.w.resident == (options.get("quantize_experts") == "fp8")
            and p.w.sequence_parallel == size]
    best = best_plan(kind) or awaiting_plan(kind)  # a recipe the run refuses today: the plan that awaits
    precision = next((k for k, v in PRECISION_OPTIONS.items() if v and v["optim"] == options.get("optim")),
                     "fp32_master")
    levers = Levers(options.get("mlp_tile_tokens", 0), bool(options.get("offload_activations")))
    assert (STRATEGIES[best.w.strategy].accelerate_config, best.w.setup.precision, best.w.checkpointing,
            best.w.levers) == (config, precision, bool(options.get("activation_checkpointing")), levers)
    skip = options.get("activation_checkpointing_skip_layers", 0)
    processes = int(re.search(r"--num_processes (\d+)", text).group(1)) if "--num_processes" in text else 3
    assert (best.w.world, best.w.sequence_parallel) == (processes, size)
    own = predict(shape, Workload(best.w.strategy, Setup(method, precision), processes, mb, best.w.seq_len,
                                            best.w.checkpointing, skip, bool(options.get("use_liger_kernel")),
                                            grad_accum=accumulation, fp8=best.w.fp8, compiled=best.w.compiled,
                                            mlp_tile_tokens=levers.mlp_tile_tokens,
                                            offload_activations=levers.offload_activations,
                                            chunked_loss=size > 1, sequence_parallel=size))
    assert own.smi_gib <= box.card_gib - MARGIN_GIB, recipe.name
    if levers.label:  # its header quotes the planner's prediction for it
        assert f"{own.smi_gib:.1f} GiB per GPU by nvidia-smi" in text, own.smi_gib
    if method == "full":
        assert f"predicted at {own.smi_gib:.1f} GiB per GPU by nvidia-smi" in text
        assert f"deepseek-sft plan --model deepseek-llm-7b --micro_batch {mb} --gradient_accumulation_steps " \
               f"{accumulation}" in text


def test_plan_auto_plans_the_users_accumulation():
    from sft.machine import Launch, Machine

    m = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                host_ram_gib=128, launch=Launch(world_size=3, local_world_size=3, launched=True, fsdp=True))
    model = SimpleNamespace(model="deepseek-llm-7b")
    lora = SimpleNamespace(lora=False, qlora=False, lora_r=16)
    training = SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=8)
    _, chosen = planned_options(model, lora, SimpleNamespace(max_length=2048), training, m)
    assert chosen.w.grad_accum == 8 and chosen.w.strategy == "fsdp" and chosen.roomy


def test_the_header_names_each_strategys_kernels():
    dense, mla = SHAPES["deepseek-coder-1.3b"], SHAPES["deepseek-v2-lite"]
    assert kernels_text(dense, ["ddp", "fsdp"]) == "flex_attention + Liger"
    assert kernels_text(dense, ["ddp", "tp", "fsdp"]) == "flex_attention + Liger (tp: sdpa, no Liger)"
    assert kernels_text(mla, ["zero3_offload", "zero3"]) == "varlen, no Liger"


# ---- issue 28: a plan runs with the fast paths its run gets (--fp8 / --compile_layers auto), and predicts them

def test_a_lora_plan_on_the_default_box_runs_fp8_and_the_compiled_layers_and_counts_their_memory():
    """3 x RTX 4090 (compute capability 8.9): the run's own rule turns both on under DDP, so the plan is predicted
    with them: the compiled layers' memory on top (fitted on their bench rows), the MFU of the rows that ran with
    both; the command needs no option for them, and the header and the recommendation say so."""
    shape = SHAPES["deepseek-llm-7b"]
    plans = enumerate_plans(shape, BOX, "lora", 2048)
    best = best_plan(plans)
    assert (best.w.strategy, best.w.fast) == ("ddp", "fp8+compiled")
    plain = predict(shape, Workload("ddp", Setup("lora"), 3, best.w.micro_batch, 2048, best.w.checkpointing))
    # the compiled layers' share is counted against layers without Liger's kernels (Liger keeps only its loss beside
    # them): negative, yet the plan holds more than its eager twin with Liger, as the bench rows measured
    assert best.prediction.parts["fast_paths"] != 0 and best.prediction.smi_gib > plain.smi_gib
    assert "lora-1-fp8-compile" in best.tok_s_source and "no row of this kind with" not in best.tok_s_source
    by_strategy = {p.w.strategy: p.w.fast for p in plans}
    assert by_strategy["fsdp"] == "compiled" and by_strategy["zero2"] == by_strategy["zero3"] == ""  # as resolve.py
    out = run_planner("--model", "deepseek-llm-7b", "--lora")
    header, recommended = out.stdout.splitlines()[0], out.stdout.split("Recommended: ")[1].splitlines()
    assert "ddp, single_gpu: FP8 + compiled layers (defaults on this GPU)" in header
    assert "fsdp: compiled layers" in header and "zero2, zero3: neither" in header
    assert recommended[1] == "  FP8 + compiled layers (defaults on this GPU)"
    assert "--fp8" not in recommended[0] and "--compile_layers" not in recommended[0]
    assert "fp8+compiled" in out.stdout.splitlines()[3]  # the table's column, first row


def test_an_rtx_3090_box_gets_the_compiled_layers_and_no_fp8_and_says_why():
    plans = enumerate_plans(SHAPES["deepseek-llm-7b"], Box(3, 24, gpu="RTX 3090"), "lora", 2048)
    best = best_plan(plans)
    assert best.w.compiled and not best.w.fp8 and not any(p.w.fp8 for p in plans)
    assert "lora-1-compile" in best.tok_s_source
    out = run_planner("--model", "deepseek-llm-7b", "--lora", "--gpu", "RTX 3090")
    assert out.returncode == 0 and "3 x RTX 3090 24 GB" in out.stdout.splitlines()[0]
    assert ("compiled layers on (the default), FP8 off (GPU 0 (RTX 3090) has compute capability 8.6; FP8 matmuls "
            "need 8.9 or newer") in out.stdout.split("Recommended: ")[1]
    assert "scaled to 71 TFLOP/s per GPU" in out.stdout  # the GPU's own peak
    out = run_planner("--model", "deepseek-llm-7b", "--gpu", "GTX 1080")
    assert out.returncode == 2 and out.stderr.startswith("error: --gpu GTX 1080: not a GPU the planner knows")


def test_the_fast_paths_memory_is_fitted_on_their_bench_rows_and_checked_there():
    """Each fast path adds a share of the whole layers' activations, fitted on the rows that ran with it against
    their twins without it; its rows are in the check table, within the memory model's worst error (HEADROOM)."""
    results = {x["name"]: x for x in check_rows()}
    for name, fast in [("lora-best-compile", "compiled"), ("lora-best-fp8-compile", "fp8+compiled"),
                       ("lora-1-compile", "compiled"), ("lora-1-fp8-compile", "fp8+compiled"),
                       ("full-sr16-compile", "compiled"), ("full-fp8", "fp8+compiled")]:
        assert results[name]["fast"] == fast, name
        assert abs(results[name]["err_reserved"]) <= HEADROOM, name
    table = fitted()["fast_path_memory"]
    # FP8 activations; the compiled layers' shares are counted against layers without Liger's kernels (Liger keeps only
    # its loss beside them): what they add over an eager twin with Liger is checked below, as measured
    assert table["lora"]["fp8"][0] > 0 > table["full"]["fp8"][0]
    # a pair measured apart: the prediction moves with the measured difference (GiB)
    for fast, plain, measured in [("lora-best-compile", "lora-best", 6.08), ("lora-1-compile", "lora-1", 0.56),
                                  ("full-fp8", "full-sr16", 63.73 - 70.15)]:
        moved = results[fast]["pred_reserved"] - results[plain]["pred_reserved"]
        assert abs(moved - measured) < 0.5, (fast, moved, measured)


def test_the_mfu_of_fast_plans_is_their_rows_or_says_it_is_not(tmp_path):
    import json

    base = {"run_id": "r", "peer": "ours", "gpu": "NVIDIA H200", "n_gpus": 1, "strategy": "single",
            "model": "deepseek-llm-7b", "seq_len": 2048, "micro_batch": 4, "peak_mem_gib": 20.0, "method": "lora",
            "train_args": "--activation_checkpointing true --attn_implementation flex_attention"}
    fast = " --fp8 true --compile_layers true"
    rows = [{**base, "name": "plain", "mfu": 0.4},
            {**base, "name": "both", "mfu": 0.6, "train_args": base["train_args"] + fast},
            {**base, "name": "broken", "mfu": 0.9, "train_args": base["train_args"] + fast, "notes": "INVALID: no"},
            {**base, "name": "auto", "mfu": 0.7, "train_args": base["train_args"] + fast.replace("true", "auto")},
            {**base, "name": "fsdp-plain", "mfu": 0.2, "strategy": "fsdp", "n_gpus": 2}]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mfu, why = mfu_reference("ddp", "lora", True, results, fast="fp8+compiled")
    assert mfu == pytest.approx(0.65) and "(auto, both)" in why  # auto on an H200: both; INVALID rows left out
    assert mfu_reference("ddp", "lora", True, results) == (0.4, "median MFU 40.0% of 1 rows (plain)")
    mfu, why = mfu_reference("fsdp", "lora", True, results, fast="compiled")  # no FSDP row with them
    assert mfu == pytest.approx(0.2) and why.endswith("no row of this kind with compiled layers: the rows without them")


def test_the_plans_command_runs_with_the_fast_paths_it_was_planned_with():
    """The plan's options parsed as sft/train.py parses them (ModelArguments) and resolved on the plan's box and
    launch give the fast paths the plan was predicted with, for the defaults and for an explicit value."""
    from sft.options.arguments import read_options
    from sft.options.resolve import resolve_defaults
    from sft.plan.fast_paths import Asked

    data = str(REPO / "data" / "alpaca_demo.json")
    for gpu in ("RTX 4090", "RTX 3090"):
        box = Box(3, 24, host_ram_gib=512, gpu=gpu)
        for method, asked in [("lora", Asked()), ("full", Asked()), ("qlora", Asked()), ("lora", Asked(fp8="false")),
                              ("full", Asked(compile_layers="false"))]:
            plans = enumerate_plans(SHAPES["deepseek-llm-7b"], box, method, 2048, (1,), asked=asked)
            for p in {q.w.strategy: q for q in plans if q.fits}.values():
                words = shlex_words(command(p, "deepseek-llm-7b", box))
                flags = {"lora": ["--lora"], "qlora": ["--qlora"], "full": []}[method]
                extra = [word for i, w in enumerate(words) if w in ("--fp8", "--compile_layers")
                         for word in words[i:i + 2]]  # both where the planner turned one off beside the user's
                options = read_options(["--model", "m", "--dataset", data, "--output_dir", "/nonexistent/out",
                                        *flags, *extra])
                machine = dataclasses.replace(box.described(), launch=STRATEGIES[p.w.strategy].launch(p.w.world))
                if p.w.strategy == "tp":
                    options.model.tp_size = p.w.world
                model = resolve_defaults(options, machine).model
                assert (model.fp8_on, model.compile_layers_on) == (p.w.fp8, p.w.compiled), (gpu, method, p.w)


def shlex_words(command: str) -> list[str]:
    import shlex

    return shlex.split(command)


def test_an_explicit_fast_path_is_passed_and_a_strategy_that_refuses_it_does_not_fit():
    out = run_planner("--model", "deepseek-llm-7b", "--lora", "--fp8", "false")
    recommended = out.stdout.split("Recommended: ")[1].splitlines()
    assert recommended[0].endswith("--fp8 false") and recommended[1] == \
        "  compiled layers on (the default), FP8 off (--fp8 false)"
    from sft.plan.fast_paths import Asked

    plans = enumerate_plans(SHAPES["deepseek-llm-7b"], BOX, "lora", 2048, asked=Asked(fp8="true"))
    zero3 = [p for p in plans if p.w.strategy == "zero3"]
    assert zero3 and not any(p.fits for p in zero3) and all("--fp8 with DeepSpeed ZeRO-3" in p.why_not for p in zero3)
    assert best_plan(plans).w.fp8


def test_plan_auto_predicts_the_fast_paths_of_this_machine():
    from sft.machine import Launch, Machine

    m = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                gpu_capabilities=((8, 9),) * 3, host_ram_gib=128,
                launch=Launch(world_size=3, local_world_size=3, launched=True),
                packages=frozenset({"liger_kernel", "torchao"}))
    model = SimpleNamespace(model="deepseek-llm-7b", fp8="auto", compile_layers="auto")
    lora = SimpleNamespace(lora=True, qlora=False, lora_r=16)
    training = SimpleNamespace(per_device_train_batch_size=1, torch_compile=False)
    _, chosen = planned_options(model, lora, SimpleNamespace(max_length=2048), training, m)
    assert chosen.w.fast == "fp8+compiled" and "FP8 + compiled layers: predicted" in prediction_line(chosen)
    probe = dataclasses.replace(m, fp8_probe_error="torch cannot run a rowwise-scaled FP8 matmul here")
    _, chosen = planned_options(model, lora, SimpleNamespace(max_length=2048), training, probe)
    assert chosen.w.fast == "compiled"  # this machine's own FP8 probe, as the run reads it
    model.compile_layers = "false"
    _, chosen = planned_options(model, lora, SimpleNamespace(max_length=2048), training, m)
    assert chosen.w.fast == "fp8"


# ---- issue 27 item 3: long rows (--mlp_tile_tokens, --offload_activations) and one name per model

R1 = "deepseek-r1-distill-qwen-7b"
LONG_ROWS = {"long-r1-4k", "long-r1-32k", "long-llm-4k", "long-llm-32k"}


def test_the_long_rows_are_predicted_with_their_levers():
    """The 32k rows ran with the MLP tiled and the checkpoints in host RAM: the planner reads both from their
    options and predicts their GPU memory and host RAM (both within 10%: the two tests above check every row)."""
    checked = {x["name"]: x for x in check_rows() if x["run_id"] == "20261203T1918Z-long"}
    assert set(checked) == LONG_ROWS
    assert {n: x["levers"] for n, x in checked.items()} == {"long-r1-4k": "", "long-r1-32k": "tile+offload",
                                                             "long-llm-4k": "", "long-llm-32k": "tile+offload"}
    for name in ("long-r1-32k", "long-llm-32k"):
        assert checked[name]["offload"] and abs(checked[name]["err_host"]) <= 0.10, checked[name]
    # without the levers, the same 32k row is predicted over its 24 GiB cap: they are what makes it fit
    row = next(r for r in measured_rows() if r["name"] == "long-r1-32k")
    bare = dataclasses.replace(workload_of_row(row), mlp_tile_tokens=0, offload_activations=False)
    assert predict(SHAPES[R1], bare).reserved_gib > 24


def test_a_plan_of_long_rows_takes_the_levers_it_needs_and_says_so():
    shape = SHAPES[R1]
    box = Box(3, 24, host_ram_gib=128)
    levers = {n: best_plan(enumerate_plans(shape, box, "lora", n)).w.levers.label
              for n in (2048, 4096, 32768)}
    assert levers[2048] == levers[4096] == ""  # short rows: none
    assert levers[32768] == "tile+offload"
    best = best_plan(enumerate_plans(shape, box, "lora", 32768))
    cmd = command(best, R1, box)
    # ... and without the compiled layers, which keep more than each layer's input at 32k (run 20261205T1120Z)
    assert "--max_length 32768" in cmd and cmd.endswith("--activation_checkpointing --mlp_tile_tokens 4096 "
                                                        "--offload_activations --compile_layers false")
    assert best.fast.fp8 and not best.fast.compiled and "compiled layers off (with them the plan needs" in \
        fast_paths_said(best)
    assert best.prediction.host_gib > predict(shape, dataclasses.replace(best.w, offload_activations=False)).host_gib
    # each lever only where it is needed: the same plan with one lever fewer does not keep the card's margin
    for fewer in (dataclasses.replace(best.w, mlp_tile_tokens=0), dataclasses.replace(best.w, offload_activations=False)):
        assert predict(shape, fewer).smi_gib > box.card_gib - MARGIN_GIB


@pytest.mark.parametrize("length", [8192, 16384, 32768, 65536, 131072])
def test_no_long_plan_at_or_over_the_card_is_recommended(length):
    """Long or short, a recommended plan leaves the card its margin (nvidia-smi by the prediction), or there is
    none and the planner says so."""
    for model in (R1, "deepseek-llm-7b"):
        plans = enumerate_plans(SHAPES[model], Box(3, 24, host_ram_gib=128), "lora", length)
        best = best_plan(plans)
        if best is not None:
            assert best.prediction.smi_gib <= Box(3, 24).card_gib - MARGIN_GIB, (model, length)
        assert all(p.w.levers.label == "" for p in plans if not is_long(length))


def test_a_tiled_mlp_costs_flops_only_where_it_runs_more_than_the_layers_checkpoint():
    """--mlp_tile_tokens under the layers' checkpoints: two MLP forwards a step, as the checkpoint alone runs (the
    6N/4N count leaves the recompute out), so no FLOPs more. Without checkpoints: one more forward of each MLP. A row
    measured before the eager recompute was marked (or a -layer-recompute row) ran all tiles but the last once more:
    7/8 of a forward at 8 tiles; its compiled twin did not."""
    shape = SHAPES[R1]
    w = Workload("ddp", Setup("lora", "fp32_master"), 1, 1, 32768, True, mlp_tile_tokens=4096)
    forward = 2.0 * shape.layers * shape.dense_mlp_params()
    assert tiled_mlp_flops_per_token(shape, w) == 0.0
    assert tiled_mlp_flops_per_token(shape, dataclasses.replace(w, checkpointing=False)) == forward
    assert tiled_mlp_flops_per_token(shape, dataclasses.replace(w, tiles_in_layer_recompute=True)) == forward * 7 / 8
    assert tiled_mlp_flops_per_token(shape, dataclasses.replace(w, seq_len=4096, tiles_in_layer_recompute=True)) == 0
    rows = {r["name"]: workload_of_row(r) for r in measured_rows() if r["run_id"].startswith("20261205T1845Z")}
    assert rows["long-r1-32k-recipe"].tiles_in_layer_recompute  # eager, dated before 162167b
    assert not rows["long-r1-32k-sdpa-default"].tiles_in_layer_recompute  # compiled layers
    today = dict(next(r for r in measured_rows() if r["name"] == "long-r1-32k-recipe"), date="2026-12-07T00:00:00Z")
    assert not workload_of_row(today).tiles_in_layer_recompute
    assert workload_of_row(dict(today, name="long-r1-32k-recipe-layer-recompute")).tiles_in_layer_recompute


def test_long_plans_read_the_long_rows_speed_with_their_attention():
    """A long plan's MFU comes from the rows of one long conversation each, counted with their attention (which
    at 32k tokens costs what a packed short row's does not): predicted for measured 32k rows of the plan's
    attention (varlen; sdpa's causal kernel on one conversation a row) within 10%, at the bench's MFU reference,
    naming those rows. The short kinds never read a long row."""
    chosen = {("long-r1-32k-sdpa", "20261205T1315Z-long-h100"), ("long-r1-32k-recipe", "20261207T0301Z-experts-split-h100"),
              ("long-r1-32k-varlen-default", "20261206T1532Z-dense-default-2-h100")}
    rows = [r for r in measured_rows() if (r["name"], r["run_id"]) in chosen]
    assert len(rows) == len(chosen)
    for row in rows:
        shape, w = row_shape(row), workload_of_row(row)
        tok_s, why = tokens_per_second(shape, w, 790e12)
        assert abs(tok_s / row["real_tok_s"] - 1) <= 0.10, (row["name"], tok_s, row["real_tok_s"])
        assert row["name"] in why and "attention FLOPs counted" in why
    for table in fitted()["mfu"].values():
        for key, (_, why) in table.items():
            assert key.endswith(" long") or "long-" not in why, (key, why)
    # the same MFU read for short rows would promise 32k rows far more than was measured
    row = next(r for r in rows if r["name"] == "long-r1-32k-sdpa")
    short, _ = mfu_reference("single_gpu", "lora", True, model=R1)
    assert short * 790e12 / (4 * SHAPES[R1].matmul_params()) > 1.5 * row["real_tok_s"]


def test_plan_auto_sets_the_long_row_levers_and_keeps_the_users():
    from sft.machine import Launch, Machine

    # cards that leave 23.5 GiB (an RTX 4090 that also drives a display): with the compiled layers DDP at 32k is
    # predicted at 23.0 GiB by nvidia-smi, inside a bare card's 1 GiB margin but not this one's
    m = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.5,) * 3, bf16=True,
                host_ram_gib=128, launch=Launch(world_size=3, local_world_size=3, launched=True))
    bare = dataclasses.replace(m, gpu_memory_gib=(23.99,) * 3)
    model = SimpleNamespace(model="r1-distill-qwen-7b", mlp_tile_tokens=0, fp8="auto", compile_layers="auto")
    lora = SimpleNamespace(lora=True, qlora=False, lora_r=16)
    training = SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=1,
                               activation_checkpointing=False, offload_activations=False)
    data = SimpleNamespace(max_length=32768)
    options, chosen = planned_options(model, lora, data, training, m)
    assert options["mlp_tile_tokens"] == 4096 and options["offload_activations"] is True and chosen.roomy
    # under DDP at 32k the compiled layers would leave no margin: the run is told to leave them off, FP8 at auto
    assert options["compile_layers"] == "false" and "fp8" not in options and not chosen.fast.compiled
    assert "\n               compiled layers off (with them the plan needs" in prediction_line(chosen)  # the first screen
    # the user's --mlp_tile_tokens wins, and the plan is predicted with it: at 16k, no offloading is then needed
    model.mlp_tile_tokens = 4096
    options, chosen = planned_options(model, lora, SimpleNamespace(max_length=16384), training, bare,
                                           given={"mlp_tile_tokens"})
    assert "mlp_tile_tokens" not in options and options["offload_activations"] is False
    assert chosen.w.levers == Levers(4096, False) and chosen.roomy


def test_one_name_per_model_either_spelling_is_accepted(capsys):
    """The planner's shapes say deepseek-r1-distill-qwen-7b, the recipes and bench rows r1-distill-qwen-7b: the
    planner's --model, a recipe's name and the bench's --model take both."""
    import importlib

    from sft.configs import shipped_recipe
    from sft.options.recipe import load_recipe

    assert resolve_shape("r1-distill-qwen-7b") is resolve_shape(R1) is SHAPES[R1]
    assert hub_id("r1-distill-qwen-7b") == hub_id(R1) == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    for name in ("r1-distill-qwen-7b-long", "deepseek-r1-distill-qwen-7b-long.yaml",
                 "recipes/deepseek-r1-distill-qwen-7b-long.yaml"):
        assert shipped_recipe(name) == RECIPES / "r1-distill-qwen-7b-long.yaml", name
    assert load_recipe("deepseek-r1-distill-qwen-7b-lora") == load_recipe("r1-distill-qwen-7b-lora")
    assert mfu_reference("ddp", "lora", True, model="r1-distill-qwen-7b") == \
        mfu_reference("ddp", "lora", True, model=R1)
    assert R1 in fitted()["mfu"] and "r1-distill-qwen-7b" not in fitted()["mfu"]
    for name in ("r1-distill-qwen-7b", R1):
        assert main(["--model", name, "--lora", "--max_length", "32768", "--host_ram", "128"]) == 0
        assert "--mlp_tile_tokens 4096 --offload_activations" in capsys.readouterr().out
    sys.path.insert(0, str(REPO / "bench"))
    try:
        bench = importlib.import_module("train_throughput")
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert bench.bench_model(R1) == bench.bench_model("r1-distill-qwen-7b") == "r1-distill-qwen-7b"


# ---- 67B / 70B QLoRA on the box (issue 26 item 4): FSDP2 over the 4-bit base, refused until its GPU check passes

BIG_QLORA = {"deepseek-llm-67b": "deepseek-llm-67b-qlora.yaml",
             "deepseek-r1-distill-llama-70b": "r1-distill-llama-70b-qlora.yaml"}


@pytest.mark.parametrize("model", BIG_QLORA)
def test_67b_and_70b_qlora_plan_is_its_recipe_and_awaits_its_check(model, capsys):
    """On 3 x 24 GB the only plan that fits is FSDP over the 4-bit base, below the card less its margin; the
    planner gives its command as refused until bench/qlora_check.py --fsdp two passes (exit 1: nothing runs
    today), never as Recommended; the recipe holds that plan's values."""
    from sft.configs import RECIPES
    from sft.options.recipe import load_recipe

    recipe = load_recipe(str(RECIPES / BIG_QLORA[model]))
    value = lambda name: option_value(recipe, f"--{name}")  # noqa: E731
    length, mb, accumulation = value("max_length"), value("per_device_train_batch_size"), \
        value("gradient_accumulation_steps")
    assert main(["--model", model, "--qlora", "--gpus", "3", "--gpu_mem", "24", "--host_ram", "512",
                      "--max_length", length, "--gradient_accumulation_steps", accumulation]) == 1
    out = capsys.readouterr().out
    assert "Recommended:" not in out
    line = next(x for x in out.splitlines() if x.startswith("Fits, but refused until"))
    assert AWAITED_CHECK in line and "--config_file accelerate_configs/fsdp.yaml" in line
    assert f"--per_device_train_batch_size {mb} " in line and f"--max_length {length} " in line
    assert f"--gradient_accumulation_steps {accumulation} " in line and line.endswith("--activation_checkpointing")
    assert "the run today: error: --qlora under FSDP: not enabled until its check passes" in out
    assert value("qlora") == "true" and value("activation_checkpointing") == "true"
    for name in ("attn_implementation", "use_liger_kernel"):
        assert value(name) == str(kernels("fsdp", SHAPES[model])[name]).lower()
    box = Box(3, 24.0, 512.0)
    waiting = awaiting_plan(enumerate_plans(SHAPES[model], box, "qlora", int(length), (1, 2, 4, 8),
                                                      grad_accum=int(accumulation)))
    assert waiting.w.strategy == "fsdp" and waiting.w.micro_batch == int(mb) and waiting.w.checkpointing
    assert waiting.prediction.smi_gib <= box.card_gib - MARGIN_GIB and waiting.awaits
    assert str(round(waiting.prediction.smi_gib, 1)) in (RECIPES / BIG_QLORA[model]).read_text()  # its header


def test_refused_plans_are_never_recommended_nor_planned():
    """A plan the run refuses today (FSDP + QLoRA) is not best_plan, which `--plan auto` applies; on the 7B the
    DDP QLoRA plan, which runs, is recommended."""
    plans = enumerate_plans(SHAPES["deepseek-llm-67b"], Box(3, 24.0, 512.0), "qlora")
    assert best_plan(plans) is None and awaiting_plan(plans).w.strategy == "fsdp"
    assert all("refused until" in p.mark() for p in plans if p.w.strategy == "fsdp" and p.fits)
    seven = enumerate_plans(SHAPES["deepseek-llm-7b"], Box(3, 24.0, 512.0), "qlora")
    assert best_plan(seven).w.strategy == "ddp" and awaiting_plan(seven) is not None
    assert enumerate_plans(SHAPES["deepseek-llm-7b"], BOX, "lora")[0].awaits is None


def test_fsdp_qlora_memory_counts_the_4bit_base_as_it_moves():
    """FSDP + QLoRA from the units accelerate builds: the base sharded in NF4, two decoder layers gathered as NF4
    bytes (not bf16) with one linear dequantized in pieces beside them, or the bf16 tail (lm_head) at the end of
    the forward, whichever is larger; the allocator's cache over the gathered bytes; every rank holding the NF4
    base in host RAM as it reads the checkpoint weight by weight. At 2048 tokens the 70B's 2.1 GB lm_head leaves less than the card's margin."""
    from sft.model.nf4_layout import dequantize_peak_bytes
    from sft.parallel.strategies import NF4_BYTES

    shape = SHAPES["deepseek-llm-67b"]
    qlora, lora = (Workload("fsdp", Setup(m), 3, 1, 2048, True) for m in ("qlora", "lora"))
    transient, gathered = fsdp_adapter_buffers(shape, qlora)
    layer = shape.layer_params(0) - 2 * shape.hidden
    assert 2 * layer * NF4_BYTES < gathered == 2 * (shape.vocab * shape.hidden + shape.hidden)  # the tail's moment
    assert transient == gathered  # the layers' moment is smaller: 2 NF4 layers + one dequantized MLP weight
    assert 2 * layer * NF4_BYTES + dequantize_peak_bytes(22016, 8192, 3) < transient
    assert dequantize_peak_bytes(22016, 8192, 3) < 2 * 2 * 22016 * 8192  # pieces: not torchao's 7x of the whole
    assert fsdp_adapter_buffers(shape, lora)[0] == 2 * (2 * layer + 2 * 2 * shape.hidden
                                                              + shape.lora_params(16) / shape.layers * 2)
    p = predict(shape, qlora)
    assert p.parts["weights"] * GIB == pytest.approx((shape.linear_params() * NF4_BYTES + (
        shape.params() - shape.linear_params()) * 2 + shape.lora_params(16) * 4) / 3)
    assert p.parts["cache"] == pytest.approx(CALIBRATION["cache_per_gathered"]["fsdp"] * gathered / GIB)
    # each rank: the NF4 base, the rest in bf16, the largest linear (the MLP's 22016 x 8192) in flight in bf16
    assert p.host_gib == pytest.approx(20 + 3 * (shape.linear_params() * NF4_BYTES + (
        shape.params() - shape.linear_params()) * 2 + 22016 * 8192 * 2) / GIB)
    seventy = SHAPES["deepseek-r1-distill-llama-70b"]
    assert (round(p.host_gib), round(predict(seventy, qlora).host_gib)) == (125, 132)  # as docs/planner.md says
    assert seventy.params() == pytest.approx(70.55e9, rel=1e-3)
    plans = enumerate_plans(seventy, Box(3, 24.0, 512.0), "qlora")
    assert awaiting_plan(plans) is None and best_plan(plans) is None


def test_the_autoep_plan_holds_its_share_of_the_experts_and_is_never_recommended_unmeasured():
    """sft/plan/expert_parallel.py: V2-Lite under DeepSpeed AutoEP on 2 cards holds DDP's bf16 base less half the
    routed experts (from first principles: no row measured it), plus its all-to-all buffers; its speed is the
    resident plan's MFU and says it is not measured: listed, never recommended, whatever its estimate."""
    from sft.plan import expert_parallel

    shape = SHAPES["deepseek-v2-lite"]
    plans = enumerate_plans(shape, Box(2, 24, host_ram_gib=128), "lora", 2048, (4,))
    autoep = next(p for p in plans if p.w.strategy == "autoep" and p.w.checkpointing)
    assert autoep.w.world == 2 and autoep.w.chunked_loss  # no Liger for MLA: the loss in chunks, as its bench row
    expert_bytes = 26 * 64 * 3 * 2048 * 1408 * 2  # 28.8 GB of bf16 routed experts
    assert expert_parallel.experts_elsewhere(shape) == expert_bytes / 2
    weights = autoep.prediction.parts["weights"] * GIB
    assert weights == pytest.approx(shape.params() * 2 - expert_bytes / 2 + shape.lora_params(16) * 2)
    assert autoep.fits and autoep.speed_unmeasured and "not recommended: speed not measured" in autoep.mark()
    assert "AutoEP's speed is not measured yet (bench row moe-lora-autoep-ddp" in autoep.tok_s_source
    assert not recommended(autoep) and best_plan(plans).w.strategy != "autoep"
    faster = dataclasses.replace(autoep, tok_s=autoep.tok_s * 100)  # an estimate far above every other plan
    assert best_plan([faster, *plans]) is best_plan(plans)
    assert ranked([faster, *plans])[0] is not faster
    line = command(autoep, "deepseek-v2-lite", Box(2, 24))
    assert "--config_file accelerate_configs/autoep.yaml --num_processes 2" in line
    # the loss in chunks without asking: --chunked_loss auto takes it for an MLA model
    assert line.endswith("--activation_checkpointing") and "--quantize_experts" not in line
    # its command runs as printed: parsed with the DeepSpeed JSON its accelerate config names, checked on its box
    import shlex

    from sft.machine import Launch, Machine
    from sft.options.arguments import parse_args, validate_setup

    args = shlex.split(line.replace("data.jsonl", str(REPO / "data" / "alpaca_demo.json")))
    args = [a for a in args[args.index("sft/train.py") + 1:] if a != "--bf16"]  # no bf16 on this CPU: set below
    parsed = parse_args([*args, "--deepspeed", str(REPO / "ds_configs" / "autoep.json"), "--output_dir",
                         "/nonexistent/out"])
    parsed[3].bf16 = True
    box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 2, gpu_memory_gib=(23.99,) * 2, bf16=True,
                  host_ram_gib=128, host_ram_available_gib=120, launch=STRATEGIES["autoep"].launch(2))
    validate_setup(*parsed, machine=box)
    dense = enumerate_plans(SHAPES["deepseek-llm-7b"], Box(2, 24, host_ram_gib=128), "lora", 2048)
    assert not any(p.w.strategy == "autoep" for p in dense)  # a model without routed experts has no such plan


# ---- issue 27 item 3: --sequence_parallel N planned (sft/plan/sequence_parallel.py), its speed not measured

def sp_plans(gpus: int = 3, length: int = 65536, model: str = R1) -> list:
    return enumerate_plans(SHAPES[model], Box(gpus, 24, host_ram_gib=128), "lora", length)


def test_the_sp_plan_holds_a_slice_through_the_layers_and_the_whole_row_at_attention():
    """Per card: the ZeRO-3 base over the 2 launched processes; the long-row activations of a 32k slice (as a 32k
    row's: the same levers, the loss in chunks); plus the layer's attention over all 65k tokens with 14 of the 28
    heads (q, k, v, output) and the all-to-all buffers, twice that. N divides the heads, and the key/value heads
    divide by N or N by them; no MLA model."""
    from sft.plan import sequence_parallel

    shape = SHAPES[R1]
    assert sequence_parallel.sizes(shape, 3) == [2] and sequence_parallel.sizes(shape, 4) == [2, 4]  # 28 heads, 4 kv
    assert sequence_parallel.sizes(SHAPES["deepseek-r1-distill-qwen-1.5b"], 3) == [2]  # 12 heads, 2 kv: not 3
    assert sequence_parallel.sizes(SHAPES["deepseek-v2-lite"], 3) == []
    split = split_plan(sp_plans())
    w = split.w
    assert (w.strategy, w.world, w.sequence_parallel, w.slice_len, w.chunked_loss, w.fused_loss) == \
        ("zero3", 2, 2, 32768, True, False)
    assert sequence_parallel.processes(3, 2) == 2 and sequence_parallel.processes(4, 2) == 4
    parts = split.prediction.parts
    whole = predict(shape, dataclasses.replace(w, world=3, sequence_parallel=1))
    assert parts["weights"] * 2 == pytest.approx(whole.parts["weights"] * 3)  # the base over 2 processes, not 3
    attention = 4 * 65536 * 14 * 128 * 2  # bytes: q, k, v and the output of the gathered row, 14 heads each
    assert parts["sequence_parallel_attention"] * GIB == pytest.approx(3 * attention)  # + the all-to-alls
    slice_row = predict(shape, dataclasses.replace(w, seq_len=32768, sequence_parallel=1))
    assert parts["activations"] - parts["sequence_parallel_attention"] == pytest.approx(
        slice_row.parts["activations"])
    assert parts["offloaded_activations"] == pytest.approx(slice_row.parts["offloaded_activations"])
    assert parts["activations"] < 0.5 * predict(shape, dataclasses.replace(w, chunked_loss=False)).parts[
        "activations"]  # no whole logits: the loss in chunks
    assert not any(p.w.sequence_parallel > 1 for p in sp_plans(length=4096))  # short rows are not split
    assert not any(p.w.sequence_parallel > 1 for p in sp_plans(model="deepseek-v2-lite"))


def test_an_sp_plan_is_recommended_only_where_no_measured_plan_fits():
    """Its speed is not measured (one card's long-row MFU, said so): beside a measured plan that fits with its
    margin it is never recommended, however fast its estimate, and the planner prints it as the other way; where no
    measured plan fits, it is the recommendation, saying its speed is not measured. Never at or over the card."""
    plans = sp_plans()
    split, best = split_plan(plans), best_plan(plans)
    assert split.speed_unmeasured and not recommended(split) and split.last_resort and split.roomy
    assert "sequence parallelism's speed is not measured yet (bench row long-r1-64k-sp2" in split.tok_s_source
    assert "recommended only where no measured plan fits" in split.mark()
    assert best.w.sequence_parallel == 1 and not best.speed_unmeasured
    faster = dataclasses.replace(split, tok_s=split.tok_s * 100)
    assert best_plan([faster, *plans]) is best
    unmeasured_only = [p for p in plans if not p.ready]
    assert best_plan(unmeasured_only) is split
    others = best_plan([p for p in unmeasured_only if p is not split and p.w.sequence_parallel > 1])
    assert others is None or others.last_resort  # the next SP plan, where one fits with its margin
    for gpus in (2, 3, 4):
        for length in (8192, 32768, 65536, 131072):
            found = sp_plans(gpus, length)
            for chosen in (best_plan(found), split_plan(found),
                           best_plan([p for p in found if p.w.sequence_parallel > 1])):
                assert chosen is None or chosen.prediction.smi_gib <= Box(gpus, 24).card_gib - MARGIN_GIB


def test_the_planner_prints_the_split_plans_command_and_it_runs(monkeypatch, capsys):
    """65,536-token rows on 3 x 24 GB: the recommendation is unchanged (a measured kind's), and the SP plan's exact
    command follows it: 2 processes under ZeRO-3, sdpa, no --packing, its levers and --sequence_parallel 2. It parses
    and passes every check on its box. Where no measured plan fits, it is the recommendation and says so."""
    import re
    import shlex

    from sft.machine import Machine
    from sft.options.arguments import parse_args, validate_setup

    argv = ["--model", R1, "--lora", "--gpus", "3", "--gpu_mem", "24", "--max_length", "65536", "--host_ram", "128"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Recommended: .*--config_file accelerate_configs/zero2\.yaml sft/train\.py", out, re.M)
    line = re.search(r"^Each row split over 2 cards instead \(its speed is not measured.*?: (.+)$", out, re.M).group(1)
    assert "--config_file accelerate_configs/zero3.yaml --num_processes 2 sft/train.py" in line
    assert line.endswith("--attn_implementation sdpa --activation_checkpointing --mlp_tile_tokens 4096 "
                         "--offload_activations --sequence_parallel 2") and "--packing" not in line
    predicted = float(re.search(r"sequence parallelism.*$", out, re.S) and
                      re.findall(r"predicted ([\d.]+) GiB per GPU", out)[-1])
    assert predicted <= Box(3, 24).card_gib - MARGIN_GIB
    args = shlex.split(line.replace("data.jsonl", str(REPO / "data" / "alpaca_demo.json")))
    args = [a for a in args[args.index("sft/train.py") + 1:] if a != "--bf16"]  # no bf16 on this CPU: set below
    size = args.index("--sequence_parallel")
    parsed = parse_args([*args[:size], *args[size + 2:], "--output_dir", "/nonexistent/out"])
    parsed[3].bf16, parsed[3].sequence_parallel = True, 2  # this machine is no DeepSpeed launch of 2: set back
    box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                  host_ram_gib=128, host_ram_available_gib=120, launch=STRATEGIES["zero3"].launch(2))
    validate_setup(*parsed, machine=box)
    # no measured plan fits (here: none offered): the SP plan is recommended, and says its speed is not measured
    enumerate_all = enumerate_plans
    monkeypatch.setattr(planner, "enumerate_plans", lambda *a, **k: [p for p in enumerate_all(*a, **k) if not p.ready])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Recommended (its speed is not measured, and no plan whose speed is measured fits): " in out
    assert "--sequence_parallel 2" in out.split("Recommended")[1] and "Each row split" not in out


def test_the_64k_recipe_is_the_planners_split_plan():
    """recipes/r1-distill-qwen-7b-64k.yaml: the command its header gives the planner prints this recipe's plan
    (test_each_recipe_is_the_planners_plan_for_its_micro_batch checks its strategy, levers and margin), with its
    prediction, and the header says no GPU row measured it."""
    from sft.options.recipe import load_recipe

    recipe = RECIPES / "r1-distill-qwen-7b-64k.yaml"
    text, options = recipe.read_text(), load_recipe(str(recipe))
    value = lambda name: option_value(options, f"--{name}")  # noqa: E731
    plans = enumerate_plans(SHAPES[R1], Box(3, 24, host_ram_gib=128), "lora", int(value("max_length")),
                                 (int(value("per_device_train_batch_size")),),
                                 grad_accum=int(value("gradient_accumulation_steps")))
    split = split_plan(plans)
    assert (int(value("sequence_parallel")), value("attn_implementation"), value("packing")) == \
        (split.w.sequence_parallel, "sdpa", "false")
    assert f"--num_processes {split.w.world} sft/train.py" in text and "accelerate_configs/zero3.yaml" in text
    assert f"{split.prediction.smi_gib:.1f} GiB per GPU by nvidia-smi" in text
    assert f"~{split.tok_s:,.0f} tok/s" in text and "its speed is not measured" in text
    assert "No GPU row has measured it yet: bench row long-r1-64k-sp2" in text
    best = best_plan(plans)  # what the header says the planner recommends instead
    # ZeRO-2 since the compiled layers' memory at long rows was measured (DDP's NCCL context leaves it tight)
    assert f"ZeRO-2, a whole row on each of the 3 cards: {best.prediction.smi_gib:.1f} GiB predicted" in text
    assert (best.w.strategy, best.w.world) == ("zero2", 3)


def measured_split_row(peak_flops: float) -> dict:
    """A row as bench/throughput.py's long-r1-64k-sp2 would write it once measured (its options; made-up numbers of
    the same order as long-r1-32k's, its MFU the bench's: tok/s x 4N over the peak of its 2 GPUs)."""
    tok_s = 9000.0
    return {"run_id": "20991231T0000Z-made-up", "commit": "test", "gpu": "NVIDIA H200", "n_gpus": 2,
            "mem_cap_gib": 24.0, "model": "r1-distill-qwen-7b", "method": "lora", "strategy": "zero3", "peer": "ours",
            "seq_len": 65536, "micro_batch": 1, "grad_accum": 1, "real_tok_s": tok_s,
            "mfu": tok_s * 4 * SHAPES[R1].matmul_params() / (peak_flops * 2), "peak_mem_gib": 19.5,
            "peak_allocated_gib": 18.9, "nvidia_smi_mem_gib": 21.9, "host_ram_gib": 30.0, "name": "long-r1-64k-sp2",
            "train_args": "--lora_dropout 0 --attn_implementation sdpa --activation_checkpointing true "
                          "--offload_activations true --mlp_tile_tokens 4096 --sequence_parallel 2"}


def test_a_measured_split_row_is_its_own_kind(tmp_path, monkeypatch):
    """A measured --sequence_parallel row (long-r1-64k-sp2's kind, in a results file of today's rows, it, and a
    ZeRO-2 pair of such rows without and with FP8) gives the SP plans of its size, family and method their speed,
    and --check its memory, and nothing else: the snapshot fitted with them is today's but for their own `sp2` keys
    (ZeRO-3's long-row MFU, and the fast paths' memory, which the FP8 twin would move, unchanged). The plan of its
    configuration then predicts its tok/s, and is measured (ranked as any plan)."""
    import json

    peak = 989e12
    row = measured_split_row(peak)
    zero2 = dict(row, strategy="zero2", name="long-zero2-sp2", mfu=row["mfu"] * 1.2)
    zero2_fp8 = dict(zero2, name="long-zero2-sp2-fp8", peak_mem_gib=15.0,
                     train_args=row["train_args"] + " --fp8 true")  # a twin without it: what fast_path_memory fits on
    results = tmp_path / "results.jsonl"
    results.write_text(RESULTS.read_text() + "".join(json.dumps(r) + "\n" for r in (zero2, zero2_fp8, row)))
    today = fitted()
    numbers = json.loads(json.dumps(fitted_numbers(results)))
    assert {k: v for k, v in numbers.items() if k != "mfu"} == {k: v for k, v in today.items() if k != "mfu"}
    for model, table in numbers["mfu"].items():
        own = {k: v for k, v in table.items() if not k.endswith(" sp2")}
        assert own == today["mfu"][model], model  # every other kind's MFU, ZeRO-3's long rows' included
    split_keys = {k for k in numbers["mfu"][R1] if k.endswith(" sp2")}
    assert split_keys == {f"{s} lora {c} long sp2" for s in ("zero3", "zero2") for c in ("ckpt", "no-ckpt")} | \
        {f"zero2 lora {c} fp8 long sp2" for c in ("ckpt", "no-ckpt")}
    mfu, why = numbers["mfu"][R1]["zero3 lora ckpt long sp2"]
    assert "of 1 rows (long-r1-64k-sp2)" in why and "rows split by --sequence_parallel 2" in why  # its family's
    _, why = mfu_reference("zero3", "lora", True, results, R1, long=True, sequence_parallel_size=4)
    assert "rows split by" not in why and "speed is not measured yet" in why  # another size's all-to-alls
    w = workload_of_row(row)
    matmul = 4 * SHAPES[R1].matmul_params()
    assert mfu == pytest.approx(row["mfu"] * (matmul + long_row_flops_per_token(SHAPES[R1], w)) / matmul)

    before = {(p.w.strategy, p.w.sequence_parallel, p.w.micro_batch, p.w.levers): p.tok_s for p in sp_plans()}
    monkeypatch.setattr(snapshot, "fitted", lambda: numbers)
    plans = enumerate_plans(SHAPES[R1], Box(3, 24, host_ram_gib=128, peak_flops=peak), "lora", 65536)
    split = next(p for p in plans if p.w.sequence_parallel == 2 and p.w.strategy == "zero3"
                 and (p.w.checkpointing, p.w.levers) == (w.checkpointing, w.levers) and p.w.micro_batch == 1)
    assert not split.speed_unmeasured and "long-r1-64k-sp2" in split.tok_s_source
    assert split.tok_s == pytest.approx(row["real_tok_s"])  # the measured configuration predicts its tok/s
    assert split_plan(plans).ready and "speed not measured" not in split_plan(plans).mark()
    zero2_split = next(p for p in plans if p.w.sequence_parallel == 2 and p.w.strategy == "zero2")
    assert not zero2_split.speed_unmeasured and "long-zero2-sp2" in zero2_split.tok_s_source
    assert "long-r1-64k-sp2" not in zero2_split.tok_s_source  # another family's split row
    after = {(p.w.strategy, p.w.sequence_parallel, p.w.micro_batch, p.w.levers): p.tok_s for p in sp_plans()}
    assert {k: v for k, v in after.items() if k[1] == 1} == {k: v for k, v in before.items() if k[1] == 1}

    checked = check_rows(results)
    assert checked[:-3] == check_rows()  # every other row's check unchanged
    mine = checked[-1]
    predicted = predict(SHAPES[R1], w)
    assert (mine["name"], mine["strategy"], mine["sequence_parallel"], w.world, w.slice_len) == \
        ("long-r1-64k-sp2", "zero3", 2, 2, 32768)
    assert predicted.parts["sequence_parallel_attention"] > 0
    assert (mine["pred_reserved"], mine["reserved"]) == (predicted.capped(24.0)[0], row["peak_mem_gib"])
    assert mine["err_smi"] == pytest.approx(predicted.capped(24.0)[1] / row["nvidia_smi_mem_gib"] - 1)
    assert "| long-r1-64k-sp2 (0000Z) | zero3+sp2 | lora | 2 |" in check_table(checked)


def test_plan_auto_plans_the_split_only_for_a_launch_of_its_processes():
    """`--plan auto` under a ZeRO-3 launch: with --sequence_parallel 2 given on 2 processes, the SP plan's options
    (its kernels, no packing, its levers); on 3 processes no SP plan is planned (the run's check refuses the size)."""
    from sft.machine import Launch, Machine

    def machine(processes: int) -> Machine:
        return Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                       host_ram_gib=128, launch=Launch(world_size=processes, local_world_size=processes,
                                                       launched=True, zero_stage="3"))

    model = SimpleNamespace(model="r1-distill-qwen-7b", mlp_tile_tokens=0, attn_implementation="flex_attention")
    lora = SimpleNamespace(lora=True, qlora=False, lora_r=16)
    training = SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=1, sequence_parallel=2,
                               activation_checkpointing=False, offload_activations=False, use_liger_kernel=False)
    data = SimpleNamespace(max_length=65536, packing=True)
    options, chosen = planned_options(model, lora, data, training, machine(2), given={"sequence_parallel"})
    assert chosen.w.sequence_parallel == 2 and chosen.roomy and "sequence_parallel" not in options
    assert options["packing"] is False and options["attn_implementation"] == "sdpa"
    assert options["use_liger_kernel"] is False and options["offload_activations"] is True
    assert planned_options(model, lora, data, training, machine(3), given={"sequence_parallel"}) == \
        NOT_PLANNED
    options, chosen = planned_options(model, lora, data, training, machine(2))  # a measured plan fits there
    assert chosen.w.sequence_parallel == 1 and "sequence_parallel" not in options


def test_a_row_is_planned_with_the_fast_paths_its_model_held():
    """A recipe row runs `auto`, which settles by the GPU: the options alone do not say whether FP8 and the
    compiled layers ran; the bench records what the model held, and the planner's check reads that first."""
    from sft.plan.rows import fast_of_row

    row = {"gpu": "NVIDIA H100 80GB HBM3", "n_gpus": 1, "strategy": "single", "method": "lora",
           "train_args": "--config recipes/r1-distill-qwen-7b-lora.yaml"}
    assert fast_of_row(row).label == ""  # no record: a recipe row of the days the bench passed false first
    assert fast_of_row({**row, "fp8_layers": 196, "compiled_layers": 28}).label == "fp8+compiled"
    assert fast_of_row({**row, "fp8_layers": 196, "compiled_layers": 0}).label == "fp8"


def test_a_long_plans_speed_is_read_from_rows_of_its_own_attention():
    """A dense model's long plans run varlen, as the long recipe does (sft/plan/kernels.py): their MFU pool holds the
    32k rows that ran it, or sdpa's causal kernel on one conversation a row (the same kernel), and leaves out the
    flex_attention rows, which ran 0.8-0.9x as fast (long-r1-32k-default against long-r1-32k-sdpa-default); the 4k
    rows (short plans: flex_attention) stay."""
    from sft.plan.speed import long_mfu_rows

    names = {r["name"] for r in long_mfu_rows(RESULTS, "r1-distill-qwen-7b")}
    assert {"long-r1-32k-sdpa", "long-r1-32k-varlen-default", "long-r1-4k"} <= names
    assert not names & {"long-r1-32k", "long-r1-32k-default", "long-r1-16k"}
