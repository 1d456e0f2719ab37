"""Why FSDP + QLoRA gave other logits on GPUs, and that the fix holds: one process, one CUDA GPU, a few seconds.

bitsandbytes packs two 4-bit values per byte and, for FSDP, stores the bytes in bf16 tensors. Those bytes are
not numbers: some pairs form bf16 NaN patterns. FSDP2 all-gathers a unit's parameters through one buffer; when
all of them share one dtype it copies them as floats with torch._foreach_copy_, which on CUDA writes every NaN
as the one canonical NaN (pytorch issue 159333; on CPU the bits survive, which is why CPU tests passed). Part
of the 4-bit base changes at every all-gather. When a unit's dtypes differ, FSDP2 copies raw bytes (uint8).
--qlora under FSDP no longer uses that layout: it holds the base as torchao's NF4 bytes (sft/model/nf4_base.py), which
FSDP2 gathers through NF4Tensor's all-gather hooks as uint8/int8, and checks that at the start of training.

    python bench/fsdp_qlora_bytes.py --run_id R [--results bench/results.jsonl]   # starts its two ranks

Checks (PASS/FAIL lines, exit status 1 on a FAIL): (1) the copies FSDP2 uses on every one of the 65,536 bf16
bit patterns; (2) a tiny Llama with a 4-bit NF4 base (bf16 storage) and a LoRA adapter (B != 0), its logits
under raw `fully_shard` (each decoder layer and the root) on two ranks (torch 2.13 skips the all-gather of one;
NCCL with two GPUs, else gloo with both ranks on one GPU: the copies are the GPU's either way) against the same
model unsharded, with
accelerate's policy (param_dtype bf16) and with no all-gather cast (informational rows: that layout is no longer used;
left out where bitsandbytes is not installed);
(3) the NF4 base as --qlora under FSDP runs it: the start-of-training check (sft/parallel/fsdp.py fsdp_qlora_problem)
and its logits sharded against unsharded, which must be equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FAILED: list[str] = []


def report(name: str, ok: bool, detail: str) -> bool:
    if os.environ.get("RANK", "0") == "0":
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)
    return ok


def bit_patterns() -> dict:
    """Every bf16 bit pattern through the copies FSDP2 makes: which ones keep the bits."""
    source = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    changed = {}
    for name, copy in {
        "copy_": lambda dst: dst.copy_(source),
        "_foreach_copy_ (bf16)": lambda dst: torch._foreach_copy_([dst], [source]),
        "_foreach_copy_ (uint8 views)": lambda dst: torch._foreach_copy_([dst.view(torch.uint8)],
                                                                         [source.view(torch.uint8)]),
    }.items():
        dst = torch.zeros_like(source)
        copy(dst)
        changed[name] = int((dst.view(torch.int16) != source.view(torch.int16)).sum())
    return changed


def tiny_base(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def nf4_model(base: Path):
    """--qlora under FSDP's base: torchao NF4 bytes laid out for two shards (sft/model/nf4_base.py), LoRA B != 0."""
    from transformers import AutoModelForCausalLM

    from sft.model.loading import attach_lora
    from sft.model.nf4_base import quantize_base_nf4
    from sft.options.arguments import LoraArguments

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, device_map={"": torch.cuda.current_device()})
    quantize_base_nf4(model, 2)
    return with_adapter(model, attach_lora, LoraArguments)


def with_adapter(model, attach_lora, LoraArguments):
    torch.manual_seed(0)
    model = attach_lora(model, LoraArguments(lora=True, lora_r=8, lora_dropout=0.0), False)
    for name, p in model.named_parameters():  # B != 0: the adapter changes the logits
        if "lora_B" in name:
            p.data.normal_(0, 0.05, generator=torch.Generator(device=p.device).manual_seed(len(name)))
    return model


def qlora_model(base: Path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sft.options.arguments import LoraArguments
    from sft.model.loading import attach_lora, qlora_quantization_kwargs

    config = BitsAndBytesConfig(**qlora_quantization_kwargs(torch.bfloat16, torch.bfloat16, fsdp=True))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, quantization_config=config,
                                                 device_map={"": torch.cuda.current_device()})
    return with_adapter(model, attach_lora, LoraArguments)


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(input_ids=ids, use_cache=False).logits.float()


def shard(model, policy) -> None:
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if type(module).__name__ == "LlamaDecoderLayer":
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_id", default="local")
    p.add_argument("--results", type=Path, default=None, help="append one JSON row here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main() -> int:
    args = parser().parse_args()
    if not args.worker:  # two ranks, then rank 0's verdict
        import subprocess

        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_port", os.environ.get("MASTER_PORT", "29533"), __file__, "--worker",
                                "--run_id", args.run_id, *(["--results", str(args.results)] if args.results else [])])
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from sft.parallel.fsdp import float_gathered_4bit_units, qlora_policy

    changed = bit_patterns()
    report("bit_patterns/foreach_bf16", True, f"bf16 patterns changed by each copy: {changed}")
    report("bit_patterns/bytes_exact", changed["_foreach_copy_ (uint8 views)"] == 0 and changed["copy_"] == 0,
           "copy_ and a uint8 _foreach_copy_ keep every bit")

    rank, gpus = int(os.environ["RANK"]), torch.cuda.device_count()
    torch.cuda.set_device(rank % gpus)
    backend = "nccl" if gpus >= 2 else "gloo"  # NCCL refuses two ranks on one GPU
    dist.init_process_group(backend)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    base = Path(tempfile.gettempdir()) / f"fsdp_qlora_bytes_{os.environ.get('MASTER_PORT', '29533')}"
    if rank == 0:
        tiny_base(base)
    dist.barrier()
    row = {"run_id": args.run_id, "bench": "fsdp_qlora_bytes", "gpu": torch.cuda.get_device_name(),
           "ranks": 2, "backend": backend, "bf16_patterns_changed": changed,
           # the fields every row of results.jsonl has (no compile here, so no compile cache to be cold)
           "peer": "ours", "n_gpus": gpus, "gpu_indices": list(range(gpus)), "mem_cap_gib": None, "cold_cache": None,
           "nvidia_smi_mem_gib": None}
    policies = {"accelerate (param_dtype bf16)": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                      reduce_dtype=torch.bfloat16),
                "ours (param_dtype None, reduce fp32)": qlora_policy()}
    if importlib.util.find_spec("bitsandbytes") is None:  # the GPU sessions' wheels (.whl) carry none
        policies = {}
        report("bnb/skipped", True, "bitsandbytes is not installed: its informational rows are left out")
    else:
        reference = logits(qlora_model(base), ids)
    for label, policy in policies.items():
        model = qlora_model(base)
        shard(model, policy)
        unsafe = float_gathered_4bit_units(model)
        diff = float((logits(model, ids) - reference).abs().max())
        row[label] = {"max_abs_logit_diff": diff, "units_gathering_4bit_as_floats": len(unsafe)}
        # bitsandbytes' layout is no longer used under FSDP: its rows say what it does, and fail nothing
        report(f"bnb/{'no-cast' if label.startswith('ours') else 'accelerate'}", True,
               f"max |logits - unsharded| = {diff:.3g}; units that all-gather the 4-bit bytes as floats: {len(unsafe)}")
        del model
    # What --qlora under FSDP runs: the NF4 base (bytes only), with the start-of-training check
    from sft.parallel.fsdp import fsdp_qlora_problem, gathered_bytes_problem, qlora_policy as policy, sharding_mesh

    nf4_reference = logits(nf4_model(base), ids)
    model = nf4_model(base)
    shard(model, policy())
    problem = fsdp_qlora_problem(model)
    report("nf4/start_check", problem is None, problem or "every byte value round-tripped FSDP2's all-gather")
    diff = float((logits(model, ids) - nf4_reference).abs().max())
    row["nf4"] = {"max_abs_logit_diff": diff, "start_check": problem}
    report("nf4/logits", diff == 0.0, f"max |logits - unsharded| = {diff:.3g} (must be 0: the same bytes, the same "
                                      f"kernels)")
    row["nf4"]["probe"] = gathered_bytes_problem(sharding_mesh(model), torch.device("cuda", torch.cuda.current_device()))
    del model
    dist.destroy_process_group()
    row["passed"] = not FAILED
    if rank != 0:
        return 1 if FAILED else 0
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
