"""What the terminal shows while a run trains: one short line per log instead of the Trainer's metric dicts, no
nested evaluation bars where the output is not a terminal, and always the last step's loss.

transformers' ProgressCallback (PrinterCallback without tqdm) prints every log as a dict of 7-9 fields, which
wraps and runs into the progress bar (the demo: 43 of them in 150 lines); the dicts stay whole in trainer_log.jsonl
and TensorBoard. Its evaluation bar, piped to a file, is a line of cursor codes per evaluation. SFTTrainer puts
these subclasses in the Trainer's place (sft/trainer.py).
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback, TrainerCallback


def log_line(logs: dict, step: int, max_steps: int) -> str | None:
    """A training log -> `step 10/220 (epoch 0.91): loss 5.845, lr 3.00e-03, 3,838 tok/s`; an evaluation's ->
    `step 11/220 (epoch 1): eval loss 3.809 (perplexity 45.1)`; the final metrics (train_loss: the run summary
    says them) and anything else -> None."""
    where = f"step {step:,}/{max_steps:,}" + (f" (epoch {logs['epoch']:.3g})" if "epoch" in logs else "")
    if "loss" in logs:
        parts = [f"loss {logs['loss']:.4g}"]
        if "learning_rate" in logs:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        if "real_tokens_per_second" in logs:
            parts.append(f"{logs['real_tokens_per_second']:,.0f} tok/s")
        return f"{where}: {', '.join(parts)}"
    if "eval_loss" in logs:
        perplexity = f" (perplexity {logs['eval_perplexity']:.4g})" if "eval_perplexity" in logs else ""
        return f"{where}: eval loss {logs['eval_loss']:.4g}{perplexity}"
    return None


class ConsoleProgress(ProgressCallback):
    """The Trainer's progress bar, with `log_line` under it instead of the dicts, and the evaluation's bar only
    where stderr is a terminal."""

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if sys.stderr.isatty():
            super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        line = log_line(logs or {}, state.global_step, state.max_steps)
        if not state.is_world_process_zero or line is None:
            return
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:  # an evaluation after training (the bar is closed): said all the same
            print(line, flush=True)


class ConsolePrinter(PrinterCallback):
    """--disable_tqdm: `log_line`, printed."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        line = log_line(logs or {}, state.global_step, state.max_steps)
        if state.is_world_process_zero and line is not None:
            print(line, flush=True)


class LastStepLogged(TrainerCallback):
    """The last step is always logged: a run shorter than --logging_steps (10 by default, the length anyone tries
    first) would print no loss, leave TensorBoard without train/loss and draw an empty loss.png."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps and str(getattr(args.logging_strategy, "value",
                                                                args.logging_strategy)) != "no":
            control.should_log = True


class FirstStepWait(TrainerCallback):
    """The first step's seconds, the user's wait before training runs at speed: where kernels compile at the first
    step (`compiles`: flex_attention's, the compiled layers'), at a new row length too: 37-45 s at 32k tokens on an
    empty cache on an H200 (bench/RESULTS.md, `first_step_s`). Said once on the console
    where something compiles, and logged as `first_step_seconds` with the next log (trainer_log.jsonl,
    TensorBoard) in every run."""

    def __init__(self, compiles: list[str]):
        self.compiles = compiles
        self.began: float | None = None
        self.seconds: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.began, self.seconds = time.perf_counter(), None

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds is not None or self.began is None:
            return
        self.seconds = time.perf_counter() - self.began
        if self.compiles and state.is_world_process_zero:
            tqdm.write(f"first step: {self.seconds:.1f} s, {' and '.join(self.compiles)} compiled for these row "
                       f"shapes (cached for later runs; a new --max_length compiles again)", file=sys.stdout)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.seconds is not None and "loss" in logs and self.began is not None:
            logs["first_step_seconds"] = round(self.seconds, 2)
            self.began = None  # logged once


def what_compiles(attn_implementation: str, compile_layers: bool, torch_compile: bool) -> list[str]:
    """What compiles its kernels at the first step, in the words of the first-step line (FP8's casts compile
    inside the compiled layers)."""
    return [name for name, on in (("the whole model (--torch_compile)", torch_compile),
                                  ("the decoder layers (--compile_layers)", compile_layers and not torch_compile),
                                  ("flex_attention", attn_implementation == "flex_attention")) if on]
