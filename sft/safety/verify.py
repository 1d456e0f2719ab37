"""Verified saves: reload what was just written and compare its logits with the in-memory model's.

A save that silently dropped a tensor, wrote the wrong dtype, saved a LoRA adapter that does not attach to the
base, or wrote nothing (ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`) fails here, loudly, instead
of at the user's first inference.

- LoRA (unsharded): the saved adapter is loaded with peft next to the trained one, on the same base in memory,
  and the two are compared on the same device with the same kernels (cheap at any model size; exact). Modules
  trained whole beside it (--lora_modules_to_save) come back in the base's dtype, as a user's reload gives them (on
  a bf16 base: at bf16's tolerance); tied ones are reloaded with the base (peft cannot tie a second adapter's).
- Full models (and sharded LoRA): reloaded from the saved directory in the main process, on the model's own GPU
  when it has room (exact), else on CPU (other kernels: a looser tolerance, still far below what a wrong or
  missing tensor does). Every process computes the in-memory logits, since sharded models (ZeRO-3, FSDP) need
  all ranks for a forward.
- A full fine-tune in FP8: the saved weights against the trained ones, bit for bit (logits cannot tell: the
  trained model's compiled FP8 matmuls and an eager reload's round different values across an e4m3 step, and
  four layers of that moved the logits by up to 1.15 on an H200, run 20261204T2135Z-resident22).
- QLoRA (a LoRA adapter on a 4-bit base): the same, with the base reloaded quantized as in training (the same
  bits: NF4 quantization of the same weights is deterministic), on the model's GPU. On the unquantized base the
  adapter gives other logits, by the quantization error (tests/test_qlora.py): what users load to merge
  (sft.tools.merge) is that, by design, not the 4-bit model trained.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sft.errors import SaveMismatchError
from sft.machine import GIB, is_first_process
from sft.model.nf4_base import QUANT_METHOD, NF4Linear
from sft.model.moe import expert_parallel_layers
from sft.model.rope_scaling import scaled
from sft.model.saved_modules import tied_copies, trained_copies
from sft.safety.run_dir import ADAPTER_WEIGHTS
from sft.safety.private_names import ACCELERATE_ORIGINAL_FORWARD, expect

CHEAP_PARAMETERS = 1e9  # below this, reloading at every checkpoint costs seconds: `--verify_saves auto` does it


def fixed_batch(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (2, 32), generator=generator)


@torch.no_grad()
def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The model's fp32 logits for `input_ids`, eval mode, its compiled layers (--compile_layers) run eagerly: a
    check compiles nothing. (Compiled, the no-grad forward and the saved adapter loaded beside the trained one were
    new graphs to compile at every save; on an H100 one of them failed in inductor, and the save was declared
    broken.) The reloaded model it is compared with runs eagerly too."""
    device = next(model.parameters()).device
    was_training, tf32 = model.training, torch.backends.cuda.matmul.allow_tf32
    model.eval()  # no dropout
    torch.backends.cuda.matmul.allow_tf32 = False  # --tf32 would make two identical models disagree by ~1e-3
    try:
        # use_cache=False: a cache would change the attention mask path (see sft/data/packing.py)
        with own_forward(model), torch.compiler.set_stance("force_eager"):
            return model(input_ids=input_ids.to(device), use_cache=False).logits.float().cpu()
    finally:
        model.train(was_training)
        torch.backends.cuda.matmul.allow_tf32 = tf32


@contextmanager
def own_forward(model):
    """The model's forward without accelerate's autocast wrapper, still called through `model(...)`.

    accelerate's mixed precision replaces `model.forward` with an autocast wrapper and keeps the original as
    `_original_forward`; the reloaded model runs without autocast, as a user's would, so the trained one must
    too (bf16 autocast against fp32: ~2e-3). Calling `_original_forward` directly would skip the module's hooks,
    and FSDP2 gathers the root's own parameters (final norm, lm_head) in a forward pre-hook: under FSDP the
    direct call met sharded weights ("mixed torch.Tensor and DTensor", seen with FSDP + QLoRA on an H200)."""
    original = getattr(model, "_original_forward", None)
    if original is None or "forward" not in vars(model):  # no autocast wrapper (no mixed precision): nothing to undo
        yield
        return
    expect(ACCELERATE_ORIGINAL_FORWARD)  # accelerate's own attribute: only in the versions it was checked on
    wrapped = model.forward
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


def is_sharded(model) -> bool:
    """ZeRO-3 (parameters carry ds_id), FSDP2 (DTensor parameters) or DeepSpeed AutoEP (each rank a share of the
    routed experts, sft/parallel/expert_parallel.py): no process holds the whole model, and a forward needs all."""
    return (any(hasattr(p, "ds_id") or hasattr(p, "to_local") for p in model.parameters())
            or bool(expert_parallel_layers(model)))


def plain_name(name: str) -> str:
    """A parameter's name as a plain reload of the model has it: without the activation checkpoint wrapper's and
    torch.compile's module prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def reload_device(model) -> torch.device:
    """The model's own GPU if a second copy fits there (with a margin), else CPU."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return torch.device("cpu")
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    free, _ = torch.cuda.mem_get_info(device)
    return device if free > 1.5 * need + GIB else torch.device("cpu")


def _broadcast(value):
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if PartialState().num_processes == 1:
        return value
    return broadcast_object_list([value])[0]


@dataclass
class SaveVerifier:
    base_model: str  # hub id or directory of the base model (reloaded under LoRA)
    lora: bool
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    checkpoints: bool = True  # verify every checkpoint, not only the final save
    final: bool = True
    lora_in_place: bool = True  # False: reload base + adapter from disk even when the in-place check could run
    quantization: dict | None = None  # QLoRA: the base's BitsAndBytesConfig (as a dict), to reload it the same way
    fp8_recipe: str | None = None  # a full fine-tune in FP8: its saves are checked weight by weight
    base_overrides: dict = field(default_factory=dict)  # a LoRA base's config values (--rope_scaling), as trained

    def verifiable(self, path: str | Path) -> bool:
        """Whether `path` holds consolidated weights. Sharded checkpoints (FSDP's SHARDED_STATE_DICT, ZeRO-3
        without the gather flag) hold none: they resume, and the consolidated final save is what gets checked."""
        pattern = ADAPTER_WEIGHTS if self.lora else "model*.safetensors"
        return any(Path(path).glob(pattern))

    def reload(self, path: Path, dtype: torch.dtype, device: torch.device):
        model = self.load_whole(self.base_model if self.lora else str(path), dtype, device)
        if self.lora:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(path))
        return model

    def saved_weights_mismatch(self, model, path: Path) -> str | None:
        """The plain model saved in `path`, reloaded on the CPU, against the trained weights bit for bit; on every
        rank (FSDP2's shards are gathered one parameter at a time, to the main process's host RAM)."""
        from torch.distributed.tensor import DTensor

        reloaded, error = None, None
        if is_first_process():
            if not any(path.glob("model*.safetensors")):
                error = "no weights were written"
            else:
                try:
                    dtype = next(model.parameters()).dtype
                    reloaded = dict(self.load_whole(str(path), dtype, torch.device("cpu")).named_parameters())
                except Exception as e:  # a save that cannot even be loaded is the loudest mismatch of all
                    error = f"{type(e).__name__}: {e}"
        error = _broadcast(error)
        if error:
            return error
        differing = []
        for name, p in model.named_parameters():
            whole = p.full_tensor() if isinstance(p, DTensor) else p  # a collective: every rank, in one order
            if reloaded is not None:
                saved = reloaded.pop(plain_name(name), None)
                if saved is None or not torch.equal(saved, whole.detach().to("cpu")):
                    differing.append(plain_name(name))
        if reloaded:  # tensors in the file that the trained model does not have
            differing += sorted(reloaded)
        return _broadcast(f"{len(differing)} saved tensors differ from the trained ones or are missing (first: "
                          f"{differing[0]})" if differing else None)

    def load_whole(self, source: str, dtype: torch.dtype, device: torch.device):
        """A whole copy of the model (a LoRA run's base: quantized again as in training under QLoRA) in this
        process, on `device`."""
        from transformers import AutoModelForCausalLM

        from sft.model.loading import NO_HUB_KERNELS
        from sft.model.zero3 import zero3_init_disabled

        quantized = {}
        nf4 = self.lora and self.quantization and self.quantization.get("quant_method") == QUANT_METHOD
        if nf4:  # --qlora under FSDP: the same NF4 bytes again, read weight by weight (sft/model/nf4_loading.py)
            model = self.load_nf4_base(source, dtype, device)
            if model is not None:
                return model
        if self.lora and self.quantization and not nf4:
            from transformers import BitsAndBytesConfig

            quantized = {"quantization_config": BitsAndBytesConfig.from_dict(dict(self.quantization))}
        with zero3_init_disabled():  # one process loads a whole copy: no zero.Init (the other ranks would not join)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=self.attn_implementation,
                                                         trust_remote_code=self.trust_remote_code, use_safetensors=True,
                                                         device_map={"": device}, **NO_HUB_KERNELS, **quantized,
                                                         **(self.base_overrides if self.lora else {}))
        if nf4:  # a checkpoint not read weight by weight: the same NF4 bytes again (deterministic, the trained layout)
            from sft.model.nf4_base import quantize_base_nf4

            quantize_base_nf4(model, int(self.quantization["shards"]))
        return model

    def load_nf4_base(self, source: str, dtype: torch.dtype, device: torch.device):
        """The --qlora base quantized to NF4 as it is read, on `device` (no bf16 copy of the whole in host RAM), or
        None where its checkpoint does not map 1:1 onto the model."""
        from transformers import AutoConfig

        from sft.model.nf4_loading import NotStreamable, load_nf4_model

        config = scaled(AutoConfig.from_pretrained(source, trust_remote_code=self.trust_remote_code),
                        self.base_overrides if self.lora else {})
        try:
            return load_nf4_model(source, config, dtype, int(self.quantization["shards"]), self.attn_implementation,
                                  self.trust_remote_code, device=device)
        except NotStreamable:
            return None

    def adapter_in_place(self, model, path: Path, input_ids: torch.Tensor) -> str | None:
        """Load the saved adapter beside the trained one on the same base; compare; remove it again."""
        expected = logits_of(model, input_ids)
        trained = model.active_adapter
        # DeepSpeed's fp16/bf16 engines cast the trained adapter to half precision with the rest of the model; peft
        # would upcast the loaded one to fp32 and compute differently. Load it in the trained adapter's dtype.
        adapter_dtype = next((p.dtype for p in model.parameters() if p.requires_grad), torch.float32)
        try:
            model.load_adapter(str(path), adapter_name="_saved", autocast_adapter_dtype=adapter_dtype == torch.float32)
            model.set_adapter("_saved")
            got = logits_of(model, input_ids)
            # peft loads the modules trained whole (--lora_modules_to_save) in the base's dtype, as a user's
            # PeftModel.from_pretrained does: on a bf16 base their fp32 weights come back rounded to bf16
            rounded = {p.dtype for copy in trained_copies(model, "_saved").values() for p in copy.parameters()}
        except Exception as e:  # a save that cannot even be loaded is the loudest mismatch of all
            return f"{type(e).__name__}: {e}"
        finally:
            model.set_adapter(trained)  # also makes the trained adapter's weights trainable again
            if "_saved" in model.peft_config:
                model.delete_adapter("_saved")
        return compare(expected, got, next(iter(rounded - {adapter_dtype}), torch.float32), same_device=True)

    def reload_and_compare(self, model, base, path: Path, input_ids: torch.Tensor,
                           expected: torch.Tensor) -> str | None:
        dtype = next(p.dtype for p in base.parameters() if not p.requires_grad or not self.lora)
        device = reload_device(model)
        if self.lora and self.quantization and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # 4-bit kernels; a 4-bit base is small
        if not self.lora and not any(path.glob("model*.safetensors")):
            return ("no weights were written (DeepSpeed ZeRO-3 writes them only with "
                    "\"stage3_gather_16bit_weights_on_model_save\": true in its config)")
        try:
            reloaded = self.reload(path, dtype, device)
            got = logits_of(reloaded, input_ids)
            del reloaded
        except Exception as e:  # a save that cannot even be loaded is the loudest mismatch of all
            return f"{type(e).__name__}: {e}"
        # A sharded model computes under FSDP's mixed-precision policy (a LoRA adapter's fp32 weights cast to
        # bf16), the reloaded one through peft's own casts: other rounding, so the other-device tolerance.
        same_kernels = device == next(model.parameters()).device and not is_sharded(model)
        return compare(expected, got, dtype, same_device=same_kernels)

    def check(self, model, path: str | Path) -> None:
        """Raise SaveMismatchError (on every rank) unless the files in `path` give the in-memory logits."""
        path = Path(path)
        base = model.get_base_model() if self.lora and hasattr(model, "get_base_model") else model
        input_ids = fixed_batch(base.config.vocab_size)
        error = None
        # Loading initialises modules from the RNG: leave the training's RNG streams (dropout, shuffling) as they
        # were, or a resumed run (which restores the RNG state saved before this check) would diverge.
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            if self.fp8_recipe and not self.lora:
                error = self.saved_weights_mismatch(model, path)
            elif self.lora and self.lora_in_place and not is_sharded(model):
                if is_first_process():
                    error = self.adapter_in_place(model, path, input_ids)
            else:
                expected = logits_of(model, input_ids)
                if is_first_process():
                    error = self.reload_and_compare(model, base, path, input_ids, expected)
        error = _broadcast(error)
        if error and self.lora and is_sharded(model):  # every rank: the explanation gathers shards
            error = _broadcast(f"{error}; {self.explain_sharded(model, base, path, input_ids, expected)}")
        if error:
            what = "LoRA adapter" if self.lora else "model"
            raise SaveMismatchError(f"the {what} saved in {path} does not reproduce the trained model: {error}. "
                                    f"Do not use these files; the run's earlier checkpoints are untouched.")

    def explain_sharded(self, model, base, path: Path, input_ids: torch.Tensor, expected: torch.Tensor) -> str:
        """Which side of a failed sharded (FSDP) LoRA check differs, in words; called on every rank (it gathers).

        A reload check compares two sides, and a mismatch alone does not say which is wrong: the file (the adapter
        written is not the trained one), the in-memory forward (a forward that changes the model's state, or ranks
        that hold different copies of the frozen base), or the reloaded base (QLoRA: other 4-bit bits or
        quantization constants than the trained base's). Each is checked here, so one failed run tells."""
        findings = [f"the in-memory forward {repeat_note(logits_of(model, input_ids), expected)}",
                    f"across ranks {ranks_note(expected)}"]
        trained = gathered_trainable(model)  # collective: every rank
        base_bits = gathered_4bit_base(base)  # collective; {} without a 4-bit base
        if is_first_process():
            findings.append(f"the saved adapter {adapter_note(trained, path)}")
            if base_bits:
                findings.append(f"the reloaded 4-bit base {self.base_note(base_bits, base)}")
        return "diagnosis: " + "; ".join(findings)

    def base_note(self, trained: dict, base) -> str:
        """The trained 4-bit base (gathered) against the base quantized again as the check reloads it."""
        dtype = next(p.dtype for p in base.parameters() if not p.requires_grad)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        try:
            reloaded = gathered_4bit_base(self.load_whole(self.base_model, dtype, device))
        except Exception as e:  # noqa: BLE001 (an explanation must not hide the mismatch it explains)
            return f"could not be reloaded for the comparison ({type(e).__name__}: {e})"
        return tensors_note(trained, reloaded, "4-bit weights and quantization constants")


def repeat_note(again: torch.Tensor, first: torch.Tensor) -> str:
    diff = (again - first).abs().max().item()
    if diff == 0:
        return "is repeatable (a second forward gives the same logits)"
    return f"is NOT repeatable: a second forward differs by {diff:.3g} (a forward changed the model's state)"


def ranks_note(expected: torch.Tensor) -> str:
    """Every rank computes the same gathered model: their logits must agree bit for bit."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return "nothing to compare (one process)"
    reference = [expected if is_first_process() else None]
    dist.broadcast_object_list(reference, src=0)
    diffs = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, (expected - reference[0]).abs().max().item())
    if not any(diffs):
        return "the in-memory logits agree on every rank"
    return "the in-memory logits DIFFER between ranks (largest difference from rank 0 per rank: " + \
        ", ".join(f"{d:.3g}" for d in diffs) + "): the ranks do not compute the same model"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def gathered_trainable(model) -> dict[str, torch.Tensor]:
    """Every trainable (LoRA) weight, whole, on CPU; a collective under FSDP2 (every rank calls it)."""
    return {name: _full(p).float().cpu() for name, p in model.named_parameters() if p.requires_grad}


def gathered_4bit_base(base) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """The 4-bit base's NF4 layers (NF4Linear: --qlora under FSDP, the only 4-bit base a sharded run holds; a
    bitsandbytes base under FSDP is refused before the first step, sft/parallel/fsdp.py fsdp_qlora_problem): each
    inner tensor of its NF4Tensor (packed values, block scales, factors; torch's __tensor_flatten__ names them) as
    bytes, whole, on CPU. A collective under FSDP2 (every rank calls it, in one order)."""
    found = {}
    for name, module in base.named_modules():
        if not isinstance(module, NF4Linear):
            continue
        name = name.replace(".base_layer", "")  # peft's wrapper: the reloaded plain base has no such level
        weight = _full(module.weight)  # FSDP2: the NF4Tensor all-gathered through its own hooks
        inner, _ = weight.__tensor_flatten__()
        for key in inner:
            value = getattr(weight, key)
            found[f"{name}.weight.{key}"] = (value.reshape(-1).contiguous().view(torch.uint8).cpu(), value.dtype)
    return found


def tensors_note(trained: dict, other: dict, what: str) -> str:
    missing = sorted(set(trained) - set(other))
    differ = [k for k in trained if k in other and not torch.equal(trained[k][0], other[k][0])]
    if not missing and not differ:
        return f"is the trained one ({len(trained)} tensors of {what}, equal bit for bit)"
    return (f"DIFFERS from the trained one: {len(differ)} of {len(trained)} tensors of {what} differ"
            + (f" (first: {differ[0]})" if differ else "") + (f", {len(missing)} missing (first: {missing[0]})"
                                                              if missing else ""))


def adapter_note(trained: dict[str, torch.Tensor], path: Path) -> str:
    """The adapter file against the trained LoRA weights (peft saves them without the adapter's name)."""
    from safetensors.torch import load_file

    try:
        saved = load_file(Path(path) / ADAPTER_WEIGHTS)
    except Exception as e:  # noqa: BLE001
        return f"could not be read ({type(e).__name__}: {e})"
    names = {k: k.replace(".default.", ".") for k in trained}
    missing = [k for k, n in names.items() if n not in saved]
    worst = max((float((saved[n].float() - trained[k]).abs().max()) for k, n in names.items() if n in saved),
                default=0.0)
    if not missing and worst == 0:
        return f"holds exactly the trained LoRA weights ({len(trained)} tensors)"
    return (f"DIFFERS from the trained LoRA weights: {len(missing)} of {len(trained)} missing, the others differ by "
            f"up to {worst:.3g}" + (f" (first missing: {missing[0]})" if missing else ""))


def compare(expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, same_device: bool) -> str | None:
    if expected.shape != got.shape:
        return f"logits shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    if not torch.isfinite(expected).all():
        return "the trained model itself gives NaN/inf logits (training diverged; see --nan_policy)"
    scale = max(1.0, expected.abs().max().item())
    # Same device: same weights through the same kernels, identical but for a rounding step. Other device:
    # other kernels round differently. A missing, stale or mis-cast tensor moves logits by O(scale).
    half = dtype in (torch.bfloat16, torch.float16)
    tolerance = (1e-2 if half else 1e-5) if same_device else (3e-2 if half else 1e-3)
    diff = (expected - got).abs().max().item()
    if not diff <= tolerance * scale:  # `not <=` also catches NaN
        return f"logits differ by up to {diff:.3g} on a fixed batch (allowed {tolerance * scale:.3g})"
    return None


def make_verifier(mode: str, model, model_path: str, lora: bool, attn_implementation: str,
                  trust_remote_code: bool, fp8_recipe: str | None = None,
                  base_overrides: dict | None = None) -> SaveVerifier | None:
    """--verify_saves: auto (final save always; checkpoints too under LoRA, checked in place, or when the model
    has < 1e9 parameters), all, final, no. `fp8_recipe`: torchao's recipe of a full fine-tune in FP8.
    `base_overrides`: the config values the base was loaded with (--rope_scaling), for a LoRA reload."""
    if mode == "no":
        return None
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 holds shards
    in_place = not (lora and tied_copies(model))  # peft cannot load a second adapter's tied copies beside the first
    cheap = (lora and in_place and not is_sharded(model)) or n < CHEAP_PARAMETERS
    every_checkpoint = mode == "all" or (mode == "auto" and cheap)
    return SaveVerifier(model_path, lora, attn_implementation, trust_remote_code, checkpoints=every_checkpoint,
                        lora_in_place=in_place, quantization=quantization_of(model), fp8_recipe=fp8_recipe,
                        base_overrides=dict(base_overrides or {}))


def quantization_of(model) -> dict | None:
    """The BitsAndBytesConfig (as a dict) of a base loaded in 4 bits (--qlora), or the NF4 settings of one
    quantized for FSDP (sft/model/nf4_base.py), else None."""
    from sft.model.nf4_base import nf4_settings

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(getattr(base, "hf_quantizer", None), "quantization_config", None)
    if config is None or not getattr(base, "is_loaded_in_4bit", False):
        return nf4_settings(base)
    return config.to_dict()
