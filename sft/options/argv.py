"""The command line as users type it: option names from other trainers, one-line errors, a one-screen `--help`.

Users arrive with LLaMA-Factory, Axolotl and TRL recipes in their heads (and in their YAML files). Their names map
to ours through one table, with a one-line note; an unknown name gets a "did you mean" among the options people
use; a bad value is one `error:` line, never argparse's usage block.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields

from transformers import HfArgumentParser

from sft.errors import ConfigError
from sft.machine import note
from sft.names import hub_id


@dataclass(frozen=True)
class Alias:
    ours: str             # our option, without the dashes
    where: str            # whose name it is
    value: Callable[[str], list[str]] | None = None  # their value -> our option's values ([] drops the option)
    note: str = ""        # what differs, or (no values) what this toolkit does instead, for the one-line note
    also: Callable[[str], list[str]] | None = None  # their value -> one more option of ours and its values, added
    #                                                 unless the user gave that option


def split_list(value: str) -> list[str]:
    """`embed_tokens,lm_head` (one YAML string or command-line word, as LLaMA-Factory and Axolotl write lists) -> the
    names."""
    return [v.strip() for v in value.replace(",", " ").split() if v.strip()]


def split_names(value: str) -> list[str]:
    """LLaMA-Factory's `lora_target: q_proj,v_proj` (and `all`) -> our list of module names."""
    names = split_list(value)
    return ["all-linear"] if names == ["all"] else names


def _method(value: str) -> list[str]:
    """`finetuning_type: lora` / `adapter: lora` -> --lora true (`adapter: qlora`: apply_aliases adds --qlora);
    full -> no option."""
    if value.lower() in ("lora", "qlora"):
        return ["true"]
    if value.lower() in ("full", "none", ""):
        return []
    raise ConfigError(f"fine-tuning method {value!r}: this toolkit trains `full` weights, a `lora` adapter "
                      f"(--lora) or one on a 4-bit base (--qlora).")


def _switch(name: str, value: str) -> bool:
    """A yes/no value as YAML files and command lines write it (bare: yes); anything else is one error line, not a
    silent no."""
    if value.lower() in ("", "true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ConfigError(f"{name} {value!r}: give true or false.")


def _flag_to(name: str, ours: str) -> Callable[[str], list[str]]:
    """Axolotl's `X: true` switches -> our option's value `ours`; false -> nothing."""
    def value_of(value: str) -> list[str]:
        return [ours] if _switch(name, value) else []
    return value_of


def _eight_bit(value: str) -> list[str]:
    if not _switch("load_in_8bit", value):
        return []
    raise ConfigError("load_in_8bit: this toolkit quantizes the base to 4 bits only (--qlora), or trains LoRA on the "
                      "bf16 base (--lora).")


def _stage(value: str) -> list[str]:
    """LLaMA-Factory's `stage: sft` is what this toolkit does; another stage is another trainer."""
    if value.lower() == "sft":
        return []
    raise ConfigError(f"stage {value!r}: this toolkit does supervised fine-tuning only (stage: sft); train "
                      f"{value} with LLaMA-Factory or TRL.")


def _nothing(value: str) -> list[str]:
    return []


def _quantization_bit(value: str) -> list[str]:
    """`quantization_bit: 4` (bitsandbytes) -> --qlora true; no other width is offered."""
    if value.strip() in ("4", ""):
        return ["true"] if value.strip() else []
    raise ConfigError(f"quantization_bit {value}: this toolkit quantizes the base to 4 bits only (--qlora).")


def _attention(value: str) -> list[str]:
    """LLaMA-Factory's `flash_attn: auto|disabled|sdpa|fa2|fa3` -> --attn_implementation (auto: ours, sdpa)."""
    names = {"auto": [], "disabled": ["eager"], "sdpa": ["sdpa"], "fa2": ["flash_attention_2"],
             "fa3": ["flash_attention_3"]}
    if value.lower() not in names:
        raise ConfigError(f"flash_attn {value!r}: use auto, disabled, sdpa, fa2 or fa3 (or --attn_implementation).")
    return names[value.lower()]


def _replies_only(name: str) -> Callable[[str], list[str]]:
    """TRL's `completion_only_loss` / `assistant_only_loss`: true (or bare) is our default, the loss on the replies
    alone; false trains every token -> --train_on_prompt true."""
    def value_of(value: str) -> list[str]:
        return [] if _switch(name, value) else ["true"]
    return value_of


def _packing_strategy(value: str) -> list[str]:
    """TRL's `packing_strategy`: bfd is how --packing packs; wrapped cuts conversations across rows, which ours never
    does."""
    if value.lower() == "bfd":
        return ["true"]
    raise ConfigError(f"packing_strategy {value!r}: --packing packs whole conversations best-fit decreasing (TRL's "
                      f"bfd) and never cuts one across rows; use bfd or --packing.")


def _text_field(value: str) -> list[str]:
    raise ConfigError(f"dataset_text_field {value!r} (TRL) trains raw text as a language model; this toolkit trains "
                      f"conversations: alpaca, messages (ShareGPT/OpenAI) or oasst records (docs/data.md).")


def _eos_token(value: str) -> list[str]:
    raise ConfigError(f"eos_token {value!r} (TRL): each --template ends a reply with its model's own end token, the "
                      f"one its tokenizer and saved chat template use; drop eos_token (or choose the --template).")


def _environment_only(key: str) -> Callable[[str], list[str]]:
    """Axolotl's wandb settings that the Trainer's wandb logger reads from the environment only."""
    variable = key.upper()

    def value_of(value: str) -> list[str]:
        if value.lower() in ("false", "0", "no", "none"):  # off: what the logger does unless told
            return []
        raise ConfigError(f"{key} {value!r} (Axolotl): the Trainer's wandb logger reads it from the environment; "
                          f"run `export {variable}={value}` before the command, and leave it out of the options.")
    return value_of


# Axolotl's `datasets:` entry keys that read as ours do when they hold these values (None: any value)
AXOLOTL_DATASET_KEYS = {"path": None, "type": None, "ds_type": None, "split": ("train",),
                        "field_messages": ("messages", "conversations"), "roles_to_train": (["assistant"],),
                        "message_property_mappings": ({"role": "role", "content": "content"},
                                                      {"role": "from", "content": "value"})}


def _axolotl_dataset(value: str) -> list[str]:
    """An Axolotl `datasets:` entry ({path, type, ...}: a recipe's mapping arrives as JSON) -> --dataset PATH, its
    format detected from its records as ours always is (a hub dataset's `split`: --dataset NAME:SPLIT). A type this
    toolkit does not read, or a key that would read the records otherwise, is one error line."""
    import json

    from sft.data.formats import FORMAT_NAMES, FORMATS, is_local

    try:
        entry = json.loads(value)
    except ValueError:
        return [value]  # a path, as --dataset takes it
    if not isinstance(entry, dict) or "path" not in entry:
        raise ConfigError(f"datasets entry {value}: give its path (and type), as Axolotl's `- path: data.jsonl`.")
    kind = str(entry.get("type", "alpaca")).split(":")[0]
    if kind not in FORMATS and kind not in FORMAT_NAMES:
        raise ConfigError(f"datasets type {kind!r} ({entry['path']}): this toolkit reads alpaca, messages (Axolotl's "
                          f"chat_template and sharegpt) and oasst records.")
    path, split = str(entry["path"]), str(entry.get("split", "train"))
    hub_split = split != "train" and not is_local(path)  # a hub dataset's other split or slice: --dataset NAME:SPLIT
    for key, held in entry.items():
        allowed = AXOLOTL_DATASET_KEYS.get(key, ())
        if key == "split" and not hub_split and held != "train":
            raise ConfigError(f"datasets split: {held!r} ({path}): a local file is read whole; give held-out "
                              f"records as --eval_dataset FILE (a hub dataset's split or slice, `train[:20%]`, is "
                              f"taken as named).")
        if allowed is not None and held not in allowed and key != "split":
            raise ConfigError(f"datasets {key}: {held!r} ({path}) is not read here: give the file in one of "
                              f"the formats docs/data.md names, or --dataset_columns for other column names.")
    return [f"{path}:{split}" if hub_split else path]


OFF = ("false", "0", "no", "none")
ANY = None  # every value needs nothing here

# Other trainers' keys that no option of ours takes: key -> (whose, the values that need nothing here (ANY: all),
# what this toolkit does instead). A value that needs nothing is a note; another is one error line that says what to do.
NO_EQUIVALENT: dict[str, tuple[str, tuple[str, ...] | None, str]] = {
    "low_cpu_mem_usage": ("LLaMA-Factory", ANY, "transformers 5 loads the weights as it reads them"),
    "print_param_status": ("LLaMA-Factory", ANY, "the first screen says what trains"),
    "quantization_method": ("LLaMA-Factory", ("bitsandbytes",), "--qlora quantizes the base with bitsandbytes; "
                            "other methods are not offered"),
    "quantization_type": ("LLaMA-Factory", ("nf4",), "--qlora's 4-bit type is NF4; fp4 is not offered"),
    "bnb_4bit_quant_type": ("TRL", ("nf4",), "--qlora's 4-bit type is NF4; fp4 is not offered"),
    "double_quantization": ("LLaMA-Factory", ANY, "--qlora always quantizes the quantization constants too"),
    "use_bnb_nested_quant": ("TRL", ANY, "--qlora always quantizes the quantization constants too (nested)"),
    "lora_task_type": ("TRL", ("CAUSAL_LM",), "the adapter is a causal LM's"),
    "hf_hub_token": ("LLaMA-Factory", (), "give the token to `hf auth login` or the HF_TOKEN variable, never a "
                     "recipe file"),
    "cache_dir": ("LLaMA-Factory", (), "HF_HOME (or HF_HUB_CACHE) moves the Hugging Face cache; "
                  "--dataset_cache_dir holds the prepared data"),
    "use_unsloth": ("LLaMA-Factory", OFF, "this toolkit's own fast paths take its place (Liger, FP8, compiled "
                    "layers: docs/speed.md); leave it out"),
    **{key: ("LLaMA-Factory", OFF, "full fine-tuning, LoRA and QLoRA are the methods offered here; leave it out")
       for key in ("use_galore", "use_badam", "use_apollo", "pissa_init")},
    "freeze_trainable_layers": ("LLaMA-Factory", (), "a fine-tune of chosen layers is not offered: use --lora"),
    "unfrozen_parameters": ("Axolotl", (), "training chosen parameters only is not offered: use --lora (with "
                            "--lora_modules_to_save) or a full fine-tune"),
    **{key: (where, (), "new or replaced special tokens are not offered: each --template uses its tokenizer's own")
       for key, where in (("resize_vocab", "LLaMA-Factory"), ("new_special_tokens", "LLaMA-Factory"),
                          ("special_tokens", "Axolotl"), ("tokens", "Axolotl"), ("eot_tokens", "Axolotl"))},
    "pad_token": ("TRL", ANY, "padding is masked out of the loss; the tokenizer's own pad (or end) token pads"),
    **{key: (where, (), "each --template writes what its model's official chat template writes (docs/families.md); "
                        "a template of your own is not read")
       for key, where in (("tool_format", "LLaMA-Factory"), ("chat_template_jinja", "Axolotl"),
                          ("chat_template_path", "TRL"))},
    **{key: (where, (), "a system prompt comes from each record's own system text (docs/data.md)")
       for key, where in (("default_system", "LLaMA-Factory"), ("default_system_message", "Axolotl"))},
    "enable_thinking": ("LLaMA-Factory", (), "the --template decides: r1 trains the <think> text, "
                        "r1_distill_no_reasoning leaves it out, deepseek_v31 reads each record's `thinking`"),
    "lora_fan_in_fan_out": ("Axolotl", OFF, "peft sets it for the layers that need it; DeepSeek models have none"),
    "auto_resume_from_checkpoints": ("Axolotl", OFF, "give --resume_from_checkpoint true to go on from the newest "
                                     "complete checkpoint of --output_dir"),
    "xformers_attention": ("Axolotl", OFF, "use --attn_implementation sdpa, or varlen on a GPU (torch's own "
                           "kernels)"),
    "s2_attention": ("Axolotl", OFF, "shifted-sparse attention is not offered; long rows: docs/speed.md"),
    "resize_token_embeddings_to_32x": ("Axolotl", OFF, "the embeddings keep the model's vocabulary size"),
    "group_by_length": ("Axolotl", OFF, "transformers 5 dropped it; --packing fills the rows instead"),
    "shuffle_merged_datasets": ("Axolotl", ANY, "the rows of all --dataset files are shuffled together each epoch"),
    **{key: (where, ANY, "under --packing the evaluation rows are packed too, each conversation attending to itself "
                         "alone, so the eval loss is the unpacked one")
       for key, where in (("eval_sample_packing", "Axolotl"), ("eval_packing", "TRL"))},
    **{key: ("Axolotl", ANY, "read from the model's config")
       for key in ("model_type", "tokenizer_type", "is_llama_derived_model")},
    **{key: ("Axolotl", ANY, "computed from the data") for key in ("sample_packing_eff_est", "total_num_tokens")},
    "include_tokens_per_second": ("Axolotl", ANY, "real tokens/s is always logged (train/real_tokens_per_second)"),
    "do_causal_lm_eval": ("Axolotl", ANY, "the eval loss and perplexity are logged (eval/perplexity)"),
    "eval_table_size": ("Axolotl", ("0",), "no table of generated predictions is logged"),
    "is_preprocess": ("Axolotl", (), "the data is prepared at the start of each run and cached "
                      "(--dataset_cache_dir); `deepseek-sft data` prepares it alone"),
    "plugins": ("Axolotl", (), "its plugins do not load here: --use_liger_kernel is Liger's, --chunked_loss "
                "stands for cut_cross_entropy"),
    **{key: ("Axolotl", OFF, f"use --{ours} true ({ours} compute; the weights are kept as --dtype auto says)")
       for key, ours in (("bfloat16", "bf16"), ("float16", "fp16"))},
    "dataset_config": ("TRL", (), "a hub dataset's configuration is not chosen here: give its files, or "
                       "`name:split` of its default one"),
    **{key: ("TRL", (), "give their settings as this toolkit's options (`python sft/train.py --help all`)")
       for key in ("model_init_kwargs", "dataset_kwargs")},
}


def _without_equivalent(key: str) -> Callable[[str], list[str]]:
    """NO_EQUIVALENT[key]: a value that needs nothing -> [] (apply_aliases notes it), another -> one error line."""
    where, fine, says = NO_EQUIVALENT[key]

    def value_of(value: str) -> list[str]:
        if fine is ANY or value.lower() in fine or value in fine:
            return []
        raise ConfigError(f"{key} {value!r} ({where}): {says}.")
    return value_of


# LLaMA-Factory's template names for the DeepSeek families -> ours.
TEMPLATE_NAMES = {"deepseekcoder": "deepseek_coder", "deepseek3": "deepseek_v3", "deepseekr1": "r1_distill",
                  "deepseek_r1": "r1", "deepseek_v2": "deepseek", "llama3": "model", "qwen": "model"}

ALIASES: dict[str, Alias] = {
    "model_name_or_path": Alias("model", "LLaMA-Factory/TRL"),
    "base_model": Alias("model", "Axolotl"),
    "dataset_name": Alias("dataset", "TRL"),
    "cutoff_len": Alias("max_length", "LLaMA-Factory", also=lambda v: ["--overlong", "cut"], note=(
        "--overlong cut keeps LLaMA-Factory's meaning: a conversation over it ends after its last reply that fits, "
        "or, when none does, is cut at it mid-reply; --max_length alone drops those")),
    "preprocessing_num_workers": Alias("num_proc", "LLaMA-Factory"),
    "stage": Alias("stage", "LLaMA-Factory", _stage, note="supervised fine-tuning is what this toolkit does"),
    "plot_loss": Alias("plot_loss", "LLaMA-Factory", _nothing,
                       note="loss.png is always written to the output directory"),
    "overwrite_cache": Alias("overwrite_cache", "LLaMA-Factory", _nothing, note=(
        "the prepared-data cache is keyed on the data, the options and the tokenizer, so a change already "
        "prepares anew; to rebuild an entry, delete it under --dataset_cache_dir")),
    "enable_liger_kernel": Alias("use_liger_kernel", "LLaMA-Factory"),
    "quantization_bit": Alias("qlora", "LLaMA-Factory", _quantization_bit),
    "neat_packing": Alias("packing", "LLaMA-Factory", note="our packing never attends across conversations"),
    "flash_attn": Alias("attn_implementation", "LLaMA-Factory", _attention),
    "sequence_len": Alias("max_length", "Axolotl"),
    "sequence_parallel_degree": Alias("sequence_parallel", "Axolotl",
                                      note="ours splits rows through DeepSpeed's Ulysses, not ring attention"),
    "sequence_parallel_size": Alias("sequence_parallel", "ms-swift", note="ours runs DeepSpeed's Ulysses"),
    "max_seq_length": Alias("max_length", "TRL < 0.20"),
    "use_peft": Alias("lora", "TRL"),
    "torch_dtype": Alias("dtype", "transformers 4/TRL"),
    "eos_token": Alias("eos_token", "TRL", _eos_token),
    "load_in_4bit": Alias("qlora", "TRL/Axolotl", note="the base in 4-bit NF4 under a LoRA adapter"),
    "load_in_8bit": Alias("qlora", "Axolotl", _eight_bit),
    "lora_target_linear": Alias("lora_target_modules", "Axolotl", _flag_to("lora_target_linear", "all-linear")),
    "flash_attention": Alias("attn_implementation", "Axolotl", _flag_to("flash_attention", "varlen"), note=(
        "torch's own FlashAttention-2, each packed conversation alone: no flash-attn package")),
    "sdp_attention": Alias("attn_implementation", "Axolotl", _flag_to("sdp_attention", "sdpa")),
    "save_safetensors": Alias("save_safetensors", "transformers 4", lambda v: [],
                              note="saves are always safetensors"),
    "completion_only_loss": Alias("train_on_prompt", "TRL", _replies_only("completion_only_loss"), note=(
        "the loss is on the replies alone by default; false trains every token")),
    "assistant_only_loss": Alias("train_on_prompt", "TRL", _replies_only("assistant_only_loss"), note=(
        "the loss is on the assistant's replies alone by default; false trains every token")),
    "packing_strategy": Alias("packing", "TRL", _packing_strategy, note="best-fit decreasing, as bfd"),
    "padding_free": Alias("packing", "TRL", note="packed rows without padding, each conversation attending to itself"),
    "dataset_text_field": Alias("dataset", "TRL", _text_field),
    "lora_rank": Alias("lora_r", "LLaMA-Factory"),
    "lora_target": Alias("lora_target_modules", "LLaMA-Factory", split_names),
    "finetuning_type": Alias("lora", "LLaMA-Factory", _method),
    "adapter": Alias("lora", "Axolotl", _method,  # `adapter: qlora`: the adapter on a 4-bit base
                     also=lambda v: ["--qlora", "true"] if v.lower() == "qlora" else []),
    "peft_use_rslora": Alias("use_rslora", "Axolotl"),
    "peft_use_dora": Alias("use_dora", "Axolotl"),
    "additional_target": Alias("lora_modules_to_save", "LLaMA-Factory", split_list),
    "modules_to_save": Alias("lora_modules_to_save", "peft", split_list),
    "micro_batch_size": Alias("per_device_train_batch_size", "Axolotl"),
    "num_epochs": Alias("num_train_epochs", "Axolotl"),
    "sample_packing": Alias("packing", "Axolotl"),
    "pad_to_sequence_len": Alias("pad_to_max_length", "Axolotl"),
    "train_on_inputs": Alias("train_on_prompt", "Axolotl"),
    "val_set_size": Alias("eval_split", "Axolotl"),
    "val_size": Alias("eval_split", "LLaMA-Factory"),
    "early_stopping_steps": Alias("early_stopping_patience", "LLaMA-Factory"),
    "lr_scheduler": Alias("lr_scheduler_type", "Axolotl"),
    "optimizer": Alias("optim", "Axolotl"),
    "dataset_prepared_path": Alias("dataset_cache_dir", "Axolotl"),
    "strict": Alias("strict", "Axolotl", _nothing, note="every option is checked against the model and data"),
    "warmup_ratio": Alias("warmup_steps", "transformers 4"),  # transformers 5: a warmup_steps < 1 is a ratio
    # transformers 5 takes the old names with a FutureWarning each; Axolotl's and TRL's recipes still write them
    "gradient_checkpointing": Alias("activation_checkpointing", "transformers 4"),
    "gradient_checkpointing_kwargs": Alias("activation_checkpointing_kwargs", "transformers 4"),
    "chat_template": Alias("template", "Axolotl", lambda v: [TEMPLATE_NAMES.get(v, v)]),
    "datasets": Alias("dataset", "Axolotl", _axolotl_dataset, note="each file's format read from its records"),
    "wandb_project": Alias("project", "Axolotl", also=lambda v: ["--report_to", "tensorboard", "wandb"],
                           note="the Weights & Biases project the run reports to"),
    "wandb_name": Alias("run_name", "Axolotl"),
    **{key: Alias(key, "Axolotl", _environment_only(key))
       for key in ("wandb_entity", "wandb_watch", "wandb_log_model")},
    "adapter_name_or_path": Alias("lora_from", "LLaMA-Factory"),
    "lora_model_dir": Alias("lora_from", "Axolotl"),
    "eval_batch_size": Alias("per_device_eval_batch_size", "Axolotl"),
    "dataset_processes": Alias("num_proc", "Axolotl"),
    "dataset_num_proc": Alias("num_proc", "TRL"),
    "activation_offloading": Alias("offload_activations", "TRL", note="the activation checkpoints, with "
                                   "--activation_checkpointing"),
    "cut_cross_entropy": Alias("chunked_loss", "Axolotl", _flag_to("cut_cross_entropy", "true"),
                               note="the loss from the hidden states in chunks, no [tokens x vocabulary] logits"),
    **{key: Alias("use_liger_kernel", "Axolotl", _flag_to(key, "true"), note="all of Liger's kernels for the model")
       for key in ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm",
                   "liger_fused_linear_cross_entropy")},
    **{key: Alias(key, where, _without_equivalent(key), note=says) for key, (where, _, says) in NO_EQUIVALENT.items()},
}

# The TrainingArguments shown by the one-screen help (`--help all` lists every one).
COMMON_TRAINING = ("output_dir", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                   "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "optim",
                   "bf16", "fp16", "activation_checkpointing", "logging_steps", "eval_strategy", "save_steps",
                   "save_total_limit", "resume_from_checkpoint", "seed", "report_to")


def apply_aliases(argv: list[str]) -> list[str]:
    """Rewrite other trainers' option names (and values) to ours; one note per rewrite, from rank 0 only."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        name, eq, inline = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        given = [inline] if eq else []
        end = i + 1
        while not eq and end < len(argv) and not argv[end].startswith("--"):
            given.append(argv[end])
            end += 1
        alias = ALIASES.get(name.replace("-", "_"))
        if name in ("bf16", "fp16") and [g.lower() for g in given] == ["auto"]:  # Axolotl's: ours is true/false
            raise ConfigError(f"--{name} auto (Axolotl's): give --{name} true where every GPU computes in it "
                              f"(bf16: RTX 30xx/40xx, A100, H100 and newer), or false.")
        if alias is None:
            if name == "template" and len(given) == 1 and given[0] in TEMPLATE_NAMES:
                word, ours = "--template", TEMPLATE_NAMES[given[0]]
                note(f"--template {given[0]} is LLaMA-Factory's name: using --template {ours}")
                out += [word, ours]
            else:
                out += argv[i:end]
            i = end
            continue
        values = [v for value in given for v in alias.value(value)] if alias.value else given
        i = end
        if alias.value and not values:  # e.g. finetuning_type: full, our default
            note(f"--{name} {' '.join(given)} ({alias.where}): " + (f"{alias.note}; nothing to set." if alias.note
                                                                     else "this toolkit's default: nothing to set."))
            continue
        also = alias.also(given[0] if given else "") if alias.also else []
        if also and any(word.split("=")[0] == also[0] for word in argv):  # the user's own value wins
            also = []
        out += [f"--{alias.ours}", *values, *also]
        note(f"--{name} is {alias.where}'s name for --{alias.ours}: using "
             + " ".join([f"--{alias.ours}", *values, *also]) + (f" ({alias.note})" if alias.note else ""))
    return out


def _last_value(argv: list[str], name: str) -> str | None:
    """The value of `--name V` / `--name=V` in argv (the last one given), else None."""
    found = None
    for i, word in enumerate(argv):
        if word == f"--{name}" and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            found = argv[i + 1]
        elif word.startswith(f"--{name}="):
            found = word.split("=", 1)[1]
    return found


def _without(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv less the options `names` and their values."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        end = i + 1
        while "=" not in word and end < len(argv) and not argv[end].startswith("--"):
            end += 1
        if not (word.startswith("--") and word[2:].split("=")[0] in names):
            out += argv[i:end]
        i = end
    return out


def cosine_min_lr_ratio(argv: list[str]) -> list[str]:
    """Axolotl's `cosine_min_lr_ratio: R` (its cosine schedule ends at R x the learning rate) -> transformers' own
    schedule for it: --lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs {"min_lr_rate": R}. On the whole
    argv: it needs --lr_scheduler_type's value."""
    value = _last_value(argv, "cosine_min_lr_ratio")
    if value is None:
        return argv
    try:
        ratio = float(value)
    except ValueError:
        ratio = -1.0
    if not 0 <= ratio < 1:
        raise ConfigError(f"cosine_min_lr_ratio {value!r} (Axolotl): give the share of the learning rate the cosine "
                          f"schedule ends at, from 0 up to 1 (0.1: a tenth).")
    kind = _last_value(argv, "lr_scheduler_type") or "cosine"
    if kind not in ("cosine", "cosine_with_min_lr"):
        raise ConfigError(f"cosine_min_lr_ratio {value} (Axolotl) ends a cosine schedule, and --lr_scheduler_type is "
                          f"{kind}: give cosine, or leave cosine_min_lr_ratio out.")
    if _last_value(argv, "lr_scheduler_kwargs") is not None:
        raise ConfigError(f"cosine_min_lr_ratio {value} (Axolotl) with --lr_scheduler_kwargs: give one of them "
                          f"(cosine_min_lr_ratio R is --lr_scheduler_kwargs '{{\"min_lr_rate\": R}}').")
    ours = ["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", f'{{"min_lr_rate": {ratio}}}']
    note(f"--cosine_min_lr_ratio {value} (Axolotl): using {' '.join(ours[:3])} '{ours[3]}' (transformers' cosine "
         f"schedule down to {ratio:g} x the learning rate)")
    return _without(argv, ("cosine_min_lr_ratio", "lr_scheduler_type")) + ours


def dataset_splits(argv: list[str]) -> list[str]:
    """TRL's `dataset_train_split` and `dataset_test_split` (splits of its `dataset_name`, our --dataset) -> the hub
    datasets as `--dataset NAME:SPLIT`, and `--eval_dataset NAME:SPLIT` where the run evaluates (--eval_strategy
    other than no: TRL reads its test split then only). On the whole argv, recipe and command line together."""
    train, test = _last_value(argv, "dataset_train_split"), _last_value(argv, "dataset_test_split")
    if train is None and test is None:
        return argv
    from sft.data.formats import is_local

    out, i, names = [], 0, []
    while i < len(argv):
        word = argv[i]
        end = i + 1
        while "=" not in word and end < len(argv) and not argv[end].startswith("--"):
            end += 1
        name = word[2:].split("=")[0] if word.startswith("--") else ""
        if name in ("dataset_train_split", "dataset_test_split"):
            i = end
            continue
        if name == "dataset":
            values = [word.split("=", 1)[1]] if "=" in word else argv[i + 1:end]
            hub = [v for v in values if not is_local(v) and ":" not in v]
            names += hub
            out += ["--dataset", *(f"{v}:{train}" if v in hub and train else v for v in values)]
        else:
            out += argv[i:end]
        i = end
    if not names:  # files: read whole, as TRL reads a data file's one split, `train`
        if train not in (None, "train"):
            raise ConfigError(f"dataset_train_split {train!r} (TRL): --dataset names files, which are read whole; "
                              f"give a hub dataset's name to take its split, or the file of that split.")
        if test is not None:
            note(f"--dataset_test_split {test} (TRL): --dataset names files, read whole; give held-out records as "
                 f"--eval_dataset FILE")
        return out
    evaluates = (_last_value(argv, "eval_strategy") or "no") != "no"
    if test is not None and evaluates and _last_value(argv, "eval_dataset") is None:
        out += ["--eval_dataset", *(f"{v}:{test}" for v in names)]
    note("TRL's dataset splits: using " + " ".join(["--dataset", *(f"{v}:{train or 'train'}" for v in names)])
         + (" --eval_dataset " + " ".join(f"{v}:{test}" for v in names) if test and evaluates else
            f" (the test split {test}: read where --eval_strategy evaluates, as TRL does)" if test else ""))
    return out


WHOLE_ARGV_RULES: tuple[Callable[[list[str]], list[str]], ...] = (dataset_splits, cosine_min_lr_ratio)


def model_hub_id(model: str) -> str:
    """--model as the planner names it (`r1-distill-qwen-7b`, `deepseek-llm-7b-chat`: sft/names.py) -> the hub id
    it means, with a one-line note, as --template takes LLaMA-Factory's names; a local directory of that name, a
    hub id or any other name stays as given."""
    hub = hub_id(model)
    if hub != model:
        note(f"--model {model} is short for {hub} (the name `deepseek-sft plan` takes): using --model {hub}")
    return hub


TRAIN_HELP = "python sft/train.py --help"  # the help an option error points at: the tool's own (sft.data.dataset)


class Parser(HfArgumentParser):
    """HfArgumentParser whose errors are one ConfigError line instead of argparse's usage block and exit;
    `help_command`: the help that lists the options, as the user would type it."""

    def __init__(self, *args, help_command: str = TRAIN_HELP, **kwargs):
        super().__init__(*args, **kwargs)
        self.help_command = help_command

    def error(self, message: str):
        raise ConfigError(f"{message.rstrip('.')}. `{self.help_command}` lists the options.")


def known_options(parser: HfArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--")]


def unknown_options_message(unknown: list[str], parser: HfArgumentParser, ours: list[str]) -> str:
    """Each unknown option with the closest of OUR options and the common ones first (so that `--lora_rnk`
    suggests --lora_r, not TrainingArguments' --local_rank), then the longest of them that the name begins with
    (`--lora_rank_8` is --lora_r with more typed after it, not --local_rank), then the closest of every option."""
    everything = known_options(parser)
    preferred = [f"--{n}" for n in (*ours, *COMMON_TRAINING)]
    parts = []
    for option in (u for u in unknown if u.startswith("--")):
        name = option.split("=")[0]
        close = (difflib.get_close_matches(name, preferred, n=1, cutoff=0.75)
                 or sorted((o for o in preferred if name.startswith(o)), key=len)[-1:]
                 or difflib.get_close_matches(name, everything, n=1))
        parts.append(name + (f" (did you mean {close[0]}?)" if close else ""))
    if not parts:  # values without an option: a list given to an option that takes one value
        return (f"unexpected value(s) {' '.join(unknown)}: an option takes one value unless it takes a list "
                f"(--dataset a.json b.json; in a recipe, dataset: [a.json, b.json]).")
    return (f"unknown option(s): {', '.join(parts)}. "
            f"`{getattr(parser, 'help_command', TRAIN_HELP)}` lists the options (`--help all`: every one).")


def help_requested(argv: list[str]) -> str | None:
    """None, "short" or "all"."""
    for i, word in enumerate(argv):
        if word in ("-h", "--help"):
            return "all" if argv[i + 1:i + 2] == ["all"] else "short"
    return None


def short_help(groups: list[tuple[str, type, tuple[str, ...]]], usage: str = "",
               intro: list[str] | None = None) -> str:
    """One line per option: (title, dataclass, the fields to show, in order); `usage` and `intro`: another
    tool's first lines (sft.data.dataset), instead of training's."""
    lines = [usage or "usage: accelerate launch [--config_file accelerate_configs/<strategy>.yaml] sft/train.py "
                      "[options]",
             *(intro if intro is not None else [
                 "  no options: the embedded demo; --config recipe.yaml: the options in a YAML file (the command line "
                 "wins over it)"]),
             "  --help all: every option, and each description whole (here one cut short ends in ...)"]
    for title, cls, names in groups:
        by_name = {f.name: f for f in fields(cls)}
        lines.append(f"\n{title}:")
        for name in names:
            f = by_name[name]
            first = " ".join(str(f.metadata.get("help", "")).split()).split(". ")[0].rstrip(".")
            default = None if f.default is MISSING else f.default
            shown = "" if default in (None, False, "", "no") or "default" in first.lower() else f" [{default}]"
            line = f"  --{name:<28} {first}{shown}"
            lines.append(line if len(line) <= 118 else line[:line.rfind(" ", 0, 115)] + " ...")
    return "\n".join(lines)
