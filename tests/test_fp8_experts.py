"""sft/speed/fp8_experts.py: `--fp8` beside `--quantize_experts fp8`, the routed experts' grouped matmuls in FP8 on
the held e4m3 weights. torch has no CPU kernel for its FP8 grouped matmul, so the op's CPU kernel emulates it
(dequantized operands, fp32 sums, one rounding to bf16); everything around it runs here as on the GPU: the
quantization of tokens and gradients, the move of the weights' row scales onto the gradient, the transposed
weights, the routing, the compiled form. The GPU kernel against this emulation, and the speed:
bench/fp8_experts_check.py and bench/RESULTS.md."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config


def routed(tokens: int = 40, experts: int = 4, k: int = 32, n: int = 48, seed: int = 0):
    """Rows sorted by expert (one expert gets none), their expert ids and group ends, and e4m3 weights with their
    row scales, as sft/model/quantized_experts.py holds them."""
    from sft.model.quantized_experts import quantize_rows

    g = torch.Generator().manual_seed(seed)
    expert_ids = torch.sort(torch.tensor([0, 1, 3] * (tokens // 3) + [0] * (tokens % 3)))[0]
    offsets = torch.cumsum(torch.bincount(expert_ids, minlength=experts), 0).to(torch.int32)
    x = (torch.randn(tokens, k, generator=g) * 3).bfloat16()
    w = (torch.randn(experts, n, k, generator=g) * torch.logspace(-2, 1, n).view(1, n, 1)).bfloat16()
    q, scale = quantize_rows(w)
    return x, expert_ids, offsets, w, q, scale.squeeze(-1)


def test_the_cpu_kernel_is_each_experts_scaled_matmul():
    from sft.speed.fp8 import quantize_rows
    from sft.speed.fp8_experts import fp8_grouped_mm

    x, expert_ids, offsets, _, w_q, w_scale = routed()
    x_q, x_scale = quantize_rows(x)
    got = fp8_grouped_mm(x_q, x_scale.view(-1), w_q, w_scale, offsets)
    for row in range(x.shape[0]):
        e = int(expert_ids[row])
        want = (x_q[row].float() * x_scale[row]) @ (w_q[e].float() * w_scale[e][:, None]).t()
        # one row's fp32 sums run in another order than the expert's block (BLAS's vector and matrix paths, which
        # differ by CPU: seen on an AMD EPYC), so their bf16 rounding may differ by one unit (2^-7 relative)
        torch.testing.assert_close(got[row], want.bfloat16(), rtol=2 ** -7, atol=0)


def test_forward_and_input_gradient_are_the_bf16_matmuls_within_fp8s_rounding():
    """Against the dequantized weights' bf16 matmuls: the forward, and the input gradient, whose weight scales lie
    along the contraction and move onto the gradient (left out, the gradient would be off by the scales: 1e-2 to
    1e1 here)."""
    from sft.speed.fp8_experts import grouped_linear

    x, expert_ids, offsets, w, w_q, w_scale = routed()
    grad = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    x1 = x.clone().requires_grad_()
    out = grouped_linear(x1, w_q, w_scale, expert_ids, offsets)
    out.backward(grad)
    x2 = x.clone().float().requires_grad_()
    dequantized = w_q.float() * w_scale[..., None]
    want = torch.stack([x2[i] @ dequantized[int(e)].t() for i, e in enumerate(expert_ids)])
    want.backward(grad.float())
    assert out.dtype == torch.bfloat16 and x1.grad.dtype == torch.bfloat16
    for got, expected in ((out.float(), want.detach()), (x1.grad.float(), x2.grad)):
        assert (got - expected).norm() / expected.norm() < 0.04  # e4m3's rounding of tokens and gradients only


def test_the_input_gradient_quantizes_the_scaled_gradient_per_row():
    """The backward's exact formula: grad_out times its expert's row scales, quantized per row, times the e4m3
    weights (the scales already in the gradient)."""
    from sft.speed.fp8 import quantize_rows
    from sft.speed.fp8_experts import grouped_linear

    x, expert_ids, offsets, w, w_q, w_scale = routed(seed=3)
    grad = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(4)).bfloat16()
    x1 = x.clone().requires_grad_()
    grouped_linear(x1, w_q, w_scale, expert_ids, offsets).backward(grad)
    g_q, g_scale = quantize_rows(grad.float() * w_scale[expert_ids])
    want = torch.stack([(g_q[i].float() * g_scale[i]) @ w_q[int(e)].float() for i, e in enumerate(expert_ids)])
    torch.testing.assert_close(x1.grad, want.bfloat16(), rtol=0, atol=0)


def test_the_compiled_form_gives_the_eager_ops_output_and_gradient():
    """Under --compile_layers the quantization is traced beside the op (sft::fp8_grouped_linear_quantized) and its
    backward formula is traced too: the eager op's numbers, in one graph."""
    from torch._dynamo.utils import counters

    from sft.speed.fp8_experts import grouped_linear

    x, expert_ids, offsets, w, w_q, w_scale = routed(seed=5)
    grad = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(6)).bfloat16()

    def run(fn):
        xi = x.clone().requires_grad_()
        out = fn(xi, w_q, w_scale, expert_ids, offsets)
        out.backward(grad)
        return out.detach(), xi.grad

    torch._dynamo.reset()
    counters.clear()
    eager = run(grouped_linear)
    compiled = run(torch.compile(grouped_linear, fullgraph=True, backend="aot_eager"))
    assert not counters["graph_break"]
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()


def test_the_option_runs_the_routed_experts_in_fp8_and_stays_near_the_dequantized_path(tmp_path, fp8_on_cpu, capsys):
    """load_model with --lora --quantize_experts fp8 --fp8 true (SFT_FP8_ON_CPU=1: the CPU's FP8 emulations): every
    MoE layer's experts compute in FP8, the first screen says so, and a LoRA step's loss and gradients stay near the
    same model's with the experts dequantized to bf16 (no --fp8: the dense layers in bf16 too)."""
    from transformers import AutoModelForCausalLM

    from sft.model.loading import load_model
    from sft.model.quantized_experts import QuantizedExperts
    from sft.options.arguments import LoraArguments, ModelArguments
    from test_regional_compile import packed_batch

    path = tmp_path / "v2"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("deepseek_v2", vocab_size=300, first_k_dense_replace=0)
                                     ).save_pretrained(path)
    batch = packed_batch(300)

    def step(fp8: str):
        torch.manual_seed(0)  # the same LoRA init
        model = load_model(ModelArguments(model=str(path), quantize_experts="fp8", fp8=fp8),
                           LoraArguments(lora=True, lora_dropout=0.0), gradient_checkpointing=True)
        model.train()
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss
        loss.backward()
        held = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return loss.item(), grads, held

    plain, plain_grads, held = step("false")
    assert held and not any(m.fp8_forward for m in held)
    capsys.readouterr()
    fp8, fp8_grads, held = step("true")
    assert len(held) == 2 and all(m.fp8_forward for m in held)
    assert "FP8: 2 MoE layers' routed experts compute in e4m3 as held" in capsys.readouterr().out
    assert fp8 == pytest.approx(plain, rel=0.02)
    assert fp8_grads.keys() == plain_grads.keys()
    got = torch.cat([g.flatten() for g in fp8_grads.values()])
    want = torch.cat([g.flatten() for g in plain_grads.values()])
    assert (got - want).norm() / want.norm() < 0.1  # FP8 in every base matmul, dense and experts


def test_gpus_without_an_fp8_grouped_matmul_keep_the_dequantized_experts():
    from sft.machine import Launch, Machine

    def box(*capabilities, on_cpu=False):
        return Machine(gpu_names=tuple(f"GPU{i}" for i in range(len(capabilities))), gpu_capabilities=capabilities,
                       launch=Launch(fp8_on_cpu=on_cpu))

    assert box((9, 0)).fp8_grouped_problem() is None
    assert box((10, 0), (9, 0)).fp8_grouped_problem() is None
    assert "compute capability 8.9" in box((8, 9)).fp8_grouped_problem()  # an RTX 4090: FP8, but no grouped matmul
    assert "GPU 1" in box((9, 0), (12, 0)).fp8_grouped_problem()
    assert "8.6" in box((8, 6)).fp8_grouped_problem()
    assert box(on_cpu=True).fp8_grouped_problem() is None
    assert box().fp8_grouped_problem() == "no CUDA GPU here"
