"""What a run records beside the Trainer's logs (sft/report/telemetry.py): per-GPU telemetry from NVML sampled on a thread
(here a fake pynvml), eval perplexity, trainer_log.jsonl (one line per log; a resumed run appends), loss.png and
all_results.json at the end, and the closing summary."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import tensorboard_scalars, tiny_config
from sft.report import telemetry
from sft.report.telemetry import EvalPerplexity, GpuTelemetry, RunRecord, run_summary
from sft.safety.run_dir import ALL_RESULTS, LOSS_PLOT, TRAINER_LOG

GIB = 2**30


def fake_nvml(fail_init: bool = False) -> types.ModuleType:
    """A pynvml with two GPUs: "GPU-aaa" (memory alternating 2 and 6 GiB) and "GPU-bbb" (fixed numbers, no power
    reading, as on boards that do not report it). Records the threads that called it."""
    nvml = types.ModuleType("pynvml")
    nvml.callers, nvml.samples, nvml.shutdown = set(), {"GPU-aaa": 0, "GPU-bbb": 0}, False

    class NVMLError(Exception):
        pass

    def called(f):
        def wrapper(*args):
            nvml.callers.add(threading.current_thread().name)
            return f(*args)
        return wrapper

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    def memory(handle, version=None):
        assert version == nvml.nvmlMemory_v2  # the count nvidia-smi shows
        nvml.samples[handle] += 1
        used = (2 if nvml.samples[handle] % 2 else 6) * GIB if handle == "GPU-aaa" else 10 * GIB
        return SimpleNamespace(used=used, total=24 * GIB)

    def power(handle):
        if handle == "GPU-bbb":
            raise NVMLError("Not Supported")
        return 250_000  # mW

    nvml.NVMLError, nvml.NVML_TEMPERATURE_GPU, nvml.nvmlMemory_v2 = NVMLError, 0, 0x02000028
    nvml.nvmlInit = called(init)
    nvml.nvmlShutdown = called(lambda: setattr(nvml, "shutdown", True))
    nvml.nvmlDeviceGetHandleByUUID = called(lambda uuid: uuid)
    nvml.nvmlDeviceGetUtilizationRates = called(lambda h: SimpleNamespace(gpu=90 if h == "GPU-aaa" else 40))
    nvml.nvmlDeviceGetMemoryInfo = called(memory)
    nvml.nvmlDeviceGetTemperature = called(lambda h, sensor: 70 if h == "GPU-aaa" else 55)
    nvml.nvmlDeviceGetPowerUsage = called(power)
    return nvml


CUDA = SimpleNamespace(device=torch.device("cuda"))  # TrainingArguments of a GPU run, as far as GpuTelemetry looks


def rank0():
    return SimpleNamespace(is_world_process_zero=True, global_step=0, max_steps=10, log_history=[])


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(telemetry, "visible_gpus", lambda: ["GPU-aaa", "GPU-bbb"])


def wait_for(condition, timeout: float = 600.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_gpu_telemetry_samples_on_its_own_thread_and_logs_each_gpu(monkeypatch, two_gpus):
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    callback, state = GpuTelemetry(interval=0.01), rank0()
    callback.on_train_begin(CUDA, state, None)
    wait_for(lambda: nvml.samples["GPU-aaa"] >= 4)

    logs = {"loss": 1.0}
    callback.on_log(None, state, None, logs=logs)
    assert logs["gpu0/util"] == 90 and logs["gpu0/temp_c"] == 70 and logs["gpu0/power_w"] == 250
    assert logs["gpu0/mem_peak_gib"] == 6 and 2 <= logs["gpu0/mem_used_gib"] <= 6  # the window's peak and mean
    assert logs["gpu1/util"] == 40 and logs["gpu1/mem_used_gib"] == logs["gpu1/mem_peak_gib"] == 10
    assert "gpu1/power_w" not in logs  # not reported by that board: left out, the rest still logged

    evaluation = {"eval_loss": 2.0}
    callback.on_log(None, state, None, logs=evaluation)
    assert evaluation == {"eval_loss": 2.0}  # train/gpu* tags only beside the training logs
    again = {"loss": 0.9}
    callback.on_log(None, state, None, logs=again)  # however few samples came since: still every key
    assert {k for k in again if k.startswith("gpu")} == {k for k in logs if k.startswith("gpu")}
    final = {"train_loss": 1.0, "train_runtime": 3.0}
    callback.on_log(None, state, None, logs=final)
    assert final["gpu_mem_peak_gib"] == 10  # the highest GPU over the session

    thread = callback.thread
    callback.on_train_end(None, state, None)
    assert callback.thread is None and not thread.is_alive() and nvml.shutdown
    assert nvml.callers == {"gpu-telemetry"}  # never an NVML call on the training thread


def test_the_gpus_a_node_trains_on():
    """Under a launcher local rank r trains on cuda:r: the node's first LOCAL_WORLD_SIZE visible GPUs; a launcher
    that does not say (DeepSpeed's), or one process alone, uses every GPU it sees."""
    from sft.machine import Launch, Machine, nvml_uuid

    def node(**launch) -> Machine:  # four GPUs seen, as machine() reads them
        uuids = tuple(nvml_uuid(u) for u in ["GPU-a", "b", "c", "MIG-d"])  # torch drops NVML's GPU- prefix at times
        return Machine(gpu_names=("NVIDIA H200",) * 4, gpu_memory_gib=(139.8,) * 4, gpu_uuids=uuids,
                       launch=Launch(**launch))

    assert telemetry.visible_gpus(node(world_size=4, local_world_size=2)) == ["GPU-a", "GPU-b"]
    assert telemetry.visible_gpus(node(world_size=4)) == ["GPU-a", "GPU-b", "GPU-c", "MIG-d"]
    assert telemetry.visible_gpus(node(world_size=1, local_world_size=1)) == ["GPU-a", "GPU-b", "GPU-c", "MIG-d"]
    assert telemetry.visible_gpus(Machine()) == []  # a machine without a CUDA GPU


def test_gpu_telemetry_does_nothing_without_gpus_or_nvml(monkeypatch, capsys):
    state = rank0()
    monkeypatch.setattr(telemetry, "visible_gpus", lambda: [])  # a machine without a CUDA GPU
    no_gpu = GpuTelemetry()
    no_gpu.on_train_begin(CUDA, state, None)
    assert no_gpu.thread is None
    monkeypatch.setattr(telemetry, "visible_gpus", lambda: ["GPU-aaa"])
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    cpu_run = GpuTelemetry()  # --use_cpu on a GPU machine
    cpu_run.on_train_begin(SimpleNamespace(device=torch.device("cpu")), state, None)
    assert cpu_run.thread is None

    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed: the import fails
    no_nvml = GpuTelemetry()
    no_nvml.on_train_begin(CUDA, state, None)
    assert no_nvml.thread is None

    for callback in (no_gpu, cpu_run, no_nvml):
        logs = {"loss": 1.0}
        callback.on_log(None, state, None, logs=logs)
        callback.on_train_end(None, state, None)
        assert logs == {"loss": 1.0}
    assert capsys.readouterr() == ("", "")


def test_gpu_telemetry_without_nvml_access_logs_nothing(monkeypatch, two_gpus):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(fail_init=True))
    callback, state = GpuTelemetry(interval=0.01), rank0()
    callback.on_train_begin(CUDA, state, None)
    callback.thread.join(timeout=600)
    logs = {"loss": 1.0}
    callback.on_log(None, state, None, logs=logs)
    callback.on_train_end(None, state, None)
    assert logs == {"loss": 1.0}


def test_gpu_telemetry_only_on_rank_0(monkeypatch, two_gpus):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    from sft.machine import Launch

    monkeypatch.setattr("sft.machine.launch", lambda: Launch(world_size=2, rank=1))  # what is_first_process reads
    callback = GpuTelemetry()
    callback.on_train_begin(CUDA, SimpleNamespace(is_world_process_zero=False), None)
    assert callback.thread is None


def test_eval_perplexity():
    logs = {"eval_loss": 2.0, "eval_alpaca_loss": 1.0, "loss": 3.0, "epoch": 1.0}
    EvalPerplexity().on_log(None, None, None, logs=logs)
    assert logs["eval_perplexity"] == pytest.approx(math.exp(2.0))
    assert logs["eval_alpaca_perplexity"] == pytest.approx(math.e)
    assert "perplexity" not in logs and len(logs) == 6
    huge = {"eval_loss": 1000.0}
    EvalPerplexity().on_log(None, None, None, logs=huge)
    assert huge["eval_perplexity"] == math.inf


def test_a_kill_while_writing_leaves_the_old_file(tmp_path):
    path = tmp_path / ALL_RESULTS
    path.write_text("{}")

    def killed(f):
        f.write(b'{"train_lo')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        telemetry.write_atomically(path, killed)
    assert path.read_text() == "{}"


def test_non_finite_numbers_are_strict_json_and_matplotlib_is_optional(tmp_path, monkeypatch, capsys):
    record, state = RunRecord(), rank0()
    args = SimpleNamespace(output_dir=str(tmp_path))
    record.on_train_begin(args, state, None)
    record.on_log(args, state, None, logs={"loss": math.nan, "grad_norm": math.inf, "epoch": 0.1})
    line = (tmp_path / TRAINER_LOG).read_text()
    json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert json.loads(line)["loss"] == "NaN" and json.loads(line)["grad_norm"] == "Infinity"

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # matplotlib not installed
    state.log_history = [{"loss": 1.0, "step": 1}, {"train_runtime": 1.0, "train_loss": 1.0, "step": 1}]
    record.on_train_end(args, state, None)
    record.on_train_end(args, state, None)
    assert not (tmp_path / LOSS_PLOT).exists()
    assert json.loads((tmp_path / ALL_RESULTS).read_text())["train_loss"] == 1.0
    assert capsys.readouterr().out.count("matplotlib is not installed") == 1


def train(out: Path, max_steps: int, resume: str | None = None):
    """A tiny in-process run with the callbacks as sft/train.py lists them (TensorBoard last); eval every 2 steps,
    checkpoints every 2."""
    import datasets
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.integrations import TensorBoardCallback

    from sft.report.callbacks import ThroughputCallback
    from sft.data.packing import Collator

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=128), dtype=torch.float32)
    rows = datasets.Dataset.from_list([{"input_ids": list(range(1, n)), "labels": list(range(1, n))}
                                       for n in (11, 21, 31, 41)])
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=2,
                             per_device_eval_batch_size=4, logging_steps=1, eval_strategy="steps", eval_steps=2,
                             save_strategy="steps", save_steps=2, use_cpu=True, report_to=["tensorboard"],
                             remove_unused_columns=False, disable_tqdm=True,
                             include_num_input_tokens_seen="non_padding")
    callbacks = [ThroughputCallback(flops_per_token=1e6, peak_flops_per_gpu=1e12), GpuTelemetry(), EvalPerplexity(),
                 RunRecord()]
    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, data_collator=Collator(0),
                      callbacks=callbacks)
    if trainer.pop_callback(TensorBoardCallback):
        trainer.add_callback(TensorBoardCallback)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / TRAINER_LOG).read_text().splitlines()]


def test_a_run_leaves_its_log_plot_results_and_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / TRAINER_LOG).write_text('{"step": 9, "loss": 5.0}\n')  # an earlier attempt killed before any checkpoint
    trainer = train(out, max_steps=4)

    logged = lines(out)
    assert len(logged) == 4 + 2 + 1  # 4 training logs, 2 evaluations, the final train metrics: one line per log
    train_lines = [line for line in logged if "loss" in line]
    assert [line["step"] for line in train_lines] == [1, 2, 3, 4] and all(line["total_steps"] == 4 for line in logged)
    for line in train_lines:
        assert {"epoch", "learning_rate", "grad_norm", "real_tokens_per_second", "mfu", "elapsed_s"} <= line.keys()
    evals = [line for line in logged if "eval_loss" in line]
    assert [line["step"] for line in evals] == [2, 4]
    assert all(line["eval_perplexity"] == pytest.approx(math.exp(line["eval_loss"])) for line in evals)
    assert tensorboard_scalars(out / "runs", "eval/perplexity") == pytest.approx([e["eval_perplexity"] for e in evals])

    png = (out / LOSS_PLOT).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    results = json.loads((out / ALL_RESULTS).read_text())
    assert {"train_loss", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "epoch",
            "eval_loss", "eval_perplexity", "eval_runtime", "eval_samples_per_second", "global_step",
            "total_real_tokens", "train_real_tokens_per_second", "train_mfu", "effective_tokens_per_sec"} \
        <= results.keys()
    assert results["global_step"] == 4 and results["eval_loss"] == evals[-1]["eval_loss"]
    assert results["total_real_tokens"] == 4 * 2 * 25  # 4 steps of 2 rows, 25 real tokens per row on average
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]

    metrics = trainer.evaluate()  # train.py's final evaluation, after training: the results follow it
    assert lines(out)[-1]["eval_runtime"] == metrics["eval_runtime"] == \
        json.loads((out / ALL_RESULTS).read_text())["eval_runtime"]
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))

    summary = run_summary(str(out))
    assert summary.splitlines()[0] == "Run summary:"
    for row in ("train loss", "eval loss", "perplexity", "steps        4, epoch 2.00", "real tokens  200,",
                "tok/s in training steps", "MFU", str(out / ALL_RESULTS)):
        assert row in summary, summary
    assert run_summary(str(tmp_path)) is None  # nothing trained there


def test_a_resumed_run_appends_to_its_log(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    out = tmp_path / "out"
    train(out, max_steps=4)
    before = (out / TRAINER_LOG).read_text()
    train(out, max_steps=6, resume=str(out / "checkpoint-4"))

    after = (out / TRAINER_LOG).read_text()
    assert after.startswith(before)  # not truncated
    new = [json.loads(line) for line in after[len(before):].splitlines()]
    assert new[0]["resumed_from_step"] == 4 and new[0]["total_steps"] == 6
    assert [line["step"] for line in new[1:] if "loss" in line] == [5, 6]
    results = json.loads((out / ALL_RESULTS).read_text())
    assert results["global_step"] == 6 and results["total_real_tokens"] == 6 * 2 * 25  # the whole run's tokens


@pytest.mark.parametrize("packed", [False, True])
def test_the_collators_host_count_is_the_trainers_own(tmp_path, packed):
    """SFTTrainer counts real tokens from the collator's count made on the host (no `.item()` of a GPU count each
    micro-batch): the same number the Trainer's own count gives, and the model never sees the count."""
    import datasets
    from transformers import AutoModelForCausalLM, TrainingArguments

    from sft.data.packing import Collator
    from sft.trainer import SFTTrainer

    def tokens_seen(counts_tokens: bool) -> int:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=128), dtype=torch.float32)
        lengths = (11, 21, 31, 41)
        rows = [{"input_ids": list(range(1, n)), "labels": list(range(1, n)),
                 **({"seq_lengths": [n // 2, n - 1 - n // 2]} if packed else {})} for n in lengths]
        args = TrainingArguments(output_dir=str(tmp_path / str(counts_tokens)), max_steps=3,
                                 per_device_train_batch_size=2, use_cpu=True, report_to=[], save_strategy="no",
                                 remove_unused_columns=False, disable_tqdm=True,
                                 include_num_input_tokens_seen="non_padding")
        trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             data_collator=Collator(0, counts_tokens=counts_tokens),
                             processing_class=SimpleNamespace(pad_token_id=0))  # the Trainer's rule reads it
        trainer.train()
        return trainer.state.num_input_tokens_seen

    assert tokens_seen(True) == tokens_seen(False) > 0
