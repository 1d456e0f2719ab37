"""Config validation before any model loads: each bad combination is one line (exit code 2) that says what to
do instead. Checks that depend on the machine or the launch run against a machine described as data
(sft/machine.py), since this box has no GPU."""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from sft.options.arguments import ConfigError, parse_args, validate, validate_setup
from sft.machine import Launch, Machine

DATA = str(REPO / "data" / "alpaca_demo.json")


def parse(*extra: str):
    return parse_args(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", *extra])


def refused(*extra: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse(*extra)
    return str(e.value)


def box(gpus: int = 0, bf16: bool = True, **launch) -> Machine:
    """A machine with `gpus` 24 GB cards (bf16 capable unless said otherwise), launched as `launch` says, with
    the `lowbit` and `qlora` extras installed (no flash-attn)."""
    return Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * gpus, gpu_memory_gib=(23.5,) * gpus,
                   bf16=bf16 and gpus > 0, host_ram_gib=64, host_ram_available_gib=60, launch=Launch(**launch),
                   packages=frozenset({"liger_kernel", "torchao", "bitsandbytes"}))


def refused_on(machine: Machine, *extra: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate_setup(*parse(*extra), machine=machine)
    return str(e.value)


def test_precision_the_hardware_lacks():
    assert "Drop --bf16" in refused("--bf16", "true")
    assert "drop --fp16" in refused("--fp16", "true")
    assert "no TF32 matmuls" in refused("--tf32", "true")
    both = refused("--bf16", "true", "--tf32", "true")  # was: the second refusal a traceback
    assert "(--bf16, --tf32)" in both and "Drop --bf16" in both and "Drop --tf32" in both, both


def test_bf16_weights_on_a_gpu_without_bf16():
    assert "no bf16" in refused_on(box(1, bf16=False), "--lora", "--dtype", "bfloat16")
    validate_setup(*parse("--lora", "--dtype", "bfloat16"), machine=box(1))


def test_fsdp_and_offload_on_cpu():
    assert "FSDP needs GPUs" in refused("--fsdp", "full_shard")
    assert "FSDP needs GPUs" in refused_on(box(0, fsdp=True))
    assert "offload" in refused_on(box(0, offload=("optimizer",)))
    validate_setup(*parse(), machine=box(2, fsdp=True, offload=("optimizer",)))


def test_deepspeed_offload_json_on_cpu():
    message = refused("--deepspeed", str(REPO / "ds_configs" / "zero3_offload.json"))
    assert "offload" in message and "no GPU" in message


def test_attention_that_cannot_train_here():
    assert "use sdpa" in refused("--attn_implementation", "flex_attention", "--packing", "true")
    assert "Use sdpa" in refused("--attn_implementation", "flash_attention_2")
    assert "separates packed documents" in refused("--attn_implementation", "paged|sdpa", "--packing", "true")


def test_more_processes_than_gpus():
    message = refused_on(box(2, local_world_size=3, world_size=3))
    assert "3 processes on this machine but 2 GPU" in message and "--num_processes 2" in message
    validate_setup(*parse(), machine=box(2, local_world_size=2, world_size=2))


def test_deepspeed_json_fixed_values_must_match_the_trainer(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto",
                                  "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}))
    message = refused("--deepspeed", str(config), "--per_device_train_batch_size", "2")
    assert "train_micro_batch_size_per_gpu=8" in message and "per_device_train_batch_size=2" in message
    assert '"auto"' in message
    parse("--deepspeed", str(config), "--per_device_train_batch_size", "8")  # agreeing values pass


def test_launcher_settings_must_match_the_trainer(tmp_path):
    accumulating = box(1, gradient_accumulation_steps=4)
    assert "gradient_accumulation_steps: 4" in refused_on(accumulating, "--gradient_accumulation_steps", "2")
    validate_setup(*parse("--gradient_accumulation_steps", "4"), machine=accumulating)

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}))
    assert "two DeepSpeed configs" in refused_on(box(0, deepspeed_config_file=str(a)), "--deepspeed", str(b))

    args = parse()
    args[3].bf16 = True  # as parsed on a bf16 GPU
    with pytest.raises(ConfigError, match="mixed_precision: fp16 but the command line says --bf16"):
        validate_setup(*args, machine=box(1, mixed_precision="fp16"))


def test_quantized_base_with_zero3():
    """ZeRO-3 partitions weights as they are created: 4-bit weights cannot be (--qlora says so in its own words)."""
    model_args, data_args, lora_args, training_args = parse("--lora")
    model_args.load_in_4bit = True
    with pytest.raises(ConfigError, match="ZeRO-3.*ZeRO-2"):
        validate_setup(model_args, data_args, lora_args, training_args, machine=box(2, zero_stage="3"))


def test_our_options():
    assert "use auto, all, final or no" in refused("--verify_saves", "sometimes")
    assert "use stop or skip" in refused("--nan_policy", "ignore")
    assert "above 1" in refused("--loss_spike_factor", "0.5")
    parse("--loss_spike_factor", "0")
    assert "or 0 to turn the watchdog off" in refused("--loss_watchdog_threshold", "-1")
    assert "1 or more" in refused("--loss_watchdog_threshold", "5", "--loss_watchdog_patience", "0")


def test_an_optimizer_typo_names_the_optimizers_not_bf16():
    # transformers' own error for --optim adamw_bf16 mentions bf16, which was taken for "no bf16 on this machine"
    message = refused("--optim", "adamw_bf16")
    assert message.startswith("--optim 'adamw_bf16' is no optimizer; did you mean adamw_bf16_sr") and "support" not in message
    assert "adamw_torch_fused" in refused("--optim", "adamw_torch_fuse")
    parse("--optim", "adamw_bf16_sr")


def test_bf16_and_fp16_together_say_so():
    from sft.options.arguments import training_arguments_message

    assert training_arguments_message("At most one of fp16 and bf16 can be True, but not both").startswith(
        "--bf16 and --fp16 together")


def test_numbers_that_cannot_train_are_refused_before_loading():
    # were tracebacks once the model had loaded (batch size 0, accumulation 0, a negative learning rate, a dropout
    # over 1) or a run that saved the untrained model as its result (no steps, no epochs)
    assert refused("--per_device_train_batch_size", "0") == "--per_device_train_batch_size 0: give 1 or more."
    assert refused("--gradient_accumulation_steps", "0") == "--gradient_accumulation_steps 0: give 1 or more."
    assert refused("--learning_rate", "-1").startswith("--learning_rate -1.0: give 0 or more")
    assert refused("--lora", "--lora_dropout", "1.5") == "--lora_dropout 1.5: give a probability in [0, 1)."
    assert "trains nothing" in refused("--max_steps", "0", "--num_train_epochs", "0")
    parse("--max_steps", "5", "--num_train_epochs", "0")
    parse("--max_steps", "0", "--learning_rate", "0")


def test_options_that_contradict_each_other_are_refused_before_loading():
    assert refused("--mask_history", "--train_on_prompt").startswith("--mask_history with --train_on_prompt:")
    assert parse("--mask_history")[1].mask_history
    assert refused("--neftune_noise_alpha", "0").startswith("--neftune_noise_alpha 0: give a positive noise scale")
    assert parse("--neftune_noise_alpha", "5")[3].neftune_noise_alpha == 5
    assert "each rank holds a slice of the row" in refused("--neftune_noise_alpha", "5", "--sequence_parallel", "2")


def test_lora_options_without_lora_are_refused_not_ignored():
    # `--lora_r 8` alone trained every weight in silence (TRL and LLaMA-Factory ignore it too)
    assert refused("--lora_r", "8") == ("--lora_r only applies to a LoRA adapter, and this run fine-tunes every "
                                        "weight: add --lora (or --qlora), or drop --lora_r.")
    assert refused("--lora_rank", "8", "--lora_target_modules", "q_proj").startswith("--lora_r, --lora_target_modules only apply to")
    assert parse("--lora_r", "8", "--lora")[2].lora_r == 8
    # a recipe's LoRA turned off on the command line keeps the recipe's LoRA values, unused
    recipe = str(REPO / "recipes" / "deepseek-llm-7b-lora.yaml")
    assert not parse_args(["--config", recipe, "--lora", "false", "--dataset", DATA], data_only=True)[2].lora


def test_an_attention_that_does_not_exist_is_refused_before_loading():
    # was: transformers' ValueError traceback once the data was prepared and the model loading
    assert refused("--attn_implementation", "flash_attention2").startswith(
        "--attn_implementation 'flash_attention2': did you mean flash_attention_2? use one of sdpa, eager")
    assert "use one of" in refused("--attn_implementation", "foo")
    parse("--attn_implementation", "eager")


def test_torchao_optim_args_are_checked_before_loading():
    # bf16_stochastic_round=maybe was a ValueError traceback once the model had loaded; a misspelt key was ignored
    assert refused("--optim", "adamw_torch_4bit", "--optim_args", "bf16_stochastic_round=maybe") == \
        "--optim_args bf16_stochastic_round=maybe: give True or False."
    assert refused("--optim", "adamw_torch_8bit", "--optim_args", "bf16_stochastic_rounding=True") == (
        "--optim adamw_torch_8bit: unknown --optim_args bf16_stochastic_rounding (known: bf16_stochastic_round, "
        "block_size).")
    assert "positive whole number" in refused("--optim", "adamw_torch_8bit", "--optim_args", "block_size=x")
    parse("--optim", "adamw_torch_8bit", "--optim_args", "bf16_stochastic_round=True,block_size=128")


def test_train_prints_one_line_and_exits_2(capsys, tmp_path):
    from sft.train import main

    assert main(["--model", "tiny-deepseek", "--dataset", DATA, "--output_dir", str(tmp_path), "--fp16", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --fp16") and "\n" not in err and "Traceback" not in err


def test_a_gpu_recipe_on_a_laptop_hears_every_problem_at_once(capsys, tmp_path):
    """Was: four runs to learn four problems (bf16, flex_attention, Liger, the model), one `error:` line each time.
    Now every check runs: one `error:` line per problem, exit code 2, what needs GPUs first (said on the first line
    where there are several), and the model that cannot be found among them."""
    from sft.train import main

    recipe = str(REPO / "recipes" / "deepseek-llm-7b-lora.yaml")
    assert main(["--config", recipe, "--dataset", DATA, "--output_dir", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("error: ") for line in lines) and len(lines) == 5, lines
    assert lines[0] == ("error: this run needs GPUs and this machine has none (--bf16, --attn_implementation "
                        "flex_attention, --use_liger_kernel): run it on a GPU machine, or drop each as its line "
                        "below says.")
    assert lines[1].startswith("error: --bf16: this machine has no bf16 support")
    assert "flex_attention cannot train on CPU" in lines[2] and "--use_liger_kernel needs a GPU" in lines[3]
    assert lines[4].startswith("error: --model deepseek-ai/deepseek-llm-7b-base: not in the local Hugging Face cache")
    assert not (tmp_path / "out").exists()


def test_the_checks_say_every_problem_and_one_as_itself():
    """check_options runs every check: one problem is raised as itself (its class, its message), several as one
    ConfigErrors whose lines keep the checks' order, what needs hardware first."""
    from sft.errors import ConfigErrors, NeedsHardware

    args = parse()
    args[0].attn_implementation, args[2].lora_r, args[2].lora = "flex_attention", 0, True
    with pytest.raises(ConfigErrors) as several:
        validate(*args, machine=box(0))
    assert [type(p) for p in several.value.problems] == [NeedsHardware, ConfigError]
    assert str(several.value) == ("--attn_implementation flex_attention cannot train on CPU (no backward there); "
                                  "use sdpa.\nerror: --lora_r 0: the rank must be positive.")
    args[2].lora_r = 8
    with pytest.raises(NeedsHardware, match="^--attn_implementation flex_attention cannot train on CPU"):
        validate(*args, machine=box(0))
    validate(*args, machine=box(1))


def test_flex_attention_pads_packed_rows_to_one_shape():
    """flex_attention compiles its kernels per shape: packed rows are padded to --max_length unless told."""
    model_args, data_args, lora_args, training_args = parse("--packing", "true", "--max_length", "512")
    assert data_args.pad_to_multiple_of is None  # sdpa: the batch's longest row
    model_args.attn_implementation = "flex_attention"
    validate(model_args, data_args, lora_args, training_args, machine=box(1))
    assert data_args.pad_to_multiple_of == 512
    assert parse("--pad_to_multiple_of", "64")[1].pad_to_multiple_of == 64
    assert "positive" in refused("--pad_to_multiple_of", "0")


def test_tensor_parallel_needs_gpus():
    assert "needs GPUs" in refused("--tp_size", "2")  # accelerate's ParallelismConfig refuses MULTI_CPU


def test_tensor_parallel_checkpoints_skip_the_trainers_optimizer_saving():
    """transformers' Trainer refuses checkpoints with its own optimizer state for a model sharded at load time
    (seen on GPUs): a TP run sets save_only_model, and sft/parallel/tensor_parallel.py saves the optimizer state itself."""
    def tp_validated(*extra: str, liger: bool = False):
        model_args, data_args, lora_args, training_args = parse(*extra)  # parsed without GPUs, then "on 2 GPUs"
        model_args.tp_size, training_args.use_liger_kernel = 2, liger
        model_args.chunked_loss = "auto"  # as typed: parse_args settled it without --tp_size
        validate(model_args, data_args, lora_args, training_args, machine=box(2))
        return training_args

    assert tp_validated("--save_strategy", "steps").save_only_model
    assert not tp_validated("--save_strategy", "no").save_only_model
    assert not parse("--save_strategy", "steps")[3].save_only_model
    assert tp_validated("--resume_from_checkpoint", "true").save_only_model  # resuming is no longer refused
    with pytest.raises(ConfigError, match="--use_liger_kernel with --tp_size 2"):
        tp_validated(liger=True)  # seen on 2 H200s: mixed torch.Tensor and DTensor
    with pytest.raises(ConfigError, match="--lora with --tp_size 2.*ddp.yaml"):
        tp_validated("--lora")  # peft on the TP shards: a shape error at the first step (seen on CPU over gloo)


def test_every_check_is_named_and_takes_the_machine_as_data():
    """One function per rule, in one list; each refuses on a machine described as data, none reads torch."""
    from sft.options.checks import CHECKS

    assert len({c.__name__ for c in CHECKS}) == len(CHECKS) >= 10
    laptop, box3 = box(0), box(3, world_size=3, local_world_size=3)
    args = parse()
    args[0].attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="flex_attention cannot train on CPU"):
        validate_setup(*args, machine=laptop)
    validate_setup(*args, machine=box3)


def test_liger_refused_before_loading_where_it_cannot_run():
    """--plan auto (and users) set --use_liger_kernel where liger-kernel was not installed: the Trainer imported it
    only inside train(), a traceback after the model had loaded (seen on an H200)."""
    from dataclasses import replace

    args = parse()
    args[3].use_liger_kernel = True
    args[0].chunked_loss = "auto"  # as typed: parse_args settled it for a run without Liger
    gpu = box(1)
    with pytest.raises(ConfigError, match="needs the liger-kernel package.*lowbit"):
        validate_setup(*args, machine=replace(gpu, packages=frozenset()))
    with pytest.raises(ConfigError, match="needs a GPU"):
        validate_setup(*args, machine=replace(box(0), packages=frozenset({"liger_kernel"})))
    validate_setup(*args, machine=replace(gpu, packages=frozenset({"liger_kernel"})))


def test_lora_under_ddp_does_not_search_for_unused_parameters_unless_asked():
    """transformers' Trainer sets find_unused_parameters=True for every peft model (not a PreTrainedModel)."""
    ddp = box(2, world_size=2, local_world_size=2, launched=True)
    lora = parse("--lora")
    validate_setup(*lora, machine=ddp)
    assert lora[3].ddp_find_unused_parameters is False
    asked = parse("--lora", "--ddp_find_unused_parameters", "true")
    validate_setup(*asked, machine=ddp)
    assert asked[3].ddp_find_unused_parameters is True
    full = parse()
    validate_setup(*full, machine=ddp)
    assert full[3].ddp_find_unused_parameters is None  # the Trainer's own rule for a PreTrainedModel


def test_the_checks_write_no_option():
    """Options are resolved once (sft/options/resolve.py) and only read after: no check sets an option."""
    from sft.options.checks import CHECKS, check_options

    ddp = box(2, world_size=2, local_world_size=2, launched=True)
    args = parse("--lora", "--packing", "true", "--max_length", "512")
    args[0].attn_implementation = "flex_attention"  # a GPU run's options, checked against a described GPU box
    options = validate(*args, machine=ddp)
    assert options.data.pad_to_multiple_of == 512 and options.training.ddp_find_unused_parameters is False
    before = [dict(vars(group)) for group in options.groups()]
    assert check_options(options, ddp, CHECKS) is options
    assert [vars(group) for group in options.groups()] == before


def test_options_import_nothing_from_the_planner():
    """The planner reads options; options never read the planner (no import circle, parsing never plans)."""
    sources = (REPO / "sft" / "options").glob("*.py")
    assert not [p.name for p in sources if "from sft.plan" in p.read_text() or "import sft.plan" in p.read_text()]


def test_reporting_that_cannot_run_here_is_refused_before_loading():
    """--report_to: the Trainer made its callbacks after the model had loaded, and a missing wandb stopped there
    with a traceback."""
    from dataclasses import replace

    from sft.options.arguments import read_options, settle

    def on(machine: Machine, report_to: str):
        return settle(read_options(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out",
                                    "--report_to", report_to]), machine)

    here = replace(box(), reporting=frozenset({"tensorboard"}))
    for report_to, says in (("wandb", "wandb needs pip install wandb"), ("kubeflow", "KUBEFLOW_TRAINER_SERVER_URL"),
                            ("tensorboardx", "the Trainer reports to azure_ml, ")):
        with pytest.raises(ConfigError, match=says):
            on(here, report_to)
    with pytest.raises(ConfigError, match="none stands alone"):
        settle(read_options(["--model", "m", "--dataset", DATA, "--report_to", "tensorboard", "none"]), here)
    on(here, "none")
    assert settle(read_options(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", "--report_to",
                                "tensorboard", "wandb"]), replace(here, reporting=frozenset({"tensorboard", "wandb"}))
                  ).training.report_to == ["tensorboard", "wandb"]
    on(replace(here, reporting=frozenset({"tensorboard", "wandb"})), "wandb")


def test_an_optimizer_whose_package_is_missing_is_refused_before_loading():
    """The Trainer imported bitsandbytes, GaLore or schedulefree for --optim once the model had loaded."""
    import importlib.util

    if importlib.util.find_spec("galore_torch") is not None:
        pytest.skip("galore_torch is installed here")
    assert refused("--optim", "galore_adamw").startswith("--optim galore_adamw: You need to install `galore_torch`")
    parse("--optim", "adamw_torch")  # the Trainer's own, no package: passes
