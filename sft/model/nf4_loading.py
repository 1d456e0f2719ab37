"""--qlora under FSDP without the bf16 model in host RAM: the model built weightless (meta), each decoder-layer linear
weight read from the checkpoint's safetensors files on its own and quantized to NF4 (NF4Linear) at once, then the
rest (embeddings, norms, lm_head) read and the weights tied as the model ties them.

Why: from_pretrained followed by quantize_base_nf4 reads the whole checkpoint into every rank before the first
layer is quantized. From a bf16 checkpoint its tensors are the files' mmapped pages (safetensors reads lazily): every
page of the checkpoint stays mapped in every rank until quantization ends (in its RSS; the page cache holds one copy,
reclaimable); from any other dtype they are bf16 copies, the whole model per rank. Here each weight is opened, read,
quantized and dropped before the next (one safetensors mapping per weight, released with it), and the tensors kept
unquantized are copied out of the file: per rank the NF4 base, the unquantized bf16 weights and one weight in
flight (as Answer.AI's fsdp_qlora loads its shards a tensor at a time).

Bit for bit the model that from_pretrained + quantize_base_nf4 gives (the same casts, the same quantization of the
same values, on the same devices: tests/test_nf4_loading.py). Only for checkpoints whose keys are the model's own
(Llama, Qwen2: deepseek-llm-67b, the R1 distills): a model whose checkpoint transformers converts as it loads
(renamed or fused keys, e.g. the MoE families' experts), a pre-quantized checkpoint, or a key set that differs from
the model's is loaded the old way (`NotStreamable` says why; the caller prints it).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from sft.errors import ModelNotFoundError

SINGLE_FILE = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME
INDEX_FILE = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME


class NotStreamable(Exception):
    """This checkpoint cannot be read weight by weight into the model as it is; the message says why."""


def located(source: str, name: str) -> str | None:
    """`name` in a local model directory or hub repository (downloaded into the cache if it is not there), or None."""
    from transformers.utils.hub import cached_file, has_file

    return cached_file(source, name) if has_file(source, name) else None  # offline: whether the cache holds it


def checkpoint_files(source: str) -> dict[str, str]:
    """{checkpoint key: the safetensors file holding it} of a model directory or hub id (its shards downloaded, as
    from_pretrained would). A model without safetensors weights is refused: no run loads pickled weights."""
    from safetensors import safe_open
    from transformers.utils.hub import get_checkpoint_shard_files

    index = located(source, INDEX_FILE)
    if index is not None:
        files, metadata = get_checkpoint_shard_files(source, index)
        by_name = {Path(f).name: f for f in files}
        return {key: by_name[Path(name).name] for key, name in metadata["weight_map"].items()}
    single = located(source, SINGLE_FILE)
    if single is None:
        raise ModelNotFoundError(f"--model {source}: no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); runs "
                                 f"load only safetensors (pickled .bin weights can run code as they load). Save the "
                                 f"model as safetensors once (save_pretrained writes them) and give that directory.")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_tensor(path: str, key: str) -> torch.Tensor:
    """One tensor as safetensors reads it: backed by the file's mapped pages (no copy), the mapping released when
    the tensor is."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key)


def streaming_problem(model, keys: Iterable[str]) -> str | None:
    """Why the checkpoint's `keys` cannot be read 1:1 into `model` (built from the config, weightless), else None.
    transformers' own conversion mapping decides whether it renames or fuses keys as it loads this model."""
    from sft.safety.private_names import CONVERSION_MAPPING, expect

    get_model_conversion_mapping = expect(CONVERSION_MAPPING)
    config = model.config
    if getattr(config, "quantization_config", None):
        return "the checkpoint is quantized already (its config has a quantization_config)"
    conversions = get_model_conversion_mapping(model, add_legacy=False)
    if conversions:
        return (f"transformers converts {config.model_type} checkpoints as it loads them "
                f"({type(conversions[0]).__name__} of {conversions[0].source_patterns})")
    keys = set(keys)
    expected = set(model.state_dict())
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # {target: source}
    missing = sorted(expected - keys - tied.keys())
    unexpected = sorted(keys - expected)
    if missing or unexpected:
        return (f"its keys are not the model's ({len(missing)} missing, e.g. {missing[:2]}; {len(unexpected)} "
                f"unexpected, e.g. {unexpected[:2]})")
    both = sorted(target for target, source in tied.items() if target in keys or source not in keys)
    if both:
        return f"tied weights saved otherwise than save_pretrained writes them ({both[:2]})"
    return None


def module_names(model) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


@torch.no_grad()
def load_nf4_model(source: str, config, dtype: torch.dtype, shards: int, attn_implementation: str | None = None,
                   trust_remote_code: bool = False, quantize_on: torch.device | None = None,
                   device: torch.device | None = None):
    """The causal LM of `source` with its decoder layers' linear layers as NF4Linear (laid out for `shards`), as
    from_pretrained(dtype=dtype, device_map={"": device}) followed by quantize_base_nf4(model, shards, quantize_on)
    gives it. `config`: the model's (AutoConfig.from_pretrained(source)); `device`: where its tensors end (None: host
    RAM); `quantize_on`: where each weight is quantized (its result comes back to `device`). Raises NotStreamable
    (nothing read yet) where the checkpoint does not map 1:1 onto the model."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoModelForCausalLM, GenerationConfig

    from sft.model.nf4_base import NF4Linear, base_linears

    files = checkpoint_files(source)
    config = copy.deepcopy(config)  # the caller's stays as it was, as from_pretrained leaves it
    config.name_or_path = source  # as from_pretrained sets it (peft records it as the adapter's base)
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (RoPE's) computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    problem = streaming_problem(model, files)
    if problem:
        raise NotStreamable(problem)
    target = device or torch.device("cpu")
    # each tensor cast to its (meta) parameter's dtype, as from_pretrained casts it: `dtype`, or fp32 where the model
    # keeps a module in fp32 (from_config built it so)
    names = module_names(model)
    read = set()
    for parent, name, linear in base_linears(model):
        prefix = f"{names[id(parent)]}.{name}"
        # a linear of its own for the read weight: the model's meta one (kept in base_linears' list) never holds it
        loaded = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        for param in ("weight", "bias"):
            if getattr(linear, param) is not None:
                key = f"{prefix}.{param}"
                value = read_tensor(files[key], key).to(device=target, dtype=getattr(linear, param).dtype,
                                                        copy=param == "bias")  # a kept bias: not the file's pages
                setattr(loaded, param, nn.Parameter(value, requires_grad=False))
                read.add(key)
        setattr(parent, name, NF4Linear(loaded, shards, quantize_on))
        del loaded  # the bf16 weight (and its file mapping) goes before the next is read
    state = model.state_dict()
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    rest = {key: read_tensor(path, key).to(device=target, dtype=state[key].dtype, copy=True)
            for key, path in files.items() if key not in read and key not in tied}
    model.load_state_dict(rest, strict=False, assign=True)
    model.tie_weights()
    for name, buffer in model.named_buffers():  # computed on the CPU as the model was built (RoPE's inv_freq)
        if buffer.device != target:
            set_module_tensor_to_device(model, name, target)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"loading {source} weight by weight left {len(left)} tensors unloaded ({left[:3]})")
    try:  # as from_pretrained: the checkpoint's generation config, else the one made from the model's config
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass
    return model.eval()
