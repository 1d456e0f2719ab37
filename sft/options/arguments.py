"""Options: one dataclass per group (model, LoRA, data, training), `--config recipe.yaml`, and the embedded demo.

Every option is a dataclass field with help text, so `python sft/train.py --help` documents them all. A recipe
YAML holds the same names; options given on the command line win over the recipe. With no `--model` and no
`--dataset`, the embedded demo's recipe (a tiny DeepSeek-architecture model on `data/`) fills what is not given.

`read_options` only parses. A training run then plans (`--plan auto`, sft/train.py), resolves the derived values
(sft/options/resolve.py) and checks every rule (sft/options/checks.py); `parse_args` resolves and checks, for the
tools and tests. Nothing here imports the planner.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from typing import Literal

from transformers import TrainingArguments

from sft.configs import DEMO_DATA
from sft.errors import ConfigError, NeedsHardware
from sft.machine import Machine, launch
from sft.options.argv import (COMMON_TRAINING, WHOLE_ARGV_RULES, Parser, apply_aliases, help_requested, model_hub_id,
                              short_help, split_list, split_names, unknown_options_message)
from sft.options.command import help_command as training_help_command
from sft.options.checks import CHECKS, MACHINE_CHECKS, NEW_RUN_DIR, OPTION_CHECKS, Check, Options, check_options
from sft.options.recipe import load_recipe, recipe_to_argv
from sft.options.resolve import resolve_defaults
from sft.options.switches import FastPathSwitches
from sft.speed.lowbit import SR_ADAMW

OUR_OPTIMIZERS = (SR_ADAMW,)  # --optim values beyond transformers' own

TINY_MODEL = "tiny-deepseek"  # the embedded default, built from its config by sft/model/tiny.py
DEMO = {  # what `accelerate launch sft/train.py` with no arguments runs: about a minute on 2 CPU cores
    "model": TINY_MODEL,
    "dataset": [str(DEMO_DATA / "alpaca_demo.json"), str(DEMO_DATA / "oasst_demo.jsonl")],  # shipped in the wheel
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
DEMO_PROMPT = "What is the capital of France?"  # the chat question the demo's closing lines suggest: its data has it
# A demo value steps back when the user gave any of these (an option typed or in a recipe always wins: the demo's
# `save_strategy no` must not swallow a --save_steps 4).
DEMO_YIELDS_TO = {"save_strategy": ("save_steps", "saves_per_epoch"),
                  "eval_strategy": ("eval_steps", "evals_per_epoch"), "eval_split": ("eval_dataset",),
                  "num_train_epochs": ("max_steps",), "logging_steps": ("logging_strategy",)}


def auto_switch(help_text: str):
    """An auto/true/false option whose `auto` (the default) sft/options/resolve.py settles; the bare flag means
    true (`--fp8` as `--fp8 true`)."""
    return field(default="auto", metadata={"nargs": "?", "const": "true", "help": help_text})


@dataclass
class ModelArguments(FastPathSwitches):  # fp8_on, compile_layers_on, chunked_loss_on
    model: str = field(default=TINY_MODEL, metadata={
        "help": f"Hub id or local directory of the model to fine-tune; `{TINY_MODEL}` builds the embedded tiny "
                "DeepSeek-architecture model (no download)."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer to use, if not the model's own."})
    dtype: str = field(default="auto", metadata={
        "help": "Weights dtype: auto (fp32 master weights for full fine-tuning, bf16 base weights under LoRA "
                "where the hardware has bf16), bfloat16, float16 or float32."})
    fp8: Literal["auto", "true", "false"] = auto_switch(
        "Linear layers compute in FP8 (e4m3) on GPUs with FP8 matmuls (compute capability 8.9+: RTX 4090, L40, "
        "H100, H200). auto (the default): on wherever the GPU and the run allow it, and the first screen says "
        "so; false turns it off. With --lora the frozen base's matmuls (forward, input gradient; ours, "
        "sft/speed/fp8.py) under one GPU or DDP; without it every decoder linear layer's three matmuls through "
        "torchao's float8 training (--fp8_recipe), weights kept as they are, under one GPU, DDP or FSDP2. Not "
        "with --qlora, DeepSpeed or --tp_size. bench/RESULTS.md compares its loss and speed with bf16's.")
    fp8_recipe: Literal["tensorwise", "rowwise"] = field(default="tensorwise", metadata={
        "help": "A full fine-tune under --fp8: torchao's scales, one per tensor (tensorwise, the fastest) or one per "
                "row (rowwise: finer, slower)."})
    chunked_loss: Literal["auto", "true", "false"] = auto_switch(
        "The training loss from the last hidden states, 1024 labelled tokens at a time (a frozen lm_head's "
        "gradient computed in the forward, a trained one's chunks recomputed in the backward): no [tokens x "
        "vocabulary] logits tensor (sft/speed/chunked_loss.py). auto (the "
        "default): on wherever Liger's fused loss is not (--use_liger_kernel, or an MLA model, which Liger has "
        "no loss for) and the run allows it (deepseek-llm-7b LoRA: 9.6 GiB less at micro-batch 4; V2-Lite: 9.7), and "
        "the first screen says so; false turns it off. Not with --use_liger_kernel or --tp_size.")
    quantize_experts: Literal["none", "fp8"] = field(default="none", metadata={
        "help": "With --lora on DeepSeek-V2/V3 (MoE): hold the frozen routed experts in e4m3 (one scale per row) "
                "on the GPU, dequantized layer by layer: V2-Lite's base resident on one 24 GB card instead of "
                "offloaded. Needs --activation_checkpointing; one GPU or DDP (sft/model/quantized_experts.py)."})
    mlp_tile_tokens: int = field(default=0, metadata={
        "help": "Run each decoder layer's dense MLP this many tokens at a time, each tile checkpointed (ALST's "
                "tiled MLP; sft/speed/tiled_mlp.py): the MLP's [tokens x intermediate] tensors of a long row exist "
                "one tile at a time. 0: off. For rows of 16k+ tokens, e.g. 4096."})
    compile_layers: Literal["auto", "true", "false"] = auto_switch(
        "torch.compile each decoder layer in place (one compile shared by all layers; the first step "
        "compiles, later runs reuse inductor's cache): inductor fuses norms, RoPE, SwiGLU and LoRA's adds "
        "between the matmuls. auto (the default): on GPUs wherever the run allows it; false turns it off. With "
        "--use_liger_kernel only Liger's fused loss stays on. Single GPU, DDP or FSDP; with --fp8 too; not "
        "DeepSpeed, --tp_size or the Trainer's --torch_compile.")
    # Not options: what sft/options/resolve.py's fast_paths_where_supported chose for --fp8/--compile_layers auto
    # on a GPU, and loss_in_chunks_unless_liger for --chunked_loss auto, and why, for the first screen.
    speed_choices: tuple[str, ...] = field(default=(), init=False)
    rope_scaling: str | None = field(default=None, metadata={
        "help": "Train rows past the model's positions (--max_length over max_position_embeddings: deepseek-llm-7b "
                "has 4,096) with RoPE stretched by the smallest whole factor that covers them: linear, dynamic or "
                "yarn (LLaMA-Factory's option). A LoRA adapter's base then loads with the same RoPE "
                "(rope_scaling.json beside it; docs/speed.md, Long rows)."})
    attn_implementation: str = field(default="sdpa", metadata={
        "help": "Attention kernel: sdpa, eager, flex_attention, varlen (packed rows' documents each alone, torch's "
                "FlashAttention-2; GPUs 8.0+), flash_attention_2 (needs flash-attn). Not given: sdpa, except "
                "packed rows on a GPU, which take varlen where it runs (1.2x; rows of one document each still run "
                "sdpa's causal kernel)."})
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
    use_rslora: bool = field(default=False, metadata={
        "help": "Rank-stabilized LoRA: scale the adapter by alpha / sqrt(r) instead of alpha / r, so a higher rank "
                "keeps learning (peft's use_rslora; Axolotl's peft_use_rslora)."})
    use_dora: bool = field(default=False, metadata={
        "help": "DoRA: each adapted weight's direction from LoRA, its column norms learned apart (peft's use_dora; "
                "Axolotl's peft_use_dora). Slower than LoRA; not beside --fp8 (it reads the bf16 base weight) nor on "
                "DeepSeek MoE's MLP weights (peft has no DoRA for them)."})
    loraplus_lr_ratio: float = field(default=0.0, metadata={
        "help": "LoRA+: the B matrices learn at this many times --learning_rate (16 in the LoRA+ paper; "
                "LLaMA-Factory's and Axolotl's option); 0: off (sft/model/lora_plus.py)."})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "Module names to adapt; default: every attention and MLP projection of the model's family (on "
                "DeepSeek MoE models gate_proj/up_proj/down_proj mean the dense layers' MLP and shared experts)."})
    qlora: bool = field(default=False, metadata={
        "help": "QLoRA: train the LoRA adapter on the base quantized to 4 bits as it loads (bitsandbytes NF4, "
                "double quantization, bf16 compute; implies --lora). Needs a CUDA GPU and "
                "`pip install -e \".[qlora]\"`; runs under DDP or FSDP, not DeepSpeed. The adapter loads on the "
                "unquantized base too (sft.tools.merge merges it there)."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": "Modules trained whole beside the LoRA adapter and saved in it, comma-separated: embed_tokens,lm_head "
                "where the data has tokens the base never learned (added tokens, a chat template's untrained special "
                "tokens). peft's modules_to_save (Axolotl's and TRL's lora_modules_to_save; LLaMA-Factory's "
                "additional_target). peft trains every module whose dotted path ends with a name: lm_head, "
                "embed_tokens, or a path such as model.norm; a name that matches no module, or also ends another "
                "module's name (norm: input_layernorm), is refused. They train in fp32 like the adapter, each at its "
                "whole size in weights, gradients and AdamW states (embed_tokens,lm_head of a 7B: ~13 GB)."})
    lora_from: str | None = field(default=None, metadata={
        "help": "Start from this saved LoRA adapter (a finished --lora run's --output_dir, or a checkpoint) and "
                "train it on: a second round on new data (LLaMA-Factory's adapter_name_or_path, Axolotl's "
                "lora_model_dir). Its rank, alpha and targets are its own; implies --lora; --model defaults to the "
                "base it names."})
    lora_experts: bool = field(default=False, metadata={
        "help": "DeepSeek-V2/V3 (MoE): also adapt the routed experts (LoRA on the fused expert weights). Without "
                "it a MoE LoRA adapts the MLA projections, the dense layers' MLP and the shared experts; the "
                "router is never adapted."})

    def __post_init__(self):
        if self.lora_target_modules:  # `q_proj, v_proj` (one YAML string, as LLaMA-Factory writes it) or `all`
            self.lora_target_modules = [name for value in self.lora_target_modules for name in split_names(value)]
        if self.lora_modules_to_save is not None:  # `embed_tokens,lm_head` as one word, or a YAML list
            self.lora_modules_to_save = [name for value in self.lora_modules_to_save for name in split_list(value)]


@dataclass
class DataArguments:
    dataset: list[str] | None = field(default=None, metadata={
        "help": "Training data: one or more .json/.jsonl/.parquet/.csv files or hub names (`name` or "
                "`name:split`), mixed in one run."})
    dataset_format: str | None = field(default=None, metadata={
        "help": "alpaca, oasst or messages (OpenAI messages and ShareGPT conversations; also named sharegpt, openai); "
                "detected from each file's first record when omitted."})
    dataset_dir: str | None = field(default=None, metadata={
        "help": "LLaMA-Factory's data directory: --dataset then takes the names of its dataset_info.json "
                "(comma-separated too), each read with its own formatting, columns and tags."})
    dataset_columns: dict | str | None = field(default=None, metadata={
        "help": "Column names, as dataset_info.json's `columns` (JSON; a mapping in a recipe): prompt, query, "
                "response, system, history (alpaca) or messages, system, tools (messages); chosen, rejected."})
    dataset_tags: dict | str | None = field(default=None, metadata={
        "help": "Turn keys and role names, as dataset_info.json's `tags` (JSON; a mapping in a recipe): role_tag, "
                "content_tag, user_tag, assistant_tag, observation_tag, function_tag, system_tag."})
    template: str = field(default="auto", metadata={
        "help": "Chat template: auto (the model's own if it has one, else deepseek), model, deepseek, "
                "deepseek_coder, deepseek_v3, r1 (DeepSeek-R1: all system texts, <think> text trained), r1_distill "
                "(the distills: the last system text), r1_distill_no_reasoning (answers "
                "only: for data without reasoning), alpaca, r1_0528 (DeepSeek-R1-0528, R1-0528-Qwen3-8B: no forced "
                "<think>), deepseek_v31 (DeepSeek-V3.1: a record's \"thinking\" says whether its replies think)."})
    eval_dataset: list[str] | None = field(default=None, metadata={"help": "Evaluation data (files or hub names)."})
    eval_split: float = field(default=0.0, metadata={
        "help": "Fraction of the training conversations held out for evaluation when --eval_dataset is not given."})
    max_samples: int | None = field(default=None, metadata={"help": "Use at most this many conversations per dataset."})
    max_length: int = field(default=2048, metadata={"help": "Longest sequence (and packed row), in tokens."})
    overlong: str = field(default="truncate", metadata={
        "help": "Conversations over --max_length: truncate (after the last assistant turn that fits, else drop), "
                "cut (the same, else keep the first --max_length tokens, cutting the reply: LLaMA-Factory's "
                "cutoff_len) or drop."})
    packing: bool = field(default=False, metadata={
        "help": "Pack conversations into rows of --max_length (best-fit decreasing; no attention across them)."})
    pad_to_max_length: bool = field(default=False, metadata={
        "help": "Pad every row to --max_length: one shape at every step, so the first step already uses the memory "
                "of the longest (Axolotl's pad_to_sequence_len). Default: see --pad_to_multiple_of."})
    pad_to_multiple_of: int | None = field(default=None, metadata={
        "help": "Pad every batch to a multiple of this many tokens. Default: --max_length for packed rows under "
                "flex_attention or --compile_layers (one shape, so their kernels compile once), else the batch's "
                "longest row."})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also train on prompt tokens, not only replies."})
    mask_history: bool = field(default=False, metadata={
        "help": "Train only the last reply of each conversation; the earlier ones are context (LLaMA-Factory's "
                "option)."})
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

    def __post_init__(self):
        from sft.data.formats import ALPACA_COLUMNS, MESSAGES_COLUMNS, TAGS

        columns = (*ALPACA_COLUMNS, *MESSAGES_COLUMNS, "chosen", "rejected")
        self.dataset_columns = names_mapping(self.dataset_columns, "--dataset_columns", columns)
        self.dataset_tags = names_mapping(self.dataset_tags, "--dataset_tags", TAGS)


def names_mapping(value, option: str, keys: tuple[str, ...]) -> dict[str, str] | None:
    """--dataset_columns / --dataset_tags: JSON on the command line, a mapping in a recipe -> {key: name}."""
    if value is None or isinstance(value, dict) and not value:
        return None
    if isinstance(value, str):
        value = json_option(value, option, f'{{"{keys[0]}": "..."}}')
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ConfigError(f"{option}: give an object of key: name (keys: {', '.join(keys)}).")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(f"{option}: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(keys)}.")
    return dict(value)


@dataclass
class SFTTrainingArguments(TrainingArguments):
    """transformers' TrainingArguments with defaults for SFT (every one of its flags works as usual)."""

    output_dir: str | None = field(default=NEW_RUN_DIR, metadata={
        "help": "Where checkpoints, logs and the model go. Default: a new directory for each run, "
                "output/<model>/<method>/<start time> (output/<model>/<method>/latest: the newest finished one); "
                "with --resume_from_checkpoint true, the newest run of this model and method."})
    # Not an option: how sft/options/resolve.py output_dir_of_its_own chose --output_dir where none was given
    # ("": given; sft/options/checks.py PICKED_*).
    output_dir_picked: str = field(default="", init=False)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"], metadata={
        "help": "Loggers: tensorboard, wandb, mlflow, ..., all (every one installed) or none; several: "
                "--report_to tensorboard wandb"})
    logging_steps: float = field(default=10, metadata={"help": "Log every N steps."})
    log_level_replica: str = field(default="error", metadata={
        "help": "Log level of the processes other than rank 0 (transformers' default: warning)."})
    # Our collator needs `seq_lengths`, which the model's forward does not take.
    remove_unused_columns: bool = field(default=False, metadata={"help": "Leave at False for sft."})
    include_num_input_tokens_seen: str = field(default="non_padding", metadata={
        "help": "Count real (non-padding) tokens, for the tokens/s and MFU logs."})
    # Nothing lost (sft/safety/checkpoints.py, sft/safety/verify.py, sft/safety/guards.py).
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "Resume: `true` (the newest complete checkpoint in --output_dir; without --output_dir, of the "
                "newest run of this --model and method) or a checkpoint-N directory. The learning rate follows this "
                "run's schedule from that step (a higher --max_steps: the longer schedule)."})
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
    activation_checkpointing_keep_attention: bool = field(default=False, metadata={
        "help": "With --activation_checkpointing and sdpa: keep each layer's attention output for the backward "
                "instead of recomputing it (selective checkpointing: the backward's recompute skips attention, the "
                "costly part at long rows). It holds about one hidden vector a token per layer: in host RAM beside "
                "--compile_layers and --offload_activations, else on the GPU (docs/speed.md, Long rows)."})
    offload_activations: bool = field(default=False, metadata={
        "help": "With --activation_checkpointing: the checkpoints (each decoder layer's input) wait in host RAM "
                "between the forward and the backward instead of on the GPU (pinned; ~0.25 GB a layer at 32k "
                "tokens of hidden 4096), copied on a side stream beside the compute: for long rows on 24 GB cards "
                "(docs/speed.md, Long rows)."})
    sequence_parallel: int = field(default=1, metadata={
        "help": "Split each row's tokens over this many GPUs (DeepSpeed's Ulysses sequence parallelism, ALST, as "
                "accelerate runs it): rows too long for one card, e.g. 65,536 tokens over 2. Launch with a DeepSpeed "
                "config (accelerate_configs/zero2.yaml or zero3.yaml); the model's attention heads must divide by "
                "it; one conversation per row under sdpa (no --packing; flash_attention_2 keeps packed rows apart). "
                "1: off (docs/speed.md, Long rows)."})
    verify_saves: str = field(default="auto", metadata={
        "help": "Reload each save and compare its logits with the trained model: auto (the final save, and every "
                "checkpoint under LoRA or when the model has < 1e9 parameters), all, final, no."})
    nan_policy: str = field(default="stop", metadata={
        "help": "On a NaN/inf loss or gradient: stop (before the weights change; the last checkpoint is kept) "
                "or skip (drop that step's update and go on)."})
    # transformers' filter (on by default) looks at each micro-batch's loss on the host, which makes the host wait
    # for that micro-batch's backward; the NaN guard covers what it filters (sft/options/resolve.py).
    logging_nan_inf_filter: bool | None = field(default=None, metadata={
        "help": "Leave NaN/inf losses out of the logged mean (transformers' option). Default: only with "
                "--nan_policy skip (with stop the run ends at such a loss)."})
    loss_spike_factor: float = field(default=2.0, metadata={
        "help": "Warn (and count in the `loss_spikes` log) when a logged loss exceeds this many times the "
                "running mean; 0 turns it off."})
    loss_watchdog_threshold: float = field(default=0.0, metadata={
        "help": "Stop the run when the logged loss stays above this value for --loss_watchdog_patience logs in a "
                "row (Axolotl's option; about twice the first loss is a fair pick): no final save, and the error "
                "names the checkpoint from before the rise and how to resume from it. 0: off."})
    loss_watchdog_patience: int = field(default=3, metadata={
        "help": "Logged losses in a row above --loss_watchdog_threshold that stop the run."})

    evals_per_epoch: int = field(default=0, metadata={
        "help": "Evaluate this many times an epoch (Axolotl's option): --eval_strategy steps every 1/(N x "
                "--num_train_epochs) of the run (1: --eval_strategy epoch). Not with --eval_strategy, --eval_steps "
                "or --max_steps. 0: off."})
    saves_per_epoch: int = field(default=0, metadata={
        "help": "Save a checkpoint this many times an epoch (Axolotl's option), as --evals_per_epoch evaluates. "
                "Not with --save_strategy, --save_steps or --max_steps. 0: off."})

    early_stopping_patience: int = field(default=0, metadata={
        "help": "Stop when the evaluation's --metric_for_best_model (default: the eval loss) has not improved for "
                "this many evaluations in a row (transformers' EarlyStoppingCallback; Axolotl's option, "
                "LLaMA-Factory's early_stopping_steps). Needs evaluation (--eval_strategy steps, held-out data). "
                "0: off."})
    early_stopping_threshold: float = field(default=0.0, metadata={
        "help": "With --early_stopping_patience: the least change of the metric that counts as an improvement."})
    # transformers' own field is a dict that its parser cannot read from the command line: JSON here.
    liger_kernel_config: dict | str | None = field(default=None, metadata={
        "help": "Which Liger kernels --use_liger_kernel applies, as JSON, e.g. '{\"rms_norm\": false}' (keys: rope, "
                "rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy); default: all of the model's, or "
                "only the fused loss under --compile_layers."})
    # Not an option: set by sft/options/resolve.py liger_loss_on_labels where Liger's fused loss runs on the labelled
    # tokens only (sft/speed/chunked_loss.py liger_causal_lm_loss) instead of Liger's own, which projects every token.
    liger_loss_on_labels: bool = field(default=False, init=False)
    # Not options either, set by sft/options/resolve.py: a full fine-tune's --activation_checkpointing applied as
    # FSDP's own (fsdp_checkpoints_activations; sft/parallel/fsdp.py hands it to accelerate's plugin), and
    # --save_total_limit kept by our checkpoint rotation (our_rotation_keeps_checkpoints; the Trainer's gets None).
    fsdp_activation_checkpointing: bool = field(default=False, init=False)
    checkpoints_to_keep: int | None = field(default=None, init=False)
    # A plain string (transformers' own field offers its OptimizerNames as the only choices): ours are added.
    optim: str = field(default=next(f.default for f in fields(TrainingArguments) if f.name == "optim"), metadata={
        "help": f"The optimizer: transformers' (adamw_torch_fused, adamw_torch_8bit, ...) or {SR_ADAMW} (bf16 "
                f"weights and states, updated in fp32 and rounded stochastically: full fine-tuning without fp32 "
                f"master weights, at plain bf16 AdamW's memory traffic; sft/speed/sr_adamw.py)."})

    def to_dict(self) -> dict:
        """transformers' dict of the options, with a function in the checkpoint's kwargs (the policy of
        --activation_checkpointing_keep_attention) given by its name: the loggers write this dict as JSON
        (TensorBoard's `args` text, wandb's config)."""
        d = super().to_dict()
        for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
            if isinstance(d.get(key), dict):
                d[key] = {k: f"{v.__module__}.{v.__qualname__}" if callable(v) else v for k, v in d[key].items()}
        return d

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

    @property
    def gpus_seen(self) -> int:
        """The GPUs transformers gives this process: every visible one when a single process runs without a
        launcher, else 1 (0 on CPU)."""
        return super().n_gpu

    @property
    def n_gpu(self) -> int:
        """The GPUs this process trains on, which the Trainer reads (its nn.DataParallel, batch sizes): at most one.
        A process that sees several trains on the first (sft/parallel/distributed.py one_gpu_per_process says so):
        nn.DataParallel over them all is slower than DDP, makes the global batch per-device x GPUs, and the
        world-size-based numbers (MFU) wrong. Several GPUs are used through a launcher config."""
        return min(self.gpus_seen, 1)


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


def json_option(text: str, option: str, example: str):
    """An option's JSON value, or one line saying it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{option} {text}: not JSON ({e.msg}). Give an object, e.g. '{example}'.") from None


def liger_config_from_json(text: str) -> dict[str, bool]:
    config = json_option(text, "--liger_kernel_config", '{"rms_norm": false}')
    if not isinstance(config, dict) or not all(isinstance(v, bool) for v in config.values()):
        raise ConfigError(f"--liger_kernel_config {text}: give a JSON object of kernel names and true/false, e.g. "
                          f"'{{\"rms_norm\": false}}'.")
    return config


PARSER_TYPES = (ModelArguments, DataArguments, LoraArguments, SFTTrainingArguments)
HELP_GROUPS = [  # the one-screen --help: our options, then the TrainingArguments people use most
    ("Model", ModelArguments, tuple(f.name for f in fields(ModelArguments)  # these: in --help all
                                    if f.init and f.name not in ("fp8_recipe", "mlp_tile_tokens",
                                                                 "quantize_experts", "rope_scaling"))),
    ("LoRA", LoraArguments, tuple(f.name for f in fields(LoraArguments)  # these: in --help all
                                  if f.name not in ("use_rslora", "use_dora", "loraplus_lr_ratio",
                                                    "lora_modules_to_save", "lora_from"))),
    ("Data", DataArguments, tuple(f.name for f in fields(DataArguments)  # these: in --help all
                                  if f.name not in ("dataset_columns", "dataset_tags", "pad_to_multiple_of",
                                                    "pad_to_max_length", "mask_history"))),
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
    for rule in WHOLE_ARGV_RULES:  # other trainers' keys that read other options too
        argv = rule(argv)
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
    """Our options (not the values resolve.py sets, which no one types)."""
    ours = SFTTrainingArguments.__annotations__
    return [f.name for cls in PARSER_TYPES[:3] for f in fields(cls)] + [
        f.name for f in fields(SFTTrainingArguments) if f.name in ours and f.init]


def read_options(argv: list[str] | None = None, data_only: bool = False, help_command: str | None = None) -> Options:
    """The options as given: the recipes, the command line, the demo's defaults; parsed, not yet resolved or
    checked (and never planned: `--plan auto` is its own step, sft/train.py). `data_only`: for tools that prepare
    data and load no model (sft.data.dataset): precision is not checked against the hardware, so a GPU recipe's
    data can be audited on a laptop (precision does not enter the data). `help_command`: the tool's own help, which
    an option error points at (None: training's, as this run was started: sft/options/command.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(PARSER_TYPES, allow_abbrev=False,  # no typo passes as an abbreviation
                    help_command=help_command or training_help_command())
    wanted = help_requested(argv)
    if wanted:
        print(parser.format_help() if wanted == "all" else short_help(HELP_GROUPS))
        raise SystemExit(0)
    argv, given, recipes = expand_argv(argv)
    if data_only:
        argv += ["--bf16", "false", "--fp16", "false"]  # the last value wins; TrainingArguments checks the hardware
    problems: tuple[NeedsHardware, ...] = ()

    def parse(argv: list[str]) -> list:
        try:
            return parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False,
                                                      return_remaining_strings=True)
        except ConfigError as e:
            raise recipe_error(parser, recipes) or e from None

    while True:
        try:
            *parsed, unknown = parse(argv + [word for p in problems for word in (p.need, "false")])
            break
        except ConfigError:
            raise
        except ValueError as e:  # TrainingArguments.__post_init__ rejects some combinations itself
            message, need = training_arguments_message(str(e)), hardware_refused(str(e))
            if need is None or need in {p.need for p in problems}:
                raise ConfigError(message) from None
            # --bf16 or --tf32 where this machine has none: parsed again without it, so that the checks say what
            # else this run needs (a GPU recipe on a laptop: every problem at once), these first among them.
            problems = (*problems, NeedsHardware(message, need))
    if unknown:
        raise recipe_error(parser, recipes) or ConfigError(unknown_options_message(unknown, parser,
                                                                                   our_option_names()))
    model_args, data_args, lora_args, training_args = parsed
    model_args.model = model_hub_id(model_args.model)  # the planner's short names: what every step after reads
    return Options.of(model_args, data_args, lora_args, training_args, frozenset(given), problems)


def parse_args(argv: list[str] | None = None, data_only: bool = False, help_command: str | None = None):
    """-> (ModelArguments, DataArguments, LoraArguments, SFTTrainingArguments), resolved and checked against this
    machine (`data_only`: the options alone, see read_options). For the tools and tests; training also plans
    (sft/train.py)."""
    options = read_options(argv, data_only, help_command)
    if data_only:
        return settle(options, data_machine(), OPTION_CHECKS).groups()
    return settle(options).groups()


def settle(options: Options, machine: Machine | None = None, checks: list[Check] = CHECKS) -> Options:
    """Resolve the derived values, then check the rules: -> the final options, only read from here on.
    `machine`: this one unless given (tests describe one as data)."""
    from sft.machine import machine as this_machine

    m = machine or this_machine()
    return check_options(resolve_defaults(options, m), m, checks)


def data_machine() -> Machine:
    """What a data-only run resolves against: the launch as the environment says, no GPUs read (CUDA is not
    initialised; no derived value that enters the data depends on them)."""
    return Machine(launch=launch())


def validate(model_args: ModelArguments, data_args: DataArguments, lora_args: LoraArguments,
             training_args: SFTTrainingArguments, machine: Machine | None = None,
             check_machine: bool = True) -> Options:
    """Resolve and check options built or changed by hand (tests): every rule, caught before anything is loaded."""
    options = Options.of(model_args, data_args, lora_args, training_args)
    if not check_machine:
        return settle(options, machine or data_machine(), OPTION_CHECKS)
    return settle(options, machine)


def bf16_missing(message: str) -> bool:
    """TrainingArguments' refusal of --bf16 on hardware without it (transformers 5: "Your setup doesn't support
    bf16/gpu")."""
    return "support bf16" in message


def hardware_refused(message: str) -> str | None:
    """The option TrainingArguments refused for this machine's hardware (--bf16; --tf32: "--tf32 requires Ampere
    or a newer GPU arch"), else None."""
    return "--bf16" if bf16_missing(message) else "--tf32" if "tf32 requires" in message.lower() else None


def training_arguments_message(message: str) -> str:
    if "at most one of fp16 and bf16" in message.lower():
        return "--bf16 and --fp16 together: give one of them (--bf16 on GPUs that have it, else --fp16)."
    if bf16_missing(message):
        return ("--bf16: this machine has no bf16 support (it needs an Ampere or newer GPU). Drop --bf16 to train "
                "in fp32, or use --fp16 on an older GPU.")
    if hardware_refused(message) == "--tf32":
        return "--tf32: this machine has no TF32 matmuls (they need an Ampere or newer GPU). Drop --tf32."
    return f"invalid training options: {message}"


def validate_setup(model_args: ModelArguments, data_args: DataArguments, lora_args: LoraArguments,
                   training_args: SFTTrainingArguments, machine: Machine | None = None) -> Options:
    """Resolve, then only the checks against the machine, the launcher's settings and the DeepSpeed JSON
    (sft/options/checks.py MACHINE_CHECKS); `machine`: this one unless given (tests describe one as data)."""
    return settle(Options.of(model_args, data_args, lora_args, training_args), machine, MACHINE_CHECKS)
