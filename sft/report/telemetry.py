"""What a run records beside the Trainer's own logs: per-GPU telemetry (NVML, sampled off the training thread), eval
perplexity, and in the output directory trainer_log.jsonl (as it goes), loss.png and all_results.json (at the end),
from which train.py prints the closing summary (run_summary).

Global rank 0 does all of it: its logs are the only ones TensorBoard and the output directory receive.
File names and the all_results.json keys follow LLaMA-Factory where it has them (trainer_log.jsonl, all_results.json
from the Trainer's train and eval metrics, effective_tokens_per_sec), so that the two tools' runs compare side by side.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

from transformers import TrainerCallback

from sft.machine import GIB, Machine, is_first_process, machine as this_machine
from sft.safety.run_dir import ALL_RESULTS, LOSS_PLOT, TRAINER_LOG


# ---- GPU telemetry -------------------------------------------------------------------------------------------------

def visible_gpus(m: Machine | None = None) -> list[str]:
    """NVML UUIDs of the GPUs this node trains on, in torch's order. torch has already applied CUDA_VISIBLE_DEVICES
    (indices, UUIDs or MIG ids) while NVML numbers every GPU of the machine: a UUID names the same GPU in both.
    Under a launcher local rank r trains on cuda:r (the Trainer's device), so the node uses the first
    LOCAL_WORLD_SIZE visible GPUs; one process alone uses all it sees (the Trainer's DataParallel)."""
    m = m or this_machine()
    count = m.gpus
    if m.launch.world_size > 1:
        count = min(count, m.launch.processes_here(count))
    return list(m.gpu_uuids[:count])


def memory_used(nvml, handle) -> float:
    """Bytes used, as nvidia-smi counts them: its v2 query leaves out the driver's reserve, which v1 counts."""
    try:
        return nvml.nvmlDeviceGetMemoryInfo(handle, nvml.nvmlMemory_v2).used
    except (AttributeError, TypeError, nvml.NVMLError):  # an older nvidia-ml-py or driver
        return nvml.nvmlDeviceGetMemoryInfo(handle).used


def read_gpu(nvml, handle) -> dict[str, float]:
    """One reading of one GPU; what the board does not report (power on some) is left out."""
    probes = {
        "util": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,  # % of time a kernel ran
        "mem_used_gib": lambda: memory_used(nvml, handle) / GIB,
        "temp_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,  # milliwatts
    }
    reading = {}
    for name, probe in probes.items():
        try:
            reading[name] = float(probe())
        except nvml.NVMLError:
            pass
    return reading


class GpuTelemetry(TrainerCallback):
    """Each training log gets, per GPU i, the means over the samples since the previous log of gpu<i>/util (%),
    gpu<i>/mem_used_gib, gpu<i>/temp_c and gpu<i>/power_w, and gpu<i>/mem_peak_gib, the highest memory sample: the
    peak as nvidia-smi counts it (the CUDA context, NCCL buffers and allocator slack included), to quote beside
    peak_memory_gib (what PyTorch's allocator reserved). The final train metrics get gpu_mem_peak_gib, the highest
    over the GPUs and the session. TensorBoard shows them as train/gpu<i>/....

    A daemon thread reads NVML every `interval` seconds; the training thread only swaps the sums under a lock at each
    log (no NVML call, no CUDA synchronisation). Rank 0 samples its node's GPUs: on several nodes, the first node's.
    Without a CUDA GPU or without nvidia-ml-py (`import pynvml`) it does nothing and says nothing."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.window: dict[str, list[float]] = {}  # key -> [sum, count, max] since the last training log
        self.latest: dict[str, float] = {}  # the newest reading: shown when a log saw no new sample
        self.session_peak = 0.0  # GiB, any GPU

    def on_train_begin(self, args, state, control, **kwargs):
        if not is_first_process() or self.thread is not None or args.device.type != "cuda":
            return  # (--use_cpu on a GPU machine: the GPUs are not this run's)
        uuids = visible_gpus()
        if not uuids:
            return
        try:
            import pynvml
        except ImportError:
            return
        self.window, self.latest, self.session_peak = {}, {}, 0.0
        self.stop.clear()
        self.thread = threading.Thread(target=self._sample, args=(pynvml, uuids), name="gpu-telemetry", daemon=True)
        self.thread.start()

    def _sample(self, nvml, uuids: list[str]) -> None:
        try:
            nvml.nvmlInit()
        except Exception:  # no NVML library or no access to the driver: no telemetry; training goes on
            return
        try:
            handles = {}
            for i, uuid in enumerate(uuids):
                try:
                    handles[i] = nvml.nvmlDeviceGetHandleByUUID(uuid)
                except nvml.NVMLError:  # e.g. a MIG slice NVML will not name this way: the others still report
                    pass
            while handles:
                self._add({f"gpu{i}/{k}": v for i, h in handles.items() for k, v in read_gpu(nvml, h).items()})
                if self.stop.wait(self.interval):
                    break
        except Exception:  # a GPU that stops answering ends the telemetry, never the training
            pass
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass

    def _add(self, readings: dict[str, float]) -> None:
        with self.lock:
            for key, value in readings.items():
                total = self.window.setdefault(key, [0.0, 0, value])
                total[0], total[1], total[2] = total[0] + value, total[1] + 1, max(total[2], value)
                if key.endswith("/mem_used_gib"):
                    self.session_peak = max(self.session_peak, value)
            self.latest.update(readings)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.thread is None or logs is None:
            return
        if "train_loss" in logs and self.session_peak:  # the final train metrics
            logs["gpu_mem_peak_gib"] = round(self.session_peak, 2)
        if "loss" not in logs:  # an evaluation's log: the window goes on to the next training log
            return
        with self.lock:
            window = self.window or {key: [value, 1, value] for key, value in self.latest.items()}
            self.window = {}
        for key, (total, count, peak) in window.items():
            logs[key] = round(total / count, 2)
            if key.endswith("/mem_used_gib"):
                logs[key.replace("/mem_used_gib", "/mem_peak_gib")] = round(peak, 2)

    def on_train_end(self, args, state, control, **kwargs):
        if self.thread is not None:
            self.stop.set()
            self.thread.join(timeout=max(5.0, 2 * self.interval))
            self.thread = None


# ---- eval perplexity -----------------------------------------------------------------------------------------------

def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:  # a loss above ~709
        return math.inf


class EvalPerplexity(TrainerCallback):
    """eval_perplexity = exp(eval_loss) beside each evaluation's loss (TensorBoard: eval/perplexity); with several
    eval sets, eval_<name>_perplexity beside eval_<name>_loss."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key in [k for k in (logs or {}) if k.startswith("eval_") and k.endswith("_loss")]:
            logs[key.removesuffix("loss") + "perplexity"] = perplexity(logs[key])


# ---- the run's record in its output directory ----------------------------------------------------------------------

def jsonable(value):
    """Strict JSON (jq and JavaScript reject a bare NaN): a diverged loss or an overflowing perplexity is written
    as the string "NaN", "Infinity" or "-Infinity"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def scalars(logs: dict) -> dict:
    return {k: jsonable(v) for k, v in logs.items() if isinstance(v, (int, float, str, bool))}


def append_line(path: Path, record: dict) -> None:
    """One line in one write() on an O_APPEND descriptor: in the kernel's hands at once, so a killed run keeps every
    line it logged (at worst a last one cut short by a crash of the machine itself)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def write_atomically(path: Path, write) -> None:
    """Write a whole file beside `path` (a dot-name: the final marker's listing skips it), then rename it over
    `path`: a kill leaves the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def plot_loss(history: list[dict], path: Path) -> bool:
    """Train and eval loss against the optimizer step, from the Trainer's log_history (resumed runs: the whole run).
    -> False when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure  # not pyplot: no global figures, no GUI backend; PNG renders with Agg
    except ImportError:
        return False
    train = [(h["step"], h["loss"]) for h in history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h and "step" in h]
    figure = Figure(figsize=(8, 5), dpi=100)
    axes = figure.subplots()
    if train:
        axes.plot(*zip(*train), color="tab:blue", linewidth=1.2, label="train loss")
    if evals:
        axes.plot(*zip(*evals), "o-", color="tab:orange", label="eval loss")
    axes.set(xlabel="step", ylabel="loss", title=f"{path.parent.name}: loss")
    axes.grid(alpha=0.3)
    if train or evals:
        axes.legend()
    write_atomically(path, lambda f: figure.savefig(f, format="png"))
    return True


def final_results(train_metrics: dict, state) -> dict:
    """all_results.json: the Trainer's final train metrics (train_loss, train_runtime, train_samples_per_second,
    train_steps_per_second, total_flos, epoch: LLaMA-Factory's file holds these under the same names) with what our
    callbacks added to them (sft/report/callbacks.py's ThroughputCallback, GpuTelemetry), the last evaluation's eval_*
    numbers and eval_perplexity, and global_step."""
    results = {k: v for k, v in train_metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    last_eval = next((h for h in reversed(state.log_history) if "eval_loss" in h), None)
    if last_eval:
        results.update({k: v for k, v in last_eval.items() if k.startswith("eval_")})
        results["eval_perplexity"] = perplexity(last_eval["eval_loss"])
    results["global_step"] = state.global_step
    return {k: jsonable(v) for k, v in sorted(results.items())}


class RunRecord(TrainerCallback):
    """The run's record in its output directory, on rank 0. List it after every callback that adds to the logs.

    - trainer_log.jsonl: a JSON line per log, written as it happens: step, total_steps, every scalar logged (by
      the Trainer and the callbacks listed before this one: epoch, loss, learning_rate, grad_norm, eval_loss, ...)
      and elapsed_s since this session began. A fresh run starts the file anew (steps that an earlier attempt
      logged before any checkpoint are trained again); a resumed one appends a {"resumed_from_step": N} line, after
      which lines for steps above N replace the earlier ones.
    - loss.png and all_results.json at train end; an evaluation logged after training (train.py's final
      trainer.evaluate()) updates both.
    """

    def __init__(self):
        self.start = time.time()
        self.train_metrics: dict | None = None
        self.ended = False
        self.noted = False  # the missing-matplotlib note: said once

    def on_train_begin(self, args, state, control, **kwargs):
        self.start, self.train_metrics, self.ended = time.time(), None, False
        if not is_first_process():
            return
        path = Path(args.output_dir) / TRAINER_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        if state.global_step:
            append_line(path, {"resumed_from_step": state.global_step, "total_steps": state.max_steps,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        else:
            path.unlink(missing_ok=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not is_first_process() or not logs:
            return
        append_line(Path(args.output_dir) / TRAINER_LOG, {"step": state.global_step, "total_steps": state.max_steps,
                                                          **scalars(logs),
                                                          "elapsed_s": round(time.time() - self.start, 1)})
        if "train_loss" in logs:  # the final train metrics (train_runtime is in every log when tokens are counted)
            self.train_metrics = dict(logs)  # with what the callbacks before this one added
        elif self.ended and any(k.startswith("eval_") for k in logs):
            self._write_outputs(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = True
        if is_first_process():
            self._write_outputs(args, state)

    def _write_outputs(self, args, state) -> None:
        out = Path(args.output_dir)
        train = self.train_metrics or next((h for h in reversed(state.log_history) if "train_loss" in h), {})
        results = final_results(train, state)
        write_atomically(out / ALL_RESULTS, lambda f: f.write((json.dumps(results, indent=2) + "\n").encode()))
        if not plot_loss(state.log_history, out / LOSS_PLOT) and not self.noted:
            self.noted = True
            print(f"note: matplotlib is not installed, so no {LOSS_PLOT} (pip install matplotlib)", flush=True)


# ---- the closing summary ------------------------------------------------------------------------------------------

def run_summary(output_dir: str) -> str | None:
    """The table train.py prints at the end of a run, from its all_results.json; None when there is none (nothing
    was trained)."""
    path = Path(output_dir) / ALL_RESULTS
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        return None

    def number(key: str, form: str) -> str | None:
        value = r.get(key)
        return format(value, form) if isinstance(value, (int, float)) else (str(value) if value is not None else None)

    def joined(*parts: str | None) -> str | None:
        return ", ".join(p for p in parts if p) or None

    runtime = r.get("train_runtime")
    clock = f"{int(runtime) // 3600}:{int(runtime) // 60 % 60:02d}:{int(runtime) % 60:02d}" \
        if isinstance(runtime, (int, float)) else None
    eval_loss = number("eval_loss", ".4f")
    rows = [
        ("train loss", number("train_loss", ".4f")),
        ("eval loss", eval_loss and f"{eval_loss} (perplexity {number('eval_perplexity', '.4g')})"),
        ("steps", joined(number("global_step", ","), "epoch " + number("epoch", ".2f") if "epoch" in r else None)),
        ("time", clock and joined(clock, number("train_steps_per_second", ".3g") + " steps/s"
                                  if "train_steps_per_second" in r else None)),
        ("real tokens", joined(number("total_real_tokens", ","),
                               "train_real_tokens_per_second" in r
                               and f"{number('train_real_tokens_per_second', ',.0f')} tok/s in training steps")),
        ("MFU", number("train_mfu", ".1%")),
        ("peak memory", joined("peak_memory_gib" in r and f"{number('peak_memory_gib', '.2f')} GiB PyTorch reserved",
                               "gpu_mem_peak_gib" in r
                               and f"{number('gpu_mem_peak_gib', '.2f')} GiB by nvidia-smi's count (top GPU)")),
        ("results", str(path.resolve())),
    ]
    return "\n".join(["Run summary:"] + [f"  {name:<12} {value}" for name, value in rows if value])
