"""What is held where (sft/report/placement.py): the first screen's `held` line of MoE and quantized-base runs
counts each weight where its storage lives, by part and dtype (issue 26 item 5). The line through a real run:
tests/test_quantized_experts.py."""

from __future__ import annotations

import torch

from conftest import tiny_config

MIB = 2**20


def tiny(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type)).to(torch.bfloat16)


def experts_numel(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))
               and p.dim() == 3)


def test_the_routed_experts_the_rest_and_the_adapter_are_counted_apart_in_their_dtypes():
    from peft import LoraConfig, get_peft_model

    from sft.model.quantized_experts import quantize_experts
    from sft.report.placement import held_text, holdings, worth_saying

    model = tiny("deepseek_v2")
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))  # RoPE's too
    routed = experts_numel(model)
    held = holdings(model)
    assert held[("host", "routed experts", "bfloat16")] == 2 * routed
    assert held[("host", "the rest", "bfloat16")] == total - 2 * routed
    assert worth_saying(held)  # an MoE model

    quantize_experts(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    held = holdings(model)
    assert held[("host", "routed experts", "e4m3")] == routed  # one byte a weight
    assert held[("host", "routed experts", "scales")] > 0
    assert held[("host", "LoRA adapter", "float32")] == adapter
    assert held[("host", "the rest", "bfloat16")] == total - 2 * routed
    text = held_text(held)
    assert text.startswith("host RAM (no GPU): routed experts") and "e4m3 (+" in text and "LoRA adapter" in text


def test_a_dense_model_on_a_machine_without_gpus_is_not_worth_a_line():
    from sft.report.placement import holdings, worth_saying

    assert not worth_saying(holdings(tiny("llama")))
    assert worth_saying({("GPU", "the rest", "bfloat16"): 1, ("host", "the rest", "bfloat16"): 1})  # offloaded
    assert worth_saying({("GPU", "the rest", "4-bit"): 1})  # a quantized base


def test_an_nf4_base_is_counted_as_its_4bit_bytes_not_as_bfloat16():
    """--qlora under FSDP holds the base as torchao's NF4Tensor, which says bfloat16 at 2 bytes a value: the held line
    counts its inner tensors (packed values, block scales, factors) as "4-bit NF4" at their own bytes, so a 67B/70B
    run prints its `held` line and, on GPUs, its end-of-run predicted-against-measured memory line."""
    from test_qlora_fsdp import tiny_nf4_model

    from sft.report.placement import held_text, holdings, size, worth_saying

    model = tiny_nf4_model(shards=2)
    nf4 = [p for p in model.parameters() if type(p).__name__ == "NF4Tensor"]
    assert len(nf4) == 14
    inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")  # torchao 0.18
    packed = sum(getattr(p, name).numel() * getattr(p, name).element_size() for p in nf4 for name in inner)
    assert packed < 0.3 * sum(p.numel() * p.element_size() for p in nf4)  # ~0.53 byte a value, not 2
    others = [t for t in (*model.parameters(), *model.buffers()) if type(t).__name__ != "NF4Tensor"]
    held = holdings(model)
    assert held[("host", "the rest", "4-bit NF4")] == packed
    assert held[("host", "the rest", "bfloat16")] == sum(t.numel() * t.element_size() for t in others
                                                         if not t.requires_grad and t.dtype == torch.bfloat16)
    assert held[("host", "LoRA adapter", "float32")] == sum(p.numel() * 4 for p in model.parameters()
                                                            if p.requires_grad)
    assert worth_saying(held)  # a quantized base
    assert held_text(held).startswith(f"host RAM (no GPU): the rest {size(packed)} 4-bit NF4, the rest ")


def test_the_first_screen_shows_held_and_memory_only_when_given():
    from sft.report.console import run_overview

    common = dict(model="m", architecture="DeepseekV2ForCausalLM", total_params=10, trainable_params=1,
                  dtype="bfloat16", adapter_dtype=None, mixed_precision="bf16", lora_rank=4, processes=1,
                  strategy="no parallelism", devices="1 GPU", per_device_batch=1, grad_accum=1, data_parallel=1,
                  mean_row_tokens=None, max_steps=1, epochs=None, resume_step=0, output_dir="out", saves="none",
                  tensorboard=None)
    plain = run_overview(**common)
    assert "held" not in plain and "memory" not in plain
    said = run_overview(**common, held="per GPU: routed experts 13.4 GiB e4m3; host: none",
                        memory="predicted peak 20.0 GiB per GPU")
    assert "  held         per GPU: routed experts 13.4 GiB e4m3; host: none" in said
    assert "  memory       predicted peak 20.0 GiB per GPU" in said


def test_the_memory_line_is_the_planners_plan_of_the_run_as_configured():
    """The planner's plan for the run's own launch, method, micro-batch and checkpointing on this machine; no
    number where it does not model the run, and why."""
    from types import SimpleNamespace as NS

    from sft.machine import Launch, Machine
    from sft.plan.this_run import predict_this_run, predicted_text

    box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                  host_ram_gib=128, launch=Launch(world_size=3, local_world_size=3, launched=True))
    model = NS(model="deepseek-v2-lite", quantize_experts="none", fp8="auto", compile_layers="auto")
    lora, data = NS(qlora=False, lora=True, lora_r=16), NS(max_length=2048)
    training = NS(per_device_train_batch_size=1, gradient_accumulation_steps=4, activation_checkpointing=True,
                  torch_compile=False)
    plan = predict_this_run(model, lora, data, training, box)
    assert (plan.w.strategy, plan.w.micro_batch, plan.w.checkpointing) == ("ddp", 1, True)
    assert predicted_text(plan, model, box).startswith(f"predicted peak {plan.prediction.smi_gib:.1f} GiB per GPU")
    assert plan.prediction.smi_gib > 24  # V2-Lite's bf16 base whole on each card: the user sees it cannot fit

    quantized = NS(**{**vars(model), "quantize_experts": "fp8", "chunked_loss_on": True})
    resident = predict_this_run(quantized, lora, data, training, box)  # the experts in e4m3: it fits a card
    assert (resident.w.strategy, resident.w.resident, resident.w.chunked_loss) == ("ddp", True, True)
    assert resident.prediction.smi_gib < 23
    four = NS(**{**vars(training), "per_device_train_batch_size": 4})  # the run's own --chunked_loss is predicted
    chunks = predict_this_run(quantized, lora, data, four, box)
    whole_logits = predict_this_run(NS(**{**vars(quantized), "chunked_loss_on": False}), lora, data, four, box)
    assert whole_logits.w.resident and not whole_logits.w.chunked_loss
    assert whole_logits.prediction.smi_gib > chunks.prediction.smi_gib + 1
    unreadable = NS(**{**vars(model), "model": "no/such-model-anywhere"})
    assert predict_this_run(unreadable, lora, data, training, box) is None


def test_the_memory_line_of_a_long_row_run_counts_its_own_levers():
    """A 32k-token run is predicted with the --mlp_tile_tokens and --offload_activations it was given, not with the
    levers the planner would pick: without them the same run is predicted over a 24 GB card."""
    from types import SimpleNamespace as NS

    from sft.machine import Launch, Machine
    from sft.plan.this_run import predict_this_run

    box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True,
                  host_ram_gib=128, launch=Launch(world_size=3, local_world_size=3, launched=True))
    lora, data = NS(qlora=False, lora=True, lora_r=16), NS(max_length=32768)
    training = NS(per_device_train_batch_size=1, gradient_accumulation_steps=2, activation_checkpointing=True,
                  torch_compile=False, offload_activations=True, use_liger_kernel=True)
    model = NS(model="r1-distill-qwen-7b", quantize_experts="none", fp8="auto", compile_layers="auto",
               mlp_tile_tokens=4096)
    levered = predict_this_run(model, lora, data, training, box)
    assert (levered.w.mlp_tile_tokens, levered.w.offload_activations) == (4096, True)
    bare = predict_this_run(NS(**{**vars(model), "mlp_tile_tokens": 0}), lora, data,
                            NS(**{**vars(training), "offload_activations": False}), box)
    assert (bare.w.mlp_tile_tokens, bare.w.offload_activations) == (0, False)
    assert levered.prediction.smi_gib < 23 < bare.prediction.smi_gib
    # ... and with the loss it runs: without Liger's (nor the loss in chunks) the 32k logits count, 152k wide
    whole = predict_this_run(model, lora, data, NS(**{**vars(training), "use_liger_kernel": False}), box)
    assert not whole.w.fused_loss and whole.prediction.smi_gib > levered.prediction.smi_gib + 20


def test_under_deepspeed_autoep_a_rank_holds_its_share_of_the_experts():
    """AutoEP's replacement layers (built here as its engine builds them, for rank 0 of 2, no process group needed):
    the held line counts this rank's half of the routed experts as routed experts, and the MoE hooks find them."""
    import json

    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    from conftest import REPO
    from sft.model.moe import expert_parallel_layers, expert_parallel_line
    from sft.report.placement import holdings

    model = tiny("deepseek_v2")
    routed = experts_numel(model)
    block = json.loads((REPO / "ds_configs" / "autoep.json").read_text())["expert_parallel"]
    autoep = AutoEP(model, parse_autoep_config(block))
    autoep.replace_moe_layers(autoep.ep_parser(), ep_size=2, ep_rank=0)
    layers = expert_parallel_layers(model)
    assert len(layers) == 1 and experts_numel(model) == 0  # the fused experts are gone
    assert holdings(model)[("host", "routed experts", "bfloat16")] == 2 * (routed // 2)  # half of them, 2 B each
    assert expert_parallel_line(layers).startswith("DeepSpeed AutoEP: 1 MoE layers, each GPU holds 2 of their 4")
