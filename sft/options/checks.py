"""Combinations that cannot work: one named check per rule, run in one go, none of them writing an option.

Each check takes the options (`Options`, resolved: sft/options/resolve.py) and the `Machine` (sft/machine.py) as
plain data and raises ConfigError with what to do instead (NeedsHardware where the machine lacks a GPU or bf16).
`OPTION_CHECKS` need the options alone (a data-only run checks those); `MACHINE_CHECKS` also the hardware, the
launcher's settings and the DeepSpeed JSON. `CHECKS` lists them all in the order they run. Every check runs, and
the problems are said together (`check_options`): a GPU recipe tried on a laptop learns all it needs in one go.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from sft.errors import ConfigError, ConfigErrors, NeedsHardware, UserFacingError
from sft.speed.lowbit import LOW_BIT_OPTIMIZERS, SR_ADAMW, rounds_stochastically
from sft.machine import Machine
from sft.model.adapter_start import adapts_experts, check_adapter
from sft.model.rope_scaling import ROPE_SCALINGS

# The --output_dir default: sft/options/resolve.py output_dir_of_its_own names the run's own directory, and says
# in SFTTrainingArguments.output_dir_picked how: a new one, the newest run to resume, or none found to resume.
NEW_RUN_DIR = "output/<model>/<method>/<start time>"
PICKED_NEW, PICKED_NEWEST, PICKED_NOTHING = "new", "newest", "nothing to resume"

ATTENTIONS = ("sdpa", "eager", "flex_attention", "varlen", "flash_attention_2", "flash_attention_3", "flash_attention_4")
# The attentions that keep packed documents apart (the rest would let them attend to each other): by position_ids, or
# by the collator's document offsets (varlen, sft/speed/varlen_attention.py).
PACKING_ATTENTIONS = ("sdpa", "eager", "flex_attention", "varlen", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class Options:
    """The four option groups of one run, with the option names the user gave (recipe or command line). Frozen,
    and its groups are treated as frozen once checked: the only writers are sft/options/resolve.py's steps."""

    model: object      # ModelArguments
    data: object       # DataArguments
    lora: object       # LoraArguments
    training: object   # SFTTrainingArguments
    deepspeed: dict = field(default_factory=dict)  # the DeepSpeed JSON in effect ({} without DeepSpeed)
    given: frozenset[str] = frozenset()  # the option names the user gave: --plan auto leaves them alone
    # Problems found while parsing that do not stop the checks (--bf16 where this machine has none: parsed
    # without it), said with theirs.
    problems: tuple[ConfigError, ...] = ()

    @classmethod
    def of(cls, model_args, data_args, lora_args, training_args, given: frozenset[str] = frozenset(),
           problems: tuple[ConfigError, ...] = ()) -> Options:
        hf_config = getattr(training_args, "hf_deepspeed_config", None)
        return cls(model_args, data_args, lora_args, training_args, hf_config.config if hf_config else {},
                   frozenset(given), tuple(problems))

    def groups(self) -> tuple:
        """(ModelArguments, DataArguments, LoraArguments, SFTTrainingArguments), as parse_args returns them."""
        return self.model, self.data, self.lora, self.training

    def zero(self) -> dict:
        zero = self.deepspeed.get("zero_optimization")
        return zero if isinstance(zero, dict) else {}

    def fsdp(self, m: Machine) -> bool:
        return bool(self.training.fsdp) or m.launch.fsdp

    def zero_stage(self, m: Machine) -> str | None:
        stage = self.zero().get("stage", m.launch.zero_stage)
        return None if stage is None else str(stage)

    def deepspeed_on(self, m: Machine) -> bool:
        """DeepSpeed runs: its JSON was read, or the accelerate config or --deepspeed names one."""
        return bool(self.deepspeed or m.launch.zero_stage or m.launch.deepspeed_config_file or self.training.deepspeed)

    def autoep(self) -> bool:
        """DeepSpeed AutoEP (expert parallelism) is on in the DeepSpeed JSON (sft/parallel/expert_parallel.py)."""
        block = self.deepspeed.get("expert_parallel")
        return isinstance(block, dict) and bool(block.get("enabled"))

    def offload(self, m: Machine) -> list[str]:
        """What DeepSpeed offloads to host memory, from its JSON or the accelerate config."""
        found = {k.removeprefix("offload_") for k in ("offload_optimizer", "offload_param")
                 if str((self.zero().get(k) or {}).get("device", "none")).lower() in ("cpu", "nvme")}
        return sorted(found | set(m.launch.offload))


# ---- the options alone ------------------------------------------------------------------------------------

def dataset_given(o: Options, m: Machine) -> None:
    if not o.data.dataset:
        raise ConfigError("--dataset is missing: give one or more data files or hub dataset names.")


def data_option_values(o: Options, m: Machine) -> None:
    from sft.data.formats import FORMAT_NAMES, FORMATS, format_name
    from sft.data.templates import TEMPLATE_NAMES

    d = o.data
    if format_name(d.dataset_format) not in (None, *FORMATS):
        raise ConfigError(f"--dataset_format {d.dataset_format!r}: use one of {', '.join(FORMATS)} (messages reads "
                          f"OpenAI messages and ShareGPT conversations; also named {', '.join(FORMAT_NAMES)}).")
    if d.template not in TEMPLATE_NAMES:
        raise ConfigError(f"--template {d.template!r}: use one of {', '.join(TEMPLATE_NAMES)}.")
    if d.overlong not in ("truncate", "cut", "drop"):
        raise ConfigError(f"--overlong {d.overlong!r}: use truncate, cut or drop.")
    if d.oasst_threads not in ("best", "all"):
        raise ConfigError(f"--oasst_threads {d.oasst_threads!r}: use best or all.")
    if not 0 <= d.eval_split < 1:
        raise ConfigError(f"--eval_split {d.eval_split}: give a fraction in [0, 1).")


def mask_history_trains_replies(o: Options, m: Machine) -> None:
    """--mask_history trains the last reply alone; --train_on_prompt trains every token."""
    if o.data.mask_history and o.data.train_on_prompt:
        raise ConfigError("--mask_history with --train_on_prompt: the first trains only each conversation's last "
                          "reply, the second every token. Keep one.")


def evaluation_has_data(o: Options, m: Machine) -> None:
    t, d = o.training, o.data
    if t.eval_strategy != "no" and not (d.eval_dataset or d.eval_split):
        asked, off = ((f"--evals_per_epoch {t.evals_per_epoch}", "leave --evals_per_epoch out") if t.evals_per_epoch
                      else (f"--eval_strategy {t.eval_strategy.value}", "--eval_strategy no"))
        raise ConfigError(f"{asked} needs held-out data: add --eval_dataset FILE or --eval_split 0.05 (a share of "
                          f"the training data), or {off}.")


# Axolotl's per-epoch counts and the Trainer's options each one sets (sft/options/resolve.py per_epoch_counts_as_steps)
PER_EPOCH_COUNTS = (("evals_per_epoch", "eval_strategy", "eval_steps"),
                    ("saves_per_epoch", "save_strategy", "save_steps"))


def per_epoch_counts_alone(o: Options, m: Machine) -> None:
    """--evals_per_epoch / --saves_per_epoch set the Trainer's strategy and steps themselves, from the epochs: with
    either of those given, or --max_steps (whose run is not counted in epochs), one of them would be ignored."""
    t = o.training
    for count, strategy, steps in PER_EPOCH_COUNTS:
        value = getattr(t, count)
        if value < 0:
            raise ConfigError(f"--{count} {value}: give how many times an epoch (0: off).")
        clash = [name for name in (strategy, steps, "max_steps") if name in o.given]
        if value and clash:
            raise ConfigError(f"--{count} {value} with --{clash[0]}: --{count} sets the Trainer's {strategy} and "
                              f"{steps} from the epochs; keep one of them.")


def early_stopping_evaluates(o: Options, m: Machine) -> None:
    """--early_stopping_patience counts evaluations whose metric did not improve: it needs evaluations."""
    t = o.training
    if t.early_stopping_patience < 0 or t.early_stopping_threshold < 0:
        raise ConfigError(f"--early_stopping_patience {t.early_stopping_patience} --early_stopping_threshold "
                          f"{t.early_stopping_threshold:g}: give a number of evaluations (0: off) and a change >= 0.")
    if t.early_stopping_patience and t.eval_strategy == "no":
        raise ConfigError(f"--early_stopping_patience {t.early_stopping_patience} stops on the evaluation's metric, "
                          f"and this run evaluates nothing: add --eval_strategy steps --eval_steps N with held-out "
                          f"data (--eval_split 0.05 or --eval_dataset FILE).")


def hub_upload_named(o: Options, m: Machine) -> None:
    """--push_to_hub uploads to --hub_model_id (sft/safety/hub_push.py); one without the other would upload to a
    repository named after the run's timestamped directory, or upload nothing."""
    from sft.safety.hub_push import HUB_REPO

    t = o.training
    if t.push_to_hub and not t.hub_model_id:
        raise ConfigError("--push_to_hub needs --hub_model_id <user or organization>/<name>: the repository to "
                          "upload to.")
    if t.hub_model_id and not t.push_to_hub:
        raise ConfigError(f"--hub_model_id {t.hub_model_id} names where --push_to_hub uploads: add --push_to_hub, "
                          f"or leave --hub_model_id out.")
    if t.hub_model_id and not HUB_REPO.fullmatch(t.hub_model_id):
        raise ConfigError(f"--hub_model_id {t.hub_model_id!r}: give <user or organization>/<name> (letters, digits, "
                          f"'-', '_' and '.').")


def max_length_long_enough(o: Options, m: Machine) -> None:
    if o.data.max_length < 8:
        raise ConfigError(f"--max_length {o.data.max_length} is too short; give at least 8 tokens.")


def dtype_name(o: Options, m: Machine) -> None:
    if o.model.dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise ConfigError(f"--dtype {o.model.dtype!r}: use auto, bfloat16, float16 or float32.")


def fp8_combinations(o: Options, m: Machine) -> None:
    """--fp8: a LoRA base in FP8 or a full fine-tune through torchao; a 4-bit base is neither."""
    if not o.model.fp8_on:
        return
    if o.lora.qlora:
        raise ConfigError("--fp8 with --qlora: the base is already 4-bit (dequantized to bf16 for its matmuls); "
                          "use one of them.")
    if o.lora.use_dora:
        raise ConfigError("--fp8 with --use_dora: DoRA reads each adapted layer's bf16 weight for its column norms, "
                          "and --fp8 holds the base as FP8 copies; use one of them.")
    if not o.lora.lora and not m.has("torchao"):
        raise ConfigError("--fp8 without --lora trains through torchao's float8 training, which is not installed: "
                          "pip install 'deepseek-sft[lowbit]' (or torchao), or --fp8 false.")
    pad = rows_padded_to(o)
    if not o.lora.lora and pad is not None and pad % 16:
        raise ConfigError(f"--fp8 without --lora: the weight gradients' FP8 matmuls sum over the batch's tokens, "
                          f"which must come in multiples of 16, and rows are padded to multiples of {pad} "
                          f"(--pad_to_multiple_of, or --max_length for packed rows under flex_attention): give a "
                          f"multiple of 16.")


def rows_padded_to(o: Options) -> int | None:
    """The multiple every batch's rows are padded to: --pad_to_multiple_of, or, where it is not given, the one
    length packed rows take (packed_rows_length)."""
    d = o.data
    if d is None:  # the planner's described runs (sft/plan/fast_paths.py): its rows are multiples of 16 tokens
        return None
    if d.pad_to_multiple_of is not None:
        return d.pad_to_multiple_of
    return d.max_length if d.pad_to_max_length else packed_rows_length(o)


def packed_rows_length(o: Options) -> int | None:
    """The one length packed rows are padded to where --pad_to_multiple_of is not given, for kernels that compile
    for each new row length: --max_length under flex_attention, and under --compile_layers (a second length compiles
    the layers again: 35-38 s at the second step of 32k rows of one conversation each, bench/RESULTS.md), there
    rounded up to a multiple of 16 for a full fine-tune in FP8 (its weight gradients' matmuls need it). None: each
    batch is padded to its longest row. A packed row is nearly full, so the padding costs little."""
    d = o.data
    if d.pad_to_multiple_of is not None or not d.packing:
        return None
    if o.model.attn_implementation == "flex_attention":
        return d.max_length
    if o.model.compile_layers_on:
        return -(-d.max_length // 16) * 16 if o.model.fp8_on and not o.lora.lora else d.max_length
    return None


def long_row_levers(o: Options, m: Machine) -> None:
    """--mlp_tile_tokens is a count of tokens; --offload_activations moves the activation checkpoints, so it needs
    them (offloading every saved activation of an unchecked model would stream all of them over PCIe)."""
    if o.model.mlp_tile_tokens < 0:
        raise ConfigError(f"--mlp_tile_tokens {o.model.mlp_tile_tokens}: give a number of tokens (0: off).")
    t = o.training
    if t.offload_activations and not (t.activation_checkpointing or getattr(t, "fsdp_activation_checkpointing", False)):
        raise ConfigError("--offload_activations keeps the activation checkpoints in host RAM: add "
                          "--activation_checkpointing true.")


def quantized_experts_combinations(o: Options, m: Machine) -> None:
    """--quantize_experts fp8 holds FROZEN experts (a LoRA run's base) whole on each GPU."""
    if o.model.quantize_experts == "none":
        return
    q = "--quantize_experts fp8"
    if not o.lora.lora or o.lora.qlora:
        raise ConfigError(f"{q} quantizes the frozen experts of a LoRA run's base: add --lora (not with --qlora, "
                          f"whose base is already 4-bit).")
    if o.autoep():
        raise ConfigError(f"{q} with DeepSpeed AutoEP: AutoEP shares the bf16 experts out among the GPUs, the resident "
                          f"plan keeps them whole in e4m3 on each; use one of them (the resident plan: "
                          f"accelerate_configs/ddp.yaml).")
    if o.fsdp(m) or o.zero_stage(m) is not None or o.model.tp_size > 1:
        raise ConfigError(f"{q}: the quantized experts stay whole on each GPU; use one GPU or "
                          f"accelerate_configs/ddp.yaml (not FSDP, DeepSpeed or --tp_size).")


def dequantized_experts_need_checkpoints(o: Options, m: Machine) -> None:
    """--quantize_experts fp8 dequantizes each layer's experts to bf16 for its matmuls, and frees that copy after
    the forward only when the backward recomputes the layer (activation checkpointing). With --fp8 on a GPU that
    has an FP8 grouped matmul the experts compute as held (sft/speed/fp8_experts.py): no copy to free."""
    t = o.training
    if (o.model.quantize_experts == "none" or (o.model.fp8_on and m.fp8_grouped_problem() is None)
            or t.activation_checkpointing or getattr(t, "fsdp_activation_checkpointing", False)):
        return
    raise ConfigError("--quantize_experts fp8 needs --activation_checkpointing true: without it every layer's "
                      "dequantized experts stay on the GPU for the backward, as much memory as the bf16 base (with "
                      "--fp8 on an H100/H200 they compute in FP8 as held, and need none).")


def optimizer_arguments(o: Options, m: Machine) -> None:
    """--optim_args now, not once the model has loaded."""
    t = o.training
    if t.optim not in (SR_ADAMW, *LOW_BIT_OPTIMIZERS):
        return
    from sft.speed.sr_adamw import optim_arg_pairs, optimizer_kwargs

    pairs = optim_arg_pairs(t.optim_args)
    if any(len(pair) != 2 for pair in pairs):
        raise ConfigError(f"--optim_args {t.optim_args!r}: give key=value pairs, comma-separated.")
    if t.optim == SR_ADAMW:
        optimizer_kwargs(dict(pairs), t.seed)
    else:
        check_low_bit_args(getattr(t.optim, "value", t.optim), dict(pairs))


def check_low_bit_args(optim: str, args: dict[str, str]) -> None:
    """torchao's AdamW 8/4-bit through transformers takes block_size and bf16_stochastic_round, ignores any other
    key in silence (a misspelt bf16_stochastic_round would train without it) and fails on a bad value only once
    the model has loaded."""
    known = {"block_size", "bf16_stochastic_round"}
    if set(args) - known:
        raise ConfigError(f"--optim {optim}: unknown --optim_args {', '.join(sorted(set(args) - known))} (known: "
                          f"{', '.join(sorted(known))}).")
    rounding = args.get("bf16_stochastic_round", "false").lower()
    if rounding not in ("y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0"):
        raise ConfigError(f"--optim_args bf16_stochastic_round={args['bf16_stochastic_round']}: give True or False.")
    if not args.get("block_size", "1").isdigit() or int(args.get("block_size", "1")) < 1:
        raise ConfigError(f"--optim_args block_size={args['block_size']}: give a positive whole number (e.g. 128).")


def lora_rank_positive(o: Options, m: Machine) -> None:
    if o.lora.lora and o.lora.lora_r <= 0:
        raise ConfigError(f"--lora_r {o.lora.lora_r}: the rank must be positive.")
    if o.lora.loraplus_lr_ratio < 0:
        raise ConfigError(f"--loraplus_lr_ratio {o.lora.loraplus_lr_ratio}: give a ratio (16 in the LoRA+ paper), or 0 "
                          f"for off.")


LORA_ONLY_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_experts", "use_rslora",
                     "use_dora", "loraplus_lr_ratio", "lora_modules_to_save")
# A module's name or dotted path: peft matches it against the end of module paths, and also reads it as a regular
# expression (where it keeps those modules out of the LoRA targets), so nothing else passes.
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


def lora_options_need_lora(o: Options, m: Machine) -> None:
    """A LoRA option without --lora or --qlora would train every weight instead, in silence (TRL and
    LLaMA-Factory ignore it too). A --lora of yours (a recipe's LoRA turned off by `--lora false`) says you meant it."""
    given = [name for name in LORA_ONLY_OPTIONS if name in o.given]
    if given and not (o.lora.lora or o.lora.qlora) and "lora" not in o.given:
        names = ", ".join(f"--{name}" for name in given)
        verb = "apply" if len(given) > 1 else "applies"
        raise ConfigError(f"{names} only {verb} to a LoRA adapter, and this run fine-tunes every weight: add --lora "
                          f"(or --qlora), or drop {names}.")


def saved_module_names(o: Options, m: Machine) -> None:
    """--lora_modules_to_save takes module names (whether the model has them is checked on it: sft/model/
    saved_modules.py)."""
    names = getattr(o.lora, "lora_modules_to_save", None)
    if names is None:
        return
    bad = [name for name in names if not MODULE_NAME.fullmatch(name)]
    if not names or bad:
        raise ConfigError(f"--lora_modules_to_save {' '.join(map(repr, bad))}".rstrip() + ": give module names "
                          f"(letters, digits and _, a path's parts joined by dots), comma-separated, e.g. "
                          f"embed_tokens,lm_head.")


def sizes_in_range(o: Options, m: Machine) -> None:
    """Else a traceback once the model has loaded, or a run that trains nothing."""
    t = o.training
    for option, value, fits, wanted in (
            ("per_device_train_batch_size", t.per_device_train_batch_size, lambda v: v >= 1, "1 or more"),
            ("per_device_eval_batch_size", t.per_device_eval_batch_size, lambda v: v >= 1, "1 or more"),
            ("gradient_accumulation_steps", t.gradient_accumulation_steps, lambda v: v >= 1, "1 or more"),
            ("learning_rate", t.learning_rate, lambda v: v >= 0, "0 or more, e.g. 2e-4"),
            ("lora_dropout", o.lora.lora_dropout, lambda v: 0 <= v < 1, "a probability in [0, 1)")):
        if not fits(value):
            raise ConfigError(f"--{option} {value}: give {wanted}.")


def something_to_train(o: Options, m: Machine) -> None:
    t = o.training
    if t.max_steps <= 0 and t.num_train_epochs <= 0:
        raise ConfigError(f"--num_train_epochs {t.num_train_epochs:g} without a positive --max_steps "
                          f"trains nothing: give --num_train_epochs (e.g. 3) or --max_steps (e.g. 1000).")


def known_attention(attention: str) -> bool:
    return attention in ATTENTIONS or "/" in attention or attention.startswith("paged|")  # hub kernels pass


def attention_name(o: Options, m: Machine) -> None:
    attention = o.model.attn_implementation
    if known_attention(attention):
        return
    close = difflib.get_close_matches(attention, ATTENTIONS, n=1)
    raise ConfigError(f"--attn_implementation {attention!r}" + (f": did you mean {close[0]}?" if close else ":")
                      + f" use one of {', '.join(ATTENTIONS)} (or a hub kernel, e.g. kernels-community/flash-attn).")


def packing_attention(o: Options, m: Machine) -> None:
    attention = o.model.attn_implementation
    if o.data.packing and known_attention(attention) and attention not in PACKING_ATTENTIONS:  # (attention_name)
        raise ConfigError(f"--packing needs an attention that separates packed documents by position_ids "
                          f"(sdpa, eager, flex_attention, flash_attention_2/3), not "
                          f"{o.model.attn_implementation!r}.")


def padding_positive(o: Options, m: Machine) -> None:
    pad = o.data.pad_to_multiple_of
    if pad is not None and pad < 1:
        raise ConfigError(f"--pad_to_multiple_of {pad}: give a positive number of tokens.")


def plan_value(o: Options, m: Machine) -> None:
    if o.training.plan not in ("no", "auto"):
        raise ConfigError(f"--plan {o.training.plan!r}: use auto (or no).")


def our_option_values(o: Options, m: Machine) -> None:
    t = o.training
    if t.verify_saves not in ("auto", "all", "final", "no"):
        raise ConfigError(f"--verify_saves {t.verify_saves!r}: use auto, all, final or no.")
    if t.nan_policy not in ("stop", "skip"):
        raise ConfigError(f"--nan_policy {t.nan_policy!r}: use stop or skip.")
    if t.loss_spike_factor < 0 or 0 < t.loss_spike_factor <= 1:
        raise ConfigError(f"--loss_spike_factor {t.loss_spike_factor}: give a factor above 1, or 0 to turn spike "
                          f"warnings off.")
    if t.loss_watchdog_threshold < 0 or not math.isfinite(t.loss_watchdog_threshold):
        raise ConfigError(f"--loss_watchdog_threshold {t.loss_watchdog_threshold}: give a loss above 0 (about twice "
                          f"the first logged loss), or 0 to turn the watchdog off.")
    if o.data.pad_to_max_length and "pad_to_multiple_of" in o.given:  # (resolved from --pad_to_max_length else)
        raise ConfigError(f"--pad_to_max_length with --pad_to_multiple_of {o.data.pad_to_multiple_of}: give one of "
                          f"them (rows padded to --max_length, or to a multiple of N tokens).")
    if t.loss_watchdog_patience < 1:
        raise ConfigError(f"--loss_watchdog_patience {t.loss_watchdog_patience}: give the number of logged losses "
                          f"in a row (1 or more) that stop the run.")
    if o.model.rope_scaling is not None and o.model.rope_scaling not in ROPE_SCALINGS:
        close = difflib.get_close_matches(o.model.rope_scaling, ROPE_SCALINGS, n=1)
        raise ConfigError(f"--rope_scaling {o.model.rope_scaling!r}: " + (f"did you mean {close[0]}? " if close else "")
                          + f"Use {', '.join(ROPE_SCALINGS)}.")


# ---- against the machine, the launch and the DeepSpeed config ----------------------------------------------

def partial_checkpointing(o: Options, m: Machine) -> None:
    skip = o.training.activation_checkpointing_skip_layers
    if skip < 0:
        raise ConfigError(f"--activation_checkpointing_skip_layers {skip}: give a number of layers (0 or more).")
    if skip and o.fsdp(m) and not o.lora.lora:  # first: resolve.py has moved --activation_checkpointing to FSDP's
        raise ConfigError("--activation_checkpointing_skip_layers: a full fine-tune under FSDP uses FSDP's own "
                          "activation checkpointing of every layer; drop the option.")
    if skip and not o.training.activation_checkpointing:
        raise ConfigError(f"--activation_checkpointing_skip_layers {skip} needs --activation_checkpointing true "
                          f"(it leaves some layers out of the checkpointing).")


def kept_attention_needs(o: Options, m: Machine, inside_forward: Callable[[], bool] | None = None) -> None:
    """--activation_checkpointing_keep_attention selects what transformers' checkpoint of each layer saves: it needs
    that checkpoint (not FSDP's own), sdpa's kernels (the ops its policy names), and beside --compile_layers a
    transformers that checkpoints inside the compiled forward (sft/speed/kept_attention.py)."""
    if not o.training.activation_checkpointing_keep_attention:
        return
    if o.fsdp(m) and not o.lora.lora:  # resolve.py has moved --activation_checkpointing to FSDP's own
        raise ConfigError("--activation_checkpointing_keep_attention: a full fine-tune under FSDP uses FSDP's own "
                          "activation checkpointing; drop the option, or train LoRA.")
    if not o.training.activation_checkpointing:
        raise ConfigError("--activation_checkpointing_keep_attention needs --activation_checkpointing true (it "
                          "keeps the attention outputs that checkpointing would recompute).")
    if (o.training.activation_checkpointing_kwargs or {}).get("use_reentrant"):
        raise ConfigError("--activation_checkpointing_keep_attention needs the non-reentrant checkpoint: drop "
                          "use_reentrant from --activation_checkpointing_kwargs.")
    if o.model.attn_implementation != "sdpa":
        raise ConfigError(f"--activation_checkpointing_keep_attention keeps sdpa's outputs; under "
                          f"--attn_implementation {o.model.attn_implementation} it would keep nothing. Use "
                          f"--attn_implementation sdpa, or drop the option.")
    from sft.speed.kept_attention import checkpoints_inside_forward

    if o.model.compile_layers_on and not (inside_forward or checkpoints_inside_forward)():
        import transformers

        raise ConfigError(f"--activation_checkpointing_keep_attention with --compile_layers needs transformers >= "
                          f"5.23 (this is {transformers.__version__}: it checkpoints outside the compiled layer). "
                          f"pip install -U 'transformers>=5.23', or add --compile_layers false.")


def precision_the_hardware_has(o: Options, m: Machine) -> None:
    """(--bf16 without bf16 hardware is refused by TrainingArguments itself while parsing.)"""
    if o.training.fp16 and not m.cuda:
        raise NeedsHardware("--fp16 needs a GPU (fp16 autocast with a loss scaler); on this machine drop --fp16 "
                            "and train in fp32.", "--fp16")
    if o.model.dtype == "bfloat16" and m.cuda and not m.bf16:
        raise NeedsHardware("--dtype bfloat16: this GPU has no bf16; use --dtype float16 with --lora, or float32.",
                            "--dtype bfloat16")


def full_fine_tune_keeps_small_updates(o: Options, m: Machine) -> None:
    """Full fine-tuning keeps fp32 master weights (--dtype auto) OR trains bf16 weights with an optimizer that
    rounds its update stochastically (ours, `--optim adamw_bf16_sr`: sft/speed/sr_adamw.py; or torchao's 8/4-bit AdamW
    with bf16_stochastic_round=True where memory needs low-bit states): plain bf16 AdamW
    loses every update smaller than bf16's spacing. The bf16 plan is how a 7B full fine-tune fits 24 GB cards
    without offload (FSDP: ~6 bytes per parameter over the GPUs; bench/RESULTS.md)."""
    t = o.training
    if o.lora.lora or o.model.dtype in ("auto", "float32"):
        return
    recipe = (f"--dtype bfloat16 --optim {SR_ADAMW} (or, where memory needs it, --optim adamw_torch_8bit "
              f"--optim_args bf16_stochastic_round=True)")
    if o.model.dtype == "float16":
        raise ConfigError("--dtype float16 without --lora: full fine-tuning needs fp32 master weights (--dtype "
                          f"auto with --fp16) or bf16 weights with stochastic rounding: {recipe}.")
    optim = getattr(t.optim, "value", t.optim)
    if not rounds_stochastically(optim, t.optim_args):
        raise ConfigError(f"--dtype bfloat16 without --lora with --optim {optim} "
                          f"{('--optim_args ' + t.optim_args) if t.optim_args else ''}: plain bf16 AdamW silently "
                          f"drops small updates. Use {recipe}, or --dtype auto (fp32 master weights).")
    if optim in LOW_BIT_OPTIMIZERS and not m.has("torchao"):
        raise ConfigError(f"--optim {optim} needs torchao: pip install torchao.")
    if t.bf16 and o.fsdp(m):
        raise ConfigError("--bf16 with --dtype bfloat16 under FSDP: accelerate would upcast the weights to fp32 "
                          "master weights (twice the memory). The weights are already bf16: drop --bf16.")


def qlora(o: Options) -> bool:
    return o.lora.qlora


def qlora_needs(o: Options, m: Machine) -> None:
    """--qlora: bitsandbytes' 4-bit kernels on a CUDA GPU, under DDP or FSDP (one GPU: no launcher needed)."""
    if not qlora(o):
        return
    if not m.cuda:
        raise NeedsHardware("--qlora needs a CUDA GPU (bitsandbytes' 4-bit kernels) and this machine has none. Use "
                            "--lora here (the same adapter on the unquantized base).", "--qlora")
    if o.fsdp(m):  # the base as torchao's NF4 bytes (sft/model/nf4_base.py), not bitsandbytes'
        if not m.has("torchao"):
            raise ConfigError('--qlora under FSDP needs the torchao package (its NF4Tensor holds the 4-bit base as '
                              'bytes), which is not installed: pip install -e ".[qlora]", or use '
                              'accelerate_configs/ddp.yaml.')
        if m.launch.world_size < 2:
            raise ConfigError("--qlora under FSDP with one process: nothing to shard. Drop the FSDP accelerate "
                              "config (QLoRA runs on one GPU as is).")
    elif not m.has("bitsandbytes"):
        raise ConfigError('--qlora needs the bitsandbytes package, which is not installed: pip install -e ".[qlora]"')
    if o.model.tp_size > 1:
        raise ConfigError(f"--qlora with --tp_size {o.model.tp_size}: 4-bit weights cannot be split by tensor "
                          f"parallelism. Drop --tp_size: a 4-bit 7B base fits each 24 GB card "
                          f"(accelerate_configs/ddp.yaml).")
    stage = o.zero_stage(m)
    if stage is not None and stage != "3":  # ZeRO-3: quantized_base_not_under_zero3
        raise ConfigError(f"--qlora with DeepSpeed ZeRO-{stage}: not supported (DeepSpeed's engine is not set up "
                          f"for 4-bit weights), and it would save nothing over DDP: ZeRO-{stage} shards the "
                          f"optimizer state, which under LoRA is the adapter's few MB. Use "
                          f"accelerate_configs/ddp.yaml.")


def qlora_under_fsdp_awaits_its_gpu_run(o: Options, m: Machine) -> None:
    """--qlora under FSDP holds the base as NF4 bytes that FSDP2 gathers as bytes (sft/model/nf4_base.py), checked
    bit for bit on CPU ranks and at the start of every run; its first GPU run has not passed yet (the bitsandbytes
    layout it replaces trained, then failed its verified save on 2 GPUs). Refused on GPUs until
    `python bench/qlora_check.py --fsdp two` passes there; that command reaches it with SFT_FSDP_QLORA_CHECK=1."""
    if not (qlora(o) and o.fsdp(m) and m.cuda) or m.launch.fsdp_qlora_check:
        return
    raise ConfigError("--qlora under FSDP: not enabled until its check passes on two GPUs (bench/qlora_check.py "
                      "--fsdp two; docs/strategies.md, QLoRA). A model whose 4-bit base fits one card (up to ~33B on "
                      "24 GB: a 7B takes ~4 GB) runs under accelerate_configs/ddp.yaml, each GPU holding the base; "
                      "a 67B/70B has no other plan on 24 GB cards (docs/planner.md).")


def dora_reads_its_base(o: Options, m: Machine) -> None:
    """DoRA normalizes each adapted weight's columns, so peft reads the base weight; under FSDP the 4-bit base is
    torchao's NF4 tensors (sft/model/nf4_base.py), which peft's DoRA cannot dequantize (seen on CPU)."""
    if getattr(o.lora, "use_dora", False) and qlora(o) and o.fsdp(m):
        raise ConfigError("--use_dora with --qlora under FSDP: peft's DoRA cannot read the NF4 base FSDP holds. Use "
                          "accelerate_configs/ddp.yaml (bitsandbytes' 4-bit base, which DoRA reads), or drop "
                          "--use_dora.")


def adapter_is_a_saved_lora(o: Options, m: Machine) -> None:
    """--lora_from: a saved LoRA adapter, its shape not given again, no routed experts; not under ZeRO-3, whose model
    is created partitioned before peft could load the adapter's weights into it."""
    if not o.lora.lora_from:
        return
    check_adapter(o.lora.lora_from, o.given, adapts_experts(o.lora.lora_from))
    if o.zero_stage(m) == "3":
        raise ConfigError(f"--lora_from {o.lora.lora_from} with DeepSpeed ZeRO-3: the model is created partitioned, "
                          f"and the adapter's weights are loaded whole; use ZeRO-2 (accelerate_configs/zero2.yaml), "
                          f"DDP or FSDP.")


def quantized_base_not_under_zero3(o: Options, m: Machine) -> None:
    if o.zero_stage(m) != "3":
        return
    if qlora(o):
        raise ConfigError("--qlora with DeepSpeed ZeRO-3: our ZeRO-3 path partitions the weights as the model is "
                          "created, and 4-bit weights cannot be partitioned that way. Use DDP "
                          "(accelerate_configs/ddp.yaml: a 4-bit 7B base fits each 24 GB card).")
    quantized = [k for k in ("load_in_4bit", "load_in_8bit") if getattr(o.model, k, False)]
    if quantized:
        raise ConfigError(f"--{quantized[0]} with DeepSpeed ZeRO-3: quantized base weights cannot be partitioned. "
                          f"Use DDP (accelerate_configs/ddp.yaml) or ZeRO-2 (accelerate_configs/zero2.yaml).")


def sharding_needs_gpus(o: Options, m: Machine) -> None:
    """Sharding and offload exist to save GPU memory; without GPUs they are silently ignored or pointless."""
    if m.cuda:
        return
    if o.fsdp(m):
        raise NeedsHardware("FSDP needs GPUs: on a machine without them accelerate silently runs plain DDP instead. "
                            "Drop --fsdp / the FSDP accelerate config, or run on GPUs.", "FSDP")
    if o.offload(m):
        raise NeedsHardware(f"DeepSpeed {' and '.join(o.offload(m))} offload moves GPU state to host memory, and "
                            f"this machine has no GPU. Remove the offload section (ZeRO itself runs on CPU), or run "
                            f"on GPUs.", "DeepSpeed offload")


def attention_kernel_available(o: Options, m: Machine) -> None:
    attn = o.model.attn_implementation
    if attn.startswith("flash_attention") and known_attention(attn):  # (a misspelt one: attention_name)
        package = "flash_attn_interface" if attn == "flash_attention_3" else "flash_attn"
        message = (f"--attn_implementation {attn} needs a GPU and the `{package}` package "
                   f"({'no GPU here' if not m.cuda else 'not installed'}). Use sdpa (it also separates packed "
                   f"documents)" + (", or on a GPU varlen (torch's own FlashAttention-2, each packed document "
                                    "alone)." if attn == "flash_attention_2" else "."))
        if not m.cuda:
            raise NeedsHardware(message, f"--attn_implementation {attn}")
        if not m.has(package):
            raise ConfigError(message)
    if attn == "flex_attention" and not m.cuda:
        raise NeedsHardware("--attn_implementation flex_attention cannot train on CPU (no backward there); use "
                            "sdpa.", "--attn_implementation flex_attention")
    if attn == "varlen":
        varlen_attention_runs(o, m)


def varlen_attention_runs(o: Options, m: Machine) -> None:
    """torch's varlen FlashAttention (sft/speed/varlen_attention.py): in torch 2.9 and later, on GPUs of compute
    capability 8.0 and later, on half-precision activations (autocast, or a bf16/fp16 base: LoRA's default on
    GPUs that have bf16). Without CUDA the same attention runs through sdpa."""
    import torch

    from sft.speed import varlen_attention

    if varlen_attention.kernel() is None:
        raise ConfigError(f"--attn_implementation varlen needs torch >= 2.9 (torch.nn.attention.varlen; this is "
                          f"{torch.__version__}): pip install -U torch, or use sdpa or flex_attention.")
    if not m.cuda:
        return
    old = [c for c in m.gpu_capabilities if tuple(c) < varlen_attention.MIN_CAPABILITY]
    if old:
        raise ConfigError(f"--attn_implementation varlen needs GPUs of compute capability 8.0 or later "
                          f"(FlashAttention-2; this one is {old[0][0]}.{old[0][1]}): use sdpa.")
    half_weights = o.model.dtype in ("bfloat16", "float16") or (o.model.dtype == "auto" and o.lora.lora and m.bf16)
    if not (o.training.bf16 or o.training.fp16 or half_weights):
        raise ConfigError("--attn_implementation varlen computes in bf16 or fp16 (FlashAttention-2), and this run "
                          "computes in fp32: add --bf16 (or --fp16), or use sdpa.")


def optimizer_installed(o: Options, m: Machine) -> None:
    """The Trainer imports the optimizer's package once the model has loaded (bitsandbytes' paged_adamw_8bit: an
    ImportError traceback there): its class is asked for now. One that needs the model to build (GaLore's target
    modules) stays the Trainer's to check."""
    if o.training.optim == SR_ADAMW:  # ours (sft/speed/sr_adamw.py)
        return
    from transformers import Trainer

    try:
        Trainer.get_optimizer_cls_and_kwargs(o.training)
    except ImportError as e:
        raise ConfigError(f"--optim {getattr(o.training.optim, 'value', o.training.optim)}: "
                          f"{str(e).strip().splitlines()[0]}") from None
    except (ValueError, TypeError, KeyError):
        return


# What a --report_to integration needs where it is not its own name's package (pip install NAME)
REPORTING_NEEDS = {"azure_ml": "pip install azureml-core", "flyte": "pip install flytekit",
                   "kubeflow": "a Kubeflow trainer job (KUBEFLOW_TRAINER_SERVER_URL set)"}


def reporting_installed(o: Options, m: Machine) -> None:
    """--report_to: each integration one the Trainer knows and can run here. The Trainer builds their callbacks
    after the model has loaded: a missing package (wandb) or an unknown name stopped with a traceback there."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    given = list(o.training.report_to or [])
    alone = [r for r in given if r in ("none", "all")]
    if alone and len(given) > 1:
        raise ConfigError(f"--report_to {' '.join(given)}: {alone[0]} stands alone; name it, or the loggers.")
    names = [r for r in given if r not in alone]
    unknown = [r for r in names if r not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise ConfigError(f"--report_to {' '.join(unknown)}: the Trainer reports to "
                          f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}, or none.")
    missing = [r for r in names if not m.reports_to(r)]
    if missing:
        needs = "; ".join(f"{r} needs {REPORTING_NEEDS.get(r, f'pip install {r}')}" for r in missing)
        raise ConfigError(f"--report_to {' '.join(missing)} cannot report from here: {needs}; or leave it out "
                          f"(TensorBoard, the default, is installed with deepseek-sft).")


def liger_kernel_available(o: Options, m: Machine) -> None:
    """The Trainer imports Liger only inside train(), after the model has loaded (seen on an H200: an ImportError
    traceback a minute in); its kernels are Triton, GPU only."""
    if not o.training.use_liger_kernel:
        return
    if not m.cuda:  # first: on a machine without GPUs installing it would not help
        raise NeedsHardware("--use_liger_kernel needs a GPU (its kernels are Triton); drop it on CPU.",
                            "--use_liger_kernel")
    if not m.has("liger_kernel"):
        raise ConfigError("--use_liger_kernel needs the liger-kernel package, which is not installed: "
                          "pip install 'deepseek-sft[lowbit]' (or liger-kernel), or drop --use_liger_kernel.")


def fp8_strategy_conflict(o: Options, m: Machine) -> str | None:
    """Why the run's strategy excludes --fp8 (None when it does not). LoRA: the FP8 base is quantized once and
    must stay whole on each GPU (one process per GPU or DDP). Full fine-tune: torchao's Float8Linear under one
    GPU, DDP or FSDP2; DeepSpeed's flattened parameters and TP's DTensors are not tested with it."""
    if o.zero_stage(m) is not None:
        return f"DeepSpeed ZeRO-{o.zero_stage(m)} (its flattened parameters are not tested with FP8)"
    if o.model.tp_size > 1:
        return "--tp_size (the layers' weights are DTensors)"
    if o.lora.lora and o.fsdp(m):
        return "FSDP under LoRA (the FP8 base is quantized once and must stay whole on each GPU)"
    return None


def fp8_base_needs(o: Options, m: Machine) -> None:
    """--fp8: a GPU with FP8 matmuls (compute capability 8.9+: Machine.fp8_problem) and a strategy that allows it
    (fp8_strategy_conflict). Without torch: the planner asks it of boxes described as data (sft/plan/fast_paths.py)."""
    if not o.model.fp8_on:
        return
    same = "the same LoRA in bf16" if o.lora.lora else "the same fine-tune in bf16"
    if not m.cuda and not m.launch.fp8_on_cpu:
        raise NeedsHardware(f"--fp8 needs a GPU with FP8 matmuls (compute capability 8.9+: RTX 4090, L40, H100, "
                            f"H200) and this machine has none. Drop --fp8 ({same}).", "--fp8")
    why = m.fp8_problem()
    if why:
        raise ConfigError(f"--fp8: {why}. Drop --fp8 ({same}).")
    conflict = fp8_strategy_conflict(o, m)
    if conflict:
        hint = ("A 7B LoRA fits one 24 GB card: use accelerate_configs/ddp.yaml." if o.lora.lora else
                "Use accelerate_configs/fsdp.yaml (the box's full fine-tune) or ddp.yaml.")
        raise ConfigError(f"--fp8 with {conflict}. {hint}")


def chunked_loss_combinations(o: Options, m: Machine) -> None:
    """--chunked_loss replaces the loss that Liger's fused loss also replaces; under TP the lm_head is sharded."""
    if not o.model.chunked_loss_on:
        return
    if o.training.use_liger_kernel:
        raise ConfigError("--chunked_loss with --use_liger_kernel: Liger's fused loss already avoids whole logits; "
                          "keep one of the two.")
    if o.model.tp_size > 1:
        raise ConfigError("--chunked_loss with --tp_size: the lm_head's output is sharded across the TP ranks; "
                          "drop --chunked_loss.")


def loss_in_chunks_under_zero3(o: Options, m: Machine) -> None:
    """The loss in chunks (--chunked_loss, and always under --sequence_parallel) gathers a frozen ZeRO-3 lm_head
    once (sft/speed/chunked_loss.py gathered_head); a trained one would be gathered by its hooks at every chunk and
    every chunk's recomputation, which ranks with other counts of labelled tokens run different numbers of times."""
    chunks = o.model.chunked_loss_on or o.training.sequence_parallel > 1
    if not (chunks and trains_lm_head(o) and o.zero_stage(m) == "3" and m.launch.world_size > 1):
        return
    what = "--sequence_parallel" if o.training.sequence_parallel > 1 else "--chunked_loss"
    run = "lm_head trained whole beside LoRA (--lora_modules_to_save)" if o.lora.lora else "a full fine-tune"
    raise ConfigError(f"{what} with {run} under ZeRO-3 on several processes: the loss in chunks cannot gather a "
                      f"trained lm_head there. Use ZeRO-2 (accelerate_configs/zero2.yaml), or "
                      + ("leave lm_head out." if o.lora.lora else "--lora."))


def trains_lm_head(o: Options) -> bool:
    """A full fine-tune, or LoRA with the LM head trained whole beside the adapter."""
    saved = getattr(o.lora, "lora_modules_to_save", None) or []
    return not o.lora.lora or any(name.rsplit(".", 1)[-1] == "lm_head" for name in saved)


def compiled_layers_combinations(o: Options, m: Machine) -> None:
    """--compile_layers compiles the layers in place; DeepSpeed's hooks and TP's DTensors are not measured with it,
    and the Trainer's --torch_compile would compile the whole model around them."""
    if not o.model.compile_layers_on:
        return
    if o.training.torch_compile:
        raise ConfigError("--compile_layers with --torch_compile: keep one (--compile_layers compiles each decoder "
                          "layer once; --torch_compile the whole model, loss included).")
    if o.zero_stage(m) is not None:
        raise ConfigError(f"--compile_layers with DeepSpeed ZeRO-{o.zero_stage(m)}: not supported (its parameter "
                          f"hooks are not tested with compiled layers). Drop --compile_layers, or use "
                          f"accelerate_configs/fsdp.yaml or ddp.yaml.")
    if o.model.tp_size > 1:
        raise ConfigError("--compile_layers with --tp_size: not supported (the layers' weights are DTensors). Drop "
                          "one of them.")
    if o.lora.use_dora:
        raise ConfigError("--compile_layers with --use_dora: peft's DoRA forward breaks dynamo's graph, so the "
                          "layers would run eagerly anyway. Drop one of them.")


def expert_parallel_combinations(o: Options, m: Machine) -> None:
    """DeepSpeed AutoEP (accelerate_configs/autoep.yaml) here: a LoRA run's frozen routed experts shared out among
    the GPUs, under ZeRO stage 0 (sft/parallel/expert_parallel.py says why each rule holds). The model's side (a
    DeepSeek-V2, the experts divisible by autoep_size) is checked on its config: check_expert_parallel."""
    if not o.autoep():
        return
    ep = "DeepSpeed AutoEP (expert_parallel in the DeepSpeed config)"
    if not o.lora.lora or o.lora.qlora:
        raise ConfigError(f"{ep} shares out the frozen routed experts of a LoRA run: add --lora (not --qlora, whose "
                          f"4-bit base DeepSpeed does not take).")
    if o.zero_stage(m) != "0":
        raise ConfigError(f"{ep} with ZeRO-{o.zero_stage(m)}: AutoEP trains LoRA here under ZeRO stage 0 only "
                          f"(ZeRO-1/2's optimizer needs trainable experts, which LoRA freezes; ZeRO-3 refuses frozen "
                          f"experts). Use accelerate_configs/autoep.yaml (ds_configs/autoep.json).")
    if getattr(o.lora, "lora_experts", False):
        raise ConfigError(f"--lora_experts with {ep}: AutoEP replaces the routed experts' module, so LoRA on them "
                          f"would not train; drop --lora_experts (LoRA stays on attention, the dense MLP and the "
                          f"shared experts).")
    if o.model.tp_size > 1:
        raise ConfigError(f"--tp_size with {ep}: not supported together; drop --tp_size.")


def processes_fit_gpus(o: Options, m: Machine) -> None:
    local = m.launch.processes_here(1)
    if m.cuda and local > m.gpus:
        raise ConfigError(f"{local} processes on this machine but {m.gpus} GPU(s): launch with "
                          f"`accelerate launch --num_processes {m.gpus}` (or `torchrun --nproc_per_node {m.gpus}`).")


def tensor_parallel_combinations(o: Options, m: Machine) -> None:
    """accelerate refuses TP on CPU; peft's LoRA layers and Liger's fused loss fail on the shards (seen)."""
    tp = o.model.tp_size
    if tp <= 1:
        return
    if not m.cuda:
        raise NeedsHardware(f"--tp_size {tp} needs GPUs: accelerate refuses tensor parallelism on CPU. Drop "
                            f"--tp_size (DDP over gloo trains on CPU), or run on GPUs.", f"--tp_size {tp}")
    if o.lora.lora:  # peft's LoRA layers wrap the sharded linears and fail at the first step (seen on CPU)
        raise ConfigError(f"--lora with --tp_size {tp}: peft's LoRA layers do not handle transformers' "
                          f"tensor-parallel shards. LoRA of a 7B model fits one 24 GB card: use "
                          f"accelerate_configs/ddp.yaml (a replica per GPU) without --tp_size.")
    if o.training.use_liger_kernel:  # seen on GPUs: its loss multiplies activations by the sharded lm_head
        raise ConfigError(f"--use_liger_kernel with --tp_size {tp}: Liger's fused loss cannot take the "
                          f"tensor-parallel lm_head (\"mixed torch.Tensor and DTensor\" at the first step). Drop one "
                          f"of them.")


# Attention kernels that find packed documents from position_ids alone, as DeepSpeed's Ulysses wrapper leaves them
VARLEN_ATTENTIONS = ("flash_attention_2", "flash_attention_3")
# What accelerate's sequence-parallel config accepts (eager keeps a whole-row mask; flex_attention's block mask
# would be rebuilt causal-only by DeepSpeed)
SEQUENCE_PARALLEL_ATTENTIONS = ("sdpa", *VARLEN_ATTENTIONS)


def sequence_parallel_combinations(o: Options, m: Machine) -> None:
    """--sequence_parallel N runs through DeepSpeed's Ulysses (sft/parallel/sequence_parallel.py): N ranks of a
    DeepSpeed launch share each row; its attention wrapper drops the mask, so packed conversations stay apart only
    under kernels that read documents from position_ids alone."""
    n = o.training.sequence_parallel
    if n < 1:
        raise ConfigError(f"--sequence_parallel {n}: give the number of GPUs that share each row (1: off).")
    if n == 1:
        return
    world = m.launch.world_size
    if not o.deepspeed_on(m):
        raise ConfigError(f"--sequence_parallel {n} runs through DeepSpeed (Ulysses): launch with accelerate launch "
                          f"--config_file accelerate_configs/zero2.yaml (or zero3.yaml) --num_processes {n}.")
    if world % n:
        raise ConfigError(f"--sequence_parallel {n} with {world} process(es): launch a multiple of {n} (--num_processes "
                          f"{n}; on the 3-GPU box, 2 GPUs share each row and the third is left out).")
    attention = o.model.attn_implementation
    if attention not in SEQUENCE_PARALLEL_ATTENTIONS:
        raise ConfigError(f"--sequence_parallel with --attn_implementation {attention}: DeepSpeed's Ulysses runs "
                          f"{', '.join(SEQUENCE_PARALLEL_ATTENTIONS)} (eager keeps a whole-row mask; flex_attention's mask would be "
                          f"rebuilt without the documents). Use sdpa.")
    if o.data.packing and attention not in VARLEN_ATTENTIONS:
        raise ConfigError(f"--packing with --sequence_parallel under {attention}: DeepSpeed's Ulysses drops the "
                          f"attention mask, so packed conversations would attend to each other. Drop --packing (one "
                          f"conversation per row: long traces), or use --attn_implementation flash_attention_2.")
    if o.model.tp_size > 1:
        raise ConfigError(f"--sequence_parallel with --tp_size {o.model.tp_size}: use one of them.")


def neftune_noise(o: Options, m: Machine) -> None:
    """--neftune_noise_alpha scales each token's noise by its sequence's length (sft/model/neftune.py), which a rank
    holding a slice of each row (--sequence_parallel) does not see whole."""
    alpha = o.training.neftune_noise_alpha
    if alpha is None:
        return
    if not alpha > 0:
        raise ConfigError(f"--neftune_noise_alpha {alpha:g}: give a positive noise scale (NEFTune's paper uses 5, 10 "
                          f"and 15), or drop the option.")
    if o.training.sequence_parallel > 1:
        raise ConfigError(f"--neftune_noise_alpha with --sequence_parallel {o.training.sequence_parallel}: each rank "
                          f"holds a slice of the row, not the sequences NEFTune scales its noise by. Drop one of them.")


def deepspeed_json_agrees(o: Options, m: Machine) -> None:
    mismatches = getattr(getattr(o.training, "hf_deepspeed_config", None), "mismatches", None) or []
    if mismatches:
        found = "; ".join(x.lstrip("- ") for x in mismatches)
        raise ConfigError(f"the DeepSpeed config {o.training.deepspeed} disagrees with the Trainer's options "
                          f"({found}). Set those DeepSpeed values to \"auto\" (filled from the Trainer's options) "
                          f"or give matching flags.")


def loraplus_needs_the_trainers_optimizer(o: Options, m: Machine) -> None:
    """LoRA+ regroups the optimizer the Trainer builds (sft/model/lora_plus.py); a DeepSpeed config with its own
    `optimizer` section (ds_configs/zero3_offload.json) builds DeepSpeed's, from one group at one rate."""
    if o.lora.loraplus_lr_ratio and "optimizer" in o.deepspeed:
        raise ConfigError(f"--loraplus_lr_ratio: the DeepSpeed config {o.training.deepspeed} builds its own optimizer "
                          f"(its \"optimizer\" section), at one learning rate for all the adapter's weights. Use a "
                          f"DeepSpeed config without that section (accelerate_configs/zero3.yaml), or drop the option.")


def launcher_agrees(o: Options, m: Machine) -> None:
    """The accelerate config's precision, accumulation and DeepSpeed file must match the command line's."""
    t, launch = o.training, m.launch
    ours = "bf16" if t.bf16 else "fp16" if t.fp16 else None
    if ours and launch.mixed_precision not in ("no", ours):
        raise ConfigError(f"the accelerate config says mixed_precision: {launch.mixed_precision} but the command "
                          f"line says --{ours}: make them agree (or drop one; the other is then used).")
    accumulation = launch.gradient_accumulation_steps
    if accumulation and accumulation != t.gradient_accumulation_steps:
        raise ConfigError(f"the accelerate config says gradient_accumulation_steps: {accumulation} but the Trainer "
                          f"uses --gradient_accumulation_steps {t.gradient_accumulation_steps}: give the same value "
                          f"to both.")
    ds_file = launch.deepspeed_config_file
    if (ds_file and t.deepspeed and isinstance(t.deepspeed, str)
            and os.path.realpath(ds_file) != os.path.realpath(t.deepspeed)):
        raise ConfigError(f"two DeepSpeed configs: the accelerate config names {ds_file}, --deepspeed names "
                          f"{t.deepspeed}. Keep one.")


def processes_name_one_run_directory(o: Options, m: Machine) -> None:
    """A new run directory is named after its launcher's start time (sft/options/resolve.py output_dir_of_its_own),
    which the processes on other machines (their own launchers), or where it cannot be read, do not share."""
    launch = m.launch
    if o.training.output_dir_picked != PICKED_NEW or launch.world_size == 1:
        return
    machines = launch.local_world_size is not None and launch.local_world_size < launch.world_size
    if machines or launch.launcher_started is None:
        where = "on several machines" if machines else "whose launcher's start time cannot be read here"
        raise ConfigError(f"--output_dir is missing: {launch.world_size} processes {where} cannot name one new run "
                          f"directory alike. Give --output_dir (on several machines: a directory they all write, "
                          f"on shared storage).")


Check = Callable[[Options, Machine], None]
OPTION_CHECKS: list[Check] = [
    plan_value, dataset_given, data_option_values, mask_history_trains_replies, evaluation_has_data,
    per_epoch_counts_alone, early_stopping_evaluates, hub_upload_named,
    max_length_long_enough, dtype_name,
    fp8_combinations, long_row_levers, quantized_experts_combinations, optimizer_arguments, lora_rank_positive,
    lora_options_need_lora, saved_module_names, sizes_in_range, something_to_train, attention_name, packing_attention,
    padding_positive, our_option_values, neftune_noise,
]
MACHINE_CHECKS: list[Check] = [
    partial_checkpointing, dequantized_experts_need_checkpoints, kept_attention_needs, precision_the_hardware_has,
    full_fine_tune_keeps_small_updates, adapter_is_a_saved_lora, quantized_base_not_under_zero3, qlora_needs,
    qlora_under_fsdp_awaits_its_gpu_run, dora_reads_its_base, sharding_needs_gpus, attention_kernel_available,
    processes_fit_gpus, tensor_parallel_combinations, compiled_layers_combinations, liger_kernel_available,
    reporting_installed, optimizer_installed, fp8_base_needs, chunked_loss_combinations,
    loss_in_chunks_under_zero3, sequence_parallel_combinations, expert_parallel_combinations, deepspeed_json_agrees,
    loraplus_needs_the_trainers_optimizer, launcher_agrees, processes_name_one_run_directory,
]
CHECKS: list[Check] = OPTION_CHECKS + MACHINE_CHECKS


def check_options(o: Options, m: Machine, checks: list[Check] = CHECKS) -> Options:
    """Every rule in `checks`, in order, each one run; -> the same options (from here on read, never written), or
    ConfigErrors with every problem found (`all_problems`). A data-only run, which loads no model, runs
    OPTION_CHECKS alone: a GPU recipe's data can be audited on a laptop."""
    problems: list[UserFacingError] = list(o.problems)
    for check in checks:
        try:
            check(o, m)
        except ConfigError as problem:
            problems.append(problem)
        except Exception:  # a check that trips over a value already refused: say those (else a bug: raised)
            if not problems:
                raise
            break
    if problems:
        raise all_problems(problems, m)
    return o


def all_problems(problems: list[UserFacingError], m: Machine) -> UserFacingError:
    """One error for every problem: what needs hardware this machine lacks first, and on a machine without GPUs
    that needs several, a first line that says so and names them all (the lines after it say what to drop)."""
    needs = [p for p in problems if isinstance(p, NeedsHardware)]
    lead = None
    if len(needs) > 1 and not m.cuda:
        lead = (f"this run needs GPUs and this machine has none ({', '.join(p.need for p in needs)}): run it on a "
                f"GPU machine, or drop each as its line below says.")
    return ConfigErrors.of([*needs, *(p for p in problems if not isinstance(p, NeedsHardware))], lead)
