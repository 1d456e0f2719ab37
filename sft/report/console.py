"""What a run prints: third-party noise kept away, the first screen (what is about to be trained, how, for how long,
where the outputs go) and the last one (where the model is, what to run next).

Where the noise came from (transformers 5.24, accelerate 1.15, deepspeed 0.19.8, torchao 0.18, torch 2.13):
- torchao: `from transformers import Trainer` (or any model class) imports `transformers.modeling_utils`, whose
  quantizer registry imports `quantizers/quantizer_torchao.py`, which imports torchao whenever it is installed.
  torchao's `__init__` then logs "Failed to load .../torchao/_C_mxfp8...so" and "..._C_cutlass_90a.abi3.so" (CUDA
  fp8 kernels that cannot load here: a CPU torch, and a cpython-310 build on 3.11), and registering its enums logs
  torch's `_pytree` "register_constant() on Enum subclasses is deprecated". Our own code imports torchao only in
  sft/speed/lowbit.py's patch functions (a low-bit --optim); `sft.options.arguments` reads only a name list from sft/speed/lowbit.py.
- deepspeed: accelerate's `extract_model_from_parallel` (every `Trainer(...)`, through `unwrap_model`) runs
  `from deepspeed import DeepSpeedEngine` whenever deepspeed is installed, whatever the strategy; importing it picks
  an accelerator and, with no GPU, logs "[WARNING] [real_accelerator.py] Setting accelerator to CPU...".
- Liger: transformers imports liger_kernel only under --use_liger_kernel (inside `apply_liger_kernel`).
Keeping those imports away would mean patching transformers' and accelerate's availability checks; instead the
messages themselves are filtered, each by its logger (or warning category and module) and its text: other messages
of the same libraries still show.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import shlex
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from sft.machine import is_first_process, launch  # the environment only: cheap, and no torch
from sft.safety.run_dir import TENSORBOARD_DIR


class _Drop(logging.Filter):
    """A logger filter dropping the records `matches` selects. A filter (not a level) because DeepSpeed resets
    its logger's level when it is imported, and a level would hide everything else that logger says."""

    def __init__(self, matches: Callable[[logging.LogRecord], bool]):
        super().__init__()
        self.matches = matches

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.matches(record)


def _torchao_kernel_not_loaded(record: logging.LogRecord) -> bool:
    # torchao's optional CUDA kernel libraries (fp8/mx quantization); the low-bit AdamW we use never calls them.
    message = str(record.msg)
    return message.startswith("Failed to load ") and "/torchao/_C" in message


def _torchao_enum_registration(record: logging.LogRecord) -> bool:
    # torch 2.13 deprecates what torchao 0.18 does for its own enums at import; nothing to act on for us.
    return (str(record.msg).startswith("%s is an Enum subclass and is now natively supported")
            and bool(record.args) and getattr(record.args[0], "__module__", "").startswith("torchao"))


def _deepspeed_cpu_accelerator(record: logging.LogRecord) -> bool:
    # With a CPU-only torch there is no GPU to detect: the advice "if you have a GPU..." cannot apply. With a CUDA
    # torch that sees no GPU the warning stays (a driver problem is worth seeing).
    torch = sys.modules.get("torch")
    cpu_only_torch = torch is not None and getattr(torch.version, "cuda", None) is None \
        and getattr(torch.version, "hip", None) is None
    return cpu_only_torch and str(record.msg).startswith("Setting accelerator to CPU.")


_installed: set[str] = set()


def quiet_imports() -> None:
    """Filter the known harmless messages that importing transformers (torchao) and building a Trainer (deepspeed)
    print. Stdlib only, idempotent, any rank: call it before the first transformers import of a command (sft/train.py
    at its top; sft/__init__.py can do it for every `python -m sft.<command>`)."""
    if "imports" not in _installed:  # (warnings.filterwarnings replaces an identical filter by itself)
        _installed.add("imports")
        logging.getLogger("torchao").addFilter(_Drop(_torchao_kernel_not_loaded))
        logging.getLogger("torch.utils._pytree").addFilter(_Drop(_torchao_enum_registration))
        logging.getLogger("DeepSpeed").addFilter(_Drop(_deepspeed_cpu_accelerator))
    # peft reads transformers' deprecated `is_gradient_checkpointing` alias when it wraps a model (every --lora run).
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module="transformers.modeling_utils")
    # The Trainer asks for pinned memory by default; without an accelerator torch ignores it and says so each run.
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator is found",
                            category=UserWarning, module="torch.utils.data.dataloader")


def quiet_libraries(main_process: bool | None = None) -> None:
    """At the start of training, before options, data and model (transformers may already be imported):
    `quiet_imports` (which only works before that import), then
    - progress bars that are noise off: transformers' "Loading weights" / "Writing model shards" and datasets'
      "Tokenizing" / "Saving the dataset" maps (the data summary reports what they did). Hub download bars stay on
      the main process (a download takes minutes); the Trainer's training bar is its own (rank 0 only) and stays.
    - the other ranks log errors only (transformers, datasets, accelerate, torch, peft, torchao, DeepSpeed) and show
      no Python warnings: rank 0 shows the same ones once. The Trainer resets transformers' level to
      `--log_level_replica` when it is built: keep that at "error" (or "passive").
    main_process: None reads the launcher's RANK (torchrun, accelerate launch and deepspeed set it; unset = one
    process), which is known before TrainingArguments exists."""
    if main_process is None:
        main_process = is_first_process()
    quiet_imports()
    if "libraries" in _installed:
        return
    _installed.add("libraries")
    import datasets
    import huggingface_hub.utils as hub
    import transformers.utils.logging as hf_logging  # neither imports torch nor torchao

    hub_bars = not hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # also turns huggingface_hub's download bars off: back on below
    datasets.disable_progress_bars()
    if main_process and hub_bars:
        hub.enable_progress_bars()
    if not main_process:
        hf_logging.set_verbosity_error()
        datasets.logging.set_verbosity_error()
        for name in ("accelerate", "torch", "peft", "torchao"):
            logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger("DeepSpeed").addFilter(_Drop(lambda record: record.levelno < logging.ERROR))
        warnings.simplefilter("ignore")


# ---- the first screen and the last one ---------------------------------------------------------------------------

def count(n: float) -> str:
    """4_260_000 -> '4.26M'; three significant digits, the way model sizes are spoken of."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def tensorboard_dir(output_dir: str, report_to: list[str] | str | None) -> str | None:
    """Where the Trainer's TensorBoardCallback writes (None when TensorBoard is not a logger of this run):
    $TENSORBOARD_LOGGING_DIR, else <output_dir>/runs/<date>_<host>; --logdir on the `runs` folder shows every run."""
    if "tensorboard" not in ([report_to] if isinstance(report_to, str) else (report_to or [])):
        return None
    return os.path.expanduser(launch().tensorboard_logging_dir or str(Path(output_dir).resolve() / TENSORBOARD_DIR))


def run_overview(*, model: str, architecture: str, total_params: int, trainable_params: int, dtype: str,
                 adapter_dtype: str | None, mixed_precision: str | None, lora_rank: int | None, processes: int,
                 strategy: str, devices: str,
                 per_device_batch: int, grad_accum: int, data_parallel: int, mean_row_tokens: float | None,
                 max_steps: int, epochs: float | None, resume_step: int, output_dir: str, saves: str,
                 tensorboard: str | None, speed: tuple[str, ...] = (), held: str | None = None,
                 memory: str | None = None, rslora: bool = False,
                 trained_whole: tuple[list[str], int] = ([], 0)) -> str:
    """The first screen of a run, from plain values (sft.report.callbacks.RunOverview gathers them at train begin).
    dtype: of the weights; adapter_dtype: of the LoRA weights when it differs; mixed_precision: "bf16", "fp16" or
    None; epochs: None when --max_steps set the length; speed: the fast paths chosen by default, and why
    (sft/options/resolve.py fast_paths_where_supported); held: what is held where (sft/report/placement.py) and
    memory: the planner's peak for the run, both for MoE and quantized-base runs; trained_whole: the modules
    trained whole beside a LoRA adapter (--lora_modules_to_save) and their parameters. The first line keeps the
    words 'Training on N process(es)' that the launch tests look for."""
    rows = per_device_batch * grad_accum * data_parallel
    if lora_rank:
        trained = (f"LoRA r={lora_rank}{' (rsLoRA: alpha / sqrt(r))' if rslora else ''}: {count(trainable_params)} "
                   f"trainable parameters "
                   f"({100 * trainable_params / max(total_params, 1):.2g}% of {count(total_params)})")
        names, whole = trained_whole
        if names:
            trained += f", {count(whole)} of them in {', '.join(names)} (trained whole)"
    elif trainable_params == total_params:
        trained = f"all {count(trainable_params)} parameters (full fine-tune)"
    else:
        trained = f"{count(trainable_params)} of {count(total_params)} parameters"
    precision = f"{dtype} weights" + (f", {adapter_dtype} adapter" if adapter_dtype else "") \
        + (f", {mixed_precision} mixed precision" if mixed_precision else "")
    factors = [f"{per_device_batch} per device"] + [f"{data_parallel} data-parallel"] * (data_parallel > 1) \
        + [f"{grad_accum} accumulation steps"] * (grad_accum > 1)
    batch = f"{rows} rows per optimizer step" + (f" = {' x '.join(factors)}" if len(factors) > 1 else "")
    length = "--max_steps" if epochs is None else f"{epochs:g} epoch{'s' if epochs != 1 else ''}"
    steps = f"{max_steps:,} optimizer step{'s' if max_steps != 1 else ''} ({length})"
    steps += f"; resuming after step {resume_step:,}" if resume_step else ""
    what = "LoRA adapter" if lora_rank else "model"
    lines = [
        f"Training on {processes} process(es) ({strategy}) on {devices}",
        ("model", f"{model}: {architecture}, {count(total_params)} parameters"),
        ("trained", trained),
        ("precision", precision),
        ("speed", ("\n" + " " * 15).join(speed)),  # one choice a line, under the first
        ("held", held),
        ("memory", memory),
        ("batch", batch),
        ("tokens", mean_row_tokens and f"~{round(rows * mean_row_tokens):,} real tokens per optimizer step "
                                       f"({mean_row_tokens:,.0f} per row on average)"),
        ("steps", steps),
        ("output", f"{Path(output_dir).resolve()}  (the final {what} and tokenizer)"),
        ("checkpoints", saves),
        ("tensorboard", tensorboard and f"tensorboard --logdir {shlex.quote(tensorboard)}"),
    ]
    return "\n".join(line if isinstance(line, str) else f"  {line[0]:<12} {line[1]}"
                     for line in lines if isinstance(line, str) or line[1])


FIRST_PROMPT = "Hello! Who are you?"  # what a chat model trained on the user's own data is first asked


def tool_command(tool: str) -> str:
    """The command a user types for one of our tools (chat, merge): `deepseek-sft <tool>` where the console script
    (pyproject.toml's [project.scripts]) is on PATH, else `python -m sft.tools.<tool>` (a checkout used without
    installing it)."""
    return f"deepseek-sft {tool}" if shutil.which("deepseek-sft") else f"python -m sft.tools.{tool}"


def closing_lines(output_dir: str, lora: bool, tensorboard: str | None, prompt: str = FIRST_PROMPT) -> str:
    """The last screen: where the result is and the commands that use it (paths quoted for the shell). `prompt`:
    the first chat question suggested (the demo's is one its data taught)."""
    out = Path(output_dir).resolve()
    here = shlex.quote(str(out))
    lines = [f"\nSaved {'LoRA adapter' if lora else 'model'} and tokenizer: {out}"]
    if tensorboard:
        lines.append(f"TensorBoard logs: {tensorboard}")
    lines.append("Next:")
    lines.append(f"  {tool_command('chat')} {here} --prompt {shlex.quote(prompt)}   # or without --prompt: a chat")
    if lora:
        lines.append(f"  {tool_command('merge')} {here} {shlex.quote(str(out) + '-merged')}   # a plain model, "
                     f"adapter merged in")
    if tensorboard:
        lines.append(f"  tensorboard --logdir {shlex.quote(tensorboard)}")
    return "\n".join(lines)


class ToolParser(argparse.ArgumentParser):
    """argparse for the user tools (sft.tools.chat, sft.tools.merge, sft.plan.planner): an error is one line and exit
    code 2, not a usage block; a misspelt option gets a "did you mean", as train.py's do."""

    def error(self, message: str):
        self.exit(2, f"error: {message}{self.did_you_mean(message)} ({self.prog} --help)\n")

    def did_you_mean(self, message: str) -> str:
        """'; did you mean --model (for --modle)?' for argparse's `unrecognized arguments: ...`; else ''."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = sorted(set(re.findall(r"--[\w-]+", self.format_usage())))  # the usage line names every option
        guesses = [(close[0], word) for word in message.split(":", 1)[1].split() if word.startswith("--")
                   for close in [difflib.get_close_matches(word.split("=")[0], known, n=1)] if close]
        if not guesses:
            return ""
        return "; did you mean " + ", ".join(f"{ours} (for {theirs})" for ours, theirs in guesses) + "?"
