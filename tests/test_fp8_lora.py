"""--fp8 LoRA with the adapter inside the base's FP8 matmuls (sft/speed/fp8_lora.py): the product and gradients of
the unfused path to FP8's rounding, B = 0 giving the base's output, and where it applies."""

import pytest
import torch
from torch import nn

from sft.speed.fp8 import E4M3, Fp8Linear, use_fp8_base
from sft.speed.fp8_lora import FusedFp8Lora, apply_fused_lora, fp8_lora_linear, fusable, rank_rescale

K, N, R, M = 64, 48, 16, 40


def operands(seed: int = 0, b_std: float = 0.02):
    g = torch.Generator().manual_seed(seed)
    base = Fp8Linear(nn.Linear(K, N, bias=False).to(torch.bfloat16))
    w = (base.weight.float() * base.weight_scale.view(-1, 1)).float()  # the FP8 weight the base holds
    x = torch.randn(M, K, generator=g).bfloat16().requires_grad_()
    u = (torch.randn(M, R, generator=g) * 0.5).bfloat16().requires_grad_()
    b = (torch.randn(N, R, generator=g) * b_std).requires_grad_()  # peft's adapters are fp32
    grad_y = torch.randn(M, N, generator=g).bfloat16()
    return base, w, x, u, b, grad_y


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().float() - want.detach().float()).norm() / want.detach().float().norm())


def test_the_fused_product_and_gradients_are_the_unfused_ones_to_fp8_rounding():
    base, w, x, u, b, grad_y = operands()
    y = fp8_lora_linear(x, u, b, base)
    y.backward(grad_y)
    xf, uf, bf, gf = x.detach().float(), u.detach().float(), b.detach().float(), grad_y.float()
    assert y.dtype == torch.bfloat16 and relative(y, xf @ w.t() + uf @ bf.t()) < 0.08
    assert relative(x.grad, gf @ w) < 0.08  # grad_x through the base only: u's own path is autograd's (via A)
    assert relative(u.grad, gf @ bf) < 0.08  # in e4m3 now (bf16 in peft's path)
    assert b.grad.dtype == torch.float32 and relative(b.grad, gf.t() @ uf) < 0.01  # bf16, as peft's


def test_the_rescale_keeps_each_factor_value_in_its_weight_rows_range():
    base, *_ = operands()
    b = torch.randn(N, R) * torch.logspace(-6, 1, R)  # columns from far below to far above W's range
    g = rank_rescale(b, base.weight_scale)
    scaled = b / g / base.weight_scale.view(-1, 1)
    assert scaled.abs().max() <= 448.0 * (1 + 1e-6)
    assert torch.allclose(scaled.abs().amax(dim=0), torch.full((R,), 448.0))  # each column reaches it: no range lost
    assert torch.equal(rank_rescale(torch.zeros(N, R), base.weight_scale), torch.ones(R))


def test_a_fresh_adapter_gives_the_base_layers_output():
    base, _, x, u, _, _ = operands()
    fused = fp8_lora_linear(x, u, torch.zeros(N, R, requires_grad=True), base)
    plain = base(x)
    assert (fused.float() - plain.float()).abs().max() <= 2**-7 * plain.float().abs().max()


def tiny_lora_model(r: int = 16):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, task_type="CAUSAL_LM", target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # nonzero, so every adapter weight gets a gradient
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_a_compiled_layer_runs_its_adapters_in_the_fp8_matmuls_at_the_unfused_paths_error(monkeypatch):
    """Against the bf16 model, compiled the same way: the loss within FP8's rounding, and the adapters' gradients
    within 1.5x the error the unfused FP8 path already has (measured: medians 7.5% and 5.9%, maxima 9.2% and
    7.9%: the adapters' input gradients are e4m3 products now)."""
    import statistics

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    fused_ops = []

    def count(graph, example_inputs):
        fused_ops.append(sum(node.target is torch.ops.sft.fp8_lora_matmul.default for node in graph.graph.nodes))
        return make_boxed_func(graph)

    monkeypatch.setenv("SFT_FP8_FUSED_LORA", "1")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    runs = []
    for path in ("bf16", "fp8", "fused"):
        model = tiny_lora_model()
        if path != "bf16":
            use_fp8_base(model)
        if path == "fused":
            assert apply_fused_lora(model) == 14
        torch._dynamo.reset()
        for layer in model.base_model.model.model.layers:
            layer.compile(backend=aot_autograd(fw_compiler=count, bw_compiler=count), fullgraph=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        runs.append((float(loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert fused_ops[-4:] == [7, 7, 0, 0]  # the two forward graphs: 7 adapters each; none in the backward graphs
    (exact_loss, exact), (fp8_loss, fp8), (fused_loss, fused) = runs
    assert fused_loss == pytest.approx(exact_loss, rel=1e-3) and fp8_loss == pytest.approx(exact_loss, rel=1e-3)
    assert exact.keys() == fp8.keys() == fused.keys() and len(exact) == 28
    errors = {path: [relative(grads[n], exact[n]) for n in exact] for path, grads in (("fp8", fp8), ("fused", fused))}
    assert statistics.median(errors["fused"]) <= 1.5 * statistics.median(errors["fp8"])
    assert max(errors["fused"]) <= 1.5 * max(errors["fp8"])


def test_inductor_compiles_the_fused_layer_as_it_runs_eagerly():
    """The quantization of [x | u'] and of B' traced and fused by inductor (the GPU path), against the same function
    run eagerly."""
    base, _, x, u, b, grad_y = operands(seed=3)
    results = []
    for run in (fp8_lora_linear, torch.compile(fp8_lora_linear, fullgraph=True, dynamic=False)):
        for t in (x, u, b):
            t.grad = None
        y = run(x, u, b, base)
        y.backward(grad_y)
        results.append([y, x.grad, u.grad, b.grad])
    for eager, compiled in zip(*results):
        assert relative(compiled, eager) < 2e-2


def test_only_the_layers_the_fused_product_can_take_are_fused_and_only_when_asked(monkeypatch):
    model = tiny_lora_model()
    use_fp8_base(model)
    assert apply_fused_lora(model) == 0  # opt-in until measured on a GPU
    monkeypatch.setenv("SFT_FP8_FUSED_LORA", "1")
    model = tiny_lora_model(r=8)  # K + 8 is no multiple of 16
    use_fp8_base(model)
    assert apply_fused_lora(model) == 0
    model = tiny_lora_model()
    use_fp8_base(model)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    q_proj.base_layer.weight_scale[0, 3] = 0.0  # a weight row of zeros: g, and u' with it, would be unbounded
    assert not fusable(q_proj)
    assert apply_fused_lora(model) == 13 and not isinstance(q_proj, FusedFp8Lora)
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    assert isinstance(layer, FusedFp8Lora) and type(layer).__name__ == "Linear"  # peft's name kept
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(layer(x), type(layer).__mro__[2].forward(layer, x))  # eager: peft's forward, unchanged
    assert layer.base_layer.weight.dtype == E4M3  # the base stays the FP8 one


def test_loading_with_fp8_fuses_the_adapters_and_says_so(tmp_path, fp8_on_cpu, capsys, monkeypatch):
    """sft/model/loading.py: --fp8 with LoRA converts the base, then fuses its adapters where asked (the first
    screen's line)."""
    monkeypatch.setenv("SFT_FP8_FUSED_LORA", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    from sft.model.loading import load_model
    from sft.options.arguments import LoraArguments, ModelArguments

    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "m")
    model = load_model(ModelArguments(model=str(tmp_path / "m"), fp8="true"), LoraArguments(lora=True))
    assert sum(isinstance(m, FusedFp8Lora) for m in model.modules()) == 14
    assert "FP8: 14 LoRA adapters compute inside their base layer's FP8 matmuls" in capsys.readouterr().out
