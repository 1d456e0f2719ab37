"""--quantize_experts fp8 from a checkpoint quantizes the routed experts as they load (sft/model/experts_on_load.py):
the same model, bit for bit, as from_pretrained followed by quantize_experts, without the whole bf16 base in host RAM;
sft/model/mapped_pages.py drops only the checkpoint pages it can drop without loss."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from conftest import loading_peaks, tiny_config


def save_moe(path, model_type: str = "deepseek_v2", dtype=torch.bfloat16, **overrides):
    """A tiny random MoE model saved by save_pretrained in several safetensors shards."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(model_type, vocab_size=256, num_hidden_layers=3, **overrides)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("model-*.safetensors"))) > 2
    return path


def loaded_then_quantized(path, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    from sft.model.quantized_experts import quantize_experts

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    quantize_experts(model)
    return model


def quantized_as_loaded(path, dtype=torch.bfloat16):
    from transformers import AutoConfig, AutoModelForCausalLM

    from sft.model.experts_on_load import on_load_config

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                **on_load_config(AutoConfig.from_pretrained(path), None))


def differences(a, b) -> list[str]:
    """What differs between two models: tensors (names, order, dtype, bits, requires_grad, the e4m3 experts'
    scales), module classes, the model's and its config's attributes."""
    from sft.model.quantized_experts import WEIGHTS

    first = [*a.named_parameters(), *a.named_buffers()]
    second = [*b.named_parameters(), *b.named_buffers()]
    differ = [] if [n for n, _ in first] == [n for n, _ in second] else ["the tensors' names or order"]
    for (name, x), (_, y) in zip(first, second):
        if x.dtype != y.dtype or x.requires_grad != y.requires_grad or not torch.equal(x, y):
            differ.append(name)
    for (name, m), (_, n) in zip(a.named_modules(), b.named_modules()):
        if type(m) is not type(n) or set(vars(m)) != set(vars(n)):
            differ.append(f"{name} (module)")
        elif type(m).__name__.startswith("Fp8"):
            differ += [f"{name}.{w}_scale" for w in WEIGHTS
                       if not torch.equal(getattr(m, f"{w}_scale"), getattr(n, f"{w}_scale"))]
            differ += [f"{name}.compute_dtype"] * (m.compute_dtype != n.compute_dtype)
    if set(vars(a)) != set(vars(b)):
        differ.append(f"model attributes {set(vars(a)) ^ set(vars(b))}")
    if vars(a.config).keys() != vars(b.config).keys() or a.config.to_dict() != b.config.to_dict():
        differ.append("config")
    return differ


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("checkpoint_dtype", [torch.bfloat16, torch.float32])
def test_quantized_as_loaded_is_the_loaded_then_quantized_model(tmp_path, model_type, checkpoint_dtype):
    """From a checkpoint in several shards, bf16 as the real ones and fp32 (cast as it is read): every tensor, the
    scales, the classes and the attributes as loading whole then quantizing gives them; the same logits; no trace of
    the quantizer on the model or its config."""
    path = save_moe(tmp_path / "model", model_type, checkpoint_dtype)
    old, new = loaded_then_quantized(path), quantized_as_loaded(path)
    assert sum(type(m).__name__.startswith("Fp8") for m in new.modules()) == 2  # layers 1 and 2 (layer 0 dense)
    assert differences(old, new) == []
    assert not hasattr(new, "hf_quantizer") and "quantization_config" not in vars(new.config)
    assert not new.training and new.config.name_or_path == str(path)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(old(input_ids=ids).logits, new(input_ids=ids).logits)


def test_load_model_quantizes_as_it_loads_and_says_what_it_did(tmp_path, capsys):
    """load_model under --quantize_experts fp8: from a checkpoint, quantized as it loads; from a model factory (the
    bench's random weights), loaded whole and then quantized. The same model and the same line either way; a model
    without routed experts is the same error as before."""
    from transformers import AutoModelForCausalLM

    from sft.errors import ConfigError
    from sft.model.loading import experts_quantization, load_model
    from sft.options.arguments import LoraArguments, ModelArguments

    path = save_moe(tmp_path / "model")
    model_args = ModelArguments(model=str(path), dtype="bfloat16", quantize_experts="fp8")
    assert "quantization_config" in experts_quantization(model_args)
    lora_args = LoraArguments(lora=True, lora_r=4, lora_dropout=0.0)
    torch.manual_seed(0)
    on_load = load_model(model_args, lora_args)
    said = capsys.readouterr().out
    torch.manual_seed(0)
    whole = load_model(model_args, lora_args, model_factory=AutoModelForCausalLM.from_pretrained)
    assert capsys.readouterr().out == said and "Experts: 2 MoE layers' routed experts held in e4m3" in said
    assert differences(on_load, whole) == []
    dense = tmp_path / "dense"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=256)).save_pretrained(dense)
    with pytest.raises(ConfigError, match="no routed experts"):
        load_model(ModelArguments(model=str(dense), dtype="bfloat16", quantize_experts="fp8"), lora_args)


def resident_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_only_unwritten_file_pages_are_dropped(tmp_path):
    """Pages of a read-only mapping leave this process's RSS and read back the same; a copy-on-write mapping that
    was written to keeps its pages and what was written."""
    from sft.model.mapped_pages import drop_file_pages

    data = os.urandom(64 << 20)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    with open(path, "rb") as f:
        read_only = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        before = resident_kib()
        assert bytes(read_only[:]) == data  # every page read
        assert resident_kib() - before > 60 << 10
        assert drop_file_pages([str(path)]) > 60 << 20
        assert resident_kib() - before < 4 << 10
        assert bytes(read_only[:]) == data
        read_only.close()
        written = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: a write makes the page this process's
        written[:4] = b"ours"
        assert bytes(written[4:]) == data[4:]
        assert drop_file_pages([str(path)]) == 0
        assert written[:4] == b"ours" and bytes(written[4:]) == data[4:]
        written.close()
    assert drop_file_pages([str(tmp_path / "not-mapped.bin")]) == 0


PEAK_IMPORTS = ("from sft.model.experts_on_load import on_load_config\n"
                "from sft.model.quantized_experts import quantize_experts")
PEAK_QUANTIZE_AFTER = "quantize_experts(model)"
PEAK_LOAD_NEW = ("model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, use_safetensors=True, "
                 "**on_load_config(config, None))")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_quantizing_as_it_loads_holds_less_host_ram(tmp_path):
    """Peak RSS of loading a bf16 MoE checkpoint of ~230 MB (its experts 200 MB), each way in a process of its own:
    loaded whole, every page of the checkpoint is mapped and the fused bf16 experts copied out of them before any is
    quantized (here about twice the checkpoint); quantized as it loads, one layer's experts in flight beside the e4m3
    experts (kept in host RAM here: no GPU) and within what the planner counts for it (sft/plan/resident.py
    load_host_bytes) plus the allocator's slack. glibc's malloc is given a fixed mmap threshold, as in
    tests/test_nf4_loading.py's twin of this test (conftest.loading_peaks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sft.plan.shapes import shape_from_config
    from sft.plan.resident import load_host_bytes

    config = tiny_config("deepseek_v2", vocab_size=1024, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=5, moe_intermediate_size=512, n_routed_experts=32)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path, max_shard_size="50MB")
    checkpoint = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    growth = loading_peaks(tmp_path, PEAK_IMPORTS, PEAK_QUANTIZE_AFTER, PEAK_LOAD_NEW)
    predicted = load_host_bytes(shape_from_config(AutoConfig.from_pretrained(tmp_path), "test"), experts_on_host=True)
    assert growth["old"] > 1.5 * checkpoint, (growth, checkpoint)  # the pages and the fused bf16 experts at once
    assert growth["new"] < 0.6 * growth["old"], (growth, checkpoint)
    assert growth["new"] < predicted + (32 << 20), (growth, predicted)
