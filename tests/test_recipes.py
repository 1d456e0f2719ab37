"""recipes/*.yaml: every recipe parses with our options (no unknown name, no bad value), resolves against the box it
is written for (3 x RTX 4090, compute capability 8.9, described as data, launched by the accelerate config its header
names) and passes every check there, with the command its header gives; and what it then runs: FP8 and the compiled
layers, which `auto` turns on where the run's checks allow them (sft/options/resolve.py fast_paths_where_supported)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from sft.errors import ConfigError
from sft.machine import Launch, Machine, read_launch
from sft.options.arguments import read_options, settle

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
# What a CPU cannot parse (TrainingArguments refuses --bf16 without bf16 hardware): parsed off, then set back to the
# recipe's own value before the options are resolved and checked against the box.
GPU_ONLY = {"bf16": "false"}

# --qlora under FSDP is refused on GPUs until bench/qlora_check.py --fsdp two passes (sft/options/checks.py): its
# recipes meet exactly that refusal, and every other check passes with it lifted (SFT_FSDP_QLORA_CHECK=1)
AWAITING = "--qlora under FSDP: not enabled until its check passes on two GPUs"

# What each recipe runs on the box, (--fp8, --compile_layers) as `auto` resolves them, and for the ones off, the
# reason the first screen gives (a part of it).
ON = ("true", "true", None)
FAST_PATHS = {
    "deepseek-coder-6.7b-lora": ON,
    "deepseek-llm-7b-full": ON,
    "deepseek-llm-7b-lora": ON,
    "r1-distill-qwen-7b-lora": ON,
    "r1-distill-qwen-7b-long": ("true", "false", "planned off"),  # compile_layers: false, the planner's (32k, DDP)
    "deepseek-llm-67b-qlora": ("false", "false", "4-bit"),
    "r1-distill-llama-70b-qlora": ("false", "false", "4-bit"),
    "deepseek-v2-lite-lora": ("false", "false", "DeepSpeed ZeRO-3"),
    "r1-distill-qwen-7b-64k": ("false", "false", "DeepSpeed ZeRO-3"),
}


def launched_by(config: str, processes: int) -> Launch:
    """What `accelerate launch --config_file accelerate_configs/CONFIG --num_processes N` exports to each process
    (accelerate's own reading of the file), as sft.machine reads it: FSDP from ACCELERATE_USE_FSDP, DeepSpeed from
    the JSON file the config names (ACCELERATE_DEEPSPEED_CONFIG_FILE; the ZeRO stage is read from it)."""
    from accelerate.commands.config.config_args import load_config_from_file

    accelerate = load_config_from_file(str(REPO / "accelerate_configs" / config))
    env = {"WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes), "LOCAL_RANK": "0",
           "ACCELERATE_MIXED_PRECISION": accelerate.mixed_precision or "no"}  # no key: "no", as accelerate sets it
    if accelerate.distributed_type == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
    if accelerate.distributed_type == "DEEPSPEED":
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(REPO / accelerate.deepspeed_config["deepspeed_config_file"])
    return read_launch(env)


RTX_4090, RTX_3090 = ("NVIDIA GeForce RTX 4090", (8, 9)), ("NVIDIA GeForce RTX 3090", (8, 6))


def box(config: str, fsdp_qlora_check: bool = False, processes: int = 3, gpu=RTX_4090) -> Machine:
    """The box: 3 x 24 GB RTX 4090 (compute capability 8.9: FP8 matmuls), 64 GB of host RAM, the `lowbit` extra
    installed as the README installs it, launched by `config`."""
    launch = dataclasses.replace(launched_by(config, processes), fsdp_qlora_check=fsdp_qlora_check)
    name, capability = gpu
    return Machine(gpu_names=(name,) * 3, gpu_memory_gib=(23.5,) * 3, gpu_capabilities=(capability,) * 3,
                   bf16=True, host_ram_gib=64, host_ram_available_gib=60, launch=launch,
                   packages=frozenset({"liger_kernel", "torchao"}))


def test_there_are_recipes_for_the_box():
    names = {p.stem for p in RECIPES}
    assert {"deepseek-llm-7b-lora", "deepseek-llm-7b-full", "deepseek-coder-6.7b-lora",
            "r1-distill-qwen-7b-lora", "r1-distill-qwen-7b-long", "r1-distill-qwen-7b-64k", "deepseek-v2-lite-lora",
            "deepseek-llm-67b-qlora",
            "r1-distill-llama-70b-qlora"} <= names


def header_command(recipe: Path) -> tuple[str, int]:
    """The accelerate config and process count of the command the recipe's header gives (default 3)."""
    text = recipe.read_text()
    command = re.search(r"--config_file accelerate_configs/(\S+)", text)
    processes = int(re.search(r"--num_processes (\d+)", text).group(1)) if "--num_processes" in text else 3
    assert command and f"--config recipes/{recipe.name}" in text, "the header gives the command that runs it"
    assert (REPO / "accelerate_configs" / command.group(1)).is_file()
    return command.group(1), processes


def recipe_options(recipe: Path):
    """The recipe's options as a user's command gives them, parsed here, not yet resolved or checked."""
    options = yaml.safe_load(recipe.read_text())
    overrides = [f"--{k}={GPU_ONLY[k]}" for k in GPU_ONLY if k in options]
    o = read_options(["--config", str(recipe), "--dataset", str(REPO / "data" / "alpaca_demo.json"), *overrides])
    assert o.model.model == options["model"] and o.data.max_length == options.get("max_length", 2048)
    for key in GPU_ONLY:
        if key in options:
            target = next(group for group in (o.model, o.lora, o.training) if hasattr(group, key))
            setattr(target, key, options[key])
    return o


def settled_on_its_box(recipe: Path, gpu=RTX_4090):
    """Resolved and checked (every check) against the box its header's command launches on."""
    config, processes = header_command(recipe)
    if yaml.safe_load(recipe.read_text()).get("qlora") and config == "fsdp.yaml":
        assert "REFUSED on GPUs today" in recipe.read_text() and "bench/qlora_check.py --fsdp" in recipe.read_text()
        with pytest.raises(ConfigError) as refused:
            settle(recipe_options(recipe), box(config, processes=processes, gpu=gpu))
        assert str(refused.value).startswith(AWAITING) and "\n" not in str(refused.value)  # that one error alone
        return settle(recipe_options(recipe), box(config, True, processes, gpu))
    return settle(recipe_options(recipe), box(config, processes=processes, gpu=gpu))


def test_every_recipe_has_its_fast_paths_stated():
    assert set(FAST_PATHS) == {p.stem for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_fits_its_box_with_the_fast_paths_it_gets(recipe: Path):
    """Every check passes on the box, and FP8 and the compiled layers are what `auto` gives there: on for the bf16
    LoRA and the full fine-tune (DDP, FSDP), off with the reason said for the 4-bit bases and ZeRO-3."""
    o = settled_on_its_box(recipe)
    fp8, compile_layers, why = FAST_PATHS[recipe.stem]
    assert (o.model.fp8, o.model.compile_layers) == (fp8, compile_layers)
    notes = tuple(note for note in o.model.speed_choices if note.startswith(("compiled layers", "FP8")))
    if why is None:
        assert notes == ("compiled layers on (--compile_layers false turns them off)",
                                         "FP8 on (compute capability 8.9; --fp8 false turns it off)")
    elif why == "planned off":  # the recipe says false, as the planner's command does: only FP8's choice is said
        assert notes == ("FP8 on (compute capability 8.9; --fp8 false turns it off)",)
        assert "compile_layers: false" in recipe.read_text()
    else:
        assert len(notes) == 2 and all(why in said for said in notes)


@pytest.mark.parametrize("recipe", [p for p in RECIPES if FAST_PATHS.get(p.stem) == ON], ids=lambda p: p.stem)
def test_on_cards_without_fp8_the_recipe_keeps_the_compiled_layers_only(recipe: Path):
    """The same recipe on RTX 3090s (compute capability 8.6): the capability is what turns FP8 off. A full
    fine-tune's FP8 needs the compiled layers, not the reverse, so those stay on."""
    o = settled_on_its_box(recipe, gpu=RTX_3090)
    assert (o.model.fp8, o.model.compile_layers) == ("false", "true")
    assert "compute capability 8.6" in o.model.speed_choices[1]


def test_the_box_sees_each_accelerate_configs_strategy():
    """DeepSpeed configs launch DeepSpeed (the stage from the JSON they name), FSDP's FSDP, DDP's neither."""
    assert box("zero3_offload.yaml").launch.zero_stage == "3"
    assert box("zero3_offload.yaml").launch.deepspeed_config_file.endswith("ds_configs/zero3_offload.json")
    assert box("zero3.yaml", processes=2).launch.zero_stage == "3" and box("zero2.yaml").launch.zero_stage == "2"
    assert box("fsdp.yaml").launch.fsdp and not box("fsdp.yaml").launch.zero_stage
    ddp = box("ddp.yaml").launch
    assert not ddp.fsdp and ddp.zero_stage is None and ddp.deepspeed_config_file is None and ddp.world_size == 3


@pytest.mark.parametrize("recipe", RECIPES[:1], ids=lambda p: p.stem)
def test_a_gpu_recipes_data_can_be_audited_on_a_laptop(recipe: Path, tmp_path, tiny_llama, capsys):
    """`python -m sft.data.dataset --config <recipe>` prepares its data without a GPU (precision does not enter it)."""
    from sft.data.dataset import main

    code = main(["--config", str(recipe), "--model", str(tiny_llama), "--dataset", str(REPO / "data" / "alpaca_demo.json"),
                 "--max_length", "256", "--dataset_cache_dir", str(tmp_path), "--show_masks", "1"])
    assert code == 0, capsys.readouterr().err
    assert "trained tokens between [[ and ]]" in capsys.readouterr().out
