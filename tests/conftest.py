"""Shared test fixtures: tiny random-init models saved with save_pretrained, the shared real data, a way to
run the training entry point in a fresh process (as a user does), and the check that no test writes into the
repository (where a user's own runs live)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
# The folders a run writes by default (the demo's output/demo, a run's runs/, the Trainer's trainer_output): a user's
# runs are there, and a test's must not be. What the tools that run the tests keep is theirs: pytest's cache,
# bytecode, .cache (DeepSpeed's CPU op compiled once: TORCH_EXTENSIONS_DIR), the virtual environment.
RUN_FOLDERS = ("output", "runs", "trainer_output")
TOOL_FILES = {".pytest_cache", "__pycache__", ".cache", ".venv", ".git", ".coverage"}

# Torch gives each process one thread per core. Under xdist the workers, and the training processes their tests
# start, share the cores: each takes its worker's share, so 2 workers on the 2-core CI box run 2 threads, not 4 to 6
# that spin against each other (a test's two demo LoRA runs beside a 2-rank test: 39 s with torch's default, 20 s).
# Each rank of a multi-process launch gets 1 anyway (torch.distributed.run); a value set outside pytest wins.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# hypothesis keeps its example database and caches in ./.hypothesis, the repository when pytest runs from there.
if "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = tempfile.mkdtemp(prefix="deepseek-sft-hypothesis-")
    atexit.register(shutil.rmtree, os.environ["HYPOTHESIS_STORAGE_DIRECTORY"], ignore_errors=True)


def repository_state() -> dict[str, int]:
    """The repository's top-level names (-> 0), and each entry two levels into the run folders with its mtime: a
    new name anywhere there, or a run written into a user's output/demo, shows as a difference."""
    state = {name: 0 for name in os.listdir(REPO) if name not in TOOL_FILES}
    for folder in RUN_FOLDERS:
        for entry in [REPO / folder] if (REPO / folder).is_dir() else []:
            for child in entry.iterdir():
                state[str(child.relative_to(REPO))] = child.stat().st_mtime_ns
                for grandchild in child.iterdir() if child.is_dir() else []:
                    state[str(grandchild.relative_to(REPO))] = grandchild.stat().st_mtime_ns
    return state


AT_START = repository_state()


def changes_since(before: dict[str, int]) -> list[str]:
    after = repository_state()
    return sorted(name for name in after.keys() | before.keys() if after.get(name) != before.get(name))


# The files that take longest on 2 cores (--durations, summed per file; measured with the threads set above), longest
# first. Under `--dist loadfile` a worker takes one file at a time in collection order (the README's command turns off
# xdist's reordering by test count, which put files of few but long tests last): started first, they end together
# with the many short ones instead of one worker finishing a long file alone at the end. A file not listed runs after
# them, as collected.
LONGEST_FILES = ("test_readme.py", "test_distributed.py", "test_lowbit.py", "test_regional_compile.py",
                 "test_fp8_training.py", "test_lowbit_resume.py", "test_user_paths.py", "test_train_e2e.py",
                 "test_bench.py", "test_quantized_experts.py", "test_resume_advice.py", "test_multinode.py",
                 "test_resume.py", "test_package.py", "test_nf4_loading.py", "test_lora_variants.py",
                 "test_expert_parallel.py", "test_sequence_parallel.py", "test_moe_sharded.py", "test_long_rows.py",
                 "test_tensor_parallel.py", "test_qlora_fsdp.py", "test_packing.py", "test_rope_scaling.py",
                 "test_console.py", "test_kept_attention.py", "test_loss_accounting.py", "test_experts_on_load.py")


def longest_first(name: str) -> int:
    return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(items):
    """Longest files first; a stable sort, so each file's tests keep their order (test_readme's blocks use what
    the blocks before them wrote)."""
    items.sort(key=lambda item: longest_first(item.path.name))


def pytest_sessionfinish(session, exitstatus):
    """Also what nothing of one test wrote: collecting the tests, a library's set-up at the first use."""
    changed = changes_since(AT_START)
    if changed:
        print(f"\nerror: the test session wrote into the repository {REPO}: {changed}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def writes_nothing_into_the_repository():
    """Every test writes into its own tmp_path only: never a run (output/, runs/), a data cache or a library's
    files into the repository, where they would mix with the user's (or a user's earlier run make the test fail)."""
    before = repository_state()
    yield
    changed = changes_since(before)
    assert not changed, (f"this test (or one running beside it) wrote into the repository {REPO}: {changed}; "
                         f"write under tmp_path instead")


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """SFT_FP8_ON_CPU=1 for an in-process test (--fp8 on the CPU's FP8 matmul and the FP8 grouped matmul's
    emulation): the process's cached launch and machine facts read anew, and again after the test."""
    from sft.machine import launch, machine

    monkeypatch.setenv("SFT_FP8_ON_CPU", "1")
    launch.cache_clear()
    machine.cache_clear()
    yield
    monkeypatch.delenv("SFT_FP8_ON_CPU")
    launch.cache_clear()
    machine.cache_clear()


ALPACA_SAMPLE = SHARED / "datasets" / "alpaca_sample.json"
OASST_SAMPLE = SHARED / "datasets" / "oasst1_sample.jsonl"
DEEPSEEK_TOKENIZER = SHARED / "tokenizers" / "deepseek-coder-6.7b-instruct"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared (real samples and tokenizer) is absent "
                                                              "in this checkout; CI has it")


def tiny_config(model_type: str, vocab_size: int = 1024, **overrides):
    """A few-layer config of each family we support (sizes only; the architecture is the real one)."""
    from transformers import AutoConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if model_type in ("deepseek_v2", "deepseek_v3"):
        common.update(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                      num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, topk_method="greedy")
        if model_type == "deepseek_v3":
            common.update(n_group=2, topk_group=1, q_lora_rank=16)
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def save_tiny_model(path: Path, model_type: str = "llama", tokenizer_dir: Path | None = None, seed: int = 0) -> Path:
    """Save a random-init model (and a tokenizer: the embedded demo's, or the one given) to `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft.model.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or ensure_tiny_model())
    config = tiny_config(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def peak_host_growth(setup: str, load: str, *argv: str) -> int:
    """Bytes the peak RSS (VmHWM) of a fresh Python process grows by while it runs `load`, from its RSS after `setup`
    (imports: not counted); both code that reads `argv` as sys.argv[1:]. One thread, and glibc's malloc given a fixed
    mmap threshold: with its default, dynamic one, freed working buffers under 32 MB stay in the heap, fragmented,
    and blur what is compared."""
    import json
    import textwrap

    code = "import json, sys\n" + textwrap.dedent(setup) + \
        "\ndef status(field):  # kB\n" \
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(field + ':'))\n" \
        "before = status('VmRSS')\n" + textwrap.dedent(load) + \
        "\nprint(json.dumps({'peak_growth': (status('VmHWM') - before) * 1024}))\n"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    done = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_growth"]


def loading_peaks(path: Path, imports: str, quantize_after: str, load_new: str) -> dict[str, int]:
    """peak_host_growth of loading the bf16 checkpoint at `path` two ways, each in a process of its own: "old",
    from_pretrained whole then `quantize_after` (code on `model`), and "new", `load_new` (code that sets `model`).
    Both see `path`, `config` (its AutoConfig), torch, AutoModelForCausalLM and `imports`."""
    setup = "import torch\nfrom transformers import AutoConfig, AutoModelForCausalLM\n" + imports + \
        "\npath = sys.argv[1]\nconfig = AutoConfig.from_pretrained(path)\n"
    whole = "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, use_safetensors=True)\n"
    return {"old": peak_host_growth(setup, whole + quantize_after, str(path)),
            "new": peak_host_growth(setup, load_new, str(path))}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    """A folder of this test session that its xdist workers share (each worker's tmp_path_factory has its own):
    what one worker builds there with built_once, the others reuse instead of building it again."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(folder: Path, build: Callable[[Path], object]) -> Path:
    """`folder`, filled by build(folder) by the first test of the session that asks, on whichever worker; the others
    wait for it. A build that failed leaves no mark: the next test that asks tries it again (and fails as its own)."""
    from filelock import FileLock

    with FileLock(f"{folder}.lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / ".built").touch()
    return folder


def run_train(args: list[str], *, launcher: list[str] | None = None, env: dict | None = None,
              timeout: int = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `sft/train.py` in a new process (optionally under a launcher such as `accelerate launch ...`)."""
    command = (launcher or [sys.executable]) + [str(REPO / "sft" / "train.py"), *args]
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(command, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def train_here(args: list[str], *, env: dict | None = None) -> subprocess.CompletedProcess:
    """sft.train.main(args) in this process, with run_train's environment: -> what run_train returns (the exit code,
    stdout, stderr). For a test whose point is the run, not the process: a new Python with torch, transformers and
    peft costs ~5 s of CPU before it trains. The launch's and machine's cached facts are read anew for the run and
    after it (they read the environment: SFT_FP8_ON_CPU, ...). What a library reads at its import (huggingface_hub's
    HF_HUB_OFFLINE) is this process's: .ci/run exports HF_HUB_OFFLINE=1 and TOKENIZERS_PARALLELISM=false."""
    import contextlib
    import io
    import signal

    from sft.machine import launch, machine
    from sft.train import main

    added = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    before = {key: os.environ.get(key) for key in added}
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # the run sets its own
    out, err = io.StringIO(), io.StringIO()
    os.environ.update(added)
    launch.cache_clear()
    machine.cache_clear()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        launch.cache_clear()
        machine.cache_clear()
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def logged_losses(output: Path) -> list[float]:
    """The training losses a run logged, step by step (its trainer_log.jsonl)."""
    return [json.loads(line)["loss"] for line in (output / "trainer_log.jsonl").read_text().splitlines()
            if '"loss"' in line and '"step"' in line]


def lora_demo_run(folder: Path, name: str, *extra: str) -> tuple[list[float], str]:
    """3 logged steps of the demo's LoRA with activation checkpointing, into folder/name: -> its losses, stdout. In
    this process (train_here)."""
    output = folder / name
    result = train_here(["--max_steps", "3", "--logging_steps", "1", "--lora", "--report_to", "none",
                        "--eval_strategy", "no", "--seed", "0", "--activation_checkpointing", "true",
                        "--output_dir", str(output), "--dataset_cache_dir", str(folder / "cache"), *extra])
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return logged_losses(output), result.stdout


@pytest.fixture(scope="session")
def plain_lora_demo_losses(session_dir) -> list[float]:
    """lora_demo_run without a lever, what the levers of test_long_rows and test_kept_attention must train like:
    one run per session for both (the same command twice cost ~15 s on 2 cores)."""
    folder = built_once(session_dir / "lora-demo-plain", lambda folder: lora_demo_run(folder, "plain"))
    return logged_losses(folder / "plain")


@pytest.fixture(scope="session")
def train_help(session_dir) -> subprocess.CompletedProcess:
    """`python sft/train.py --help` run from outside the repository (cwd /), once per session: what test_user_paths
    checks of its screen and test_console of its stderr are two looks at one process."""
    def run(folder: Path) -> None:
        done = subprocess.run([sys.executable, str(REPO / "sft" / "train.py"), "--help"], cwd="/",
                              capture_output=True, text=True, timeout=600)
        (folder / "help.json").write_text(json.dumps([done.args, done.returncode, done.stdout, done.stderr]))

    folder = built_once(session_dir / "train-help", run)
    return subprocess.CompletedProcess(*json.loads((folder / "help.json").read_text()))


@pytest.fixture(scope="session")
def fsdp_two_ranks(session_dir) -> dict:
    """tests/fsdp_two_ranks_worker.py's parts, {part: what rank 0 found}: one start of two gloo ranks per session
    for the FSDP2 tests of test_fsdp_embedding, test_distributed and test_modules_to_save (three starts of two
    processes importing torch, transformers and peft cost ~15 s more on 2 cores)."""
    def run(folder: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        workers = [subprocess.Popen([sys.executable, str(REPO / "tests" / "fsdp_two_ranks_worker.py"),
                                     str(folder / "rendezvous"), str(rank), str(folder)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
        outputs = [w.communicate(timeout=600)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], [out[-3000:] for out in outputs]

    folder = built_once(session_dir / "fsdp-two-ranks", run)
    return {**json.loads((folder / "found.json").read_text()), "folder": str(folder)}


def tensorboard_scalars(logdir: Path, tag: str) -> list[float]:
    """Every value logged under `tag` in the TensorBoard event files below `logdir`, in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values += [e.value for e in accumulator.Scalars(tag)]
    return values
