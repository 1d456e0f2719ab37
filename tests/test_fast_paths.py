"""The fastest correct path by default: --fp8 auto and --compile_layers auto (sft/options/resolve.py
fast_paths_where_supported) turn each on where the run's own checks for it pass, off elsewhere with the reason,
and a user's true/false wins. Machines are described as data; the GPU measurements are bench/RESULTS.md's."""

from __future__ import annotations

import pytest

from sft.machine import Launch, Machine
from sft.options.arguments import parse_args, read_options, settle

DATA = "data/sample_sft.jsonl"


def gpu(capability=(8, 9), gpus: int = 1, **launch) -> Machine:
    return Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * gpus, gpu_memory_gib=(23.5,) * gpus, bf16=True,
                   gpu_capabilities=(capability,) * gpus, host_ram_gib=64, host_ram_available_gib=60,
                   launch=Launch(world_size=gpus, **launch), packages=frozenset({"liger_kernel", "torchao", "bitsandbytes"}))


def settled(machine: Machine, *extra: str):
    options = read_options(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", *extra])
    return settle(options, machine).model


def fast_path_notes(m) -> tuple[str, ...]:
    """The first screen's notes on --compile_layers and --fp8 (the loss's and the attention's have their tests)."""
    return tuple(note for note in m.speed_choices if note.startswith(("compiled layers", "FP8")))


def test_a_lora_run_on_an_fp8_gpu_gets_both_and_the_first_screen_says_how_to_turn_each_off():
    m = settled(gpu(), "--lora", "--lora_dropout", "0")
    assert m.fp8_on and m.compile_layers_on
    assert fast_path_notes(m) == ("compiled layers on (--compile_layers false turns them off)",
                                  "FP8 on (compute capability 8.9; --fp8 false turns it off)")


def test_a_lora_dropout_is_said_to_keep_the_adapters_down_projections_apart():
    """Each adapter's dropout draws its own mask, so the compiled layers cannot share q/k/v's (gate/up's)
    down-projection matmul (sft/speed/shared_input_adapters.py): the first screen says what 0 would give."""
    dropout = fast_path_notes(settled(gpu(), "--lora"))[0]  # the default 0.05
    assert dropout == ("compiled layers on (--compile_layers false turns them off); under --lora_dropout 0.05 each "
                       "adapter keeps its own down-projection matmul (0 lets q/k/v's and gate/up's share one: 1.03x a "
                       "7B LoRA step)")
    off = settled(gpu(shared_input_adapters=False), "--lora")  # SFT_SHARED_INPUT_ADAPTERS=0: nothing to say
    assert fast_path_notes(off)[0] == "compiled layers on (--compile_layers false turns them off)"


def test_fp8_s_forward_accumulates_fast_on_hopper_unless_asked_not_to_and_the_first_screen_says_so():
    """Fast accumulation passed its loss check on Hopper (bench/RESULTS.md); Ada keeps cuBLAS's fp32 promotion
    until measured; SFT_FP8_FAST_ACCUM=1 or 0 wins either way."""
    from sft.machine import fp8_fast_accum_on, read_launch

    assert [fp8_fast_accum_on(None, c) for c in ((8, 9), (9, 0), (10, 0))] == [False, True, True]
    assert fp8_fast_accum_on(False, (9, 0)) is False and fp8_fast_accum_on(True, (8, 9)) is True
    assert [read_launch({"SFT_FP8_FAST_ACCUM": v}).fp8_fast_accum for v in ("1", "0", "")] == [True, False, None]
    hopper = settled(gpu((9, 0)), "--lora")
    assert hopper.speed_choices[1] == ("FP8 on (compute capability 9.0; --fp8 false turns it off), its forward "
                                       "matmuls accumulating fast (SFT_FP8_FAST_ACCUM=0 keeps cuBLAS's fp32 promotion)")
    assert settled(gpu((9, 0), fp8_fast_accum=False), "--lora").speed_choices[1].endswith("turns it off)")
    assert settled(gpu(), "--lora").speed_choices[1].endswith("turns it off)")  # an RTX 4090: not measured there


def test_each_is_off_where_its_check_refuses_it_with_the_checks_reason():
    m = settled(gpu(gpus=2, zero_stage="3"), "--lora")  # DeepSpeed: neither is tested with its hooks
    assert not m.fp8_on and not m.compile_layers_on
    assert m.speed_choices[0].startswith("compiled layers off (DeepSpeed ZeRO-3: not supported")
    assert m.speed_choices[1].startswith("FP8 off (DeepSpeed ZeRO-3")
    m = settled(gpu(gpus=2, fsdp=True), "--lora")  # FSDP LoRA: compiled layers yes, the FP8 base no
    assert m.compile_layers_on and not m.fp8_on
    assert m.speed_choices[1] == ("FP8 off (FSDP under LoRA (the FP8 base is quantized once and must stay whole "
                                  "on each GPU))")
    m = settled(gpu((8, 6)), "--lora")  # an RTX 3090: no FP8 tensor cores
    assert m.compile_layers_on and not m.fp8_on and "compute capability 8.6" in m.speed_choices[1]
    m = settled(gpu(), "--qlora")
    assert not m.fp8_on and m.speed_choices[1].startswith("FP8 off (--qlora: the base is already 4-bit")
    m = settled(gpu(), "--lora", "--torch_compile", "true")
    assert not m.compile_layers_on and "--torch_compile" in m.speed_choices[0]


def test_a_full_fine_tune_gets_fp8_only_with_the_compiled_layers():
    sr = ("--dtype", "bfloat16", "--optim", "adamw_bf16_sr")
    m = settled(gpu(gpus=2, fsdp=True), *sr)
    assert m.fp8_on and m.compile_layers_on
    m = settled(gpu(), *sr, "--compile_layers", "false")
    assert not m.fp8_on and fast_path_notes(m) == ("FP8 off (a full fine-tune in FP8 needs the compiled layers to "
                                                   "be fast: --fp8 true to try it eager)",)


def test_the_users_word_wins_and_cpu_gets_neither_without_a_note():
    m = settled(gpu(), "--lora", "--fp8", "false", "--compile_layers", "false")
    assert not m.fp8_on and not m.compile_layers_on and fast_path_notes(m) == ()
    m = settled(Machine(), "--lora")
    assert not m.fp8_on and not m.compile_layers_on and fast_path_notes(m) == ()
    m = settled(gpu(), "--lora", "--fp8")  # a bare flag means true
    assert m.fp8_on


def test_an_unknown_value_is_one_error_line():
    from sft.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--fp8: invalid choice: 'maybe'"):
        parse_args(["--fp8", "maybe"], data_only=True)


def test_packed_rows_take_one_length_where_the_layers_compile():
    """The compiled layers compile again for a second row length (35-38 s at the second step of 32k rows of one
    conversation each, run 20261206T0611Z-long-h100): packed rows are padded to --max_length, as under
    flex_attention; unpacked rows, or a --pad_to_multiple_of of the user's, are left as they are."""
    def padded_to(machine: Machine, *extra: str) -> int | None:
        options = read_options(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", *extra])
        return settle(options, machine).data.pad_to_multiple_of

    packed = ("--packing", "true", "--max_length", "1000")
    assert padded_to(gpu(), "--lora", *packed) == 1000  # --compile_layers auto: on
    assert padded_to(gpu(), "--lora", *packed, "--compile_layers", "false") is None
    assert padded_to(gpu(), "--lora", "--max_length", "1000") is None  # unpacked: the batch's longest row
    assert padded_to(gpu(), "--lora", *packed, "--pad_to_multiple_of", "64") == 64
    assert padded_to(gpu(gpus=0), "--lora", *packed) is None  # no GPU: nothing compiled
    # a full fine-tune in FP8: one length, and a multiple of 16 for its weight gradients' matmuls
    assert padded_to(gpu(), "--dtype", "bfloat16", "--optim", "adamw_bf16_sr", *packed) == 1008


def test_a_full_fine_tune_in_fp8_pads_each_batch_to_16_tokens():
    """Its weight gradients' FP8 matmuls sum over the tokens, in multiples of 16 (an H200 run failed at a batch of
    4 x 1,234 tokens before this)."""
    from sft.errors import ConfigError

    sr = ("--dtype", "bfloat16", "--optim", "adamw_bf16_sr")
    assert settle(read_options(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", *sr]),
                  gpu()).data.pad_to_multiple_of == 16
    lora = settle(read_options(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", "--lora"]),
                  gpu())
    assert lora.data.pad_to_multiple_of is None  # LoRA's FP8 base has no weight gradient
    flex = ("--attn_implementation", "flex_attention", "--packing", "true", "--max_length", "1000")
    with pytest.raises(ConfigError, match="rows are padded to multiples of 1000 .--pad_to_multiple_of, or --max_length"):
        settled(gpu(), *sr, *flex, "--fp8", "true")
    m = settled(gpu(), *sr, *flex)  # auto: off, and why
    assert not m.fp8_on and "multiples of 16" in m.speed_choices[1]


def test_the_first_screen_says_what_was_chosen():
    from sft.report.console import run_overview

    text = run_overview(model="m", architecture="LlamaForCausalLM", total_params=10, trainable_params=1,
                        dtype="bfloat16", adapter_dtype=None, mixed_precision="bf16", lora_rank=8, processes=1,
                        strategy="no parallelism", devices="1 GPU", per_device_batch=1, grad_accum=1, data_parallel=1,
                        mean_row_tokens=None, max_steps=1, epochs=None, resume_step=0, output_dir="out", saves="none",
                        tensorboard=None,
                        speed=settled(gpu(), "--lora", "--lora_dropout", "0", "--packing").speed_choices)
    lines = text.splitlines()
    at = lines.index("  speed        compiled layers on (--compile_layers false turns them off)")
    assert lines[at + 1:at + 4] == [
        "               FP8 on (compute capability 8.9; --fp8 false turns it off)",
        "               loss in chunks on (no [tokens x vocabulary] logits held whole; --use_liger_kernel fuses it "
        "instead, --chunked_loss false turns it off)",
        "               attention per packed document (varlen: 1.20-1.23x sdpa's step behind the packed rows' mask; "
        "--attn_implementation sdpa keeps sdpa)"]
    assert lines[at + 4].startswith("  batch ")


def test_quantized_experts_get_no_compiled_layers_by_default():
    m = settled(gpu(), "--lora", "--quantize_experts", "fp8", "--activation_checkpointing", "true")
    assert not m.compile_layers_on
    assert "beside --quantize_experts: 1.49x, its GPU loss check not run yet" in m.speed_choices[0]
    # FP8 for the MLA projections beside the e4m3 experts: not measured, so not by default
    assert not m.fp8_on and m.speed_choices[1] == "FP8 off (not yet measured beside --quantize_experts; --fp8 true " \
        "to try)"


def test_batches_reach_the_gpu_without_a_wait_where_they_are_pinned():
    def non_blocking(machine, *extra):
        options = read_options(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", *extra])
        return settle(options, machine).training.accelerator_config.non_blocking

    assert non_blocking(gpu(), "--lora")
    assert not non_blocking(gpu(), "--lora", "--dataloader_pin_memory", "false")  # pageable: the copy waits anyway
    cpu = Machine(gpu_names=(), gpu_memory_gib=(), bf16=False, gpu_capabilities=(), host_ram_gib=64,
                  host_ram_available_gib=60, launch=Launch(world_size=1), packages=frozenset())
    assert not non_blocking(cpu, "--lora")
