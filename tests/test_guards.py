"""Guards: a NaN/inf loss or gradient stops the run before the weights change (keeping the last good checkpoint)
or skips the step; loss spikes are warned about and counted in TensorBoard; a loss that stays too high (Axolotl's
loss watchdog) stops the run and names the checkpoint from before the rise."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

from conftest import REPO, tensorboard_scalars
from sft.safety.checkpoints import checkpoint_dirs, is_complete, newest_complete
from sft.safety.run_dir import FINAL_MARKER
from sft.errors import LossBrokeDown
from sft.safety.guards import LossSpikeLogger, LossWatchdog, NonFiniteError, NonFiniteGuard
from sft.speed.sr_adamw import AdamWBf16SR


def run_args(model: Path, output_dir: Path, cache: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--dataset", str(REPO / "data" / "alpaca_demo.json"), "--max_length", "64",
            "--per_device_train_batch_size", "2", "--max_steps", "8", "--save_strategy", "steps", "--save_steps", "2",
            "--learning_rate", "1e-3", "--logging_steps", "1", "--disable_tqdm", "true", "--seed", "0",
            "--dataset_cache_dir", str(cache), "--output_dir", str(output_dir), *extra]


class PoisonWeight(TrainerCallback):
    """Test-only: after step `at`, one weight becomes NaN, so the next forward gives a NaN loss."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            with torch.no_grad():
                next(p for p in model.parameters() if p.dim() == 2)[0, 0] = float("nan")


class BlowUpHead(TrainerCallback):
    """Test-only: after step `at`, the LM head's weights x `factor`: the loss jumps (finite) and stays high."""

    def __init__(self, at: int, factor: float = 100.0):
        self.at, self.factor = at, factor

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(self.factor)


class PoisonGradient(TrainerCallback):
    """Test-only: at step `at`, one gradient element becomes inf in the backward (as an overflow would: before
    the Trainer clips); records the weights around that step."""

    def __init__(self, at: int):
        self.at = at
        self.before = self.after = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.at:
            self.before = {n: p.detach().clone() for n, p in model.named_parameters()}
            target = next(p for p in model.parameters() if p.requires_grad)

            def poison(p):
                p.grad.view(-1)[0] = float("inf")
                handle.remove()

            handle = target.register_post_accumulate_grad_hook(poison)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            self.after = {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_nan_loss_stops_before_the_update_and_keeps_the_last_checkpoint(tmp_path, tiny_llama, capsys):
    from safetensors.torch import load_file

    from sft.train import main

    out = tmp_path / "run"
    rc = main(run_args(tiny_llama, out, tmp_path / "cache", "--report_to", "none"), callbacks=[PoisonWeight(at=5)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "step 6: the loss or a gradient is NaN/inf" in err and "checkpoint-4" in err
    assert "--resume_from_checkpoint true" in err and "--nan_policy skip" in err
    assert newest_complete(out).name == "checkpoint-4"
    assert [p.name for p in checkpoint_dirs(out)] == ["checkpoint-2", "checkpoint-4"]
    assert all(torch.isfinite(t).all() for t in load_file(out / "checkpoint-4" / "model.safetensors").values())
    assert not (out / FINAL_MARKER).exists() and not (out / "model.safetensors").exists()


@pytest.mark.slow
def test_skip_policy_drops_the_step_and_goes_on(tmp_path, tiny_llama):
    from sft.train import main

    out = tmp_path / "run"
    poison = PoisonGradient(at=3)
    rc = main(run_args(tiny_llama, out, tmp_path / "cache", "--nan_policy", "skip", "--report_to", "tensorboard"),
              callbacks=[poison])
    assert rc == 0
    assert poison.before is not None and poison.after is not None
    unchanged = [n for n in poison.before if torch.equal(poison.before[n], poison.after[n])]
    assert len(unchanged) == len(poison.before), "the skipped step changed weights"
    assert is_complete(out, FINAL_MARKER)
    assert max(tensorboard_scalars(out / "runs", "train/skipped_steps")) == 1
    assert tensorboard_scalars(out / "runs", "train/loss_spikes")  # the spike count reaches TensorBoard


def test_the_check_reads_the_clippings_norm_and_else_the_gradients():
    """The Trainer has the total norm at hand before the optimizer step (SFTTrainer._get_grad_norm hands it over):
    the guard looks at that (here a NaN norm beside finite gradients, so that the test tells which one was read); a
    step without it reads the gradients. Under DeepSpeed the Trainer's norm is a float from the engine, after its
    step: not taken for the check."""
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    guard = NonFiniteGuard("stop", lambda: None, "")
    args, state = SimpleNamespace(fp16=False), SimpleNamespace(global_step=2)
    guard.saw_norm(torch.tensor(math.nan))
    with pytest.raises(NonFiniteError, match="step 3"):
        guard.on_pre_optimizer_step(args, state, None, model=model)
    guard.on_pre_optimizer_step(args, state, None, model=model)  # no norm since: the finite gradients pass
    model.weight.grad[0, 0] = math.inf
    guard.saw_norm(math.nan)  # DeepSpeed's float: the gradients are asked instead (and they are not finite)
    with pytest.raises(NonFiniteError):
        guard.on_pre_optimizer_step(args, state, None, model=model)
    model.weight.grad[0, 0] = 1.0
    guard.saw_norm(math.nan)
    guard.on_pre_optimizer_step(args, state, None, model=model)


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=0.1, fused=True)


def adamw_bf16_sr(params):
    return AdamWBf16SR(params, lr=0.1)


@pytest.mark.parametrize("make_optimizer", [fused_adamw, adamw_bf16_sr])
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_an_optimizer_takes_the_verdict_without_a_wait_and_the_bad_step_changes_nothing(policy, make_optimizer):
    """With torch's fused AdamW or adamw_bf16_sr the guard reads no norm on the host before the step: the optimizer
    gets the verdict (GradScaler's found_inf) and leaves weights, moments and step count alone on a bad step; the
    verdict is read before the next step (stop: the run ends there) and before any save or log."""
    model = torch.nn.Linear(2, 2)
    optimizer = make_optimizer(model.parameters())
    guard = NonFiniteGuard(policy, lambda: None, "")
    args = SimpleNamespace(fp16=False)
    control = SimpleNamespace(should_save=False, should_log=False, should_evaluate=False, should_training_stop=False)

    def step(number: int, norm: float):
        state = SimpleNamespace(global_step=number - 1, max_steps=10)
        for p in model.parameters():
            p.grad = torch.full_like(p, norm)
        guard.saw_norm(torch.tensor(norm))
        guard.on_pre_optimizer_step(args, state, control, model=model, optimizer=optimizer)
        optimizer.step()
        guard.on_optimizer_step(args, state, control)
        assert not hasattr(optimizer, "found_inf")  # the verdict was that step's only
        state.global_step = number
        guard.on_step_end(args, state, control)

    step(1, 1.0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    step(2, math.nan)  # not read yet: no save or log follows this step
    assert guard.pending and all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    assert all(torch.equal(moments[k], v) for k, v in optimizer.state[model.weight].items())  # the step count too
    if policy == "stop":
        with pytest.raises(NonFiniteError, match="step 2: .*skipped that step's update"):
            step(3, 1.0)
        return
    step(3, 1.0)
    assert guard.skipped == 1 and [v.step for v in guard.pending] == [3]  # step 3: read before the next
    assert float(optimizer.state[model.weight]["step"]) == 2  # steps 1 and 3


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (`.item()`, `bool()`, `float()`: aten._local_scalar_dense),
    each a wait for the GPU's queue there."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make_optimizer, reads_on_host", [
    (adamw_bf16_sr, False),  # the full fine-tune's optimizer: the clipping, the guard and the step, no read
    (lambda params: torch.optim.AdamW(params, foreach=False), True),  # the guard reads the norm, AdamW its steps
])
def test_a_guarded_step_reads_nothing_on_the_host_where_the_optimizer_takes_the_verdict(make_optimizer, reads_on_host):
    """A whole guarded step as SFTTrainer runs it (clipping, the norm handed to the guard, the guard, the step, its
    end), counted for host reads: none with adamw_bf16_sr (folded clipping, found_inf, step counts and bias
    corrections on the device); torch's single-tensor AdamW, which takes no found_inf, shows that they are counted."""
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    optimizer = make_optimizer(list(model.parameters()))
    guard = NonFiniteGuard("skip", lambda: None, "")
    args = SimpleNamespace(fp16=False)
    control = SimpleNamespace(should_save=False, should_log=False, should_evaluate=False, should_training_stop=False)
    for number in (1, 2):
        state = SimpleNamespace(global_step=number - 1, max_steps=10)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(number)).to(p.dtype)
        with HostReads() as reads:
            if isinstance(optimizer, AdamWBf16SR):
                norm = optimizer.clip_gradients(list(model.parameters()), 1.0)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            guard.saw_norm(norm)
            guard.on_pre_optimizer_step(args, state, control, model=model, optimizer=optimizer)
            optimizer.step()
            guard.on_optimizer_step(args, state, control)
            state.global_step = number
            guard.on_step_end(args, state, control)
        assert (reads.count > 0) == reads_on_host, (number, reads.count)
        control.should_log = True  # a log follows: the verdict is read (outside the count)
        guard.on_step_end(args, state, control)
        control.should_log = False
    assert float(optimizer.state[model.weight]["step"]) == 2 and guard.skipped == 0


def test_a_bad_step_is_read_before_a_checkpoint_is_written():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    guard = NonFiniteGuard("stop", lambda: "out/checkpoint-4", "")
    args, state = SimpleNamespace(fp16=False), SimpleNamespace(global_step=4, max_steps=10)
    control = SimpleNamespace(should_save=True, should_log=False, should_evaluate=False, should_training_stop=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    guard.saw_norm(torch.tensor(math.inf))
    guard.on_pre_optimizer_step(args, state, control, model=model, optimizer=optimizer)
    optimizer.step()
    guard.on_optimizer_step(args, state, control)
    state.global_step = 5
    with pytest.raises(NonFiniteError, match="step 5.*checkpoint-4"):
        guard.on_step_end(args, state, control)


def test_the_probe_finds_that_fused_adamw_honours_found_inf():
    from sft.safety.guards import fused_adam_skips_on

    assert fused_adam_skips_on("cpu")


def test_guard_without_gradients_checks_the_logs():
    """DeepSpeed keeps gradients in its engine: then the logged loss/grad_norm are checked."""
    guard = NonFiniteGuard("stop", lambda: "out/checkpoint-4", "python sft/train.py --resume_from_checkpoint true")
    args, state = SimpleNamespace(fp16=False), SimpleNamespace(global_step=7)
    guard.on_log(args, state, None, logs={"loss": 2.0, "grad_norm": 1.0})
    with pytest.raises(NonFiniteError, match="step 7.*grad_norm.*checkpoint-4"):
        guard.on_log(args, state, None, logs={"loss": 2.0, "grad_norm": math.inf})


def test_fp16_overflow_is_the_loss_scalers_business_but_a_nonfinite_loss_stops():
    """Under fp16 dynamic loss scaling the first steps overflow (grad_norm inf) and are skipped by the scaler:
    seen on GPUs under ZeRO-3, where stopping there ended every fp16 run at step 1."""
    guard = NonFiniteGuard("stop", lambda: None, "")
    args, state = SimpleNamespace(fp16=True), SimpleNamespace(global_step=1)
    guard.on_log(args, state, None, logs={"loss": 7.1, "grad_norm": math.inf})
    with pytest.raises(NonFiniteError, match="step 1.*loss"):
        guard.on_log(args, state, None, logs={"loss": math.nan, "grad_norm": math.inf})


def test_loss_spike_is_warned_and_counted(caplog):
    spikes = LossSpikeLogger(factor=2.0)
    state = SimpleNamespace(global_step=0)
    counts = []
    for loss in (5.0, 4.8, 4.6, 4.4, 12.0, 4.3, math.nan):
        logs = {"loss": loss}
        spikes.on_log(None, state, None, logs=logs)
        counts.append(logs.get("loss_spikes"))
    assert counts == [0, 0, 0, 0, 1, 1, None]
    assert spikes.spikes == 1


def test_the_loss_watchdog_counts_logs_in_a_row_and_names_the_checkpoint_before_the_rise():
    """A log at or under the threshold starts the count again; checkpoint-N holds the weights of step N+1's loss, so
    the last good log at step G vouches for checkpoints up to G - 1."""
    asked = []

    def checkpoint_up_to(step):
        asked.append(step)
        return Path(f"run/checkpoint-{step}")

    watchdog = LossWatchdog(threshold=5.0, patience=3, checkpoint_up_to=checkpoint_up_to,
                            resume_command=lambda c: f"resume {c}")
    for step, loss in enumerate((4.0, 6.0, 7.0, 4.5, 6.0, 8.0, math.nan), start=1):  # a NaN is the guard's
        watchdog.on_log(None, SimpleNamespace(global_step=step), None, logs={"loss": loss})
    watchdog.on_log(None, SimpleNamespace(global_step=8), None, logs={"eval_loss": 99.0})  # an evaluation's
    with pytest.raises(LossBrokeDown) as stopped:
        watchdog.on_log(None, SimpleNamespace(global_step=9), None, logs={"loss": 9.0})
    message = str(stopped.value)
    assert message.startswith("step 9: the logged loss stayed above --loss_watchdog_threshold 5 for 3 logs in a "
                              "row (6, 8, 9, from step 5)"), message
    assert asked == [3] and "resume run/checkpoint-3" in message and "no final save" in message
    early = LossWatchdog(threshold=5.0, patience=1, checkpoint_up_to=checkpoint_up_to, resume_command=str)
    with pytest.raises(LossBrokeDown, match="No checkpoint was saved before it rose"):
        early.on_log(None, SimpleNamespace(global_step=1), None, logs={"loss": 6.0})  # over from the first log


@pytest.mark.slow
def test_a_loss_that_breaks_down_stops_the_run_and_its_resume_command_trains_from_before_the_rise(tmp_path, tiny_llama,
                                                                                               capsys):
    """Axolotl's option names, from a recipe: the LM head blown up after step 3 makes steps 4 and 5 log a high
    (finite) loss; the run stops at step 5 with exit code 1 and no final save, naming checkpoint-2 (checkpoint-4
    was saved after the rise), and the command it prints resumes from there to a finished run."""
    import shlex

    from sft.train import main

    out = tmp_path / "run"
    recipe = tmp_path / "axolotl.yaml"
    recipe.write_text("loss_watchdog_threshold: 20.0\nloss_watchdog_patience: 2\n")
    args = run_args(tiny_llama, out, tmp_path / "cache", "--report_to", "none", "--config", str(recipe))
    assert main(args, callbacks=[BlowUpHead(at=3)]) == 1
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "--loss_watchdog_threshold 20" in line)
    assert "step 5:" in line and "from step 4" in line and f"is {out / 'checkpoint-2'};" in line, line
    assert [p.name for p in checkpoint_dirs(out)] == ["checkpoint-2", "checkpoint-4"]
    assert not (out / FINAL_MARKER).exists() and not (out / "model.safetensors").exists()
    command = shlex.split(line.split("--learning_rate: ", 1)[1].rstrip("."))
    resume_args = command[next(i for i, word in enumerate(command) if word.startswith("--")):]  # the options
    assert resume_args[resume_args.index("--resume_from_checkpoint") + 1] == str(out / "checkpoint-2")
    assert main(resume_args) == 0, capsys.readouterr().err[-3000:]
    assert is_complete(out, FINAL_MARKER)
