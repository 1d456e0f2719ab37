"""Model: load the tokenizer and the causal LM (hub id or local directory), and attach LoRA.

Precision policy (correctness before speed): full fine-tuning keeps fp32 master weights and trains under the
Trainer's bf16/fp16 autocast, never plain bf16 AdamW; under LoRA the frozen base may be bf16 while the adapter
weights stay fp32 (peft's default).
"""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from sft.options.arguments import TINY_MODEL, LoraArguments, ModelArguments
from sft.errors import ConfigError, ModelNotFoundError
from sft.model.families import MLP_PROJECTIONS, family_of
from sft.model.model_type import check_hub_model
from sft.machine import GIB, Machine, is_first_process, launch, machine
from sft.model.moe import mark_moe_leaves
from sft.model.nf4_base import nf4_settings
from sft.model.rope_scaling import scaled
from sft.model.saved_modules import (check_saved_modules, check_wrapped, embeddings_named, ties_embeddings,
                                     train_copies_in_fp32)
from sft.safety.run_dir import QUANTIZED_BASE
from sft.speed import varlen_attention


@functools.lru_cache(maxsize=None)
def resolve_model_path(name: str, option: str = "--model") -> str:
    """A loadable model: the embedded tiny one (built once), a local directory with a config.json, or a hub id
    that is in the local cache or reachable now. Anything else is a ModelNotFoundError naming what was looked
    for and where, within seconds (transformers would retry the hub for a minute, then print a traceback)."""
    if name == TINY_MODEL:
        from sft.model.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{option} {name}: the directory {path.resolve()} holds no config.json, so it "
                                     f"is not a saved model (save_pretrained writes one). Give the model's directory "
                                     f"or a hub id.")
        return str(path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1 or not name.strip("/"):
        raise ModelNotFoundError(f"{option} {name}: no such directory ({path.resolve()}). Give a local model "
                                 f"directory or a hub id such as deepseek-ai/deepseek-llm-7b-base.")
    check_hub_model(name, option)
    return name


PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth")


def check_safetensors_weights(name: str) -> None:
    """A local model directory holds safetensors weights (runs never unpickle weights: use_safetensors=True), else a
    ModelNotFoundError that says how to convert them, before any data work (transformers' own OSError comes as the
    model loads, as a traceback). A hub id is left to the download."""
    path = Path(name).expanduser()
    if name == TINY_MODEL or not path.is_dir() or any(path.glob("*.safetensors")):
        return
    pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in path.glob(pattern))
    if not pickled:
        raise ModelNotFoundError(f"--model {name}: the directory holds a config.json but no weights (model.safetensors "
                                 f"or model-*.safetensors). Give the directory save_pretrained wrote.")
    raise ModelNotFoundError(
        f"--model {name}: its weights are pickled PyTorch files ({', '.join(pickled[:2])}{', ...' * (len(pickled) > 2)}), "
        f"which can run code as they load; runs load only safetensors. If you trust them, convert them once: "
        f"python -c \"from transformers import AutoModelForCausalLM as M; M.from_pretrained('{path}', dtype='auto')"
        f".save_pretrained('{path}-safetensors')\" and give --model {path}-safetensors (copy its tokenizer files too).")


def load_config(model_args: ModelArguments):
    """The model's config alone (no weights read): for the checks made before the model loads."""
    return AutoConfig.from_pretrained(resolve_model_path(model_args.model),
                                      trust_remote_code=model_args.trust_remote_code)


def load_tokenizer(model_args: ModelArguments):
    source = resolve_model_path(*((model_args.tokenizer, "--tokenizer") if model_args.tokenizer else
                                  (model_args.model, "--model")))
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    if tokenizer.pad_token is None:
        # Padding is masked out of attention and labels, so any id works; EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


# from_pretrained's default from transformers 5.25 (`kernels` became a dependency): hub kernels on, so a model on a
# CUDA device swaps its RMSNorm, RoPE and activations for kernels downloaded from the Hub at its first
# `model.train()`/`eval()`. Our runs train and compare (verified saves) the model's own code, as on 5.24, where
# they were opt-in; `use_kernels` is a from_pretrained argument of both.
NO_HUB_KERNELS = {"use_kernels": False}


def weights_dtype(model_args: ModelArguments, lora: bool, m: Machine | None = None) -> torch.dtype:
    """The dtype of the weights as loaded; under --qlora, of the weights that stay unquantized (embeddings, norms,
    lm_head) and of the 4-bit weights' storage under FSDP."""
    if model_args.dtype != "auto":
        return getattr(torch, model_args.dtype)
    if lora and (m or machine()).bf16:
        return torch.bfloat16  # frozen base weights: bf16 loses nothing that training could have kept
    return torch.float32


def load_model(model_args: ModelArguments, lora_args: LoraArguments, gradient_checkpointing: bool = False,
               model_factory=None, config_overrides: dict | None = None):
    """`model_factory`: called as from_pretrained would be, e.g. random weights from the config (bench/).
    `config_overrides`: config values the model loads with (--rope_scaling: sft/model/rope_scaling.py)."""
    if model_args.attn_implementation == varlen_attention.NAME:  # our attention, named before transformers meets it
        varlen_attention.register()
    qlora = qlora_requested(lora_args)
    nf4_for_fsdp = qlora and machine().launch.fsdp  # the base as NF4 bytes (sft/model/nf4_base.py)
    streamed = nf4_for_fsdp and model_factory is None
    model = load_nf4_for_fsdp(model_args, lora_args, config_overrides) if streamed else None
    experts_on_load = experts_quantization(model_args) if model_factory is None else {}
    if model is None:  # not read weight by weight: loaded whole
        model = (model_factory or AutoModelForCausalLM.from_pretrained)(
            resolve_model_path(model_args.model),
            dtype=weights_dtype(model_args, lora_args.lora),
            attn_implementation=model_args.attn_implementation,
            trust_remote_code=model_args.trust_remote_code,
            use_safetensors=True,  # never unpickle weights: a .bin checkpoint can run code when loaded
            **NO_HUB_KERNELS,
            **tensor_parallel(model_args),
            **quantization(model_args, lora_args),
            **experts_on_load,
            **(config_overrides or {}),
        )
    if model_args.quantize_experts == "fp8":  # before LoRA: the routed experts are the frozen base's
        from sft.model.quantized_experts import apply_quantized_experts

        apply_quantized_experts(model, quantized_on_load=bool(experts_on_load),
                                fp8=model_args.fp8_on and lora_args.lora)
    report_zero3_partitioning(model)
    mark_moe_leaves(model)  # ZeRO-3: each MoE block one leaf (before the Trainer builds the engine)
    if nf4_for_fsdp and not nf4_settings(model):  # loaded whole (a model factory, or not read weight by weight)
        quantize_base_for_fsdp(model)
    elif qlora:
        report_quantization(model)
    # config.use_cache stays the base's (a saved model must cache in generate): every batch turns it off (Collator)
    if lora_args.lora:  # --qlora has set it (sft/options/resolve.py)
        model = attach_lora(model, lora_args, gradient_checkpointing)
        if model_args.quantize_experts == "fp8":  # named as DDP will see them: inside the peft model
            from sft.model.quantized_experts import keep_out_of_ddp

            keep_out_of_ddp(model)
        if model_args.fp8_on:  # the frozen base's linear layers in FP8 (sft/speed/fp8.py)
            from sft.speed.fp8 import apply_fp8_base

            apply_fp8_base(model)
            if model_args.quantize_experts == "fp8":  # and the routed experts' grouped matmuls, where the GPU can
                from sft.speed.fp8_experts import apply_fp8_experts

                apply_fp8_experts(model)
    elif model_args.fp8_on:  # a full fine-tune's linear layers train in FP8 (sft/speed/fp8_training.py)
        from sft.speed.fp8_training import apply_fp8_training

        apply_fp8_training(model, model_args.fp8_recipe)
    if model_args.mlp_tile_tokens:  # before compiling: the compiled layers trace the tiled forward
        from sft.speed.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, model_args.mlp_tile_tokens)
    if model_args.compile_layers_on:  # last: the layers are compiled as they will run (sft/speed/regional_compile.py)
        from sft.speed.regional_compile import compile_decoder_layers, final_norm

        compiled = compile_decoder_layers(model)
        if is_first_process():
            norm = " and the final norm" if final_norm(model) is not None else ""
            print(f"Compiled: {compiled} decoder layers{norm} (torch.compile in place; the first step compiles)",
                  flush=True)
    return model


def experts_quantization(model_args: ModelArguments) -> dict:
    """--quantize_experts fp8: from_pretrained's arguments that quantize the routed experts as the checkpoint is read
    (sft/model/experts_on_load.py), so that no process holds the whole bf16 base in host RAM."""
    if model_args.quantize_experts != "fp8":
        return {}
    from sft.model.experts_on_load import on_load_config
    from sft.model.quantized_experts import quantization_device

    return on_load_config(load_config(model_args), quantization_device())


# ---- QLoRA: a LoRA adapter on a base quantized to 4 bits as it loads (bitsandbytes NF4) ----------------------

def qlora_requested(lora_args: LoraArguments) -> bool:
    return lora_args.qlora


def qlora_compute_dtype(cuda: bool, bf16: bool, weights: torch.dtype) -> torch.dtype:
    """The dtype bitsandbytes dequantizes the 4-bit weights to for each matmul: bf16 where the GPU has it, else
    fp16; without a GPU (tests only: --qlora needs one) the weights' own dtype."""
    if not cuda:
        return weights
    return torch.bfloat16 if bf16 else torch.float16


def qlora_quantization_kwargs(weights: torch.dtype, compute: torch.dtype, fsdp: bool) -> dict:
    """transformers' BitsAndBytesConfig arguments for --qlora (plain data: tested without bitsandbytes).

    NF4 with double quantization (the quantization constants quantized again: ~0.4 bit per weight less) and
    `compute` as the matmul dtype. Under FSDP the packed 4-bit values are stored in tensors of the weights' dtype
    (bf16) instead of uint8, as in Answer.AI's FSDP+QLoRA: FSDP shards and all-gathers floating-point tensors of
    one dtype per unit, and accelerate leaves uint8 Params4bit out of the sharding (every GPU would hold the
    whole 4-bit base). The stored bits are the same either way; an adapter trained on one loads on the other."""
    kwargs = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
              "bnb_4bit_compute_dtype": compute}
    if fsdp:
        kwargs["bnb_4bit_quant_storage"] = weights
    return kwargs


def quantization(model_args: ModelArguments, lora_args: LoraArguments) -> dict:
    """from_pretrained's arguments under --qlora: the 4-bit config, and each process's own GPU as the device
    (under DDP and FSDP alike every process loads and quantizes the whole base on its GPU; FSDP then shards it).

    peft's prepare_model_for_kbit_training is not called. Of what it does, peft's get_peft_model already freezes
    the base, and attach_lora already makes the embeddings' output require grad under activation checkpointing.
    The rest is casting every unquantized weight (embeddings, lm_head, norms) to fp32: for deepseek-llm-7b's
    0.84B embedding and lm_head values that is +1.6 GiB held, and under bf16 autocast the lm_head matmul would
    cast its fp32 weight back to a bf16 copy (0.78 GiB) in every forward, for nothing: those weights are frozen
    (no update to lose), the RMSNorms already compute in fp32, and the adapter stays fp32. Where the GPU has no
    bf16, --dtype auto loads those weights in fp32 anyway (weights_dtype), as that cast would."""
    if not qlora_requested(lora_args):
        return {}
    m = machine()
    if m.launch.fsdp:  # loaded as is, then quantized to torchao's NF4 (quantize_base_for_fsdp)
        return {}
    from transformers import BitsAndBytesConfig

    weights = weights_dtype(model_args, True, m)
    compute = qlora_compute_dtype(m.cuda, m.bf16, weights)
    config = BitsAndBytesConfig(**qlora_quantization_kwargs(weights, compute, m.launch.fsdp))
    device = m.launch.local_rank if m.cuda else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}


def load_nf4_for_fsdp(model_args: ModelArguments, lora_args: LoraArguments, config_overrides: dict | None = None):
    """--qlora under FSDP: the model with its decoder layers' linear weights read one at a time from the checkpoint and
    quantized to NF4 as they are read (sft/model/nf4_loading.py): host RAM for the NF4 base, not the bf16 model. None,
    with a note, where the checkpoint does not map 1:1 onto the model: the caller loads it whole, then quantizes."""
    from sft.model.nf4_loading import NotStreamable, load_nf4_model

    m = machine()
    source = resolve_model_path(model_args.model)
    try:
        config = scaled(load_config(model_args), config_overrides or {})
        model = load_nf4_model(source, config, weights_dtype(model_args, lora_args.lora, m),
                               m.launch.world_size, model_args.attn_implementation, model_args.trust_remote_code,
                               quantize_on=torch.device("cuda", m.launch.local_rank) if m.cuda else None)
    except NotStreamable as why:
        if is_first_process():
            print(f"QLoRA: {model_args.model} is loaded whole into every process's host RAM, then quantized: its "
                  f"checkpoint cannot be read weight by weight ({why})", flush=True)
        return None
    report_nf4_base(model, "read from the checkpoint one weight at a time")
    return model


def quantize_base_for_fsdp(model) -> None:
    """--qlora under FSDP, a model loaded whole: the decoder layers' linear weights to NF4 held as bytes (torchao's
    NF4Tensor) instead of bitsandbytes' bf16-held bytes, whose NaN-looking patterns CUDA's float copies in FSDP2's
    all-gather rewrite. Quantized on this process's GPU, layer by layer, and left in host RAM for FSDP2 to move each
    unit to the GPU as it shards it (a 70B's 4-bit base, ~35 GiB, fits no 24 GB card whole)."""
    from sft.model.nf4_base import quantize_base_nf4

    m = machine()
    device = torch.device("cuda", m.launch.local_rank) if m.cuda else None
    quantize_base_nf4(model, m.launch.world_size, device)
    report_nf4_base(model, "quantized after loading")


def report_nf4_base(model, how: str) -> None:
    from sft.model.nf4_base import NF4Linear

    if not is_first_process():
        return
    settings = nf4_settings(model) or {}
    count = sum(isinstance(m, NF4Linear) for m in model.modules())
    packed = sum(p.numel() // 2 for n, p in model.named_parameters() if n.endswith("weight")
                 and type(p).__name__ == "NF4Tensor")
    print(f"QLoRA: {count} linear layers of the base quantized to 4-bit NF4 with double quantization (torchao "
          f"NF4Tensor, blocks of {settings.get('block_size')}; {how}), computed in {str(weights_dtype_of(model))[6:]}, "
          f"stored as uint8, laid out in {settings.get('shards')} equal shards; {packed / GIB:.2f} GiB of packed "
          f"weights", flush=True)


def weights_dtype_of(model) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def report_quantization(model) -> None:
    config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    if config is None or not is_first_process():
        return
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    size = model.get_memory_footprint()
    footprint = f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"
    print(f"QLoRA: base weights quantized to 4-bit {config.bnb_4bit_quant_type.upper()}"
          f"{' with double quantization' if config.bnb_4bit_use_double_quant else ''}, computed in "
          f"{name(config.bnb_4bit_compute_dtype)}, stored as {name(config.bnb_4bit_quant_storage)}; the base "
          f"holds {footprint}", flush=True)




def record_quantized_base(model, output_dir: str) -> bool:
    """A --qlora adapter trained on a 4-bit base: write that base's quantization beside the adapter (peft's
    adapter_config.json records nothing of it), so that sft.tools.merge can say what the merged model is. -> written."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(getattr(base, "hf_quantizer", None), "quantization_config", None)
    settings = nf4_settings(base) if config is None else \
        config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    if settings is None:
        return False
    (Path(output_dir) / QUANTIZED_BASE).write_text(json.dumps(settings, indent=1, default=str) + "\n")
    return True


def tensor_parallel(model_args: ModelArguments) -> dict:
    """from_pretrained's arguments for --tp_size > 1: the model's own tp_plan, sharded as it loads. The Trainer
    then sees `model.tp_size` and sets accelerate's ParallelismConfig itself."""
    if model_args.tp_size <= 1:
        return {}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=model_args.tp_size)}


def report_zero3_partitioning(model) -> None:
    from sft.model.zero3 import zero3_partition_report

    report = zero3_partition_report(model)
    if report and is_first_process():
        print(report, flush=True)


def lora_targets(model, lora_args: LoraArguments) -> tuple[list[str] | str, list[str]]:
    """(target_modules, target_parameters): the user's, else the family's (sft/model/families.py), else peft's
    "all-linear" (every linear layer but the LM head); --lora_experts adds a MoE family's routed experts.

    On the DeepSeek MoE families peft would turn a module target named gate_proj/up_proj/down_proj, and
    "all-linear", into LoRA on the routed experts alone (sft/model/families.py says why and what it costs). So there a
    user's MLP names become the weights of those layers (`gate_proj` -> `gate_proj.weight`, target_parameters),
    and "all-linear" the family's default plus the routed experts: still never the router."""
    family = family_of(model.config.model_type)
    experts = family.expert_parameters if family else []  # only the MoE families have routed experts
    if lora_args.lora_experts and not experts:
        raise ConfigError(f"--lora_experts: {model.config.model_type} models have no routed experts; only the "
                          f"DeepSeek MoE families (deepseek_v2, deepseek_v3) have.")
    extra = experts if lora_args.lora_experts else []
    names = lora_args.lora_target_modules or []
    if [n.lower() for n in names] == ["all-linear"]:
        if not experts:
            return "all-linear", []  # peft knows the shorthand only as a string, not as a list's one entry
        names, extra = [], experts  # every linear layer: the MoE default and the routed experts
    if not names:
        return (family.lora_modules, family.lora_parameters + extra) if family else ("all-linear", [])
    if not experts:
        return names, []
    mlp = [n for n in names if n.rsplit(".", 1)[-1] in MLP_PROJECTIONS]
    return [n for n in names if n not in mlp], [f"{n}.weight" for n in mlp] + extra


def attach_lora(model, lora_args: LoraArguments, gradient_checkpointing: bool):
    """A new LoRA adapter on `model`, or, with --lora_from, the saved one (its own shape, --lora_dropout's dropout)."""
    from peft import LoraConfig, get_peft_model

    if lora_args.lora_from:
        from sft.model.adapter_start import load_adapter

        if gradient_checkpointing:
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
        model, parameters, saved = load_adapter(model, lora_args.lora_from, lora_args.lora_dropout)
        return finish_lora(model, parameters, saved)
    modules, parameters = lora_targets(model, lora_args)
    dropout = lora_args.lora_dropout
    if parameters and dropout:
        print(f"LoRA: lora_dropout {dropout} -> 0: peft cannot apply dropout to LoRA on weights targeted as "
              f"parameters (the DeepSeek MoE MLP: sft/model/families.py), and an adapter has one dropout.")
        dropout = 0.0
    saved = lora_args.lora_modules_to_save or []  # trained whole beside the adapter
    check_saved_modules(model, saved)  # peft would leave out a name that matches nothing, in silence
    config = LoraConfig(r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha, lora_dropout=dropout,
                        use_rslora=lora_args.use_rslora, use_dora=lora_args.use_dora, target_modules=modules,
                        target_parameters=parameters or None, task_type="CAUSAL_LM", modules_to_save=saved or None,
                        # tied embeddings stay tied: two copies trained apart, the saved lm_head would be lost to
                        # the tie when the merged model loads
                        ensure_weight_tying=ties_embeddings(model) and embeddings_named(model, saved))
    if lora_args.lora_experts:  # the experts' LoRA low-rank beside their grouped matmul, not a merged weight
        from sft.speed.expert_lora import register_split_expert_lora

        register_split_expert_lora(config, model)
    if gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    try:
        model = get_peft_model(model, config)
    except TypeError as e:  # peft: "modules_to_save cannot be applied to modules of type ...ParamWrapper"
        if not saved or "modules_to_save" not in str(e):
            raise
        raise ConfigError(f"--lora_modules_to_save {' '.join(saved)}: names a module that the LoRA adapter adapts "
                          f"as a parameter ({', '.join(parameters[:3])}, ...), which peft cannot also train whole. "
                          f"Name modules outside the adapted ones (embed_tokens, lm_head).") from None
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        if "use_dora" in str(e) and parameters:  # peft: "lora.ParamWrapper does not work with use_dora=True"
            raise ConfigError(f"--use_dora: peft has no DoRA for weights adapted as parameters, as "
                              f"{model.config.model_type}'s MLP weights are ({', '.join(parameters[:3])}, ...). Adapt "
                              f"attention only (--lora_target_modules with its projections: "
                              f"{', '.join(modules if isinstance(modules, list) else linear_names(model))}), or "
                              f"drop --use_dora.") from None
        if "not found" not in str(e) or not lora_args.lora_target_modules:
            raise
        raise ConfigError(f"--lora_target_modules {' '.join(lora_args.lora_target_modules)}: no module of "
                          f"{model.config.model_type} has that name. Its linear layers are named: "
                          f"{', '.join(linear_names(model))} (or give all-linear).") from None
    return finish_lora(model, parameters, saved)


def finish_lora(model, parameters: list[str], saved: list[str]):
    """What an adapter, new or loaded, gets after peft built it: the weights adapted as parameters traced as LoRA
    on a linear layer, the modules trained whole checked and kept in fp32, peft's input casts left to autocast."""
    if parameters:  # the MLP weights' LoRA low-rank, as on a linear layer, not peft's weight-sized W + B @ A
        from sft.speed.traced_param_lora import trace_param_lora

        trace_param_lora(model)
    if saved:
        check_wrapped(model.get_base_model(), saved)
        train_copies_in_fp32(model)
    if not launch().peft_input_cast:  # set: peft's own casts (bench/throughput.py's -peftcast rows)
        skip_input_casts_under_autocast(model)
    return model


def linear_names(model) -> list[str]:
    """The distinct last names of the model's linear layers: what --lora_target_modules can name."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_lora_targets(model_args: ModelArguments, lora_args: LoraArguments) -> None:
    """User-given LoRA targets (and --lora_experts, --use_dora, --lora_modules_to_save) must fit this model: checked
    on a weightless (meta) copy built from the config, before anything loads."""
    if lora_args.lora and (lora_args.lora_target_modules or lora_args.lora_experts or lora_args.use_dora
                           or lora_args.lora_modules_to_save):
        planned_lora_config(model_args, lora_args)


def planned_lora_config(model_args: ModelArguments, lora_args: LoraArguments):
    """The LoraConfig this run attaches, its targets resolved as peft resolves them, from a weightless (meta) copy
    of the model built from its config: nothing loads."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if lora_args.lora_from:  # the saved adapter's own
        from peft import LoraConfig

        config = LoraConfig.from_pretrained(lora_args.lora_from)
        config.inference_mode = False  # saved as an inference config: the run trains it
        return config
    config = load_config(model_args)
    with torch.device("meta"):
        return attach_lora(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config), lora_args, False).peft_config["default"]


def _cast_unless_autocast(self, x, dtype: torch.dtype):
    if x is None or x.dtype == dtype or torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(dtype=dtype)


def skip_input_casts_under_autocast(model) -> None:
    """peft casts each adapted layer's input to the adapter's dtype (fp32) before the LoRA matmuls. Under the
    Trainer's bf16/fp16 autocast those matmuls run in half precision anyway, so the cast writes an fp32 copy of
    the activations that autocast at once casts back: an exact round trip that costs memory traffic at 7 layers
    per block, in forward, recomputation and backward. Under autocast the input now goes to the LoRA matmuls as
    it is (the same values, the same loss and gradients bit for bit: tests/test_lora_casts.py); without
    autocast peft's cast stays."""
    from peft.tuners.lora import LoraLayer

    from sft.safety.private_names import PEFT_INPUT_CAST, expect

    expect(PEFT_INPUT_CAST)  # peft's private method, replaced per layer: only where it is what we expect
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module._cast_input_dtype = types.MethodType(_cast_unless_autocast, module)


class PartialCheckpointing(TrainerCallback):
    """`--activation_checkpointing_skip_layers K`: the last K decoder layers keep their activations instead of
    recomputing them in backward. The Trainer switches checkpointing on for every layer at the start of train();
    this runs right after (on_train_begin) and switches it off again for those layers."""

    def __init__(self, skip_layers: int):
        self.skip_layers = skip_layers
        self.unchecked: list[str] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.unchecked = []  # the Trainer switched every layer back on (again, if train() is called twice)
        layers = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        for name, layer in layers[len(layers) - min(self.skip_layers, len(layers)):]:
            layer.gradient_checkpointing = False
            self.unchecked.append(name)
        if is_first_process():
            print(f"Activation checkpointing: {len(layers) - len(self.unchecked)} of {len(layers)} layers "
                  f"checkpointed, the last {len(self.unchecked)} keep their activations", flush=True)
