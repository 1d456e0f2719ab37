"""--compile_layers against eager, one decoder stack, on a GPU (a minute): where do the compiled layers' loss and
gradients leave the eager ones? On an H200, `--fp8 --compile_layers` trained with gradients 12x too small while
eager `--fp8` and every CPU comparison agreed (bench/RESULTS.md, run 20261201T2145Z-compile); this finds the case.

    python bench/compile_check.py                     # deepseek-llm-7b's layer shape, 2 layers, bf16 and fp8
    python bench/compile_check.py --cpu_smoke         # the plumbing on a CPU: tiny shapes

For each case (bf16 base, FP8 base; each eager, compiled as sft/regional_compile.py does, and compiled with
inductor's epilogue fusion off; FP8 also compiled with `_scaled_mm` visible to inductor (as before it became the
opaque op sft::fp8_scaled_mm) and with the quantization opaque too), LoRA (r16, B nonzero so every adapter weight gets a gradient) on a random-init
LlamaForCausalLM, one forward and backward of packed rows under bf16 autocast, the same batch and weights: the loss,
the whole gradient's norm against the eager one's, the cosine of the two, and the worst tensor. The eager bf16 run
is the reference; FP8 is also compared with eager FP8. PASS/FAIL per compiled case: gradient norm within 2% and
cosine >= 0.99 of its eager twin. Then one Fp8Linear alone, compiled against eager (output and input gradient within
1%): the FP8 matmul and its quantizations outside any layer. A JSON line at the end; exit status 1 on a FAIL.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, vocab_size=512)
             if args.cpu_smoke else dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                         num_key_value_heads=32, vocab_size=102400))
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=4096, **shape)
    return LlamaForCausalLM(config).to(args.device, torch.bfloat16)


def lora_model(base, fp8: bool, compiled: bool, device):
    from peft import LoraConfig, get_peft_model

    from sft.fp8 import use_fp8_base
    from sft.regional_compile import compile_decoder_layers

    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                           target_modules=LORA_TARGETS))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    if fp8:
        use_fp8_base(model, torch.device(device))
    if compiled:
        compile_decoder_layers(model)
    return model.train()


def batch(args, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(2)
    rows, length = (2, 64) if args.cpu_smoke else (args.micro_batch, 2048)
    ids = torch.randint(3, vocab, (rows, length), generator=generator)
    labels = ids.clone()
    labels[:, : length // 4] = -100  # a prompt
    half = length // 2
    positions = torch.cat([torch.arange(half), torch.arange(length - half)]).repeat(rows, 1)  # two packed documents
    return {k: v.to(args.device) for k, v in dict(input_ids=ids, labels=labels, position_ids=positions).items()}


def loss_and_grads(model, inputs: dict, device: str) -> tuple[float, dict[str, torch.Tensor]]:
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def compare(grads: dict, reference: dict) -> dict:
    flat = torch.cat([g.flatten() for g in grads.values()])
    ref = torch.cat([reference[n].flatten() for n in grads])
    errors = {n: ((g - reference[n]).norm() / reference[n].norm().clamp(min=1e-30)).item() for n, g in grads.items()}
    worst = max(errors, key=errors.get)
    return {"norm_ratio": (flat.norm() / ref.norm()).item(),
            "cosine": torch.nn.functional.cosine_similarity(flat, ref, dim=0).item(),
            "worst": worst.removeprefix("base_model.model."), "worst_error": errors[worst]}


def inductor_mm(a, a_scale, b_t, b_scale):
    """sft.fp8.scaled_matmul as it was before it became a custom op: `_scaled_mm` traced, inductor lowers it."""
    return torch._scaled_mm(a, b_t.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


@torch.library.custom_op("bench::fp8_quantize_rows", mutates_args=())
def opaque_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sft.fp8.quantize_rows run eagerly inside compiled graphs (nothing fused into it)."""
    from sft.fp8 import quantize_rows

    return quantize_rows(x)


@opaque_quantize.register_fake
def _opaque_quantize_shape(x):
    from sft.fp8 import E4M3

    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], 1), dtype=torch.float32)


PRODUCTION = ("bf16-compiled", "fp8-compiled")  # what --compile_layers runs: a FAIL there fails the check;
# the other compiled cases are diagnoses

# name -> (attribute of sft.fp8, stand-in) for the cases that swap a piece of the FP8 path
SWAPS = {"inductor-mm": ("scaled_matmul", inductor_mm), "opaque-quantize": ("quantize", opaque_quantize)}


def single_linear(args) -> dict:
    """One Fp8Linear (4096 -> 11008, 2 x 2048 rows), forward and input gradient, torch.compiled against eager: the
    FP8 matmul and its quantizations alone, outside any layer."""
    from torch import nn

    from sft.fp8 import Fp8Linear

    torch.manual_seed(3)
    k, n, rows = (64, 128, 256) if args.cpu_smoke else (4096, 11008, 4096)
    layer = Fp8Linear(nn.Linear(k, n, bias=False).to(args.device, torch.bfloat16), torch.device(args.device))
    x = torch.randn(rows, k, device=args.device, dtype=torch.bfloat16)
    grad_out = torch.randn(rows, n, device=args.device, dtype=torch.bfloat16) * 1e-3

    def run(fn):
        inp = x.clone().requires_grad_()
        out = fn(inp)
        out.backward(grad_out)
        return out.float(), inp.grad.float()

    import sft.fp8

    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    out, grad = run(layer)
    found = {}
    for variant, mm in (("", sft.fp8.scaled_matmul), ("inductor-mm-", inductor_mm)):
        original, sft.fp8.scaled_matmul = sft.fp8.scaled_matmul, mm
        try:
            torch._dynamo.reset()
            out_c, grad_c = run(torch.compile(layer.forward))
        finally:
            sft.fp8.scaled_matmul = original
        found.update({f"{variant}out_error": rel(out_c, out), f"{variant}grad_error": rel(grad_c, grad),
                      f"{variant}grad_norm_ratio": (grad_c.norm() / grad.norm()).item()})
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--cpu_smoke", action="store_true")
    args = p.parse_args(argv)
    args.device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    base = base_model(args)
    inputs = batch(args, base.config.vocab_size)
    results, grads, fails = {}, {}, []
    cases = [("bf16", False, False, {}), ("bf16-compiled", False, True, {}),
             ("bf16-compiled-no-epilogue-fusion", False, True, {"epilogue_fusion": False}),
             ("fp8", True, False, {}), ("fp8-compiled", True, True, {}),
             ("fp8-compiled-no-epilogue-fusion", True, True, {"epilogue_fusion": False}),
             ("fp8-compiled-inductor-mm", True, True, {}), ("fp8-compiled-opaque-quantize", True, True, {})]
    import sft.fp8

    for name, fp8, compiled, inductor in cases:
        if fp8 and args.device == "cpu" and not args.cpu_smoke:
            continue
        torch._dynamo.reset()
        attribute, stand_in = SWAPS.get(name.split("compiled-")[-1], (None, None))
        original = getattr(sft.fp8, attribute) if attribute else None
        try:
            if attribute:
                setattr(sft.fp8, attribute, stand_in)
            with torch._inductor.config.patch(inductor):
                model = lora_model(base, fp8, compiled, args.device)
                loss, grads[name] = loss_and_grads(model, inputs, args.device)
        finally:
            if attribute:
                setattr(sft.fp8, attribute, original)
        row = {"loss": loss, **compare(grads[name], grads["bf16"])}
        if compiled:
            twin = name.split("-compiled")[0]
            row["vs_eager_twin"] = compare(grads[name], grads[twin])
            ok = abs(row["vs_eager_twin"]["norm_ratio"] - 1) <= 0.02 and row["vs_eager_twin"]["cosine"] >= 0.99
            print(f"{'PASS' if ok else 'FAIL'} {name}: against {twin}: gradient norm x"
                  f"{row['vs_eager_twin']['norm_ratio']:.4f}, cosine {row['vs_eager_twin']['cosine']:.5f}, worst "
                  f"{row['vs_eager_twin']['worst']} ({row['vs_eager_twin']['worst_error']:.3f})", flush=True)
            fails += [] if ok or name not in PRODUCTION else [name]
        print(f"{name}: loss {loss:.5f}; against bf16: gradient norm x{row['norm_ratio']:.4f}, cosine "
              f"{row['cosine']:.5f}", flush=True)
        results[name] = row
        del model
    if args.device == "cuda" or args.cpu_smoke:
        results["fp8-linear"] = one = single_linear(args)
        ok = one["out_error"] < 0.01 and one["grad_error"] < 0.01
        print(f"{'PASS' if ok else 'FAIL'} fp8-linear compiled against eager: output {one['out_error']:.2e}, "
              f"input gradient {one['grad_error']:.2e} apart (norm x{one['grad_norm_ratio']:.4f}); with inductor's "
              f"_scaled_mm: {one['inductor-mm-out_error']:.2e}, {one['inductor-mm-grad_error']:.2e} (norm "
              f"x{one['inductor-mm-grad_norm_ratio']:.4f})", flush=True)
        fails += [] if ok else ["fp8-linear"]
    print(json.dumps({"compile_check": results, "device": torch.cuda.get_device_name() if args.device == "cuda"
                      else "cpu", "torch": torch.__version__, "fails": fails}), flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
