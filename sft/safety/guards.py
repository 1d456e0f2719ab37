"""Guards: stop (or skip) on a NaN/inf loss or gradient before it reaches the weights; log loss spikes; stop a run
whose loss broke down (the loss watchdog, below).

The check runs at `on_pre_optimizer_step`, after backward and clipping and before `optimizer.step()`: a NaN or
inf loss makes NaN/inf gradients, so one look at the gradients covers both, and the weights (and every
checkpoint, since checkpoints are written after a step) never contain a poisoned update. The look is at the total
norm the Trainer's gradient clipping has just computed (`saw_norm`, from SFTTrainer: a norm is finite iff every gradient is),
so the gradients are not read a second time; where that norm is out of reach (tensor parallelism's mixed meshes,
FSDP2's DTensor norm) the gradients are read here. With
`--nan_policy stop` (default) the run ends with the newest complete checkpoint intact; with `skip` the step's
gradients are dropped (`p.grad = None`: torch optimizers then leave those parameters and their moments
untouched, so the step changes no weight) and training goes on; skipped steps are counted in the logs.

Not covered by the gradient check: DeepSpeed keeps gradients inside its engine (then the logged loss and
grad_norm are checked at each log, so use `--logging_steps 1` for a per-step check), and fp16, whose loss scaler
skips overflowing steps by design (there only the logged loss is checked: an inf grad_norm is such an overflow).
Loss spikes are judged per logged value (the mean over `--logging_steps`).

Without a wait on the GPU where the optimizer allows it. Reading the norm on the host (`.item()`) makes the host wait
for the whole backward every step, and the GPU then idles while the host issues the optimizer step and the next
forward. torch's fused Adam/AdamW (`adamw_torch_fused`, transformers' default) and ours (`--optim adamw_bf16_sr`,
the full fine-tune's) take the verdict on the GPU instead, as torch's GradScaler hands it over: `found_inf` set on
the optimizer, and its kernel leaves every weight, moment and step count as they were where it is 1. Then the verdict is read on the host later, once it is there
(a non-blocking copy and an event): before the next optimizer step, and with a wait before any checkpoint, log or
evaluation and at the end of training. `stop` still ends the run with no weight changed by the bad step; the
message comes one step later at most. Whether the installed torch's fused kernel does skip so is checked once per device, on a
one-element optimizer, before it is relied on (`skips_on_device`); elsewhere the verdict is read at once, as before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from sft.errors import LossBrokeDown, NonFiniteError

logger = logging.get_logger("sft.safety.guards")


def grads_finite(model) -> bool | None:
    """True if every gradient is finite (across all ranks), None if this process holds no gradients."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2 shards (DTensor)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:  # offloaded gradients live on the CPU
        by_device.setdefault(g.device, []).append(g)
    # One fused pass per device: a norm is finite iff every element is (an fp32 norm overflows only past 3e38).
    device = grads[0].device
    bad = sum((~torch.isfinite(torch.stack(torch._foreach_norm(gs)).sum())).float().to(device)
              for gs in by_device.values())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if "nccl" in str(torch.distributed.get_backend()) and torch.cuda.is_available():
            bad = bad.cuda()  # NCCL reduces GPU tensors only
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # shards differ between ranks
    return bad.item() == 0


@functools.lru_cache(maxsize=None)
def fused_adam_skips_on(device_type: str) -> bool:
    """Whether torch's fused AdamW on this device type honours `found_inf` as GradScaler uses it: with 1 it changes
    neither the weight nor its step count, with 0 it steps. Tried once per device type on one element."""
    weight = torch.nn.Parameter(torch.ones(1, device=device_type))
    weight.grad = torch.ones(1, device=device_type)
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    optimizer.found_inf = torch.ones((), device=device_type)
    optimizer.step()
    kept = bool(weight.detach().eq(1).all()) and float(optimizer.state[weight]["step"]) == 0
    optimizer.found_inf = torch.zeros((), device=device_type)
    optimizer.step()
    return kept and not bool(weight.detach().eq(1).all())


def skips_on_device(optimizer, norm) -> torch.optim.Optimizer | None:
    """The torch optimizer (inside accelerate's wrapper) if it can take this step's verdict on the device: fused
    Adam/AdamW (GradScaler's protocol: `_step_supports_amp_scaling`) with the probe passed, or an optimizer of
    ours that says it skips so (`skips_on_found_inf`: `--optim adamw_bf16_sr`, held to it by
    tests/test_sr_adamw.py), the norm a plain tensor.
    Else None: the verdict is read on the host at once. On a CPU it changes nothing but the order (no wait to save
    there), and runs the same code as on a GPU."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if type(norm) is not torch.Tensor or norm.device.type not in ("cuda", "cpu"):
        return None
    if getattr(type(inner), "skips_on_found_inf", False):  # ours, by its own code (no probe: its tests hold it)
        return inner
    if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        return None
    if not getattr(inner, "_step_supports_amp_scaling", False) or not all(g.get("fused") for g in inner.param_groups):
        return None
    return inner if fused_adam_skips_on(norm.device.type) else None


@dataclass
class PendingVerdict:
    """One step's verdict on its way to the host: 1.0 where the norm was NaN/inf."""

    step: int
    on_host: torch.Tensor  # from a GPU: pinned, filled by a non-blocking copy
    copied: torch.cuda.Event | None  # None: computed on the CPU, there already

    @classmethod
    def of(cls, step: int, bad: torch.Tensor) -> PendingVerdict:
        if not bad.is_cuda:
            return cls(step, bad, None)
        on_host = torch.empty((), dtype=bad.dtype, pin_memory=True)
        on_host.copy_(bad, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(step, on_host, copied)

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()

    def bad(self) -> bool:
        if self.copied is not None:
            self.copied.synchronize()  # long done where ready() said so
        return bool(self.on_host.item())


class NonFiniteGuard(TrainerCallback):
    def __init__(self, policy: str = "stop", last_checkpoint=lambda: None, resume_command: str = ""):
        self.policy = policy
        self.last_checkpoint = last_checkpoint  # called when stopping: the newest complete checkpoint
        self.resume_command = resume_command
        self.skipped = 0
        self.checked_gradients = False
        self.clip_norm: torch.Tensor | None = None  # this step's total gradient norm, from the Trainer's clipping
        self.pending: list[PendingVerdict] = []  # verdicts taken on the GPU, not read yet
        self.skipping_on: torch.optim.Optimizer | None = None  # the optimizer holding this step's found_inf

    def saw_norm(self, norm) -> None:
        """The total gradient norm of this optimizer step, as the Trainer computed it for clipping and logging
        (SFTTrainer._get_grad_norm hands it over; with --max_grad_norm 0 the Trainer still computes it, to log
        grad_norm): one look at it instead of another read of every gradient (for a 7B full fine-tune, 14 GB of
        memory traffic a step). Under DeepSpeed it is the engine's, after its step: not used (see on_log)."""
        self.clip_norm = norm if isinstance(norm, torch.Tensor) else None

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        norm, self.clip_norm = self.clip_norm, None
        if args.fp16 or model is None:
            return
        self._read_verdicts(wait=False)  # earlier steps' verdicts that have reached the host
        if (inner := skips_on_device(optimizer, norm)) is not None:
            bad = (~torch.isfinite(norm)).float()
            inner.found_inf = bad  # the fused kernel leaves weights, moments and step counts alone where it is 1
            self.skipping_on = inner
            self.pending.append(PendingVerdict.of(state.global_step + 1, bad))
            self.checked_gradients = True
            return
        # A plain tensor: the norm of every gradient of the model, the same on every rank (DDP's are all-reduced,
        # FSDP1's clip reduces over shards). A DTensor (FSDP2) or none (TP, DeepSpeed): ask the gradients.
        finite = bool(torch.isfinite(norm).item()) if type(norm) is torch.Tensor else grads_finite(model)
        if finite is None:
            return
        self.checked_gradients = True
        if finite:
            return
        step = state.global_step + 1
        if self.policy == "skip":
            for p in model.parameters():
                p.grad = None
            self._skipped(step)
            return
        self._stop(f"step {step}: the loss or a gradient is NaN/inf; stopped before the optimizer step, so no "
                   f"weight took the bad update")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.skipping_on is not None:  # the verdict was this step's only
            del self.skipping_on.found_inf
            self.skipping_on = None

    def on_step_end(self, args, state, control, **kwargs):
        # a checkpoint, log or evaluation comes next (or the end): it must not come from a step that was bad
        if control.should_save or control.should_log or control.should_evaluate or control.should_training_stop \
                or state.global_step >= state.max_steps:
            self._read_verdicts(wait=True)

    def on_train_end(self, args, state, control, **kwargs):
        self._read_verdicts(wait=True)

    def _read_verdicts(self, wait: bool) -> None:
        while self.pending and (wait or self.pending[0].ready()):
            verdict = self.pending.pop(0)
            if not verdict.bad():
                continue
            if self.policy == "skip":
                self._skipped(verdict.step)
                continue
            self.pending.clear()
            self._stop(f"step {verdict.step}: the loss or a gradient is NaN/inf; the optimizer skipped that "
                       f"step's update, so no weight took it")

    def _skipped(self, step: int) -> None:
        self.skipped += 1
        logger.warning(f"step {step}: NaN/inf loss or gradient; the step was skipped (no weight changed), "
                       f"{self.skipped} skipped so far.")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        if self.policy == "skip":
            logs["skipped_steps"] = self.skipped
        elif not self.checked_gradients:  # gradients were out of our sight (DeepSpeed, fp16): check the logs
            # fp16's dynamic loss scaling overflows by design (a grad_norm of inf): the scaler skips that step and
            # lowers the scale. Only a non-finite loss is a real failure there.
            watched = ("loss",) if args.fp16 else ("loss", "grad_norm")
            bad = {k: logs[k] for k in watched if k in logs and not math.isfinite(logs[k])}
            if bad:
                self._stop(f"step {state.global_step}: logged {bad}")

    def _stop(self, what: str):
        checkpoint = self.last_checkpoint()
        kept = f"The last good checkpoint is {checkpoint}" if checkpoint else "No checkpoint was saved before it"
        resume = f"; resume from it (perhaps with a lower --learning_rate): {self.resume_command}" if checkpoint else ""
        raise NonFiniteError(f"{what}. {kept}{resume}. To skip such steps instead of stopping: --nan_policy skip.")


class LossSpikeLogger(TrainerCallback):
    """Warn when a logged loss exceeds `factor` x the running mean of earlier ones; log the count as `loss_spikes`."""

    def __init__(self, factor: float = 2.0, warmup_logs: int = 3, beta: float = 0.9):
        self.factor, self.warmup_logs, self.beta = factor, warmup_logs, beta
        self.mean: float | None = None
        self.seen = 0
        self.spikes = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is None or not math.isfinite(loss):
            return
        if self.mean is not None and self.seen >= self.warmup_logs and loss > self.factor * self.mean:
            self.spikes += 1
            logger.warning(f"step {state.global_step}: loss spike, {loss:.4g} against a running mean of "
                           f"{self.mean:.4g} ({self.spikes} so far).")
        self.mean = loss if self.mean is None else self.beta * self.mean + (1 - self.beta) * loss
        self.seen += 1
        logs["loss_spikes"] = self.spikes


class LossWatchdog(TrainerCallback):
    """Axolotl's loss watchdog, made safe: when `patience` logged losses in a row exceed `threshold` (training broke
    down: a learning rate too high, bad data), the run stops with one error line and no final save, and names the
    newest checkpoint whose weights the last log under the threshold vouches for. (Axolotl ends the run as if it
    had finished, and saves the broken weights as its result.) Logged values are judged (the mean over
    --logging_steps, the same on every rank), so every rank stops at the same log; NaN/inf is NonFiniteGuard's."""

    def __init__(self, threshold: float, patience: int, checkpoint_up_to: Callable[[int], Path | None],
                 resume_command: Callable[[Path], str]):
        self.threshold, self.patience = threshold, patience
        self.checkpoint_up_to = checkpoint_up_to  # step -> the newest complete checkpoint of that step or earlier
        self.resume_command = resume_command      # checkpoint -> the command that resumes from it
        self.over: list[tuple[int, float]] = []   # (step, loss) of the logs over the threshold, in a row
        self.last_good_step = 0                   # the step of the last log at or under it (0: the start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is None or not math.isfinite(loss):
            return
        if loss <= self.threshold:
            self.over, self.last_good_step = [], state.global_step
            return
        self.over.append((state.global_step, loss))
        if len(self.over) < self.patience:
            return
        losses = ", ".join(f"{value:.4g}" for _, value in self.over)
        # checkpoint-N holds the weights that step N+1's loss is computed with: the last log under the threshold, at
        # step G, vouches for the weights up to step G - 1
        checkpoint = self.checkpoint_up_to(self.last_good_step - 1) if self.last_good_step else None
        where = (f"The last checkpoint saved before it rose is {checkpoint}; resume from it with a lower "
                 f"--learning_rate: {self.resume_command(checkpoint)}" if checkpoint else
                 "No checkpoint was saved before it rose; start again with a lower --learning_rate")
        raise LossBrokeDown(f"step {state.global_step}: the logged loss stayed above --loss_watchdog_threshold "
                            f"{self.threshold:g} for {len(self.over)} logs in a row ({losses}, from step "
                            f"{self.over[0][0]}); training stopped, no final save. {where}.")
