"""--lora_modules_to_save: modules trained whole beside the LoRA adapter and saved in it (peft's modules_to_save).

peft 0.21 (`peft/utils/other.py`, `_set_trainable`) wraps every module whose dotted path ends with a given name, as
plain text: `lm_head` is the LM head, but `norm` is also every layer's `input_layernorm`, and a name that matches no
module is left out without a word. Here each name must match whole names only (a module's path, or its last dotted
parts), at least one module with weights, and nothing peft would match by a part of a name: refused otherwise,
before anything loads (the LoRA targets' check builds a weightless copy: sft/model/loading.py check_lora_targets).

peft's ModulesToSaveWrapper holds the frozen original beside a trained copy, made in the base's dtype. A bf16 copy
trained with plain AdamW drops every update smaller than bf16's spacing (what full fine-tuning refuses:
sft/options/checks.py full_fine_tune_keeps_small_updates), so the copy trains in fp32, as peft keeps the adapter:
its input cast to fp32 where no autocast does it (peft's rule for the adapter's input), its output in the base's
dtype, as the module it replaces gave it (an fp32 embedding would turn the residual stream fp32).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from sft.errors import ConfigError

SHOWN_NAMES = 12  # module names an error lists at most
TRAINABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def whole_match(path: str, name: str) -> bool:
    """`name` is the module's path, or its last dotted parts."""
    return path == name or path.endswith("." + name)


def own_weights(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def weight_names(model: nn.Module) -> list[str]:
    """The distinct last names of the modules that hold weights of their own: what a name can match."""
    return sorted({path.rsplit(".", 1)[-1] for path, m in model.named_modules() if path and own_weights(m)})


def check_saved_modules(model: nn.Module, names: list[str]) -> None:
    """Each of `names` matches, as peft matches it, whole modules that hold weights, and nothing else; else a
    ConfigError naming the name and modules that exist."""
    paths = {path: module for path, module in model.named_modules() if path}
    for name in names:
        whole = [path for path in paths if whole_match(path, name)]
        partial = sorted({p.rsplit(".", 1)[-1] for p in paths if p.endswith(name) and not whole_match(p, name)})
        if partial:
            meant = (f"more of the path: {unambiguous(whole[0], paths)} names {whole[0]}"
                     + (f" and {len(whole) - 1} more" if len(whole) > 1 else "") if whole else
                     f"the whole name ({', '.join(partial)})")
            raise ConfigError(f"--lora_modules_to_save {name}: peft trains every module whose path ends with it, "
                              f"which would also train {', '.join(partial)}. Give {meant}.")
        if whole and isinstance(paths[whole[0]], (nn.ModuleList, nn.ModuleDict)):
            raise ConfigError(f"--lora_modules_to_save {name}: a list of modules, which peft cannot train whole; "
                              f"name the modules in it.")
        if not any(any(True for _ in paths[path].parameters()) for path in whole):
            found = weight_names(model)
            shown = ", ".join(found[:SHOWN_NAMES]) + (", ..." if len(found) > SHOWN_NAMES else "")
            raise ConfigError(f"--lora_modules_to_save {name}: no module of {model.config.model_type} with weights "
                              f"is named so. Its modules with weights are named: {shown}.")


def unambiguous(path: str, paths) -> str:
    """The shortest end of `path` (whole dotted parts) that ends no other module's name in part."""
    parts = path.split(".")
    for n in range(1, len(parts) + 1):
        end = ".".join(parts[-n:])
        if all(whole_match(p, end) for p in paths if p.endswith(end)):
            return end
    return path


def embeddings_named(model: nn.Module, names: list[str]) -> bool:
    """Whether `names` take the input or the output embedding (peft then ties the trained copies where the model
    ties its embeddings: ensure_weight_tying)."""
    embeddings = {id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    return any(id(module) in embeddings for path, module in model.named_modules()
               if any(whole_match(path, name) for name in names))


def ties_embeddings(model: nn.Module) -> bool:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(config, "tie_word_embeddings", False))


def trained_copies(model: nn.Module, adapter: str = "default") -> dict[str, nn.Module]:
    """{path of the wrapped module: its trained copy} for `adapter` (peft's ModulesToSaveWrapper)."""
    from peft.utils import ModulesToSaveWrapper

    return {path: wrapper.modules_to_save[adapter] for path, wrapper in model.named_modules()
            if isinstance(wrapper, ModulesToSaveWrapper) and adapter in wrapper.modules_to_save}


def tied_copies(model: nn.Module) -> bool:
    """Whether two trained copies share a weight (the embeddings of a model that ties them). peft 0.21 ties only the
    first adapter's: a second adapter loaded beside it (sft/safety/verify.py's check in place) leaves the lm_head
    without its copy, running the frozen original."""
    ids = [id(p) for copy in trained_copies(model).values() for p in copy.parameters()]
    return len(ids) != len(set(ids))


def frozen_originals(model: nn.Module) -> set[int]:
    """ids of the parameters of the originals that peft keeps beside the trained copies (they no longer run)."""
    from peft.utils import ModulesToSaveWrapper

    return {id(p) for m in model.modules() if isinstance(m, ModulesToSaveWrapper)
            for p in m.original_module.parameters()}


def check_wrapped(model: nn.Module, names: list[str]) -> None:
    """After peft attached the adapter (`model`: the base model inside it): each name wrapped (a module peft left
    out says so, not a run that trains the base unchanged), no LoRA layer inside a trained copy (a module holding
    weights adapted as parameters, which peft does not keep out of the adapter), and no quantized weight in one (a
    4-bit base's layer: peft would make its packed weight trainable)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    copies = trained_copies(model)
    missing = [name for name in names if not any(whole_match(path, name) for path in copies)]
    if missing:
        raise ConfigError(f"--lora_modules_to_save {', '.join(missing)}: peft wrapped no module of that name, so it "
                          f"would not train; name modules outside the LoRA-adapted ones (embed_tokens, lm_head).")
    adapted = [path for path, copy in copies.items() if any(isinstance(m, BaseTunerLayer) for m in copy.modules())]
    if adapted:
        raise ConfigError(f"--lora_modules_to_save: {adapted[0]} holds layers that the LoRA adapter adapts; a module "
                          f"is adapted or trained whole, not both. Name modules outside the adapted ones "
                          f"(embed_tokens, lm_head), or leave it out.")
    quantized = [path for path, copy in copies.items()
                 if any(type(p) is not nn.Parameter or p.dtype not in TRAINABLE_DTYPES for p in copy.parameters())]
    if quantized:
        raise ConfigError(f"--lora_modules_to_save: {quantized[0]} is held quantized (the 4-bit base of --qlora), and "
                          f"a quantized weight cannot train; name modules kept in 16 bits (embed_tokens, lm_head, the "
                          f"norms).")


def check_frozen_head(model: nn.Module) -> None:
    """The loss in chunks under ZeRO-3 on several processes gathers a frozen lm_head once (sft/speed/chunked_loss.py);
    a trained one is refused by name before loading (sft/options/checks.py loss_in_chunks_under_zero3), and here
    where it is trained as the tied twin of a trained embed_tokens."""
    if any(p.requires_grad for p in model.get_output_embeddings().parameters()):
        raise ConfigError("the loss in chunks (--chunked_loss, --sequence_parallel) under ZeRO-3 on several processes "
                          "cannot gather a trained lm_head, and this model ties its lm_head to the embed_tokens of "
                          "--lora_modules_to_save. Use ZeRO-2 (accelerate_configs/zero2.yaml), or leave "
                          "embed_tokens out.")


def _input_in_copy_dtype(module: nn.Module, args: tuple) -> tuple:
    """peft's rule for the adapter's input: cast to the weights' dtype unless autocast computes in its own."""
    dtype = next(module.parameters()).dtype
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 and not torch.is_autocast_enabled(a.device.type) else a for a in args)


def train_copies_in_fp32(model: nn.Module) -> int:
    """Each trained copy of a half-precision module (a LoRA base in bf16) in fp32, its output in the original's
    dtype; -> how many were cast."""
    from peft.utils import ModulesToSaveWrapper

    cast = 0
    for wrapper in [m for m in model.modules() if isinstance(m, ModulesToSaveWrapper)]:
        dtype = next(wrapper.original_module.parameters()).dtype
        if not dtype.is_floating_point or dtype == torch.float32:
            continue
        for copy in wrapper.modules_to_save.values():
            copy.float()  # a tied copy (lm_head of a tied model) shares its Parameter, cast with it
            copy.register_forward_pre_hook(_input_in_copy_dtype)
            copy.register_forward_hook(functools.partial(_output_in, dtype))
            cast += 1
    return cast


def _output_in(dtype: torch.dtype, module: nn.Module, args: tuple, out):
    return out.to(dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out
