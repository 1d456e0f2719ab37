"""--lora_modules_to_save (peft's modules_to_save): modules trained whole beside the LoRA adapter and saved in it.
Options and other trainers' names, names checked on the model before it loads, a run that trains them (and only
them beside the adapter) and saves an adapter that plain peft reloads and sft.tools.merge merges, a bf16 base (the
copies in fp32), tied embeddings, the MoE families, the 4-bit and FP8 bases, LoRA+, the FLOPs count, FSDP."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace as NS

import pytest
import torch

from conftest import REPO, save_tiny_model, tiny_config
from sft.errors import ConfigError
from sft.options.arguments import LoraArguments, ModelArguments
from test_config import parse, refused

DATA = str(REPO / "data" / "alpaca_demo.json")
EMBEDDINGS = ["embed_tokens", "lm_head"]


def tiny_model(model_type: str = "llama", dtype: torch.dtype = torch.float32, **config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **config)).to(dtype)


def attached(model, *names: str, **lora):
    from sft.model.loading import attach_lora

    return attach_lora(model, LoraArguments(lora=True, lora_r=4, lora_dropout=0.0, lora_modules_to_save=list(names),
                                            **lora), False)


def train_steps(model, steps: int = 2, autocast: bool = False) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def copies(model) -> dict:
    from sft.model.saved_modules import trained_copies

    return trained_copies(model)


# ---- options ------------------------------------------------------------------------------------------------

def test_the_option_other_trainers_names_and_bad_values(tmp_path, capsys):
    assert parse("--lora", "--lora_modules_to_save", "embed_tokens,lm_head")[2].lora_modules_to_save == EMBEDDINGS
    assert refused("--lora_modules_to_save", "lm_head") == (
        "--lora_modules_to_save only applies to a LoRA adapter, and this run fine-tunes every weight: add --lora (or "
        "--qlora), or drop --lora_modules_to_save.")
    assert refused("--lora", "--lora_modules_to_save", ",") == (
        "--lora_modules_to_save: give module names (letters, digits and _, a path's parts joined by dots), "
        "comma-separated, e.g. embed_tokens,lm_head.")
    assert refused("--lora", "--lora_modules_to_save", "model.norm,lm-head,.*_proj").startswith(
        "--lora_modules_to_save 'lm-head' '.*_proj': give module names")
    capsys.readouterr()
    assert parse("--lora", "--modules_to_save", "embed_tokens", "lm_head")[2].lora_modules_to_save == EMBEDDINGS
    assert ("note: --modules_to_save is peft's name for --lora_modules_to_save: using --lora_modules_to_save "
            "embed_tokens lm_head") in capsys.readouterr().err
    for key, value in (("additional_target", "embed_tokens,lm_head"), ("modules_to_save", "[embed_tokens, lm_head]"),
                       ("lora_modules_to_save", "[embed_tokens, lm_head]")):  # LLaMA-Factory's, peft's, Axolotl's
        recipe = tmp_path / f"{key}.yaml"
        recipe.write_text(f"lora: true\n{key}: {value}\n")
        assert parse("--config", str(recipe))[2].lora_modules_to_save == EMBEDDINGS, key
    assert "--additional_target is LLaMA-Factory's name for --lora_modules_to_save" in capsys.readouterr().err


def test_each_name_must_name_whole_modules_with_weights_before_the_model_loads(tiny_llama):
    """peft matches the end of module paths as text and leaves out a name that matches nothing, in silence; here
    each is checked on a weightless copy of the model (the run's check before loading)."""
    from sft.model.loading import check_lora_targets

    model = ModelArguments(model=str(tiny_llama))

    def said(*names: str) -> str:
        with pytest.raises(ConfigError) as e:
            check_lora_targets(model, LoraArguments(lora=True, lora_modules_to_save=list(names)))
        return str(e.value)

    assert said("lm_head", "embed_token") == (
        "--lora_modules_to_save embed_token: no module of llama with weights is named so. Its modules with weights "
        "are named: down_proj, embed_tokens, gate_proj, input_layernorm, k_proj, lm_head, norm, o_proj, "
        "post_attention_layernorm, q_proj, up_proj, v_proj.")
    assert said("norm") == ("--lora_modules_to_save norm: peft trains every module whose path ends with it, which "
                            "would also train input_layernorm, post_attention_layernorm. Give more of the path: "
                            "model.norm names model.norm.")
    assert said("head").endswith("which would also train lm_head. Give the whole name (lm_head).")
    assert said("layers").startswith("--lora_modules_to_save layers: a list of modules")
    assert said("rotary_emb").startswith("--lora_modules_to_save rotary_emb: no module of llama with weights")
    check_lora_targets(model, LoraArguments(lora=True, lora_modules_to_save=["model.norm", *EMBEDDINGS]))


# ---- a run ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_trains_them_whole_and_the_adapter_reloads_with_plain_peft_and_merges(tiny_llama, tmp_path, capsys):
    """In process: 3 steps with LoRA+ (the modules trained whole learn at --learning_rate, the B matrices at 16x),
    a verified checkpoint and final save; only the two modules and the adapter change."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sft.safety.trained_on import recorded
    from sft.tools import merge
    from sft.train import main

    out, seen = tmp_path / "run", {}
    assert main(["--model", str(tiny_llama), "--dataset", DATA, "--max_length", "64", "--max_steps", "3",
                 "--save_steps", "2", "--learning_rate", "1e-2", "--lora", "--lora_dropout", "0",
                 "--lora_modules_to_save", "embed_tokens,lm_head", "--loraplus_lr_ratio", "16",
                 "--per_device_train_batch_size", "4", "--report_to", "none", "--disable_tqdm", "true",
                 "--output_dir", str(out), "--dataset_cache_dir", str(tmp_path / "cache")],
                on_trainer=lambda trainer: seen.update(trainer=trainer)) == 0
    said = capsys.readouterr().out
    whole = 2 * 64 * json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    assert f"of them in embed_tokens, lm_head (trained whole)" in said and f"{whole / 1e3:.3g}K of them" in said
    model, optimizer = seen["trainer"].model, seen["trainer"].optimizer
    base = load_file(tiny_llama / "model.safetensors")
    for name, p in model.get_base_model().named_parameters():
        key = name.replace(".base_layer", "").replace(".original_module", "").replace(".modules_to_save.default", "")
        if ".lora_" not in name:  # the copies trained, their originals and the rest of the base did not
            assert torch.equal(p.detach(), base[key]) is (".modules_to_save." not in name), name
    rates = {g["initial_lr"] for c in copies(model).values() for p in c.parameters() for g in optimizer.param_groups
             if any(p is q for q in g["params"])}
    assert rates == {1e-2}  # LoRA+ leaves them at --learning_rate
    assert (out / "checkpoint-2").is_dir() and recorded(out)["lora_modules_to_save"] == EMBEDDINGS
    adapter = load_file(out / "adapter_model.safetensors")
    assert {k for k in adapter if ".lora_" not in k} == {"base_model.model.lm_head.weight",
                                                         "base_model.model.model.embed_tokens.weight"}
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = logits(model, ids)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), out)
    torch.testing.assert_close(logits(reloaded, ids), expected, rtol=1e-5, atol=1e-5)
    assert merge.main([str(out), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-4, atol=1e-4)


# ---- precision, tied embeddings, the verified save --------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_on_a_bf16_base_the_copies_train_in_fp32_and_the_save_verifies(tmp_path, tied):
    """A LoRA base in bf16 (a GPU's): the trained copies in fp32 (plain bf16 AdamW would drop small updates), their
    outputs in bf16, with DoRA and rsLoRA. A tied model's copies stay tied (else its merged lm_head is lost to the
    tie) and are checked by a reload (peft cannot load a second tied adapter beside the first); a save that no longer
    matches is refused."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sft.errors import SaveMismatchError
    from sft.safety.verify import make_verifier

    tiny_model(tie_word_embeddings=tied).save_pretrained(tmp_path / "base")
    model = attached(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16), *EMBEDDINGS,
                     use_dora=True, use_rslora=True)
    weights = {p for c in copies(model).values() for p in c.parameters()}
    assert len(weights) == (1 if tied else 2) and all(p.dtype == torch.float32 for p in weights)
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(1))
    assert logits(model, ids).isfinite().all() and model(input_ids=ids).logits.dtype == torch.bfloat16
    model.train()
    train_steps(model, autocast=True)
    model.save_pretrained(tmp_path / "adapter")
    verifier = make_verifier("all", model, str(tmp_path / "base"), True, "sdpa", False)
    assert verifier.lora_in_place is not tied
    verifier.check(model, tmp_path / "adapter")
    if tied:  # the merged model keeps the trained (tied) head
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                             tmp_path / "adapter")
        expected = logits(reloaded, ids)
        reloaded.merge_and_unload().save_pretrained(tmp_path / "merged")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        next(iter(weights)).add_(0.05)
    with pytest.raises(SaveMismatchError, match="does not reproduce the trained model"):
        verifier.check(model, tmp_path / "adapter")


# ---- the MoE families, the 4-bit and FP8 bases ------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_moe_families_train_them_beside_their_adapter(tmp_path, model_type):
    """The family's LoRA (MLA projections as modules, the dense and shared-expert MLP as parameters) is unchanged;
    a module whose weights the adapter adapts as parameters cannot also train whole, said by name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sft.model.families import FAMILIES

    base = save_tiny_model(tmp_path / "base", model_type)
    model = attached(AutoModelForCausalLM.from_pretrained(base), *EMBEDDINGS)
    family = FAMILIES[model_type]
    assert sorted(model.peft_config["default"].target_parameters) == sorted(family.lora_parameters)
    assert sorted(copies(model)) == ["base_model.model.lm_head", "base_model.model.model.embed_tokens"]
    model.train()
    train_steps(model)
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=1e-5, atol=1e-5)
    for name, why in (("mlp", "holds layers that the LoRA adapter adapts"), ("gate_proj", "adapts as a parameter")):
        with pytest.raises(ConfigError, match=why):
            attached(tiny_model(model_type), name)


def test_the_nf4_base_of_qlora_keeps_its_4bit_layers_and_the_copies_train():
    """--qlora's base as FSDP holds it (torchao's NF4, on CPU too): the embeddings and lm_head are not quantized,
    so they train whole as on a bf16 base. bitsandbytes' layout: test_bitsandbytes_base below."""
    from sft.model.nf4_base import NF4Linear, quantize_base_nf4

    def nf4_base():
        base = tiny_model(dtype=torch.bfloat16)
        quantize_base_nf4(base, 1)
        return base

    model = attached(nf4_base(), *EMBEDDINGS, qlora=True)
    nf4 = {n: m.weight.quantized_data.clone() for n, m in model.named_modules() if isinstance(m, NF4Linear)}
    before = {path: c.weight.detach().clone() for path, c in copies(model).items()}
    model.train()
    train_steps(model, autocast=True)
    assert len(nf4) == 2 * 7 and all(torch.equal(m.weight.quantized_data, nf4[n]) for n, m in model.named_modules()
                                     if isinstance(m, NF4Linear))
    after = {path: c.weight for path, c in copies(model).items()}
    assert len(after) == 2 and all(w.dtype == torch.float32 and not torch.equal(w, before[p]) for p, w in after.items())
    with pytest.raises(ConfigError, match="model.layers.0.self_attn.q_proj is held quantized"):
        attached(nf4_base(), "q_proj", qlora=True)  # a 4-bit layer (not the adapter's: the name keeps it out of LoRA)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                    reason='bitsandbytes is not installed (pip install -e ".[qlora]"); its CPU backend runs this')
def test_bitsandbytes_base(tiny_llama):
    import bitsandbytes as bnb

    from sft.model.loading import load_model

    lora = LoraArguments(lora=True, qlora=True, lora_r=4, lora_dropout=0.0, lora_modules_to_save=EMBEDDINGS)
    model = load_model(ModelArguments(model=str(tiny_llama)), lora)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) and len(copies(model)) == 2
    model.train()
    train_steps(model)


def test_the_fp8_base_leaves_the_trained_modules_alone():
    """--fp8 under LoRA turns the frozen base's LoRA-wrapped linear layers to e4m3; the trained lm_head is no LoRA
    layer and keeps its fp32 weight and its gradient."""
    from sft.speed.fp8 import Fp8Linear, use_fp8_base

    model = attached(tiny_model(dtype=torch.bfloat16), *EMBEDDINGS)
    assert use_fp8_base(model) == (14, 0)
    head = copies(model)["base_model.model.lm_head"]
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
    assert not any(isinstance(m, Fp8Linear) for c in copies(model).values() for m in c.modules())
    ids = torch.randint(0, 1024, (2, 16))
    with torch.autocast("cpu", torch.bfloat16):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0


# ---- what the run says and counts ------------------------------------------------------------------------------

def test_flops_and_the_first_screens_counts_take_each_module_once():
    """The frozen originals peft keeps beside the copies never run: not in the FLOPs, not in the model's size. The
    trained lm_head's weight gradient adds 2 FLOPs a weight (6 instead of LoRA's 4); the embedding, a lookup and a
    scatter, stays out."""
    from sft.report.callbacks import RunOverview, flops_per_token

    plain, whole = attached(tiny_model()), attached(tiny_model(), *EMBEDDINGS)
    head = 1024 * 64
    assert flops_per_token(whole, lora=True) == flops_per_token(plain, lora=True) + 2 * head
    first, second = RunOverview(plain, None, "m"), RunOverview(whole, None, "m")
    assert second.total == first.total and second.trainable == first.trainable + 2 * head
    assert second.whole == (EMBEDDINGS, 2 * head) and first.whole == ([], 0)


def test_the_checks_the_planner_and_resumes_around_it():
    """The loss in chunks cannot gather a trained lm_head under ZeRO-3 on several processes (a frozen one it can);
    the planner's memory model has no modules trained whole (nothing planned, said); a checkpoint resumes only with
    the modules it trained."""
    from sft.machine import Machine
    from sft.model.saved_modules import check_frozen_head
    from sft.options.checks import loss_in_chunks_under_zero3
    from sft.plan.planner import NOT_PLANNED, nothing_planned_line, planned_options
    from sft.safety.trained_on import check_same_training, this_run

    def run(saved):
        return NS(model=NS(chunked_loss_on=True), training=NS(sequence_parallel=1), zero_stage=lambda m: "3",
                  lora=NS(lora=True, lora_modules_to_save=saved))

    machine = NS(launch=NS(world_size=2))
    with pytest.raises(ConfigError, match=r"--chunked_loss with lm_head trained whole beside LoRA "
                                          r"\(--lora_modules_to_save\) under ZeRO-3 on several processes"):
        loss_in_chunks_under_zero3(run(EMBEDDINGS), machine)
    loss_in_chunks_under_zero3(run(["embed_tokens"]), machine)
    check_frozen_head(attached(tiny_model(), "embed_tokens"))  # ... and once loaded, unless tied to the lm_head
    with pytest.raises(ConfigError, match="this model ties its lm_head to the embed_tokens"):
        check_frozen_head(attached(tiny_model(tie_word_embeddings=True), "embed_tokens"))

    gpus = Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * 3, gpu_memory_gib=(23.99,) * 3, bf16=True, host_ram_gib=128)
    lora = NS(lora=True, qlora=False, lora_r=16, lora_dropout=0.05, lora_modules_to_save=EMBEDDINGS)
    assert planned_options(NS(model="deepseek-llm-7b"), lora, NS(max_length=2048), NS(), gpus) == NOT_PLANNED
    assert "not the modules trained whole beside it" in nothing_planned_line("deepseek-llm-7b", True, gpus, True)

    model, data = NS(model="m", rope_scaling=None), NS(dataset=[DATA], dataset_dir=None, dataset_format=None,
                                                      template="auto", max_length=64, packing=False)
    trained = this_run(model, data, NS(lora=True, qlora=False, lora_modules_to_save=EMBEDDINGS))
    with pytest.raises(ConfigError, match=r"--lora_modules_to_save embed_tokens lm_head \(this run: none\)"):
        check_same_training("out/checkpoint-2", trained, this_run(model, data, NS(lora=True, qlora=False)),
                            ["--model", "m", "--lora"], "out")


# ---- FSDP ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_under_fsdp2_they_train_as_unsharded_and_save_consolidated(fsdp_two_ranks):
    """Two gloo ranks with raw fully_shard in accelerate's units (its FSDP becomes DDP on CPU), a bf16 base as on
    GPUs: the fp32 copies (the only trained weights of the embedding's and the tail's units: FSDP2 wants one dtype
    among a unit's trained weights) train as in one process, the embedding's backward still skips its all-gather,
    and the consolidated adapter holds them. The ranks: conftest's fsdp_two_ranks (tests/fsdp_two_ranks_worker.py,
    part modules_to_save), one start shared with two other FSDP2 tests."""
    found = fsdp_two_ranks["modules_to_save"]
    assert "error" not in found, found.get("error")
    assert found["applied"] is True and found["gap"] < 1e-5, found
    assert found["copies"] == ["base_model.model.lm_head.modules_to_save.default.weight",
                               "base_model.model.model.embed_tokens.modules_to_save.default.weight"]
    assert found["saved"] == {"base_model.model.lm_head.weight": True,
                              "base_model.model.model.embed_tokens.weight": True}


# ---- DeepSpeed ZeRO-3 -----------------------------------------------------------------------------------------------

# The run under accelerate_configs/zero3.yaml on 2 gloo ranks with --lora_modules_to_save embed_tokens,lm_head (peft
# copies each module from its gathered ZeRO-3 partitions; the verified checkpoint and final save; the adapter's
# modules equal to DeepSpeed's own consolidation of the shards, changed from the base) is
# tests/test_distributed.py::test_zero3_lora_adapter_with_modules_trained_whole_is_complete_and_resumes: the LoRA
# run under ZeRO-3 there trains them too, and its resumed run checks that they resume.
