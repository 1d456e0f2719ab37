"""--compile_layers against eager, one decoder stack, on a GPU (a minute): where do the compiled layers' loss and
gradients leave the eager ones? On an H200, `--fp8 --compile_layers` trained with gradients 12x too small while
eager `--fp8` and every CPU comparison agreed (bench/RESULTS.md, run 20261201T2145Z-compile); this finds the case.

    python bench/compile_check.py                     # deepseek-llm-7b's layer shape, 2 layers, bf16 and fp8
    python bench/compile_check.py --attn flex_attention   # the bench rows' attention (GPU only: its backward)
    python bench/compile_check.py --cpu_smoke         # the plumbing on a CPU: tiny shapes

For each case (bf16 base, FP8 base; each eager, compiled as sft/speed/regional_compile.py does, and compiled with
inductor's epilogue fusion off), LoRA (r16, B nonzero so every adapter weight gets a gradient) on a random-init
LlamaForCausalLM, one forward and backward of packed rows under bf16 autocast, the same batch and weights: the loss,
the whole gradient's norm against the eager one's, the cosine of the two, and the worst tensor. The eager bf16 run
is the reference; FP8 is also compared with eager FP8. PASS/FAIL per compiled case: gradient norm within 2% of
its eager twin's, and as close to the eager bf16 gradient as its twin is (cosine at most 0.005 below the twin's; for
bf16-compiled, whose twin is the reference, >= 0.995). Not the cosine between the twins: since the quantization is
traced into the compiled layer (f2e0b11) it quantizes the fp32 values inductor keeps between fused ops where eager
quantizes them rounded to bf16, and FP8's rounding of two such inputs differs by FP8's own noise (run
20261202T0230Z-D: twins 0.9885 apart, each 0.9714/0.9716 from bf16, the single layer exact). Then one Fp8Linear
alone, compiled against eager (output and input gradient within 1%): the FP8 matmul and its quantizations outside
any layer. A JSON line at the end; exit status 1 on a FAIL.
--only fp8 runs the FP8 cases alone (beside the eager bf16 reference).

Run 20261202T0020Z-A (H200, torch 2.11) found it: with the FP8 matmul an autograd.Function traced into the compiled
layer, the single compiled Fp8Linear gave the right output and an input gradient of zero, whether inductor lowered
`_scaled_mm` itself or called it as an opaque op, and whether the quantization was fused or opaque (gradient norm
x0.18 over two layers). sft/speed/fp8.py now makes the forward and the input gradient custom ops with their autograd
formula registered.
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
    config._attn_implementation = args.attn
    return LlamaForCausalLM(config).to(args.device, torch.bfloat16)


def lora_model(base, fp8: bool, compiled: bool, device):
    from peft import LoraConfig, get_peft_model

    from sft.speed.fp8 import use_fp8_base
    from sft.speed.regional_compile import compile_decoder_layers

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


def batch(args, vocab: int, first: float = 0.5, seed: int = 2) -> dict:
    """Packed rows of two documents each (position_ids restart where the second begins, at `first` of the row)."""
    generator = torch.Generator().manual_seed(seed)
    rows, length = (2, 64) if args.cpu_smoke else (args.micro_batch, 2048)
    ids = torch.randint(3, vocab, (rows, length), generator=generator)
    labels = ids.clone()
    labels[:, : length // 4] = -100  # a prompt
    cut = int(length * first)
    positions = torch.cat([torch.arange(cut), torch.arange(length - cut)]).repeat(rows, 1)
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


def single_linear(args) -> dict:
    """One Fp8Linear (4096 -> 11008, 2 x 2048 rows), forward and input gradient, torch.compiled against eager: the
    FP8 matmul and its quantizations alone, outside any layer."""
    from torch import nn

    from sft.speed.fp8 import Fp8Linear

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

    torch._dynamo.reset()
    (out, grad), (out_c, grad_c) = run(layer), run(torch.compile(layer.forward))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return {"out_error": rel(out_c, out), "grad_error": rel(grad_c, grad),
            "grad_norm_ratio": (grad_c.norm() / grad.norm()).item()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--cpu_smoke", action="store_true")
    p.add_argument("--only", choices=["all", "fp8"], default="all")
    p.add_argument("--attn", default="sdpa", help="the attention: sdpa, or flex_attention (the bench rows' and the "
                                                  "planner's), whose document masks change with every batch")
    args = p.parse_args(argv)
    args.device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    if args.attn == "flex_attention" and args.device == "cpu":
        print("error: --attn flex_attention needs a GPU (flex_attention has no backward on CPU); drop --attn or "
              "run on a GPU.", file=sys.stderr)
        return 2
    base = base_model(args)
    inputs, earlier = batch(args, base.config.vocab_size), batch(args, base.config.vocab_size, first=0.3, seed=5)
    results, grads, fails = {}, {}, []
    cases = [("bf16", False, False, {}), ("bf16-compiled", False, True, {}),
             ("bf16-compiled-no-epilogue-fusion", False, True, {"epilogue_fusion": False}),
             ("fp8", True, False, {}), ("fp8-compiled", True, True, {}),
             ("fp8-compiled-no-epilogue-fusion", True, True, {"epilogue_fusion": False})]
    for name, fp8, compiled, inductor in cases:
        if fp8 and args.device == "cpu" and not args.cpu_smoke or args.only == "fp8" and not fp8 and name != "bf16":
            continue
        torch._dynamo.reset()
        with torch._inductor.config.patch(inductor):
            model = lora_model(base, fp8, compiled, args.device)
            loss_and_grads(model, earlier, args.device)  # a batch of other document boundaries first: a
            model.zero_grad(set_to_none=True)            # compiled layer must not keep the first batch's mask
            loss, grads[name] = loss_and_grads(model, inputs, args.device)
        row = {"loss": loss, **compare(grads[name], grads["bf16"])}
        if compiled:
            twin = name.split("-compiled")[0]
            row["vs_eager_twin"] = compare(grads[name], grads[twin])
            ok = (abs(row["vs_eager_twin"]["norm_ratio"] - 1) <= 0.02
                  and row["cosine"] >= results[twin]["cosine"] - 0.005)
            print(f"{'PASS' if ok else 'FAIL'} {name}: against {twin}: gradient norm x"
                  f"{row['vs_eager_twin']['norm_ratio']:.4f}, cosine {row['vs_eager_twin']['cosine']:.5f}, worst "
                  f"{row['vs_eager_twin']['worst']} ({row['vs_eager_twin']['worst_error']:.3f}); cosine to bf16 "
                  f"{row['cosine']:.5f} against the twin's {results[twin]['cosine']:.5f}", flush=True)
            fails += [] if ok else [name]
        print(f"{name}: loss {loss:.5f}; against bf16: gradient norm x{row['norm_ratio']:.4f}, cosine "
              f"{row['cosine']:.5f}", flush=True)
        results[name] = row
        del model
    if args.device == "cuda" or args.cpu_smoke:
        results["fp8-linear"] = one = single_linear(args)
        ok = one["out_error"] < 0.01 and one["grad_error"] < 0.01
        print(f"{'PASS' if ok else 'FAIL'} fp8-linear compiled against eager: output {one['out_error']:.2e}, "
              f"input gradient {one['grad_error']:.2e} apart (norm x{one['grad_norm_ratio']:.4f})", flush=True)
        fails += [] if ok else ["fp8-linear"]
    print(json.dumps({"compile_check": results, "device": torch.cuda.get_device_name() if args.device == "cuda"
                      else "cpu", "torch": torch.__version__, "fails": fails}), flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
