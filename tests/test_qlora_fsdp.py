"""FSDP + QLoRA verified saves: when the reload check of a sharded LoRA adapter fails, the error says which side
differs (the saved file, the in-memory forward, the ranks, or the reloaded 4-bit base), so that one GPU run tells
the cause. The helpers run in one process; the whole check over raw FSDP2 (`fully_shard`) on 2 gloo ranks of a
tiny llama with the NF4 base --qlora holds under FSDP (sft/model/nf4_base.py). bitsandbytes' bf16-storage layout
for FSDP is no longer loaded by any run (sft/model/loading.py quantization() skips bitsandbytes under FSDP, and
fsdp_qlora_problem refuses its layers): its save test went with it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO, save_tiny_model
from sft.safety.verify import adapter_note, gathered_trainable, ranks_note, repeat_note, tensors_note

def test_notes_name_the_side_that_differs(tmp_path):
    from safetensors.torch import save_file

    trained = {"m.q_proj.lora_A.default.weight": torch.ones(2, 4), "m.q_proj.lora_B.default.weight": torch.ones(4, 2)}
    save_file({k.replace(".default.", "."): v for k, v in trained.items()}, tmp_path / "adapter_model.safetensors")
    assert adapter_note(trained, tmp_path).startswith("holds exactly the trained LoRA weights (2 tensors)")
    save_file({"m.q_proj.lora_A.weight": torch.ones(2, 4)}, tmp_path / "adapter_model.safetensors")
    assert "DIFFERS" in adapter_note(trained, tmp_path) and "1 of 2 missing" in adapter_note(trained, tmp_path)
    logits = torch.randn(2, 3, 5)
    assert "NOT repeatable" not in repeat_note(logits.clone(), logits)
    assert "NOT repeatable" in repeat_note(logits + 1, logits)
    assert ranks_note(logits) == "nothing to compare (one process)"
    bits = {"w": (torch.arange(4, dtype=torch.uint8), torch.bfloat16)}
    assert "equal bit for bit" in tensors_note(bits, dict(bits), "x")
    assert "1 of 1 tensors of x differ" in tensors_note(bits, {"w": (torch.zeros(4, dtype=torch.uint8), None)}, "x")


def test_gathered_trainable_is_the_adapter_unsharded():
    layer = torch.nn.Linear(3, 2)
    layer.bias.requires_grad_(False)
    assert list(gathered_trainable(layer)) == ["weight"]


def test_the_4bit_base_note_compares_every_nf4_byte():
    """The diagnosis' 4-bit base: every inner tensor of each NF4Linear's NF4Tensor as bytes, under the plain base's
    names (peft's base_layer level dropped), so that one changed byte of the reloaded base is named."""
    from sft.safety.verify import gathered_4bit_base

    trained = gathered_4bit_base(tiny_nf4_model(shards=2).get_base_model())
    assert len(trained) == 14 * 5 and not any("base_layer" in k for k in trained)  # 5 inner tensors (torchao 0.18)
    assert "model.layers.0.self_attn.q_proj.weight.quantized_data" in trained
    reloaded = gathered_4bit_base(tiny_nf4_model(shards=2).get_base_model())  # the same weights quantized again
    assert tensors_note(trained, reloaded, "x") == "is the trained one (70 tensors of x, equal bit for bit)"
    key = "model.layers.1.mlp.down_proj.weight.scaler_mean"
    bits, dtype = reloaded[key]
    reloaded[key] = (bits ^ 1, dtype)  # one bit of a bf16 factor
    assert tensors_note(trained, reloaded, "x").startswith(f"DIFFERS from the trained one: 1 of 70 tensors of x "
                                                           f"differ (first: {key})")


SAVE_WORKER = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from accelerate import PartialState
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig
    from sft.errors import SaveMismatchError
    from sft.model.loading import attach_lora
    from sft.model.nf4_loading import load_nf4_model
    from sft.options.arguments import LoraArguments
    from sft.parallel.fsdp import qlora_policy
    from sft.safety.verify import SaveVerifier, quantization_of

    base, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")  # env://
    # accelerate's state as the Trainer makes it under --use_cpu: without cpu=True, on a machine without GPUs it
    # counts 1 process whatever WORLD_SIZE says, its broadcasts do nothing and each rank verifies alone
    PartialState(cpu=True)
    rank = dist.get_rank()
    model = load_nf4_model(base, AutoConfig.from_pretrained(base), torch.bfloat16, shards=2)  # as --qlora loads it
    torch.manual_seed(0)
    model = attach_lora(model, LoraArguments(lora=True, lora_r=4, lora_dropout=0.0), False)
    for name, p in model.named_parameters():  # B != 0: the adapter changes the logits
        if "lora_B" in name:
            p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=qlora_policy())
    fully_shard(model, mp_policy=qlora_policy())
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(out, state_dict=state)
    dist.barrier()
    found = {"rank": rank, "processes": PartialState().num_processes, "quantization": quantization_of(model)}
    verifier = SaveVerifier(base, True, lora_in_place=False, quantization=quantization_of(model))

    def checked():
        try:
            verifier.check(model, out)
            return None
        except SaveMismatchError as e:
            return str(e)

    found["right"] = checked()
    if rank == 0:  # a wrong adapter: lora_B zeroed in the file
        path = os.path.join(out, "adapter_model.safetensors")
        save_file({k: v * 0 if "lora_B" in k else v for k, v in load_file(path).items()}, path)
    dist.barrier()
    found["zeroed"] = checked()
    print(json.dumps(found), flush=True)
    dist.barrier()  # no rank leaves while another still works
    from sft.parallel.distributed import exit_process
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen in CI: -6)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks_env() -> dict[str, str]:
    """A launcher's environment for 2 ranks on this machine (rank variables added per process), read by torch's
    env:// rendezvous and by accelerate's PartialState (made with cpu=True, as under --use_cpu)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "HF_HUB_OFFLINE": "1"}


def run_two_ranks(code: str, *args: str, timeout: int = 600) -> list[dict]:
    """`code` on 2 gloo ranks; -> each rank's JSON line (the one that starts with {"rank")."""
    env = two_ranks_env()
    workers = [subprocess.Popen([sys.executable, "-c", code, *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [w.communicate(timeout=timeout)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [out[-4000:] for out in outputs]
    found = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith('{"rank"')]
    assert [f["rank"] for f in found] == [0, 1], [out[-4000:] for out in outputs]
    return found


@pytest.mark.slow
def test_sharded_nf4_qlora_check_passes_the_adapter_and_names_a_wrong_file(tmp_path):
    """The verified save of --qlora under FSDP (the step that failed on 2 H200s) on 2 gloo ranks: the NF4 base read
    weight by weight (load_nf4_model), sharded by FSDP2 with qlora_policy, the adapter saved from the gathered state
    dict and checked by SaveVerifier with the NF4 settings (the base reloaded as NF4 for the same 2 shards). The
    right adapter passes on every rank; one with lora_B zeroed fails on every rank, and the diagnosis names the
    file as the side that differs and the reloaded 4-bit base (its NF4 bytes) as the trained one."""
    base = save_tiny_model(tmp_path / "base", "llama")
    found = run_two_ranks(SAVE_WORKER, str(base), str(tmp_path / "adapter"))
    assert [f["processes"] for f in found] == [2, 2], found  # else accelerate's broadcast is a no-op: ranks disagree
    assert found[0]["quantization"]["quant_method"] == "torchao_nf4" and found[0]["quantization"]["shards"] == 2
    assert [f["right"] for f in found] == [None, None], found
    message = found[0]["zeroed"]
    assert message is not None and found[1]["zeroed"] == message, found  # every rank raises the same
    assert "does not reproduce the trained model" in message
    assert "the saved adapter DIFFERS from the trained LoRA weights" in message, message
    assert "the in-memory forward is repeatable" in message and "agree on every rank" in message, message
    assert "the reloaded 4-bit base is the trained one" in message, message
    assert "tensors of 4-bit weights and quantization constants, equal bit for bit" in message, message


CANONICALIZING = """
import torch
copy = torch._foreach_copy_

def canonicalizing(dsts, srcs, *args, **kwargs):  # what CUDA's float copy does (pytorch issue 159333)
    copy(dsts, srcs, *args, **kwargs)
    for d in dsts:
        if d.is_floating_point():
            d.masked_fill_(torch.isnan(d), float("nan"))

torch._foreach_copy_ = canonicalizing
"""


# ---- the 4-bit bytes under FSDP2's all-gather (sft/parallel/fsdp.py qlora_policy) ----------------------------------------

BYTES_WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from sft.parallel.fsdp import float_gathered_4bit_units, qlora_policy

    # two ranks: FSDP2 skips the all-gather for one (torch 2.13)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)
    CANONICALIZING_COPY
    PATTERNS = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 1)

    class Linear4bit(torch.nn.Module):  # bitsandbytes' packed 4-bit weight: bytes in a bf16 tensor
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(PATTERNS.clone(), requires_grad=False)

    def gathered_bits_changed(policy, adapter):
        layer = torch.nn.Module()
        layer.packed, layer.norm = Linear4bit(), torch.nn.LayerNorm(8, dtype=torch.bfloat16).requires_grad_(False)
        if adapter:
            layer.lora = torch.nn.Linear(8, 8)  # fp32, trained
        fully_shard(layer, mp_policy=policy)
        unsafe = float_gathered_4bit_units(layer)
        layer.unshard()
        changed = int((layer.packed.weight.view(torch.int16) != PATTERNS.view(torch.int16)).sum())
        return {"unsafe_units": len(unsafe), "changed": changed}

    accelerate = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    print(json.dumps({"rank": dist.get_rank(), "accelerate": gathered_bits_changed(accelerate, True),
                      "ours": gathered_bits_changed(qlora_policy(), True),
                      "ours_without_adapter": gathered_bits_changed(qlora_policy(), False)}), flush=True)
    dist.barrier()  # no rank leaves while another still works
    from sft.parallel.distributed import exit_process
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen in CI: -6)
""").replace("CANONICALIZING_COPY\n", CANONICALIZING)


def test_4bit_bytes_survive_the_all_gather(tmp_path):
    """accelerate's FSDP2 policy casts every parameter to bf16 for the all-gather, so a unit gathers in one float
    dtype and FSDP2 copies its bf16-stored 4-bit bytes as floats: CUDA's copy rewrites NaN bit patterns (emulated
    here by a canonicalizing torch._foreach_copy_: on a CPU the bits survive). Under qlora_policy a layer's unit
    mixes the fp32 adapter with the bf16 storage and FSDP2 gathers bytes; the guard names any unit that would
    not (a unit of 4-bit weights without an adapter)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    workers = [subprocess.Popen([sys.executable, "-c", BYTES_WORKER, str(tmp_path / "rendezvous"), str(r)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [w.communicate(timeout=600) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [err[-3000:] for _, err in outputs]
    result = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert result["accelerate"]["changed"] > 0 and result["accelerate"]["unsafe_units"] == 1, result
    assert result["ours"] == {"unsafe_units": 0, "changed": 0}, result
    assert result["ours_without_adapter"]["unsafe_units"] == 1, result
    assert result["ours_without_adapter"]["changed"] > 0, result  # the guard's reason: uniform dtype, float copy


# ---- --qlora under FSDP: the base as torchao's NF4 bytes (sft/model/nf4_base.py) ------------------------------------

def tiny_nf4_model(shards: int, seed: int = 0):
    """A tiny bf16 llama with an NF4 base for `shards` ranks and a LoRA adapter whose B != 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sft.model.loading import attach_lora
    from sft.model.nf4_base import quantize_base_nf4
    from sft.options.arguments import LoraArguments

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    assert quantize_base_nf4(model, shards) == 14  # 7 linear layers per decoder layer
    torch.manual_seed(seed)
    model = attach_lora(model, LoraArguments(lora=True, lora_r=4, lora_dropout=0.0), False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("shape", [(96, 64), (8, 4096), (64 * 3, 16384 // 3 + 1)])
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_nf4_layout_splits_into_equal_shards(shape, shards):
    """FSDP2 chunks dim 0 equally; NF4Tensor splits only at whole 16384-value rows. Any weight, any shard count
    (three 24 GB cards: 8192 rows do not split in three): each shard's bytes are a contiguous part of the whole,
    and the layer computes with the weight's own NF4 values (the padding dropped)."""
    from torchao.quantization import to_nf4

    from sft.model.nf4_base import ROW, NF4Linear, to_nf4_rows

    linear = torch.nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16)
    layer = NF4Linear(linear, shards)
    weight = layer.weight
    assert type(weight).__name__ == "NF4Tensor" and not weight.requires_grad
    assert weight.quantized_data.dtype == torch.uint8 and weight.quantized_scalers.dtype == torch.int8
    assert weight.shape[1] == ROW and weight.shape[0] % shards == 0
    chunks = torch.chunk(weight, shards)  # as FSDP2 shards it
    assert len(chunks) == shards and all(c.shape == chunks[0].shape for c in chunks)
    assert torch.equal(torch.cat([c.quantized_data for c in chunks]), weight.quantized_data)
    # the values are the weight's own NF4 values; the padding (its own values again) does not reach the output
    numel = shape[0] * shape[1]
    whole = to_nf4_rows(linear.weight, 1).get_original_weight().reshape(-1)[:numel]
    if numel % ROW == 0:  # no padding: exactly torchao's to_nf4 of the weight
        assert torch.equal(layer.dequantized_weight(torch.bfloat16).reshape(-1),
                           to_nf4(linear.weight.detach().reshape(-1, ROW), 64, 256).get_original_weight().reshape(-1))
    error = (layer.dequantized_weight() - linear.weight.float()).norm() / linear.weight.float().norm()
    assert error < 0.15, error  # NF4's quantization error, not a wrong layout (a wrong one is ~1.4)
    x = torch.randn(3, shape[1], dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16)))
    if shards == 1:
        assert torch.equal(layer.dequantized_weight(torch.bfloat16).reshape(-1), whole)


def test_nf4_dequantized_in_pieces_is_the_whole_dequantized():
    """NF4Linear dequantizes in equal pieces of whole rows (torchao's whole dequantization holds 7x the bf16 weight):
    bit for bit torchao's get_original_weight of the whole, for each way the rows divide."""
    from sft.model.nf4_base import dequantized, to_nf4_rows
    from sft.model.nf4_layout import dequantize_pieces

    weight = to_nf4_rows(torch.randn(300, 1000, dtype=torch.bfloat16), 3)  # 21 stored rows: 3 x 7
    whole = weight.get_original_weight().reshape(-1)[:300 * 1000].view(300, 1000)
    for piece_rows, pieces in ((21, 1), (7, 3), (3, 7), (2, 21)):
        assert dequantize_pieces(weight.shape[0], piece_rows) == pieces
        assert torch.equal(dequantized(weight, (300, 1000), torch.bfloat16, piece_rows), whole)
    assert dequantize_pieces(11010) == 15 and dequantize_pieces(14337) == 27  # a 67B's and a 70B's MLP on 3 shards
    assert dequantize_pieces(2 * 1031) == 2  # no divisor leaves <= 1024 rows: the most pieces that divide it


def test_lora_over_nf4_trains_the_adapter_and_saves_a_plain_adapter(tmp_path):
    """peft's LoRA wraps NF4Linear as any nn.Linear: the backward reaches the input and the adapter, never the 4-bit
    base; the loss falls; the saved adapter has exactly the keys of a LoRA trained on the bf16 base and loads there
    with plain peft (its logits differ from the NF4 model's by the quantization error alone)."""
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_nf4_model(shards=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # the adapter stays fp32
    assert not any(type(p).__name__ == "NF4Tensor" for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    model.save_pretrained(tmp_path / "nf4")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    base = LlamaForCausalLM(config).to(torch.bfloat16)  # the same weights, unquantized
    from safetensors.torch import load_file

    from sft.model.loading import attach_lora
    from sft.options.arguments import LoraArguments

    attach_lora(LlamaForCausalLM(config), LoraArguments(lora=True, lora_r=4, lora_dropout=0.0),
                False).save_pretrained(tmp_path / "plain")
    assert set(load_file(tmp_path / "nf4" / "adapter_model.safetensors")) == \
        set(load_file(tmp_path / "plain" / "adapter_model.safetensors"))
    on_bf16 = PeftModel.from_pretrained(base, tmp_path / "nf4").eval()
    model.eval()
    with torch.no_grad():
        nf4_logits = model(input_ids=ids, use_cache=False).logits.float()
        bf16_logits = on_bf16(input_ids=ids, use_cache=False).logits.float()
        with on_bf16.disable_adapter():
            plain = on_bf16(input_ids=ids, use_cache=False).logits.float()
    quantization = ((bf16_logits - nf4_logits).norm() / nf4_logits.norm()).item()
    adapter = ((bf16_logits - plain).norm() / plain.norm()).item()
    assert quantization < 0.5 * adapter, (quantization, adapter)  # the adapter loaded, and it is the trained one


NF4_WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, sys.argv[3])
    from test_qlora_fsdp import tiny_nf4_model
    from sft.parallel.fsdp import fsdp_qlora_problem, gathered_bytes_problem, qlora_policy, sharding_mesh

    rank = int(sys.argv[2])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
    CANONICALIZING_COPY
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(model):
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for n, p in model.named_parameters() if p.requires_grad}
        return out.loss.detach(), out.logits.detach(), grads

    reference = tiny_nf4_model(shards=2)
    packed = {n: p.quantized_data.clone() for n, p in reference.named_parameters() if type(p).__name__ == "NF4Tensor"}
    loss, logits, grads = step(reference)
    model = tiny_nf4_model(shards=2)
    layers = model.base_model.model.model.layers
    for layer in layers:
        fully_shard(layer, mp_policy=qlora_policy())
    fully_shard(model, mp_policy=qlora_policy())
    found = {"problem": fsdp_qlora_problem(model)}
    sharded = {n: p for n, p in model.named_parameters() if n in packed}
    found["shard_fraction"] = sum(p.to_local().quantized_data.numel() for p in sharded.values()) / \\
        sum(t.numel() for t in packed.values())
    loss2, logits2, grads2 = step(model)
    found["loss_equal"] = bool(torch.equal(loss, loss2))
    found["logits_max_diff"] = (logits - logits2).abs().max().item()
    found["grads_differ"] = [n for n in grads if not torch.equal(grads[n], grads2[n])]
    for layer in layers:
        layer.unshard()
    found["bytes_differ"] = [n for n, p in model.named_parameters()
                             if n in packed and not torch.equal(p.quantized_data, packed[n])]

    def corrupting(dsts, srcs, *args, **kwargs):  # a copy that loses one byte: the start-of-training check must say so
        copy(dsts, srcs, *args, **kwargs)
        for d in dsts:
            if d.dtype == torch.uint8 and d.numel():
                d.view(-1)[0] ^= 1

    torch._foreach_copy_ = corrupting
    found["corrupted"] = gathered_bytes_problem(sharding_mesh(model), torch.device("cpu"))
    print(json.dumps({"rank": rank, **found}), flush=True)
    torch._foreach_copy_ = copy
    dist.barrier()  # no rank leaves while another still works
    from sft.parallel.distributed import exit_process
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen in CI: -6)
""").replace("CANONICALIZING_COPY\n", CANONICALIZING)


@pytest.mark.slow
def test_nf4_base_under_fsdp2_moves_bytes_only(tmp_path):
    """The NF4 base sharded by raw FSDP2 (`fully_shard`, each decoder layer and the root) on two gloo ranks, with
    CUDA's NaN-canonicalizing float copy emulated: every gathered byte is the loaded one, and the loss, the logits
    and every LoRA gradient are bit-identical to the same model unsharded. The start-of-training check passes,
    and reports a copy that loses a byte."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    tests = str(REPO / "tests")
    workers = [subprocess.Popen([sys.executable, "-c", NF4_WORKER, str(tmp_path / "rendezvous"), str(r), tests],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [w.communicate(timeout=600) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [err[-3000:] for _, err in outputs]
    for out, _ in outputs:
        found = json.loads(out.strip().splitlines()[-1])
        assert found["problem"] is None, found
        assert found["shard_fraction"] == 0.5, found  # each rank holds half of the packed bytes
        assert found["loss_equal"] and found["logits_max_diff"] == 0.0, found
        assert found["grads_differ"] == [] and found["bytes_differ"] == [], found
        assert found["corrupted"] and found["corrupted"].startswith("packed 4-bit bytes changed"), found


ACCELERATE_WORKER = textwrap.dedent("""
    import contextlib, io, json, sys, torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin, fsdp2_prepare_model
    sys.path.insert(0, sys.argv[1])
    from test_qlora_fsdp import tiny_nf4_model
    from sft.machine import Launch
    from sft.parallel.fsdp import fsdp_callbacks
    from sft.report.placement import holdings

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")  # the Trainer's, under --use_cpu: 2 gloo ranks
    # accelerate_configs/fsdp.yaml's plugin, set on accelerate's state as AcceleratorState does on GPUs only (on a
    # machine without them it is MULTI_CPU: no fsdp_plugin, and Accelerator.prepare would wrap the model in DDP)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT",
                                            cpu_ram_efficient_loading=True, sync_module_states=True)
    AcceleratorState().fsdp_plugin = plugin
    callbacks = fsdp_callbacks(Launch(world_size=2, local_world_size=2, launched=True, fsdp=True), qlora=True)
    found = {"rank": accelerator.process_index, "callbacks": [type(c).__name__ for c in callbacks]}
    for callback in callbacks:  # the Trainer calls on_init_end once its Accelerator exists
        callback.on_init_end(None, None, None)
    policy = plugin.mixed_precision_policy
    found["policy"] = [str(policy.param_dtype), str(policy.reduce_dtype), plugin.cpu_ram_efficient_loading]

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    def step(model):
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                 else p.grad) for n, p in model.named_parameters() if p.requires_grad}
        return out.loss.detach(), out.logits.detach(), grads

    reference = tiny_nf4_model(shards=2)
    whole = holdings(reference)[("host", "the rest", "4-bit NF4")]
    shard = sum(getattr(p, k).numel() * getattr(p, k).element_size() // (2 if k in ("quantized_data",
                "quantized_scalers", "quantization_factor") else 1)  # sharded on dim 0; the rest on every rank
                for p in reference.parameters() if type(p).__name__ == "NF4Tensor"
                for k in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"))
    loss, logits, grads = step(reference)
    model = fsdp2_prepare_model(accelerator, tiny_nf4_model(shards=2))  # accelerate's FSDP2 preparation
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for callback in callbacks:  # raises where the bytes do not round-trip FSDP2's all-gather
            callback.on_train_begin(None, None, None, model=model)
    found["printed"] = printed.getvalue()
    found["units"] = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    found["held"] = [holdings(model)[("host", "the rest", "4-bit NF4")], shard, whole]
    loss2, logits2, grads2 = step(model)
    found["loss_equal"] = bool(torch.equal(loss, loss2))
    found["logits_max_diff"] = (logits - logits2).abs().max().item()
    found["grads"] = [len(grads), sorted(grads) == sorted(grads2),
                      max((grads[n] - grads2[n]).abs().max().item() for n in grads)]
    print(json.dumps(found), flush=True)
    torch.distributed.barrier()  # no rank leaves while another still works
    from sft.parallel.distributed import exit_process
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen in CI: -6)
""")


@pytest.mark.slow
def test_accelerates_fsdp2_preparation_of_the_nf4_base_with_our_callback():
    """--qlora under FSDP as the Trainer prepares it, on 2 gloo ranks: FourBitWeightsGatheredAsBytes sets its policy
    on accelerate's FSDP plugin (on_init_end), accelerate's own fsdp2_prepare_model shards the NF4 model as
    accelerate_configs/fsdp.yaml says (a unit per decoder layer, the embedding and the tail apart), and the
    callback's start-of-training probe (on_train_begin) passes and says so. Then the held line counts this rank's
    share of the NF4 bytes, and a step gives the unsharded model's loss and logits bit for bit. accelerate takes its
    FSDP path on GPUs only (docs/strategies.md, QLoRA): the plugin is set on its state as it does there."""
    found = run_two_ranks(ACCELERATE_WORKER, str(REPO / "tests"))
    for rank in found:
        assert rank["callbacks"] == ["EmbeddingBackwardWithoutAllGather", "FourBitWeightsGatheredAsBytes"], rank
        assert rank["policy"] == ["None", "torch.float32", False], rank
        assert rank["units"] >= 4, rank  # 2 decoder layers, the embedding, the tail and the root
        held, shard, whole = rank["held"]
        assert held == shard and held < 0.6 * whole, rank  # each rank holds half the packed bytes
        assert rank["loss_equal"] and rank["logits_max_diff"] == 0.0, rank
        assert rank["grads"] == [28, True, 0.0], rank  # every LoRA gradient, bit for bit
    assert "round-tripped FSDP2's copy and all-gather bit for bit on the run's 2 ranks" in found[0]["printed"]
    assert found[1]["printed"] == ""  # the main process says it
