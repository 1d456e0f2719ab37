"""--qlora: a LoRA adapter on a base quantized to 4 bits as it loads (bitsandbytes NF4, double quantization).

What runs everywhere: the option implies --lora, the checks (a machine described as data), and the
BitsAndBytesConfig for DDP and FSDP. What needs bitsandbytes runs on its CPU backend when it is installed
(`pip install -e ".[qlora]"`), else skips: loading, training a few steps, the verified save (in place, and
reloaded onto a 4-bit base from disk), the reload onto the UNQUANTIZED base with plain peft (logits differ by
the quantization error) and sft.tools.merge (the merged model equals the adapter on the unquantized base). Training
itself on a GPU, DDP and FSDP: bench/qlora_check.py.
"""

from __future__ import annotations

import importlib.util
from dataclasses import fields

import pytest
import torch

from conftest import REPO, save_tiny_model
from sft.options.arguments import ConfigError, LoraArguments, ModelArguments, parse_args, validate_setup
from sft.machine import Launch, Machine

DATA = str(REPO / "data" / "alpaca_demo.json")
HAS_FIELD = "qlora" in {f.name for f in fields(LoraArguments)} | {f.name for f in fields(ModelArguments)}
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason='bitsandbytes is not installed (pip install -e ".[qlora]"); its CPU backend '
                                      'runs these tests')


def box(gpus: int = 1, bf16: bool = True, packages=("bitsandbytes",), **launch) -> Machine:
    """A box of RTX 4090s with bitsandbytes installed (unless `packages` says otherwise)."""
    return Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * gpus, gpu_memory_gib=(23.5,) * gpus,
                   bf16=bf16 and gpus > 0, host_ram_gib=64, host_ram_available_gib=60, launch=Launch(**launch),
                   packages=frozenset(packages))


def parsed(*extra: str):
    """Options parsed on this (CPU) machine without --qlora, which is then set as a user would have set it."""
    args = parse_args(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", *extra])
    args[2].qlora = True  # an attribute: works before and after LoraArguments has the field
    return args


def refused_on(machine: Machine, *extra: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate_setup(*parsed(*extra), machine=machine)
    return str(e.value)


# ---- options and checks ----------------------------------------------------------------------------------

def test_qlora_implies_lora():
    args = parsed()
    assert not args[2].lora
    validate_setup(*args, machine=box(1))
    assert args[2].lora  # everything after parsing (model, verifier, FSDP settings) sees a LoRA run


def test_ddp_and_one_gpu_pass():
    validate_setup(*parsed(), machine=box(1))
    validate_setup(*parsed(), machine=box(3, world_size=3, local_world_size=3, launched=True))


def fsdp_box(gpus: int = 2, packages=("torchao",), **launch) -> Machine:
    return box(gpus, packages=packages, world_size=gpus, local_world_size=gpus, launched=True, fsdp=True, **launch)


def test_fsdp_refused_until_its_gpu_check_passes():
    """FSDP+QLoRA failed its verified save on two H200s (bitsandbytes' bytes held in bf16, rewritten by CUDA's float
    copies). The NF4 byte path replaces it (tests/test_qlora_fsdp.py); it stays refused on GPUs, DDP named instead,
    until bench/qlora_check.py --fsdp two passes on two GPUs."""
    message = refused_on(fsdp_box(3))
    assert message.startswith("--qlora under FSDP: not enabled until its check passes on two GPUs"), message
    assert "bench/qlora_check.py" in message and "accelerate_configs/ddp.yaml" in message


def test_fsdp_reachable_for_its_check_command():
    validate_setup(*parsed(), machine=fsdp_box(2, fsdp_qlora_check=True))  # no bitsandbytes needed: torchao's NF4


def test_fsdp_needs_torchao_and_two_processes():
    assert "needs the torchao package" in refused_on(fsdp_box(2, packages=("bitsandbytes",), fsdp_qlora_check=True))
    assert "with one process: nothing to shard" in refused_on(fsdp_box(1, fsdp_qlora_check=True))


def test_needs_a_cuda_gpu():
    message = refused_on(box(0))
    assert "--qlora needs a CUDA GPU" in message and "Use --lora here" in message


def test_needs_bitsandbytes():
    message = refused_on(box(1, packages=()))
    assert "\n" not in message and 'pip install -e ".[qlora]"' in message


def test_refused_with_zero3_says_ddp():
    message = refused_on(box(2, zero_stage="3", world_size=2, local_world_size=2, launched=True))
    assert "ZeRO-3" in message and "accelerate_configs/ddp.yaml" in message
    assert "accelerate_configs/fsdp.yaml" not in message  # FSDP+QLoRA is refused too
    assert "ZeRO-2" not in message


def test_refused_with_zero2():
    message = refused_on(box(2, zero_stage="2", world_size=2, local_world_size=2, launched=True))
    assert "ZeRO-2" in message and "ddp.yaml" in message


def test_refused_with_tensor_parallel():
    model_args, data_args, lora_args, training_args = parsed()
    model_args.tp_size = 2
    with pytest.raises(ConfigError, match="--qlora with --tp_size 2"):
        validate_setup(model_args, data_args, lora_args, training_args,
                       machine=box(2, world_size=2, local_world_size=2, launched=True))


@pytest.mark.skipif(not HAS_FIELD, reason="the --qlora field is not in sft/options/arguments.py yet (the lead adds it)")
def test_the_command_line_option():
    with pytest.raises(ConfigError, match="--qlora needs a CUDA GPU"):  # this CPU machine
        parse_args(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", "--qlora"])


# ---- the quantization config -----------------------------------------------------------------------------

def test_bitsandbytes_config_for_ddp_and_fsdp():
    from transformers import BitsAndBytesConfig

    from sft.model.loading import qlora_quantization_kwargs

    ddp = BitsAndBytesConfig(**qlora_quantization_kwargs(torch.bfloat16, torch.bfloat16, fsdp=False))
    fsdp = BitsAndBytesConfig(**qlora_quantization_kwargs(torch.bfloat16, torch.bfloat16, fsdp=True))
    for config in (ddp, fsdp):
        assert config.load_in_4bit and not config.load_in_8bit
        assert config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
        assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert ddp.bnb_4bit_quant_storage == torch.uint8  # bitsandbytes' own packing
    assert fsdp.bnb_4bit_quant_storage == torch.bfloat16  # FSDP shards floating-point tensors (Answer.AI's recipe)


def test_compute_dtype():
    from sft.model.loading import qlora_compute_dtype

    assert qlora_compute_dtype(cuda=True, bf16=True, weights=torch.bfloat16) == torch.bfloat16
    assert qlora_compute_dtype(cuda=True, bf16=False, weights=torch.float32) == torch.float16  # V100, T4
    assert qlora_compute_dtype(cuda=False, bf16=False, weights=torch.float32) == torch.float32


def test_weights_dtype_follows_the_machines_bf16():
    """--dtype auto: LoRA's frozen base in bf16 where the GPUs have it, fp32 otherwise and for full fine-tuning."""
    from sft.options.arguments import ModelArguments
    from sft.machine import Machine
    from sft.model.loading import weights_dtype

    bf16_box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",), gpu_memory_gib=(23.5,), bf16=True)
    t4 = Machine(gpu_names=("Tesla T4",), gpu_memory_gib=(15.0,), bf16=False)
    auto = ModelArguments(model="m")
    assert weights_dtype(auto, True, bf16_box) == torch.bfloat16
    assert weights_dtype(auto, False, bf16_box) == torch.float32  # fp32 masters for a full fine-tune
    assert weights_dtype(auto, True, t4) == weights_dtype(auto, True, Machine()) == torch.float32
    assert weights_dtype(ModelArguments(model="m", dtype="float16"), True, t4) == torch.float16


def test_no_quantization_without_qlora():
    from sft.model.loading import quantization

    assert quantization(ModelArguments(), LoraArguments(lora=True)) == {}


# ---- on bitsandbytes' CPU backend ----------------------------------------------------------------------------

def qlora_args() -> LoraArguments:
    args = LoraArguments(lora=True, lora_r=8, lora_alpha=16, lora_dropout=0.0)
    args.qlora = True
    return args


def batch(tokenizer):
    texts = ["User: What is the capital of France?\n\nAssistant: Paris.", "def add(a, b):\n    return a + b\n"]
    ids = tokenizer(texts, return_tensors="pt", padding=True)["input_ids"]
    return ids


def logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A QLoRA adapter trained 12 steps on a fixed batch of a tiny llama, saved with its tokenizer."""
    from transformers import AutoTokenizer

    from sft.model.loading import load_model

    base = save_tiny_model(tmp_path_factory.mktemp("tiny-llama-qlora"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = load_model(ModelArguments(model=str(base)), qlora_args())
    ids = batch(tokenizer)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    model.train()
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out = tmp_path_factory.mktemp("qlora-adapter")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"base": base, "model": model, "adapter": out, "ids": ids, "losses": losses}


@needs_bnb
def test_the_base_is_4bit_and_only_the_adapter_trains(trained):
    import bitsandbytes as bnb

    model = trained["model"]
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in both layers, each adapted
    assert all(m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested for m in layers)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    # unquantized weights stay in the weights' dtype (no fp32 upcast as peft's prepare_model_for_kbit_training does)
    assert model.get_input_embeddings().weight.dtype == torch.float32  # --dtype auto on a CPU: fp32
    assert not isinstance(model.get_output_embeddings(), bnb.nn.Linear4bit)
    assert trained["losses"][-1] < trained["losses"][0] - 0.5, trained["losses"]  # it learns


@needs_bnb
def test_the_verified_save_works_on_a_4bit_base(trained):
    """In place (the saved adapter beside the trained one, same 4-bit base) and from disk (the base quantized again
    as it reloads): both give the trained logits; a wrong adapter does not."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sft.safety.verify import SaveVerifier, make_verifier, quantization_of

    model, adapter = trained["model"], trained["adapter"]
    assert quantization_of(model)["bnb_4bit_quant_type"] == "nf4"
    verifier = make_verifier("all", model, str(trained["base"]), True, "sdpa", False)
    assert verifier.quantization == quantization_of(model)
    verifier.check(model, adapter)  # in place
    SaveVerifier(str(trained["base"]), True, lora_in_place=False, quantization=quantization_of(model)).check(
        model, adapter)  # reloaded from disk, onto a base quantized again
    broken = adapter.parent / "broken-adapter"
    shutil.copytree(adapter, broken, dirs_exist_ok=True)
    tensors = load_file(broken / "adapter_model.safetensors")
    save_file({k: v * 0 if "lora_B" in k else v for k, v in tensors.items()}, broken / "adapter_model.safetensors")
    from sft.errors import SaveMismatchError

    with pytest.raises(SaveMismatchError):
        verifier.check(model, broken)


@needs_bnb
def test_the_adapter_on_the_unquantized_base_and_merged(trained, tmp_path):
    """What users do: plain peft loads the adapter on the unquantized base named in adapter_config.json, and
    sft.tools.merge folds it into that base. Both differ from the 4-bit model trained by the quantization error only."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from sft.tools.merge import main as merge

    ids = trained["ids"]
    quantized = logits(trained["model"], ids)
    on_full = AutoPeftModelForCausalLM.from_pretrained(trained["adapter"], dtype=torch.float32)
    unquantized = logits(on_full, ids)
    base_only = logits(AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32), ids)
    error = relative(unquantized, quantized)
    assert 1e-4 < error < 0.2, error  # NF4's error through 2 layers: a few percent, not a broken adapter
    assert relative(unquantized, base_only) > 2 * error  # the adapter's effect survives the change of base
    merged_dir = tmp_path / "merged"
    assert merge([str(trained["adapter"]), str(merged_dir)]) == 0
    merged = logits(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32), ids)
    assert relative(merged, unquantized) < 1e-5  # the merge is exact: the adapter on the unquantized base
    assert abs(relative(merged, quantized) - error) < 1e-4


@needs_bnb
def test_an_adapter_reloads_on_a_4bit_base_with_plain_peft(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sft.safety.verify import quantization_of

    config = BitsAndBytesConfig.from_dict(quantization_of(trained["model"]))
    base = AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32, quantization_config=config,
                                                device_map={"": "cpu"})
    reloaded = PeftModel.from_pretrained(base, trained["adapter"])
    assert relative(logits(reloaded, trained["ids"]), logits(trained["model"], trained["ids"])) < 1e-6
