"""Options: one dataclass per group (model, LoRA, data, training), `--config recipe.yaml`, and the embedded demo.

Every option is a dataclass field with help text, so `python sft/train.py --help` documents them all. A recipe
YAML holds the same names; options given on the command line win over the recipe. With no `--model` and no
`--dataset`, the embedded demo's recipe (a tiny DeepSeek-architecture model on `data/`) fills what is not given.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from transformers import TrainingArguments

from sft.options.argv import (COMMON_TRAINING, Parser, apply_aliases, help_requested, short_help, split_names,
                      unknown_options_message)
from sft.configs import DEMO_DATA
from sft.errors import ConfigError
from sft.speed.lowbit import LOW_BIT_OPTIMIZERS, SR_ADAMW
from sft.options.recipe import load_recipe, recipe_to_argv

OUR_OPTIMIZERS = (SR_ADAMW,)  # --optim values beyond transformers' own
ATTENTIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")

TINY_MODEL = "tiny-deepseek"  # the embedded default, built from its config by sft/model/tiny.py
DEMO = {  # what `accelerate launch sft/train.py` with no arguments runs: about a minute on 2 CPU cores
    "model": TINY_MODEL,
    "dataset": [str(DEMO_DATA / "alpaca_demo.json"), str(DEMO_DATA / "oasst_demo.jsonl")],  # shipped in the wheel
    "output_dir": "output/demo",
    "max_length": 256,
    "packing": True,
    "eval_split": 0.05,
    "num_train_epochs": 20,
    "per_device_train_batch_size": 4,
    "learning_rate": 3e-3,
    "warmup_steps": 5,
    "lr_scheduler_type": "cosine",
    "logging_steps": 10,
    "eval_strategy": "epoch",
    "save_strategy": "no",
    "seed": 0,
}
# A demo value steps back when the user gave any of these (an option typed or in a recipe always wins: the demo's
# `save_strategy no` must not swallow a --save_steps 4).
DEMO_YIELDS_TO = {"save_strategy": ("save_steps",), "eval_strategy": ("eval_steps",), "eval_split": ("eval_dataset",),
                  "num_train_epochs": ("max_steps",), "logging_steps": ("logging_strategy",)}


@dataclass
class ModelArguments:
    model: str = field(default=TINY_MODEL, metadata={
        "help": f"Hub id or local directory of the model to fine-tune; `{TINY_MODEL}` builds the embedded tiny "
                "DeepSeek-architecture model (no download)."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer to use, if not the model's own."})
    dtype: str = field(default="auto", metadata={
        "help": "Weights dtype: auto (fp32 master weights for full fine-tuning, bf16 base weights under LoRA "
                "where the hardware has bf16), bfloat16, float16 or float32."})
    fp8: bool = field(default=False, metadata={
        "help": "With --lora: the frozen base's linear layers compute in FP8 (e4m3, rowwise scales; forward and "
                "input gradient), the adapter stays bf16. Needs compute capability 8.9+ (RTX 4090, H100, H200), "
                "one process per GPU or DDP (not FSDP or DeepSpeed). Off by default: bench/fp8_check.py compares "
                "its loss with bf16's."})
    chunked_loss: bool = field(default=False, metadata={
        "help": "The training loss from the last hidden states, 1024 labelled tokens at a time, each chunk's logits "
                "recomputed in the backward: no [tokens x vocabulary] logits tensor (sft/speed/chunked_loss.py). For "
                "models without Liger's fused loss (DeepSeek-V2/V3); not with --use_liger_kernel or --tp_size."})
    compile_layers: bool = field(default=False, metadata={
        "help": "torch.compile each decoder layer in place (one compile shared by all layers; the first step "
                "compiles, later runs reuse inductor's cache): inductor fuses norms, RoPE, SwiGLU and LoRA's adds "
                "between the matmuls. With --use_liger_kernel only Liger's fused loss stays on. Single GPU, DDP or "
                "FSDP; with --fp8 too; not DeepSpeed, --tp_size or the Trainer's --torch_compile."})
    attn_implementation: str = field(default="sdpa", metadata={
        "help": "Attention kernel: sdpa, eager, flex_attention, flash_attention_2 (needs flash-attn)."})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Run Python code shipped with a hub model. Off by default: DeepSeek models are native in "
                "transformers."})
    tp_size: int = field(default=1, metadata={
        "help": "Tensor parallel: split every layer over this many GPUs (transformers' tp_plan; launch with "
                "accelerate_configs/tp.yaml). Measured slower than FSDP: see docs/strategies.md, Tensor parallel. "
                "Its checkpoints resume under the same --tp_size."})


@dataclass
class LoraArguments:
    lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter (peft) instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scaling = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "Module names to adapt; default: every attention and MLP projection of the model's family (on "
                "DeepSeek MoE models gate_proj/up_proj/down_proj mean the dense layers' MLP and shared experts)."})
    qlora: bool = field(default=False, metadata={
        "help": "QLoRA: train the LoRA adapter on the base quantized to 4 bits as it loads (bitsandbytes NF4, "
                "double quantization, bf16 compute; implies --lora). Needs a CUDA GPU and "
                "`pip install -e \".[qlora]\"`; runs under DDP or FSDP, not DeepSpeed. The adapter loads on the "
                "unquantized base too (sft.tools.merge merges it there)."})
    lora_experts: bool = field(default=False, metadata={
        "help": "DeepSeek-V2/V3 (MoE): also adapt the routed experts (LoRA on the fused expert weights). Without "
                "it a MoE LoRA adapts the MLA projections, the dense layers' MLP and the shared experts; the "
                "router is never adapted."})

    def __post_init__(self):
        if self.lora_target_modules:  # `q_proj, v_proj` (one YAML string, as LLaMA-Factory writes it) or `all`
            self.lora_target_modules = [name for value in self.lora_target_modules for name in split_names(value)]


@dataclass
class DataArguments:
    dataset: list[str] | None = field(default=None, metadata={
        "help": "Training data: one or more .json/.jsonl/.parquet/.csv files or hub names (`name` or "
                "`name:split`), mixed in one run."})
    dataset_format: str | None = field(default=None, metadata={
        "help": "alpaca, oasst or messages; detected from each file's first record when omitted."})
    template: str = field(default="auto", metadata={
        "help": "Chat template: auto (the model's own if it has one, else deepseek), model, deepseek, "
                "deepseek_coder, deepseek_v3, r1 (DeepSeek-R1: all system texts, <think> text trained), r1_distill "
                "(the distills: the last system text), r1_distill_no_reasoning (answers "
                "only: for data without reasoning), alpaca."})
    eval_dataset: list[str] | None = field(default=None, metadata={"help": "Evaluation data (files or hub names)."})
    eval_split: float = field(default=0.0, metadata={
        "help": "Fraction of the training conversations held out for evaluation when --eval_dataset is not given."})
    max_samples: int | None = field(default=None, metadata={"help": "Use at most this many conversations per dataset."})
    max_length: int = field(default=2048, metadata={"help": "Longest sequence (and packed row), in tokens."})
    overlong: str = field(default="truncate", metadata={
        "help": "Conversations over --max_length: truncate (after the last assistant turn that fits) or drop."})
    packing: bool = field(default=False, metadata={
        "help": "Pack conversations into rows of --max_length (best-fit decreasing; no attention across them)."})
    pad_to_multiple_of: int | None = field(default=None, metadata={
        "help": "Pad every batch to a multiple of this many tokens. Default: --max_length for packed rows under "
                "flex_attention (one shape, so its kernels compile once), else the batch's longest row."})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also train on prompt tokens, not only replies."})
    skip_bad_records: bool = field(default=False, metadata={
        "help": "Skip and count malformed records instead of stopping at the first one."})
    oasst_threads: str = field(default="best", metadata={
        "help": "OASST trees: best (follow the best-ranked reply) or all (every root-to-leaf thread)."})
    oasst_lang: list[str] | None = field(default=None, metadata={
        "help": "Keep only OASST messages in these languages."})
    num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenization (default: all cores)."})
    dataset_cache_dir: str | None = field(default=None, metadata={
        "help": "Where prepared datasets are cached (default: ~/.cache/deepseek-sft/datasets)."})
    show_masks: int = field(default=0, metadata={
        "help": "Print this many rendered examples with the trained tokens marked, then continue. "
                "`python -m sft.data.dataset <options>` does only that (and the summary), loading no model."})


@dataclass
class SFTTrainingArguments(TrainingArguments):
    """transformers' TrainingArguments with defaults for SFT (every one of its flags works as usual)."""

    output_dir: str | None = field(default="output/run", metadata={"help": "Where checkpoints, logs and the model go."})
    report_to: None | str | list[str] = field(default="tensorboard", metadata={
        "help": "Loggers: tensorboard, wandb, none, or several"})
    logging_steps: float = field(default=10, metadata={"help": "Log every N steps."})
    log_level_replica: str = field(default="error", metadata={
        "help": "Log level of the processes other than rank 0 (transformers' default: warning)."})
    # Our collator needs `seq_lengths`, which the model's forward does not take.
    remove_unused_columns: bool = field(default=False, metadata={"help": "Leave at False for sft."})
    include_num_input_tokens_seen: str = field(default="non_padding", metadata={
        "help": "Count real (non-padding) tokens, for the tokens/s and MFU logs."})
    # Nothing lost (sft/safety/checkpoints.py, sft/safety/verify.py, sft/safety/guards.py).
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "Resume: `true` (the newest complete checkpoint in --output_dir) or a checkpoint-N directory."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start over in an --output_dir that holds a run: the old run is moved aside to "
                "<output_dir>.replaced-<time> (never mixed with the new one). Without it, such a run stops and "
                "prints the command to resume it."})
    router_aux_loss_coef: float | None = field(default=None, metadata={
        "help": "DeepSeek-V2/V3 (MoE): weight of the routers' load-balancing loss added to the training loss "
                "(DeepSeek's per-sequence expert balance loss, summed over the MoE layers; sft/model/moe.py). Default: "
                "the model config's aux_loss_alpha (0.001 on DeepSeek's configs), else 0.001; 0 turns it off "
                "(the expert load is still logged as moe/*)."})
    plan: str = field(default="no", metadata={
        "help": "auto: set the strategy options the planner predicts fastest on this machine (python -m sft.plan.planner); "
                "options you give win."})
    activation_checkpointing_skip_layers: int = field(default=0, metadata={
        "help": "With --activation_checkpointing: leave this many of the last decoder layers unchecked, which "
                "spends spare GPU memory to skip their recomputation (each layer ~1/num_layers of it)."})
    verify_saves: str = field(default="auto", metadata={
        "help": "Reload each save and compare its logits with the trained model: auto (the final save, and every "
                "checkpoint under LoRA or when the model has < 1e9 parameters), all, final, no."})
    nan_policy: str = field(default="stop", metadata={
        "help": "On a NaN/inf loss or gradient: stop (before the weights change; the last checkpoint is kept) "
                "or skip (drop that step's update and go on)."})
    loss_spike_factor: float = field(default=2.0, metadata={
        "help": "Warn (and count in the `loss_spikes` log) when a logged loss exceeds this many times the "
                "running mean; 0 turns it off."})

    # transformers' own field is a dict that its parser cannot read from the command line: JSON here.
    liger_kernel_config: dict | str | None = field(default=None, metadata={
        "help": "Which Liger kernels --use_liger_kernel applies, as JSON, e.g. '{\"rms_norm\": false}' (keys: rope, "
                "rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy); default: all of the model's, or "
                "only the fused loss under --compile_layers."})
    # Not an option: set by sft/options/checks.py apply_setup_defaults where Liger's fused loss runs on the labelled tokens
    # only (sft/speed/chunked_loss.py liger_causal_lm_loss) instead of Liger's own, which projects every token.
    liger_loss_on_labels: bool = field(default=False, init=False)
    # A plain string (transformers' own field offers its OptimizerNames as the only choices): ours are added.
    optim: str = field(default=next(f.default for f in fields(TrainingArguments) if f.name == "optim"), metadata={
        "help": f"The optimizer: transformers' (adamw_torch_fused, adamw_torch_8bit, ...) or {SR_ADAMW} (bf16 "
                f"weights and states, updated in fp32 and rounded stochastically: full fine-tuning without fp32 "
                f"master weights, at plain bf16 AdamW's memory traffic; sft/speed/sr_adamw.py)."})

    def __post_init__(self):
        # transformers accepts only its own --optim names (OptimizerNames); ours pass through as plain strings
        # (sft/speed/sr_adamw.py registers the Trainer's handler for them).
        if isinstance(self.liger_kernel_config, str):
            self.liger_kernel_config = liger_config_from_json(self.liger_kernel_config)
        check_optimizer_name(str(getattr(self.optim, "value", self.optim)))
        ours = self.optim if self.optim in OUR_OPTIMIZERS else None
        if ours:
            self.optim = "adamw_torch"
        super().__post_init__()
        if ours:
            self.optim = ours


def check_optimizer_name(name: str) -> None:
    """An --optim that names no optimizer, as one line with the closest names (transformers' own error lists 40
    names without ours, and its text mentions bf16 when the typo does)."""
    import difflib

    from transformers.training_args import OptimizerNames

    names = [o.value for o in OptimizerNames] + list(OUR_OPTIMIZERS)
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=3)
    raise ConfigError(f"--optim {name!r} is no optimizer" + (f"; did you mean {' or '.join(close)}?" if close else ".")
                      + f" The names: {', '.join(names)}.")


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


def liger_config_from_json(text: str) -> dict[str, bool]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--liger_kernel_config {text}: not JSON ({e.msg}). Give an object, e.g. "
                          f"'{{\"rms_norm\": false}}'.") from None
    if not isinstance(config, dict) or not all(isinstance(v, bool) for v in config.values()):
        raise ConfigError(f"--liger_kernel_config {text}: give a JSON object of kernel names and true/false, e.g. "
                          f"'{{\"rms_norm\": false}}'.")
    return config


PARSER_TYPES = (ModelArguments, DataArguments, LoraArguments, SFTTrainingArguments)
HELP_GROUPS = [  # the one-screen --help: our options, then the TrainingArguments people use most
    ("Model", ModelArguments, tuple(f.name for f in fields(ModelArguments))),
    ("LoRA", LoraArguments, tuple(f.name for f in fields(LoraArguments))),
    ("Data", DataArguments, tuple(f.name for f in fields(DataArguments))),
    ("Nothing lost", SFTTrainingArguments, ("overwrite_output_dir", "verify_saves", "nan_policy", "loss_spike_factor")),
    ("Training (transformers' TrainingArguments; --help all lists all)", SFTTrainingArguments,
     COMMON_TRAINING + ("activation_checkpointing_skip_layers",)),
]


def expand_argv(argv: list[str]) -> tuple[list[str], set[str], list[tuple[str, list[str]]]]:
    """Recipe first, then the command line (the last value of an option wins); other trainers' names become ours;
    the demo fills only what the user left out. -> (argv, the option names the user gave, each recipe's path and
    options: to name the file that holds a bad one)."""
    recipes: list[tuple[str, list[str]]] = []
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else next(it, None)
            if not path:
                raise ConfigError("--config needs the path of a recipe YAML file.")
            recipes.append((path, apply_aliases(load_recipe(path))))
        else:
            rest.append(arg)
    argv = [a for _, options in recipes for a in options] + apply_aliases(rest)
    given = {a.split("=", 1)[0][2:].replace("-", "_") for a in argv if a.startswith("--")}
    if "model" not in given and "dataset" not in given:
        demo = {k: v for k, v in DEMO.items() if k not in given and not given.intersection(DEMO_YIELDS_TO.get(k, ()))}
        argv = recipe_to_argv(demo, "demo") + argv
    return argv, given, recipes


def recipe_error(parser: Parser, recipes: list[tuple[str, list[str]]]) -> ConfigError | None:
    """The recipe that holds an unknown option or a bad value, named: its errors read like the command line's."""
    for path, options in recipes:
        try:
            unknown = parser.parse_known_args(options)[1]
        except ConfigError as e:
            return ConfigError(f"{path}: {e}")
        if unknown:
            return ConfigError(f"{path}: {unknown_options_message(unknown, parser, our_option_names())}")
    return None


def our_option_names() -> list[str]:
    return [f.name for cls in PARSER_TYPES[:3] for f in fields(cls)] + list(SFTTrainingArguments.__annotations__)


def is_demo_output(model_args: ModelArguments, training_args) -> bool:
    """The demo's own output directory (the tiny model into ./output/demo): the one directory a run may replace
    without being asked, since the demo is disposable."""
    return (model_args.model == TINY_MODEL and
            Path(training_args.output_dir).resolve() == Path(DEMO["output_dir"]).resolve())


def parse_args(argv: list[str] | None = None, data_only: bool = False):
    """-> (ModelArguments, DataArguments, LoraArguments, SFTTrainingArguments), validated. `data_only`: for tools
    that prepare data and load no model (sft.data.dataset): precision and the machine are not checked, so a GPU recipe's
    data can be audited on a laptop (precision does not enter the data)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(PARSER_TYPES, allow_abbrev=False)  # a typo must not pass as an abbreviation
    wanted = help_requested(argv)
    if wanted:
        print(parser.format_help() if wanted == "all" else short_help(HELP_GROUPS))
        raise SystemExit(0)
    argv, given, recipes = expand_argv(argv)
    if data_only:
        argv += ["--bf16", "false", "--fp16", "false"]  # the last value wins; TrainingArguments checks the hardware
    try:
        *parsed, unknown = parser.parse_args_into_dataclasses(
            args=argv, look_for_args_file=False, return_remaining_strings=True)
    except ConfigError as e:
        raise recipe_error(parser, recipes) or e from None
    except ValueError as e:  # TrainingArguments.__post_init__ rejects some combinations itself
        raise ConfigError(training_arguments_message(str(e))) from None
    if unknown:
        raise recipe_error(parser, recipes) or ConfigError(unknown_options_message(unknown, parser,
                                                                                   our_option_names()))
    model_args, data_args, lora_args, training_args = parsed
    if training_args.plan not in ("no", "auto"):
        raise ConfigError(f"--plan {training_args.plan!r}: use auto (or no).")
    if training_args.plan == "auto":  # before validate: the options it sets are checked like the user's
        from sft.plan.planner import fill_options

        training_args.planned = fill_options(model_args, lora_args, data_args, training_args, given=given)
    validate(model_args, data_args, lora_args, training_args, check_machine=not data_only)
    return model_args, data_args, lora_args, training_args


def resume_requested(value) -> str | None:
    """--resume_from_checkpoint as given: None when it says no, else the checkpoint path or "true"."""
    return None if value in (None, "", "false", "False", "no", "0") else str(value)


def validate(model_args: ModelArguments, data_args: DataArguments, lora_args: LoraArguments,
             training_args: SFTTrainingArguments, machine=None, check_machine: bool = True) -> None:
    """Combinations that cannot work, caught before anything is loaded (`machine`: see validate_setup)."""
    from sft.data.formats import FORMATS
    from sft.data.templates import TEMPLATE_NAMES

    if not data_args.dataset:
        raise ConfigError("--dataset is missing: give one or more data files or hub dataset names.")
    if data_args.dataset_format not in (None, *FORMATS):
        raise ConfigError(f"--dataset_format {data_args.dataset_format!r}: use one of {', '.join(FORMATS)}.")
    if data_args.template not in TEMPLATE_NAMES:
        raise ConfigError(f"--template {data_args.template!r}: use one of {', '.join(TEMPLATE_NAMES)}.")
    if data_args.overlong not in ("truncate", "drop"):
        raise ConfigError(f"--overlong {data_args.overlong!r}: use truncate or drop.")
    if data_args.oasst_threads not in ("best", "all"):
        raise ConfigError(f"--oasst_threads {data_args.oasst_threads!r}: use best or all.")
    if not 0 <= data_args.eval_split < 1:
        raise ConfigError(f"--eval_split {data_args.eval_split}: give a fraction in [0, 1).")
    if training_args.eval_strategy != "no" and not (data_args.eval_dataset or data_args.eval_split):
        raise ConfigError(f"--eval_strategy {training_args.eval_strategy.value} needs held-out data: add --eval_dataset "
                          f"FILE or --eval_split 0.05 (a share of the training data), or --eval_strategy no.")
    if data_args.max_length < 8:
        raise ConfigError(f"--max_length {data_args.max_length} is too short; give at least 8 tokens.")
    if model_args.dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise ConfigError(f"--dtype {model_args.dtype!r}: use auto, bfloat16, float16 or float32.")
    if model_args.fp8 and not (lora_args.lora or lora_args.qlora):
        raise ConfigError("--fp8 computes the frozen base of a LoRA run in FP8: add --lora (a full fine-tune "
                          "trains every weight, and FP8 training of those is not supported yet).")
    if model_args.fp8 and lora_args.qlora:
        raise ConfigError("--fp8 with --qlora: the base is already 4-bit (bitsandbytes computes it in bf16); use "
                          "one of them.")
    if training_args.optim in (SR_ADAMW, *LOW_BIT_OPTIMIZERS):  # --optim_args now, not once the model has loaded
        from sft.speed.sr_adamw import optimizer_kwargs

        pairs = [kv.split("=", 1) for kv in (training_args.optim_args or "").replace(" ", "").split(",") if kv]
        if any(len(pair) != 2 for pair in pairs):
            raise ConfigError(f"--optim_args {training_args.optim_args!r}: give key=value pairs, comma-separated.")
        if training_args.optim == SR_ADAMW:
            optimizer_kwargs(dict(pairs), training_args.seed)
        else:
            check_low_bit_args(getattr(training_args.optim, "value", training_args.optim), dict(pairs))
    if lora_args.lora and lora_args.lora_r <= 0:
        raise ConfigError(f"--lora_r {lora_args.lora_r}: the rank must be positive.")
    for option, value, fits, wanted in (  # else a traceback once the model has loaded, or a run that trains nothing
            ("per_device_train_batch_size", training_args.per_device_train_batch_size, lambda v: v >= 1, "1 or more"),
            ("per_device_eval_batch_size", training_args.per_device_eval_batch_size, lambda v: v >= 1, "1 or more"),
            ("gradient_accumulation_steps", training_args.gradient_accumulation_steps, lambda v: v >= 1, "1 or more"),
            ("learning_rate", training_args.learning_rate, lambda v: v >= 0, "0 or more, e.g. 2e-4"),
            ("lora_dropout", lora_args.lora_dropout, lambda v: 0 <= v < 1, "a probability in [0, 1)")):
        if not fits(value):
            raise ConfigError(f"--{option} {value}: give {wanted}.")
    if training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise ConfigError(f"--num_train_epochs {training_args.num_train_epochs:g} without a positive --max_steps "
                          f"trains nothing: give --num_train_epochs (e.g. 3) or --max_steps (e.g. 1000).")
    attention = model_args.attn_implementation
    if attention not in ATTENTIONS and "/" not in attention and not attention.startswith("paged|"):  # hub kernels pass
        import difflib

        close = difflib.get_close_matches(attention, ATTENTIONS, n=1)
        raise ConfigError(f"--attn_implementation {attention!r}" + (f": did you mean {close[0]}?" if close else ":")
                          + f" use one of {', '.join(ATTENTIONS)} (or a hub kernel, e.g. kernels-community/flash-attn).")
    if data_args.packing and model_args.attn_implementation not in ("sdpa", "eager", "flex_attention",
                                                                   "flash_attention_2", "flash_attention_3"):
        raise ConfigError(f"--packing needs an attention that separates packed documents by position_ids "
                          f"(sdpa, eager, flex_attention, flash_attention_2/3), not "
                          f"{model_args.attn_implementation!r}.")
    if data_args.pad_to_multiple_of is not None and data_args.pad_to_multiple_of < 1:
        raise ConfigError(f"--pad_to_multiple_of {data_args.pad_to_multiple_of}: give a positive number of tokens.")
    flex = model_args.attn_implementation == "flex_attention"
    if data_args.pad_to_multiple_of is None and data_args.packing and flex:
        data_args.pad_to_multiple_of = data_args.max_length  # every new shape would compile flex's kernels again
    if check_machine:
        validate_setup(model_args, data_args, lora_args, training_args, machine)


# ---- combinations that need the hardware, the launcher or the DeepSpeed config (sft/options/arguments.py's last checks) --

def training_arguments_message(message: str) -> str:
    if "at most one of fp16 and bf16" in message.lower():
        return "--bf16 and --fp16 together: give one of them (--bf16 on GPUs that have it, else --fp16)."
    if "support bf16" in message:
        return ("--bf16: this machine has no bf16 support (it needs an Ampere or newer GPU). Drop --bf16 to train "
                "in fp32, or use --fp16 on an older GPU.")
    return f"invalid training options: {message}"


def validate_setup(model_args: ModelArguments, data_args: DataArguments, lora_args: LoraArguments,
                   training_args: SFTTrainingArguments, machine=None) -> None:
    """Checks against the machine, the launcher's settings and the DeepSpeed JSON (sft/options/checks.py, one named check
    per rule); `machine`: this one unless given (tests describe one as data)."""
    from sft.options.checks import Options, apply_setup_defaults, run_checks
    from sft.machine import machine as this_machine

    options, m = Options.of(model_args, data_args, lora_args, training_args), machine or this_machine()
    run_checks(options, m)
    apply_setup_defaults(options, m)
