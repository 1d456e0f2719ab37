"""The libraries' private names that deepseek-sft overrides or patches, each checked before it is used.

A private name can move or change in any release, and a patch over a name that moved does nothing, in silence: the
NaN guard stops guarding, the folded clipping stops folding. So every one of them is a row of PRIVATE_NAMES (where
it lives, the parameters we rely on, the versions we tested it on), and `expect(row)` runs before the override is
used or the patch applied: it returns the object, or stops with one `error:` line naming the library, its version
and what to install. tests/test_private_names.py checks every row against the installed libraries, so a release
that changes one fails the suite (and `.ci/newest`) instead of a user's run.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sft.errors import LibraryMismatch


@dataclass(frozen=True)
class PrivateName:
    """`module` + `attribute` (dotted inside the module) of `library`, which we rely on having `parameters` (the
    leading parameter names, in order; None: not callable or not checked) in `versions`."""

    library: str  # the distribution's name, for its version: "transformers", "torchao"
    module: str
    attribute: str
    parameters: tuple[str, ...] | None
    versions: str  # the range tested, e.g. ">=5.17,<5.26"
    why: str  # what we do with it, for the error line

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


TRAINER = "transformers.trainer"
TESTED_TRANSFORMERS = ">=5.17,<5.26"
TESTED_TORCHAO = ">=0.18,<0.19"
TESTED_TORCH = ">=2.6,<2.15"
TESTED_PEFT = ">=0.21,<0.23"

# The Trainer's private methods that SFTTrainer (sft/trainer.py) and TensorParallelTrainer override.
CLIP_GRAD_NORM = PrivateName("transformers", TRAINER, "Trainer._clip_grad_norm", ("self", "model"),
                             TESTED_TRANSFORMERS, "the folded gradient clipping of --optim adamw_bf16_sr")
GET_GRAD_NORM = PrivateName("transformers", TRAINER, "Trainer._get_grad_norm", ("self", "model", "grad_norm"),
                            TESTED_TRANSFORMERS, "the NaN guard's look at the gradient norm")
TRACK_NUM_INPUT_TOKENS = PrivateName("transformers", TRAINER, "Trainer._track_num_input_tokens", ("self", "inputs"),
                                     TESTED_TRANSFORMERS, "the token count made on the host (no wait for the GPU)")
SAVE_CHECKPOINT = PrivateName("transformers", TRAINER, "Trainer._save_checkpoint", ("self", "model", "trial"),
                              TESTED_TRANSFORMERS,
                              "the token count summed over ranks before trainer_state.json; tensor-parallel checkpoints")
LOAD_FROM_CHECKPOINT = PrivateName("transformers", TRAINER, "Trainer._load_from_checkpoint",
                                   ("self", "resume_from_checkpoint", "model"), TESTED_TRANSFORMERS,
                                   "tensor-parallel checkpoints that resume")
LOAD_OPTIMIZER = PrivateName("transformers", TRAINER, "Trainer._load_optimizer_and_scheduler",
                             ("self", "checkpoint"), TESTED_TRANSFORMERS, "tensor-parallel checkpoints that resume")
GET_OUTPUT_DIR = PrivateName("transformers", TRAINER, "Trainer._get_output_dir", ("self", "trial"),
                             TESTED_TRANSFORMERS, "tensor-parallel checkpoints that resume")
SAVE_RNG_STATE = PrivateName("transformers", TRAINER, "Trainer._save_rng_state", ("self", "output_dir"),
                             TESTED_TRANSFORMERS, "tensor-parallel checkpoints that resume")
# peft casts each LoRA layer's input to the adapter's dtype; under autocast we skip that round trip
PEFT_INPUT_CAST = PrivateName("peft", "peft.tuners.lora.layer", "LoraLayer._cast_input_dtype",
                              ("self", "x", "dtype"), TESTED_PEFT, "LoRA inputs not cast to fp32 under autocast")
# --lora_experts (sft/speed/expert_lora.py): peft builds our wrapper of the fused experts through its custom-module
# dispatch, and the wrapper runs transformers' grouped matmul of the experts (with its fallbacks: non-bf16 weights
# under compile, CPUs) for the base weights and the adapter's factors alike.
PEFT_CUSTOM_MODULES = PrivateName("peft", "peft.tuners.lora.config", "LoraConfig._register_custom_module",
                                  ("self", "mapping"), TESTED_PEFT, "LoRA on the routed experts, low-rank")
GROUPED_LINEAR = PrivateName("transformers", "transformers.integrations.moe", "_grouped_linear",
                             ("input", "weight", "offs", "bias", "is_transposed"), TESTED_TRANSFORMERS,
                             "LoRA on the routed experts, low-rank")
# accelerate's mixed precision (in prepare_model) wraps model.forward in autocast and keeps the model's own as
# `model._original_forward`; verified saves run that one (sft/safety/verify.py checks the attribute at use too).
ACCELERATE_ORIGINAL_FORWARD = PrivateName("accelerate", "accelerate.accelerator", "Accelerator.prepare_model",
                                          ("self", "model", "device_placement", "evaluation_mode"), ">=1.15,<1.17",
                                          "verified saves compare logits without autocast (model._original_forward)")
# torchao's low-bit AdamW (sft/speed/lowbit.py): what its three patches replace.
TORCHAO_ADAM_LOAD = PrivateName("torchao", "torchao.optim.adam", "_AdamBase.load_state_dict",
                                ("self", "state_dict"), TESTED_TORCHAO, "fp32-looking low-bit states after a resume")
TORCHAO_SUBCLASS_ZEROS = PrivateName("torchao", "torchao.optim.adam", "AdamW8bit._subclass_zeros",
                                     ("p", "signed", "block_size"), TESTED_TORCHAO, "fp32-looking low-bit states")
TORCHAO_SINGLE_PARAM_ADAM = PrivateName("torchao", "torchao.optim.adam", "single_param_adam",
                                        ("p", "grad", "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
                                        TESTED_TORCHAO, "low-bit AdamW updates in chunks (bounded temporaries)")
DTENSOR_CACHE_KEY = PrivateName("torch", "torch.distributed.tensor", "DTensor._stable_hash_for_caching", ("self",),
                                TESTED_TORCH, "one compiled torchao update per state type under FSDP2")
DUCK_SHAPE = PrivateName("torch", "torch.fx.experimental._config", "use_duck_shape", None, TESTED_TORCH,
                         "adamw_bf16_sr's one compiled update for every parameter")
# --compile_layers (sft/speed/regional_compile.py): a side effect in a checkpointed layer's forward (kernels' context
# variable, which transformers' attention classes set and reset in every forward once `kernels` is installed: a
# dependency from transformers 5.25) is not replayed in the backward's recompute instead of breaking the graph.
SKIP_SIDE_EFFECTS_IN_RECOMPUTE = PrivateName("torch", "torch._dynamo.config",
                                             "skip_fwd_side_effects_in_bwd_under_checkpoint", None, TESTED_TORCH,
                                             "--compile_layers with activation checkpointing in one graph per layer")
# --compile_layers (sft/speed/regional_compile.py): inductor's multi-kernel reductions, set unless the user set them.
INDUCTOR_MULTI_KERNEL = PrivateName("torch", "torch._inductor.config", "triton.multi_kernel", None, TESTED_TORCH,
                                    "--compile_layers: persistent row reductions benchmarked against looped ones")
# --compile_layers (sft/speed/shared_input_adapters.py): the pass that lets the adapters reading one input share one
# matmul, set unless a pass of the user's own is there; its base class keys inductor's cache by the pass's uuid.
PRE_GRAD_CUSTOM_PASS = PrivateName("torch", "torch._inductor.config", "pre_grad_custom_pass", None, TESTED_TORCH,
                                   "--compile_layers: the LoRA adapters that read one input sharing one matmul")
CUSTOM_GRAPH_PASS = PrivateName("torch", "torch._inductor.custom_graph_pass", "CustomGraphPass.uuid", ("self",),
                                TESTED_TORCH, "--compile_layers: the LoRA adapters that read one input sharing one matmul")
# Read, not patched, but a rename would change what we decide in silence.
HF_DEEPSPEED_CONFIG = PrivateName("transformers", "transformers.integrations.deepspeed", "_hf_deepspeed_config_weak_ref",
                                  None, TESTED_TRANSFORMERS, "loading a whole model for verification under ZeRO-3")
FSDP_STATE = PrivateName("torch", "torch.distributed.fsdp", "FSDPModule._get_fsdp_state", ("self",), TESTED_TORCH,
                         "--qlora under FSDP: which parameter groups hold 4-bit weights")
# Called, not patched: DDP's own (underscored) way to leave tensors out of its broadcast and all-reduce.
DDP_IGNORE = PrivateName("torch", "torch.nn.parallel", "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
                         ("module", "params_and_buffers_to_ignore"), TESTED_TORCH,
                         "--quantize_experts under DDP: the frozen e4m3 experts, equal on every rank, kept out of "
                         "DDP's first broadcast (gloo cannot send float8)")
# Called, not patched: which checkpoints transformers renames or fuses as it loads (a module without a public
# export); --qlora under FSDP reads a checkpoint weight by weight only where it converts nothing (sft/model/nf4_loading.py).
CONVERSION_MAPPING = PrivateName("transformers", "transformers.conversion_mapping", "get_model_conversion_mapping",
                                 ("model", "key_mapping", "hf_quantizer", "add_legacy"), TESTED_TRANSFORMERS,
                                 "--qlora under FSDP: which checkpoints can be read weight by weight")
# Overridden: the hooks an HfQuantizer subclass implements (transformers' documented way to write a quantizer, under
# underscored names); --quantize_experts fp8 quantizes the routed experts as they load (sft/model/experts_on_load.py).
QUANTIZER_BEFORE_LOADING = PrivateName("transformers", "transformers.quantizers.base",
                                       "HfQuantizer._process_model_before_weight_loading", ("self", "model"),
                                       TESTED_TRANSFORMERS, "--quantize_experts fp8: the experts quantized as they load")
QUANTIZER_AFTER_LOADING = PrivateName("transformers", "transformers.quantizers.base",
                                      "HfQuantizer._process_model_after_weight_loading", ("self", "model"),
                                      TESTED_TRANSFORMERS, "--quantize_experts fp8: the experts quantized as they load")

# Read, not patched: --offload_activations (sft/speed/activation_offload.py) checks saved tensors' versions itself
# (autograd does not once saved-tensor hooks are set) and leaves parameters' views on the GPU.
TENSOR_VERSION = PrivateName("torch", "torch", "Tensor._version", None, TESTED_TORCH,
                             "--offload_activations: a saved activation changed in place stops the backward")
TENSOR_BASE = PrivateName("torch", "torch", "Tensor._base", None, TESTED_TORCH,
                          "--offload_activations: views of parameters stay on the GPU")
# Read, not patched: a bench row records how many modules ran compiled in place (bench/train_throughput.py
# fast_paths_ran; nn.Module.compile keeps the compiled call there), which the planner's check reads (sft/plan/rows.py).
COMPILED_CALL = PrivateName("torch", "torch.nn", "Module._compiled_call_impl", None, TESTED_TORCH,
                            "bench rows' count of the layers compiled in place (--compile_layers)")

# Not underscored, but not exported at transformers' top level either: the packed rows' mask from the collator's
# documents (sft/speed/packed_mask.py), the function transformers and-s in when it finds the documents itself.
PACKED_MASK = PrivateName("transformers", "transformers.masking_utils", "packed_sequence_mask_function",
                          ("packed_sequence_mask",), TESTED_TRANSFORMERS,
                          "the packed rows' attention mask built from the collator's documents (no wait for the GPU)")

PRIVATE_NAMES = (CLIP_GRAD_NORM, GET_GRAD_NORM, SAVE_CHECKPOINT, LOAD_FROM_CHECKPOINT, LOAD_OPTIMIZER, GET_OUTPUT_DIR,
                 SAVE_RNG_STATE,
                 PEFT_INPUT_CAST, PEFT_CUSTOM_MODULES, GROUPED_LINEAR, ACCELERATE_ORIGINAL_FORWARD, TORCHAO_ADAM_LOAD,
                 TORCHAO_SUBCLASS_ZEROS, TORCHAO_SINGLE_PARAM_ADAM, DTENSOR_CACHE_KEY, DUCK_SHAPE,
                 SKIP_SIDE_EFFECTS_IN_RECOMPUTE, INDUCTOR_MULTI_KERNEL, PRE_GRAD_CUSTOM_PASS, CUSTOM_GRAPH_PASS,
                 HF_DEEPSPEED_CONFIG, FSDP_STATE, DDP_IGNORE,
                 CONVERSION_MAPPING,
                 TENSOR_VERSION, TENSOR_BASE, TRACK_NUM_INPUT_TOKENS, QUANTIZER_BEFORE_LOADING,
                 QUANTIZER_AFTER_LOADING, PACKED_MASK, COMPILED_CALL)


@functools.cache  # read once per process: a library's version does not change under a running process
def installed_version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def replaces(new, original) -> None:
    """Mark `new`, installed under a private name in place of `original`: the check reads the original's
    signature (a test that installed it earlier in the process must not make the next check fail)."""
    new._sft_replaced = original


def leading_parameters(target) -> tuple[str, ...] | None:
    target = getattr(target, "_sft_replaced", target)  # ours, installed by replaces(): the library's original
    try:
        return tuple(inspect.signature(inspect.unwrap(target)).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def problem(row: PrivateName, resolve=importlib.import_module) -> tuple[object | None, str | None]:
    """-> (the object, None) when `row` is what we expect, else (None, what differs)."""
    version = installed_version(row.library)
    if version != "not installed" and Version(Version(version).base_version) not in SpecifierSet(row.versions):
        return None, f"version {version} is outside the tested {row.versions}"
    try:
        target = resolve(row.module)
        for part in row.attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return None, f"{row.name} does not exist"
    if row.parameters is not None:
        found = leading_parameters(target)
        if found is None or found[:len(row.parameters)] != row.parameters:
            return None, f"{row.name} takes {found}, not {row.parameters}"
    return target, None


def expect(row: PrivateName):
    """The object `row` names, checked (see the module docstring); a LibraryMismatch error otherwise."""
    target, differs = problem(row)  # not cached: the object as it is now (microseconds; called before each use)
    if differs:
        raise LibraryMismatch(
            f"{row.library} {installed_version(row.library)}: {differs}, which deepseek-sft uses for {row.why}. "
            f"Install the tested versions: pip install -c constraints.txt -e . (from the repository), or "
            f"pip install '{row.library}{row.versions}'.")
    return target
