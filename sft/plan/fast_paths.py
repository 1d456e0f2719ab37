"""The fast paths a plan runs with: --fp8 and --compile_layers as the run itself settles them, so that the planner
predicts the memory and speed of what its command will run.

`auto` (the default of both) is on wherever the run's own checks for it pass (sft/options/resolve.py
fast_paths_where_supported). The planner does not restate those rules: it asks that function, and the checks a
`true` meets, of the plan's box and strategy described as data (a Machine of the box's GPUs and the launch its
accelerate config sets up), as tests describe machines. Without torch or transformers: the planner's command line
reads no GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import SimpleNamespace

from sft.errors import ConfigError
from sft.machine import OPTIONAL_PACKAGES, Machine, gpu_kind
from sft.options.checks import (Options, compiled_layers_combinations, fp8_base_needs, fp8_combinations,
                                qlora_under_fsdp_awaits_its_gpu_run)
from sft.options.resolve import chunked_loss_allowed, fast_paths_where_supported
from sft.options.switches import FastPathSwitches
from sft.parallel.strategies import STRATEGIES

NAMES = {"fp8+compiled": "FP8 + compiled layers", "compiled": "compiled layers", "fp8": "FP8", "": "neither"}


@dataclass(frozen=True)
class Asked:
    """--fp8 and --compile_layers as given to the planner or to sft/train.py (auto, true or false), and the Trainer's
    --torch_compile, which the compiled layers give way to."""

    fp8: str = "auto"
    compile_layers: str = "auto"
    torch_compile: bool = False

    def flags(self) -> list[str]:
        """What a plan's command passes so that it runs as planned: only what differs from the default (auto)."""
        return [f"--{name} {value}" for name, value in (("fp8", self.fp8), ("compile_layers", self.compile_layers))
                if value != "auto"]


@dataclass(frozen=True)
class FastPaths:
    """What a plan runs with, and why (the run's own words for its first screen)."""

    fp8: bool = False
    compiled: bool = False
    notes: tuple[str, ...] = ()   # sft/options/resolve.py's, one per `auto`: on, or off and the check's reason
    refused: str | None = None    # a `true` the plan's strategy refuses: the run's error (the plan cannot run)
    planned_off: tuple[str, ...] = ()  # what the planner set to false for memory, with why (plans._with_levers)

    @property
    def label(self) -> str:
        """The snapshot's name for them: fp8+compiled, compiled, fp8 or "" (neither)."""
        return "+".join(name for name, on in (("fp8", self.fp8), ("compiled", self.compiled)) if on)

    @property
    def name(self) -> str:
        return NAMES[self.label]


@dataclass
class _ModelOptions(FastPathSwitches):
    """The model options the rule and its checks read, as sft/options/arguments.py's ModelArguments holds them for
    a run (building that imports transformers, which a plan does not need); tests/test_plan.py checks that a plan's
    command, parsed and resolved on the plan's machine, runs with what this says."""

    fp8: str
    compile_layers: str
    tp_size: int = 1
    quantize_experts: str = "none"  # compiled layers beside it: off by default until their GPU loss check (resolve.py)
    speed_choices: tuple[str, ...] = ()
    chunked_loss: str = "false"


def described_machine(gpu: str, gpus: int, memory_gib: float) -> Machine:
    """A box of `gpus` x `gpu` (a name of sft/machine.py's GPU_KINDS; of another, the compute capability is not
    known) as data, with the GPU extras the planner's commands use installed (Liger; torchao for a full fine-tune
    in FP8: `pip install 'deepseek-sft[lowbit]'`)."""
    kind = gpu_kind(gpu)
    capability = kind[1].capability if kind else None
    return Machine(gpu_names=(gpu,) * gpus, gpu_memory_gib=(memory_gib,) * gpus,
                   gpu_capabilities=(capability,) * gpus if capability else (),
                   bf16=bool(capability) and capability >= (8, 0), packages=frozenset(OPTIONAL_PACKAGES))


@functools.lru_cache(maxsize=None)
def fast_paths(machine: Machine, strategy: str, world: int, method: str, asked: Asked = Asked(),
               quantize_experts: str = "none") -> FastPaths:
    """What a run of `method` (lora, qlora, full) under `strategy` on `world` of `machine`'s GPUs runs with, for the
    --fp8/--compile_layers `asked` (and --quantize_experts, which the rule reads): sft/options/resolve.py's rule,
    then the checks an option set to true meets."""
    s = STRATEGIES[strategy]
    m = dataclasses.replace(machine, launch=s.launch(world))
    model = _ModelOptions(asked.fp8, asked.compile_layers, tp_size=world if s.sharded_kind == "tp" else 1,
                          quantize_experts=quantize_experts)
    o = Options(model, None, plain_lora(method),
                SimpleNamespace(torch_compile=asked.torch_compile, fsdp=""))
    fast_paths_where_supported(o, m)
    refused = None
    for check in (compiled_layers_combinations, fp8_combinations, fp8_base_needs):
        try:
            check(o, m)
        except ConfigError as e:
            refused = refused or str(e)
    return FastPaths(model.fp8_on, model.compile_layers_on, model.speed_choices, refused)


@functools.lru_cache(maxsize=None)
def loss_in_chunks_by_default(strategy: str, world: int, method: str, fused_loss: bool) -> bool:
    """Whether a plan's run computes its loss in chunks without being asked (--chunked_loss auto, the default) under
    `strategy` on `world` processes, with Liger's fused loss or not: the run's own rule (sft/options/resolve.py
    loss_in_chunks_unless_liger), asked of the plan's launch described as data."""
    return chunked_loss_allowed(*_launch_of(strategy, world, method, fused_loss))


def loss_in_chunks_allowed(strategy: str, world: int, method: str) -> bool:
    """Whether a plan's run may take --chunked_loss true (without Liger): what its `auto` gives without Liger."""
    return loss_in_chunks_by_default(strategy, world, method, False)


def _launch_of(strategy: str, world: int, method: str, fused_loss: bool) -> tuple[Options, Machine]:
    """A plan's run as the run's rules read it: its options and its launch, described as data."""
    s = STRATEGIES[strategy]
    model = _ModelOptions("false", "false", tp_size=world if s.sharded_kind == "tp" else 1, chunked_loss="auto")
    o = Options(model, None, plain_lora(method), SimpleNamespace(use_liger_kernel=fused_loss, sequence_parallel=1))
    return o, Machine(launch=s.launch(world))


# The run's refusals of a whole kind of plan until its GPU check passes: a plan they refuse fits, but cannot run yet.
AWAITING_CHECKS = (qlora_under_fsdp_awaits_its_gpu_run,)


def plain_lora(method: str) -> SimpleNamespace:
    """The LoRA options of a planned `method`: the planner plans plain LoRA (no DoRA), and its commands set
    --lora_dropout 0 (sft/plan/plan_text.py)."""
    return SimpleNamespace(lora=method != "full", qlora=method == "qlora", use_dora=False, lora_dropout=0.0)


@functools.lru_cache(maxsize=None)
def refused_today(machine: Machine, strategy: str, world: int, method: str) -> str | None:
    """The run's error for a plan of `method` under `strategy` on `world` of `machine`'s GPUs that one of
    AWAITING_CHECKS refuses (--qlora under FSDP until bench/qlora_check.py --fsdp two passes), else None: asked of
    the run's own check, as fast_paths asks its rule."""
    m = dataclasses.replace(machine, launch=STRATEGIES[strategy].launch(world))
    o = Options(_ModelOptions("false", "false"), None, plain_lora(method),
                SimpleNamespace(torch_compile=False, fsdp=""))
    for check in AWAITING_CHECKS:
        try:
            check(o, m)
        except ConfigError as e:
            return str(e)
    return None
