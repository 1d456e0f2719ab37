"""sft/speed/fp8.py: `--fp8` under LoRA, the frozen base's linear layers in FP8. torch 2.13's CPU build runs
`torch._scaled_mm` on float8 with rowwise scales, so the real autograd function runs here; the GPU's kernels and
speed are bench/fp8_check.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sft.speed.fp8 import E4M3, E4M3_MAX, Fp8Linear, quantize_rows, use_fp8_base


def test_quantize_rows_error_bound_zero_rows_and_extremes():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator) * torch.logspace(-4, 4, 64).unsqueeze(1)
    x[3] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and scale.shape == (64, 1)
    back = q.float() * scale
    # e4m3 keeps 3 bits of mantissa: half a spacing is 2**-4 of the value; below 2**-6 (subnormals) the spacing
    # is fixed at 2**-9 of the scale
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert bool(((back - x).abs() <= bound).all())
    assert bool((back[3] == 0).all()) and bool(torch.isfinite(scale).all())
    rows = torch.arange(64) != 3
    assert bool((q.float().abs().amax(dim=1)[rows] == E4M3_MAX).all())  # each row's largest value uses the range



def test_the_compiled_quantize_compiles_once_whatever_the_grad_mode_and_autocast():
    """The eager FP8 op quantizes in a forward (autocast on), its backward (off) and checkpoints' recomputes (grad
    on or off); dynamo guards on that state, and its 9th compile failed hard under fullgraph on a GPU (32k rows,
    tiled MLPs). It also guarded on the input's requires_grad and, for a view (a tile of the sequence), on its
    base's sizes. One compile serves every state, row count, base and requires_grad here, with the limit at 1."""
    import itertools

    from sft.model.quantized_experts import _compiled_dequantize
    from sft.speed.fp8 import _compiled_quantize, call_compiled

    def reset() -> None:
        torch._dynamo.reset()
        _compiled_quantize.cache_clear()
        _compiled_dequantize.cache_clear()

    reset()
    generator = torch.Generator().manual_seed(0)
    states = [(grad, autocast, dtype) for (grad, autocast), dtype in zip(
        itertools.product((True, False), repeat=2), (torch.bfloat16, torch.float16) * 2)]
    for rows, (grad, autocast, dtype), needs_grad in zip((64, 32, 96, 48), states, (True, False, False, True)):
        # a tile: rows of one sequence out of a [1, tokens, hidden] activation, itself maybe needing a gradient
        base = torch.randn(1, rows + 16, 32, generator=generator).to(torch.bfloat16).requires_grad_(needs_grad)
        x = base[0, 8:8 + rows]
        with (torch._dynamo.config.patch(recompile_limit=1), torch.set_grad_enabled(grad),
              torch.autocast("cpu", dtype=dtype, enabled=autocast)):
            q, scale = call_compiled(_compiled_quantize(), x)
            # the MoE experts' dequantize (sft/model/quantized_experts.py) goes the same way, one shape here
            weights = call_compiled(_compiled_dequantize(), q[:32], scale[:32], torch.bfloat16)
        want_q, want_scale = quantize_rows(x.detach())
        assert torch.equal(q.float(), want_q.float()) and torch.equal(scale, want_scale)
        assert torch.equal(weights, (want_q[:32].float() * want_scale[:32]).to(torch.bfloat16))
    reset()

def emulate(x, x_scale, w, w_scale):
    """What _scaled_mm computes: dequantized operands, fp32 products and sums, one rounding to bf16."""
    return ((x.float() * x_scale) @ (w.float() * w_scale.view(1, -1).t()).t()).bfloat16()


def test_forward_and_input_gradient_match_their_emulation_and_the_weight_gets_no_gradient():
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 128, bias=False).to(torch.bfloat16)
    layer = Fp8Linear(linear)
    assert layer.weight.dtype == E4M3 and not layer.weight.requires_grad and layer.compute_dtype == torch.bfloat16
    x = torch.randn(2, 8, 256, generator=generator).bfloat16().requires_grad_()
    grad_out = torch.randn(2, 8, 128, generator=generator).bfloat16()
    out = layer(x)
    out.backward(grad_out)

    q, s = quantize_rows(x.detach().reshape(-1, 256))
    want = emulate(q, s, layer.weight, layer.weight_scale).view(2, 8, 128)
    assert out.dtype == torch.bfloat16 and (out.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    q, s = quantize_rows(grad_out.reshape(-1, 128))
    want = emulate(q, s, layer.weight_t, layer.weight_t_scale).view(2, 8, 256)
    assert (x.grad.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    assert layer.weight.grad is None
    # against the bf16 layer: FP8's error, a few percent of the output's norm (measured here: 3.5%)
    with torch.no_grad():
        exact = linear(x.detach()).float()
    assert (out.float() - exact).norm() / exact.norm() < 0.08


def tiny_lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def test_lora_on_the_fp8_base_trains_saves_only_the_adapter_and_verifies(tmp_path):
    """peft's LoRA layers with Fp8Linear bases: the adapter gets gradients, the loss stays near the bf16 base's,
    the saved adapter holds LoRA weights only, sft.safety.verify's in-place check accepts it, and a cast of the whole
    model (DeepSpeed's engine does .bfloat16()) leaves the FP8 weights intact."""
    from safetensors.torch import load_file

    from sft.report.callbacks import flops_per_token
    from sft.safety.verify import SaveVerifier

    model = tiny_lora_model()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    flops = flops_per_token(model, lora=True)
    with torch.no_grad():
        bf16_logits = model(input_ids=ids, use_cache=False).logits.float()
    assert use_fp8_base(model) == (14, 0)
    assert flops_per_token(model, lora=True) == flops  # the base's weights still count (MFU)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    error = (out.logits.float() - bf16_logits).norm() / bf16_logits.norm()
    assert 0 < error < 0.08, error  # measured: 0.035 (random init, 2 layers)
    loss = out.loss
    loss.backward()
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained) and len(trained) == 28

    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert SaveVerifier("unused: the in-place check reloads no base", lora=True).adapter_in_place(
        model, tmp_path, ids) is None

    model.to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert all(m.weight.dtype == E4M3 and m.weight_t.dtype == E4M3 and m.weight_scale.dtype == torch.float32
               for m in layers)
    assert model(input_ids=ids, labels=ids, use_cache=False).loss.item() == loss.item()


def test_a_compiled_layer_quantizes_a_shared_input_once_and_gives_the_eager_gradients():
    """Under torch.compile the quantization is traced beside the FP8 matmul (sft/speed/fp8.py fp8_linear_traced): q/k/v
    read one quantized input and gate/up another (4 quantizations in the forward of a layer, not 7), and the
    loss and every adapter gradient are eager's. The first decoder layer's input needs no gradient (frozen
    embeddings), so its backward quantizes 4 output gradients (o, gate, up, down), not 7."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    counts = []

    def count_quantizations(graph, example_inputs):
        counts.append(sum(node.target is torch.ops.aten.amax.default for node in graph.graph.nodes))
        return make_boxed_func(graph)

    backend = aot_autograd(fw_compiler=count_quantizations, bw_compiler=count_quantizations,
                           partition_fn=min_cut_rematerialization_partition)  # inductor's partitioner: CSE on
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = []
    for compiled in (False, True):
        model = tiny_lora_model()
        for name, p in model.named_parameters():
            if "lora_B" in name:  # nonzero, so every adapter weight gets a gradient
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
        use_fp8_base(model)
        if compiled:
            torch._dynamo.reset()
            layer = model.base_model.model.model.layers[0]
            layer.compile(backend=backend, fullgraph=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert counts == [4, 4]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 28
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_lora_on_a_weight_parameter_keeps_training_over_an_fp8_base():
    """peft's ParamWrapper (LoRA through target_parameters: the MoE families' dense and shared-expert MLPs) adds
    B @ A to the base's weight in each forward; over an Fp8Linear that left the adapter out (no gradient, the
    adapter never trained). Split as base(x) + B(A(x)) * scaling: peft's own forward's numbers over the same
    weights, gradients for A and B, and one graph under torch.compile."""
    from peft import LoraConfig, get_peft_model
    from torch._dynamo.utils import counters

    from sft.speed.fp8 import SplitParamLora

    def wrapped():
        torch.manual_seed(0)
        model = get_peft_model(nn.Sequential(nn.Linear(64, 48, bias=False)).to(torch.bfloat16),
                               LoraConfig(r=4, lora_alpha=8, target_parameters=["0.weight"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
        return model

    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    peft_model = wrapped()
    want = peft_model(x)
    want.float().square().sum().backward()
    want_grads = {n: p.grad.float() for n, p in peft_model.named_parameters() if p.grad is not None}

    split = wrapped()
    layer = split.base_model.model[0]
    original = layer.base_layer
    layer.__class__ = type("ParamWrapper", (SplitParamLora, type(layer)), {})  # the split form over the bf16 base
    got = split(x)
    assert layer.base_layer is original
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # one bf16 rounding of W + BA apart

    fp8_model = wrapped()
    assert use_fp8_base(fp8_model) == (1, 0)
    assert isinstance(fp8_model.base_model.model[0].base_layer, Fp8Linear)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fp8_model, fullgraph=True, backend="aot_eager")
    compiled(x).float().square().sum().backward()
    assert not counters["graph_break"]
    grads = {n: p.grad.float() for n, p in fp8_model.named_parameters() if p.grad is not None}
    assert grads.keys() == want_grads.keys() and len(grads) == 2  # lora_A and lora_B
    for name, grad in grads.items():
        assert (grad - want_grads[name]).norm() / want_grads[name].norm() < 0.1, name  # FP8's rounding only
    torch._dynamo.reset()


def test_layers_whose_shape_fp8_cannot_take_stay_bf16():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 32)).to(torch.bfloat16),
                           LoraConfig(r=4, target_modules=["0", "1"]))
    assert use_fp8_base(model) == (0, 2)  # 40 is not a multiple of 16
    model = get_peft_model(nn.Sequential(nn.Linear(64, 48)).to(torch.bfloat16), LoraConfig(r=4, target_modules=["0"]))
    assert use_fp8_base(model) == (1, 0)


def test_fp8_option_needs_a_gpu_with_fp8_and_no_4bit_base():
    from sft.options.checks import Options
    from sft.options.arguments import parse_args
    from sft.errors import ConfigError
    from sft.options.checks import fp8_base_needs
    from sft.machine import Launch, Machine

    with pytest.raises(ConfigError, match="--fp8 with --qlora"):
        parse_args(["--fp8", "true", "--qlora", "true"])
    if not torch.cuda.is_available():  # listed in sft/options/checks.py's CHECKS: refused before any model loads
        with pytest.raises(ConfigError, match="--fp8 needs a GPU with FP8"):
            parse_args(["--fp8", "true", "--lora", "true"])
        with pytest.raises(ConfigError, match=r"--fp8 needs a GPU with FP8.*the same fine-tune in bf16"):
            parse_args(["--fp8"])  # a bare --fp8 means true; a full fine-tune in FP8 needs the GPU too
    options = Options.of(*parse_args(["--fp8", "true", "--lora", "true"], data_only=True))  # the options alone
    with pytest.raises(ConfigError, match="--fp8 needs a GPU with FP8"):
        fp8_base_needs(options, Machine())
    ampere = Machine(gpu_names=("NVIDIA GeForce RTX 3090",), gpu_capabilities=((8, 6),))
    with pytest.raises(ConfigError, match="compute capability 8.6; FP8 matmuls need 8.9"):
        fp8_base_needs(options, ampere)
    h200 = dict(gpu_names=("NVIDIA H200",), gpu_capabilities=((9, 0),))
    fp8_base_needs(options, Machine(**h200))  # one GPU: fine
    with pytest.raises(ConfigError, match="--fp8 with FSDP under LoRA"):
        fp8_base_needs(options, Machine(**h200, launch=Launch(fsdp=True)))
    full = Options.of(*parse_args(["--fp8", "true"], data_only=True))
    fp8_base_needs(full, Machine(**h200, launch=Launch(fsdp=True)))  # a full fine-tune in FP8 under FSDP2: fine
    with pytest.raises(ConfigError, match="--fp8 with DeepSpeed ZeRO-3"):
        fp8_base_needs(full, Machine(**h200, launch=Launch(zero_stage="3")))
