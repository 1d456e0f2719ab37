"""Options: one dataclass per group (model, LoRA, data, training), `--config recipe.yaml`, and the embedded demo.

Every option is a dataclass field with help text, so `python sft/train.py --help` documents them all. A recipe
YAML holds the same names; options given on the command line win over the recipe. With no `--model` and no
`--dataset`, the embedded demo's recipe (a tiny DeepSeek-architecture model on `data/`) fills what is not given.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser, TrainingArguments

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = "tiny-deepseek"  # the embedded default, built from its config by sft/tiny.py
DEMO = {  # what `accelerate launch sft/train.py` with no arguments runs: about a minute on 2 CPU cores
    "model": TINY_MODEL,
    "dataset": [str(REPO / "data" / "alpaca_demo.json"), str(REPO / "data" / "oasst_demo.jsonl")],
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


class ConfigError(ValueError):
    """A bad option or combination; the message says which and what to do. Shown without a traceback."""


@dataclass
class ModelArguments:
    model: str = field(default=TINY_MODEL, metadata={
        "help": f"Hub id or local directory of the model to fine-tune; `{TINY_MODEL}` builds the embedded tiny "
                "DeepSeek-architecture model (no download)."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer to use, if not the model's own."})
    dtype: str = field(default="auto", metadata={
        "help": "Weights dtype: auto (fp32 master weights for full fine-tuning, bf16 base weights under LoRA "
                "where the hardware has bf16), bfloat16, float16 or float32."})
    attn_implementation: str = field(default="sdpa", metadata={
        "help": "Attention kernel: sdpa, eager, flex_attention, flash_attention_2 (needs flash-attn)."})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Run Python code shipped with a hub model. Off by default: DeepSeek models are native in "
                "transformers."})


@dataclass
class LoraArguments:
    lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter (peft) instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scaling = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "Module names to adapt; default: every attention and MLP projection of the model's family."})


@dataclass
class DataArguments:
    dataset: list[str] | None = field(default=None, metadata={
        "help": "Training data: one or more .json/.jsonl/.parquet/.csv files or hub names (`name` or "
                "`name:split`), mixed in one run."})
    dataset_format: str | None = field(default=None, metadata={
        "help": "alpaca, oasst or messages; detected from each file's first record when omitted."})
    template: str = field(default="auto", metadata={
        "help": "Chat template: auto (the model's own if it has one, else deepseek), model, deepseek, "
                "deepseek_coder, deepseek_v3, r1_distill, alpaca."})
    eval_dataset: list[str] | None = field(default=None, metadata={"help": "Evaluation data (files or hub names)."})
    eval_split: float = field(default=0.0, metadata={
        "help": "Fraction of the training conversations held out for evaluation when --eval_dataset is not given."})
    max_samples: int | None = field(default=None, metadata={"help": "Use at most this many conversations per dataset."})
    max_length: int = field(default=2048, metadata={"help": "Longest sequence (and packed row), in tokens."})
    overlong: str = field(default="truncate", metadata={
        "help": "Conversations over --max_length: truncate (after the last assistant turn that fits) or drop."})
    packing: bool = field(default=False, metadata={
        "help": "Pack conversations into rows of --max_length (best-fit decreasing; no attention across them)."})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also train on prompt tokens, not only replies."})
    skip_bad_records: bool = field(default=False, metadata={
        "help": "Skip and count malformed records instead of stopping at the first one."})
    oasst_threads: str = field(default="best", metadata={
        "help": "OASST trees: best (follow the best-ranked reply) or all (every root-to-leaf thread)."})
    oasst_lang: list[str] | None = field(default=None, metadata={"help": "Keep only OASST messages in these languages."})
    num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenization (default: all cores)."})
    dataset_cache_dir: str | None = field(default=None, metadata={
        "help": "Where prepared datasets are cached (default: ~/.cache/deepseek-sft/datasets)."})
    show_masks: int = field(default=0, metadata={
        "help": "Print this many rendered examples with the trained tokens marked, then continue."})


@dataclass
class SFTTrainingArguments(TrainingArguments):
    """transformers' TrainingArguments with defaults for SFT (every one of its flags works as usual)."""

    output_dir: str | None = field(default="output/run", metadata={"help": "Where checkpoints, logs and the model go."})
    report_to: None | str | list[str] = field(default="tensorboard", metadata={"help": "Loggers: tensorboard, none, ..."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N steps."})
    # Our collator needs `seq_lengths`, which the model's forward does not take.
    remove_unused_columns: bool = field(default=False, metadata={"help": "Leave at False for sft."})
    include_num_input_tokens_seen: str = field(default="non_padding", metadata={
        "help": "Count real (non-padding) tokens, for the tokens/s and MFU logs."})


PARSER_TYPES = (ModelArguments, DataArguments, LoraArguments, SFTTrainingArguments)


def recipe_to_argv(recipe: dict, path: str) -> list[str]:
    """A YAML recipe's keys become command-line options, so both are parsed (and validated) the same way."""
    argv = []
    for key, value in recipe.items():
        if not isinstance(key, str):
            raise ConfigError(f"{path}: option names must be strings, got {key!r}.")
        if key == "config":
            raise ConfigError(f"{path}: a recipe cannot name another --config.")
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        argv.append(f"--{key}")
        for v in values:
            argv.append(str(v).lower() if isinstance(v, bool) else _json_if_dict(v))
    return argv


def _json_if_dict(value) -> str:
    import json

    return json.dumps(value) if isinstance(value, dict) else str(value)


def load_recipe(path: str) -> list[str]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read the file ({e.strerror}).") from None
    try:
        recipe = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', e)}).") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of option: value, got {type(recipe).__name__}.")
    return recipe_to_argv(recipe, path)


def expand_argv(argv: list[str]) -> list[str]:
    """Recipe first, then the command line (the last value of an option wins); the demo fills what is missing."""
    recipe: list[str] = []
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else next(it, None)
            if not path:
                raise ConfigError("--config needs the path of a recipe YAML file.")
            recipe += load_recipe(path)
        else:
            rest.append(arg)
    argv = recipe + rest
    given = {a.split("=", 1)[0][2:] for a in argv if a.startswith("--")}
    if "model" not in given and "dataset" not in given:
        argv = recipe_to_argv({k: v for k, v in DEMO.items() if k not in given}, "demo") + argv
    return argv


def parse_args(argv: list[str] | None = None):
    """-> (ModelArguments, DataArguments, LoraArguments, SFTTrainingArguments), validated."""
    argv = expand_argv(sys.argv[1:] if argv is None else list(argv))
    parser = HfArgumentParser(PARSER_TYPES, allow_abbrev=False)  # a typo must not pass as an abbreviation
    *parsed, unknown = parser.parse_args_into_dataclasses(
        args=argv, look_for_args_file=False, return_remaining_strings=True)
    if unknown:
        raise ConfigError(unknown_options_message(unknown, parser))
    model_args, data_args, lora_args, training_args = parsed
    validate(model_args, data_args, lora_args, training_args)
    return model_args, data_args, lora_args, training_args


def unknown_options_message(unknown: list[str], parser: HfArgumentParser) -> str:
    import difflib

    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    parts = []
    for option in (u for u in unknown if u.startswith("--")):
        close = difflib.get_close_matches(option.split("=")[0], known, n=1)
        parts.append(f"{option}" + (f" (did you mean {close[0]}?)" if close else ""))
    return (f"unknown option(s): {', '.join(parts) or ' '.join(unknown)}. "
            f"`python sft/train.py --help` lists every option.")


def validate(model_args: ModelArguments, data_args: DataArguments, lora_args: LoraArguments,
             training_args: SFTTrainingArguments) -> None:
    """Combinations that cannot work, caught before anything is loaded."""
    from sft.formats import FORMATS
    from sft.templates import TEMPLATE_NAMES

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
    if data_args.max_length < 8:
        raise ConfigError(f"--max_length {data_args.max_length} is too short; give at least 8 tokens.")
    if model_args.dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise ConfigError(f"--dtype {model_args.dtype!r}: use auto, bfloat16, float16 or float32.")
    if lora_args.lora and lora_args.lora_r <= 0:
        raise ConfigError(f"--lora_r {lora_args.lora_r}: the rank must be positive.")
    if data_args.packing and model_args.attn_implementation not in ("sdpa", "eager", "flex_attention",
                                                                   "flash_attention_2", "flash_attention_3"):
        raise ConfigError(f"--packing needs an attention that separates packed documents by position_ids "
                          f"(sdpa, eager, flex_attention, flash_attention_2/3), not "
                          f"{model_args.attn_implementation!r}.")
