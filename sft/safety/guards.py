"""Guards: stop (or skip) on a NaN/inf loss or gradient before it reaches the weights; log loss spikes.

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
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from sft.errors import NonFiniteError

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


class NonFiniteGuard(TrainerCallback):
    def __init__(self, policy: str = "stop", last_checkpoint=lambda: None, resume_command: str = ""):
        self.policy = policy
        self.last_checkpoint = last_checkpoint  # called when stopping: the newest complete checkpoint
        self.resume_command = resume_command
        self.skipped = 0
        self.checked_gradients = False
        self.clip_norm: torch.Tensor | None = None  # this step's total gradient norm, from the Trainer's clipping

    def saw_norm(self, norm) -> None:
        """The total gradient norm of this optimizer step, as the Trainer computed it for clipping and logging
        (SFTTrainer._get_grad_norm hands it over; with --max_grad_norm 0 the Trainer still computes it, to log
        grad_norm): one look at it instead of another read of every gradient (for a 7B full fine-tune, 14 GB of
        memory traffic a step). Under DeepSpeed it is the engine's, after its step: not used (see on_log)."""
        self.clip_norm = norm if isinstance(norm, torch.Tensor) else None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        norm, self.clip_norm = self.clip_norm, None
        if args.fp16 or model is None:
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
            self.skipped += 1
            logger.warning(f"step {step}: NaN/inf loss or gradient; the step was skipped (no weight changed), "
                           f"{self.skipped} skipped so far.")
            return
        self._stop(f"step {step}: the loss or a gradient is NaN/inf; stopped before the optimizer step, so no "
                   f"weight took the bad update")

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
