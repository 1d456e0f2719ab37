"""--qlora under FSDP reads the checkpoint weight by weight (sft/model/nf4_loading.py): the same model, bit for bit, as
from_pretrained followed by quantize_base_nf4, without the whole bf16 model in host RAM; checkpoints that do not map
1:1 onto the model are loaded the old way, and a model without safetensors weights is one error."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import loading_peaks, tiny_config

NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def save_sharded(path, model_type: str, dtype=torch.bfloat16, **overrides):
    """A tiny random model saved by save_pretrained in several safetensors shards."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, vocab_size=512, hidden_size=128, intermediate_size=320, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, max_shard_size="200KB")
    assert len(list(path.glob("model-*.safetensors"))) > 2
    return path


def loaded_then_quantized(path, shards: int, dtype=torch.bfloat16):
    """Today's path for a model loaded whole: from_pretrained, then quantize_base_nf4."""
    from transformers import AutoModelForCausalLM

    from sft.model.nf4_base import quantize_base_nf4

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    quantize_base_nf4(model, shards)
    return model


def read_weight_by_weight(path, shards: int, dtype=torch.bfloat16):
    from transformers import AutoConfig

    from sft.model.nf4_loading import load_nf4_model

    return load_nf4_model(str(path), AutoConfig.from_pretrained(path), dtype, shards)


def differences(a, b) -> list[str]:
    """Names of the parameters and buffers that differ in any bit, dtype or type (NF4: each inner tensor)."""
    first = {**dict(a.named_parameters()), **dict(a.named_buffers())}
    second = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    differ = sorted(first.keys() ^ second.keys())
    for name in first.keys() & second.keys():
        x, y = first[name], second[name]
        if type(x) is not type(y) or x.dtype != y.dtype:
            differ.append(name)
        elif type(x).__name__ == "NF4Tensor":
            differ += [f"{name}.{part}" for part in NF4_PARTS if not torch.equal(getattr(x, part), getattr(y, part))]
        elif not torch.equal(x, y):
            differ.append(name)
    return differ


@pytest.mark.parametrize("model_type,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
@pytest.mark.parametrize("checkpoint_dtype", [torch.bfloat16, torch.float32])
def test_read_weight_by_weight_is_the_loaded_then_quantized_model(tmp_path, model_type, overrides, checkpoint_dtype):
    """Llama (deepseek-llm-67b, R1-Distill-Llama) and Qwen2 (R1-Distill-Qwen: q/k/v biases; tied embeddings here),
    from a checkpoint in several shards, bf16 as the real ones and fp32 (cast as it is read): the same NF4 bytes,
    the same unquantized tensors and buffers, the same logits, tied weights still tied, in eval mode as
    from_pretrained leaves it."""
    from sft.model.nf4_base import NF4Linear

    path = save_sharded(tmp_path / "model", model_type, checkpoint_dtype, **overrides)
    old, new = loaded_then_quantized(path, 3), read_weight_by_weight(path, 3)
    assert sum(isinstance(m, NF4Linear) for m in new.modules()) == 14  # 7 linear layers per decoder layer
    assert differences(old, new) == []
    if overrides.get("tie_word_embeddings"):
        assert new.lm_head.weight is new.model.embed_tokens.weight
    assert not new.training and new.config.name_or_path == str(path)
    assert new.generation_config.to_dict() == old.generation_config.to_dict()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(old(input_ids=ids).logits, new(input_ids=ids).logits)


def test_checkpoints_that_do_not_map_one_to_one_are_named(tmp_path):
    """What sends a checkpoint to the old path (from_pretrained, then quantize): transformers' own conversion of its
    keys (the MoE families fuse their experts), a key the model lacks or misses, a tied weight saved beside its
    source; a plain save passes."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from sft.model.nf4_loading import streaming_problem

    def meta(model_type, **overrides):
        with init_empty_weights():
            return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))

    llama = meta("llama")
    keys = set(llama.state_dict())
    assert streaming_problem(llama, keys) is None
    assert "unexpected" in streaming_problem(llama, keys | {"model.layers.0.self_attn.rotary_emb.inv_freq"})
    assert "1 missing" in streaming_problem(llama, keys - {"model.norm.weight"})
    tied = meta("qwen2", tie_word_embeddings=True)
    keys = set(tied.state_dict())
    assert streaming_problem(tied, keys - {"lm_head.weight"}) is None  # what save_pretrained writes
    assert "tied weights" in streaming_problem(tied, keys)  # both saved: transformers may leave them untied
    assert "model.embed_tokens.weight" in streaming_problem(tied, keys - {"model.embed_tokens.weight"})
    moe = meta("deepseek_v2")
    assert "transformers converts deepseek_v2 checkpoints" in streaming_problem(moe, set(moe.state_dict()))


def test_a_model_without_safetensors_weights_is_one_error(tmp_path):
    from sft.errors import ModelNotFoundError
    from sft.model.nf4_loading import checkpoint_files

    tiny_config("llama").save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no safetensors weights") as e:
        checkpoint_files(str(tmp_path))
    assert "\n" not in str(e.value)


def add_extra_key(path) -> None:
    """A tensor the model does not have, in the checkpoint's last shard: its keys are no longer the model's own."""
    from safetensors.torch import load_file, save_file

    last = sorted(path.glob("model-*.safetensors"))[-1]
    save_file({**load_file(last), "extra.weight": torch.zeros(2)}, last, metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra.weight"] = last.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_the_verified_save_reloads_the_same_nf4_base(tmp_path):
    """A --qlora FSDP run's verified save reloads its base in the trained layout (quantized_base.json's settings):
    read weight by weight, or loaded whole where the checkpoint does not map 1:1; the same bytes either way."""
    from sft.model.nf4_base import nf4_settings
    from sft.safety.verify import SaveVerifier

    path = save_sharded(tmp_path / "model", "qwen2")
    expected = loaded_then_quantized(path, 2)
    verifier = SaveVerifier(str(path), lora=True, quantization=nf4_settings(expected))
    assert differences(verifier.load_whole(str(path), torch.bfloat16, torch.device("cpu")), expected) == []
    add_extra_key(path)
    assert differences(verifier.load_whole(str(path), torch.bfloat16, torch.device("cpu")), expected) == []


def fsdp_launch(monkeypatch, world_size: int = 2):
    """load_model as on a rank of an FSDP launch (this CPU machine otherwise)."""
    import dataclasses

    import sft.model.loading as loading
    from sft.machine import machine

    m = machine()
    launched = dataclasses.replace(m, launch=dataclasses.replace(m.launch, fsdp=True, world_size=world_size))
    monkeypatch.setattr(loading, "machine", lambda: launched)


def test_load_model_under_fsdp_reads_weight_by_weight(tmp_path, monkeypatch, capsys):
    """--qlora under FSDP: load_model reads the base weight by weight, and says so; the same model as loading it
    whole (a model factory: from_pretrained) and quantizing it. A checkpoint that does not map 1:1 is loaded whole,
    with a note saying why."""
    from transformers import AutoModelForCausalLM

    from sft.model.loading import load_model
    from sft.options.arguments import LoraArguments, ModelArguments

    fsdp_launch(monkeypatch)
    path = save_sharded(tmp_path / "model", "llama")
    model_args = ModelArguments(model=str(path), dtype="bfloat16")
    lora_args = LoraArguments(lora=True, qlora=True, lora_r=4, lora_dropout=0.0)
    torch.manual_seed(0)
    streamed = load_model(model_args, lora_args)
    assert "one weight at a time" in capsys.readouterr().out
    torch.manual_seed(0)
    whole = load_model(model_args, lora_args, model_factory=AutoModelForCausalLM.from_pretrained)
    assert "quantized after loading" in capsys.readouterr().out
    assert differences(streamed, whole) == []
    add_extra_key(path)
    load_model(model_args, lora_args)
    out = capsys.readouterr().out
    assert "loaded whole into every process's host RAM" in out and "extra.weight" in out, out
    assert "quantized after loading" in out


PEAK_IMPORTS = ("import torchao.quantization\nfrom sft.model.nf4_base import quantize_base_nf4\n"
                "from sft.model.nf4_loading import load_nf4_model")
PEAK_QUANTIZE_AFTER = "quantize_base_nf4(model, 3)"
PEAK_LOAD_NEW = "model = load_nf4_model(path, config, torch.bfloat16, 3)"


@pytest.mark.slow
def test_reading_weight_by_weight_holds_less_host_ram(tmp_path):
    """Peak RSS of loading a bf16 checkpoint (the real ones' dtype) of ~200 MB, each way in a process of its own:
    from_pretrained's tensors are the files' mapped pages, all of them touched and mapped until quantization ends; read
    weight by weight, one weight's pages at a time (here 159 MB against 333 MB, for a checkpoint of 184 MB). Compared,
    not held to a size. glibc's malloc is given a fixed mmap threshold in both: with its default, dynamic one the CPU
    quantization's freed working buffers of these small weights (under 32 MB) stay in the heap, fragmented, and both
    grew by ~360 MB here; on a GPU run that working set is GPU memory, and a 67B's weights are far over 32 MB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40MB")
    checkpoint = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    growth = loading_peaks(tmp_path, PEAK_IMPORTS, PEAK_QUANTIZE_AFTER, PEAK_LOAD_NEW)
    assert growth["old"] > checkpoint, (growth, checkpoint)  # every page of the checkpoint was held at once
    assert growth["new"] < growth["old"], (growth, checkpoint)
