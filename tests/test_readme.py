"""The docs run: every fenced block of README.md and docs/*.md is executed here on tiny models, so they cannot rot.

A block runs by RULES on its words (what kind of command it is), not from a list of known commands: a new command
of a known kind (or a new page of docs/) runs without touching this file, and a block or command that no rule
covers FAILS (test_every_block_has_a_rule lists them all), never skipped in silence. The pages run in one sequence
in one working directory: README.md first, then docs/*.md by name, each page from the top. So a later block uses
what an earlier one wrote (the demo's output/tiny-deepseek/full/latest, the README's LoRA adapter, a page's own
earlier outputs), as a reader who ran the README and then a page would. A failed command shows its page and line,
the command as run and its stderr.

How each kind of block runs:
- ```bash `python3 -m venv .venv && . .venv/bin/activate && pip install ... && X`: the set-up steps are NOT re-run
  (CI runs them itself, through .ci/run); every set-up command must name the same install steps, and each
  `pip install -e ".[extra]"` an extra of pyproject.toml. X runs by its own rule.
- `... && pytest`: .ci/run's own grep must find exactly this line (CI evals it).
- `accelerate launch [...] sft/train.py ...`, `python sft/train.py ...`, `deepseek-sft train [...] ...`: trained for
  2 steps on CPU, or refused (below). With `--help` they run as written.
- `tensorboard --logdir D`: D's event files are loaded (no server is started); `train/loss` must be in them.
- `python -m sft.<tool> ...`, `deepseek-sft data|chat|merge|plan ...` (each command the module that sft/cli.py's
  usage names): run for real on what the blocks above wrote, in this process through runpy, as `python -m` runs
  them (a Python start-up with torch costs ~8 s of CPU). Checked: exit code 0; `--show_masks N` shows N
  conversations; merge writes a model; chat without `--prompt` gets one question on stdin; plan's `Recommended:`
  line is a training command these rules run.
- ```python: executed in the working directory after the blocks above it; tracebacks point at its page's lines.
- ```yaml whose first line is `# name.yaml`: written to name.yaml (substituted); a later command must use it.
- ``` (no language) starting with `Data:`: the data summary. Its files, template, --max_length and packing are
  prepared again with the real DeepSeek tokenizer (../shared; skipped with a reason where absent), and every line
  must be what the command prints now.

Substitutions (every other word stays as written):
- `deepseek-ai/<name>` -> a tiny random model of the same family, saved by conftest.save_tiny_model: llama for
  deepseek-llm/coder/math and R1-Distill-Llama, qwen2 for R1-Distill-Qwen, deepseek_v2 for V2/V2-Lite/Coder-V2,
  deepseek_v3 for V3/R1 (FAMILIES).
- a data file that names no file (data.jsonl, my_data.jsonl, code_alpaca.json, chats.jsonl, .parquet, .csv), or a
  hub dataset given to --dataset -> data/alpaca_demo.json for .json, else a copy of it in that format.
- `...` in a training command (the reader's other options) -> `--model <tiny llama> --dataset <jsonl copy>
  --output_dir output/readme-L<line>` (a docs page's: output/docs-<page>-L<line>).
- `output/...` -> the same relative path in the working directory, where the repository's files are linked (a
  path such as ../shared/... that exists from the repository root becomes absolute). Nothing may be written
  through those links into the repository.
- no `--output_dir` in a training command with its own `--model`/`--dataset` -> `--output_dir output/readme-L<line>`
  (output/docs-<page>-L<line>, so that a later block knows where it saved); the demo (neither) saves in a new
  directory of its own, which output/tiny-deepseek/full/latest then names.
- every training command -> + `--max_steps 2 --max_length 512 --logging_steps 1 --save_strategy no --report_to none
  --dataset_cache_dir <tmp>` (`--report_to tensorboard` where a `tensorboard --logdir` block reads its output;
  no `--save_strategy no` where the command loads its best checkpoint at the end, whose saves it must keep).

Training commands on a CPU machine:
- needing nothing the machine lacks: they train. A multi-process accelerate config starts 2 processes (the configs
  say 3) with `--use_cpu true` (DDP) or `--ddp_backend gloo` (DeepSpeed), as docs/strategies.md's CPU paragraph
  says; the first command of each strategy trains 2 ranks, later ones of that strategy check their options with one
  (a command with `--sequence_parallel N` always N, the ranks that share its rows). A
  multi-node config becomes one local machine. DeepSpeed's CPU op is built in TORCH_EXTENSIONS_DIR (default
  .cache/torch_extensions, as in test_distributed and .ci/run): a test run compiles it once (~2 min on 2 cores).
- needing a GPU (`--bf16`/`--fp16`, flex/flash attention, `--use_liger_kernel`, `--fp8`, an FSDP config, offload,
  `--tp_size`): run as written (the first such command with 2 ranks where its config starts several, later ones
  with one), and it must stop before any model loads with one `error:` line per problem, the first naming all it
  needs, and no traceback (exit code 2; `accelerate launch` exits 1, which the README mentions). Each set of needs
  is checked once per launcher (the same message). Where precision is the only need, the command also
  trains without it (`--bf16` dropped, or `--bf16 false` after a recipe that sets it), so its other options, data
  and outputs are checked and later blocks can use them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import resource
import runpy
import shlex
import socket
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from conftest import DEEPSEEK_TOKENIZER, REPO, SHARED, save_tiny_model, tensorboard_scalars

README = REPO / "README.md"
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
# 512: the deepseek_coder template's system prompt alone is ~220 tokens of the tiny tokenizer (trained on data/ only).
CAPS = ["--max_steps", "2", "--max_length", "512", "--logging_steps", "1", "--save_strategy", "no"]
PYTHONS = {"python", "python3"}
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
TRAIN_SCRIPTS = {"sft/train.py"}
PRECISION = {"--bf16", "--fp16"}  # the GPU needs that a CPU run can drop (ReadmeRun.gpu_needs has them all)
# Hub ids -> the tiny family that stands in for them (first match wins).
FAMILIES = [(r"Distill-Qwen", "qwen2"), (r"Distill-Llama", "llama"), (r"V3|R1", "deepseek_v3"),
            (r"V2", "deepseek_v2"), (r"deepseek-(llm|coder|math)", "llama")]
HUB_ID = re.compile(r"deepseek-ai/[A-Za-z0-9._-]+")
# A data file name, or a path relative to the repository root that leaves it (../shared/...).
PATH_WORD = re.compile(r"(?<![\w./~-])(\.\./[\w./~-]+|[\w./~-]+(?:\.jsonl|\.json|\.parquet|\.csv))(?![\w./-])")
HUB_DATASET = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.%\[\]:-]+)?")  # --dataset owner/name[:split]
NOISE = re.compile(r"torchao/_C|_pytree\.py|Enum subclass|real_accelerator\.py|it/s\]|examples/s\]|"
                   r"To avoid this warning pass in values|`--num_machines` was set|`--mixed_precision` was set|"
                   r"`--dynamo_backend` was set|^\s*$")


# ---- the README's blocks and commands --------------------------------------------------------------------------

@dataclass
class Block:
    line: int            # line of the opening fence in its page
    lang: str            # "bash", "python", "yaml", "" (an output sample), ...
    text: str            # the body, dedented to the fence
    page: str = "README.md"  # the page, relative to the repository root (README.md, docs/data.md, ...)

    @property
    def id(self) -> str:
        return f"{self.page}:L{self.line}-{self.lang or 'output'}"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def readme_blocks(text: str, page: str = "README.md") -> tuple[list[Block], list[str]]:
    """Every fenced block of a page (also indented ones in list items) and the problems found while reading them."""
    blocks, problems = [], []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,})([\w+-]*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening[1]), opening[2]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            problems.append(f"{page}:{i + 1}: a ``` block that never closes")
            break
        body = [line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1:end]]
        blocks.append(Block(i + 1, opening[3].lower(), "\n".join(body) + "\n", page))
        i = end + 1
    return blocks, problems


@dataclass
class Command:
    line: int            # line of its page where the command starts
    text: str            # as the page writes it (continuation lines joined)
    steps: list[list[str]]  # its words, split at `&&`
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def default_output(self) -> str:
        """Its own --output_dir where it names none: output/readme-L<line>, output/docs-<page>-L<line>."""
        name = "readme" if self.page == "README.md" else "docs-" + Path(self.page).stem
        return f"output/{name}-L{self.line}"


DEMO_OUTPUT = "output/tiny-deepseek/full/latest"  # the demo's run directory, once it finished (sft/safety/run_dir.py)
SHELL_SYNTAX = {"|", "||", ";", "&", ">", ">>", "<", "2>", "2>&1", "&>"}


def bash_commands(block: Block) -> list[Command]:
    commands, pending, start = [], "", None
    for offset, raw in enumerate(block.text.splitlines()):
        if start is None:
            start = block.line + 1 + offset
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        logical, pending = pending + raw, ""
        try:
            words = shlex.split(logical, comments=True)
        except ValueError:  # an unclosed quote: a command no rule runs (classify says so)
            words = [logical]
        if words:
            steps, step = [], []
            for word in words:
                if word == "&&":
                    steps.append(step)
                    step = []
                else:
                    step.append(word)
            steps.append(step)
            commands.append(Command(start, " ".join(logical.split()), steps, block.page))
        start = None
    return commands


# ---- what a command is: rules on its words -------------------------------------------------------------------

@dataclass
class Step:
    kind: str            # setup, pytest, train, tensorboard, tool, help
    words: list[str]
    env: dict = field(default_factory=dict)
    launcher: list[str] = field(default_factory=list)   # `accelerate launch ...` words before the script
    program: list[str] = field(default_factory=list)    # the script: sft/train.py, python sft/train.py, ...
    args: list[str] = field(default_factory=list)       # the words after the script or module
    tool: str = ""                                      # a tool's module (sft.tools.chat, ...), for what to check


class NoRule(Exception):
    """A command or block that no rule of this file knows how to run."""


def classify(words: list[str]) -> Step:
    env, words = {}, list(words)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words:
        raise NoRule("no command after the variables")
    odd = [w for w in words if w in SHELL_SYNTAX or "$(" in w or "`" in w]
    if odd:
        raise NoRule(f"shell syntax {odd} (pipes, redirections, substitutions) that no rule runs")
    first, rest = words[0], words[1:]
    python = first in PYTHONS
    if python and rest[:2] == ["-m", "venv"] or first in (".", "source") and rest[:1] and \
            rest[0].endswith("bin/activate"):
        return Step("setup", words, env)
    if first == "pip" or python and rest[:2] == ["-m", "pip"]:
        return Step("setup", words, env)
    if first == "pytest" or python and rest[:2] == ["-m", "pytest"]:
        return Step("pytest", words, env)
    if first == "tensorboard":
        return Step("tensorboard", words, env)
    if first == "accelerate" and rest[:1] == ["launch"]:
        script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if script is None or words[script] not in TRAIN_SCRIPTS:
            raise NoRule("`accelerate launch` of a script other than sft/train.py")
        return train_step(words[script + 1:], env, words[:script], [words[script]])
    if python and rest[:1] and rest[0] in TRAIN_SCRIPTS:
        return train_step(rest[1:], env, [], words[:2])
    if python and rest[:2] == ["-m", "sft.train"]:
        return train_step(rest[2:], env, [], words[:3])
    if first == "deepseek-sft":  # pyproject.toml's console script: train (accelerate launch's options first), tools
        command, args = (rest[0], rest[1:]) if rest else ("", [])
        if command == "train":
            from sft.cli import split_launch_options

            launch, training = split_launch_options(args)
            return train_step(training, env, ["deepseek-sft", "train", *launch], [])
        module = CLI_TOOLS.get(command, "")
        if module and importlib.util.find_spec(module) is not None:
            return tool_step(module, ["sft.cli", command], args, words, env)
        if command in ("-h", "--help"):
            return Step("help", words, env, program=words[:1], args=rest)
        raise NoRule(f"`deepseek-sft {command}`: a command of the console script that no rule runs")
    if python and rest[:2] == ["-m", "sft.cli"]:
        return classify([*(f"{k}={v}" for k, v in env.items()), "deepseek-sft", *rest[2:]])
    if python and rest[:1] == ["-m"] and len(rest) > 1 and rest[1].startswith("sft."):
        return tool_step(rest[1], [rest[1]], rest[2:], words, env)
    raise NoRule(f"`{first}` is no command this test knows how to run")


def cli_tools() -> dict[str, str]:
    """deepseek-sft <command> -> the module it is (`python -m <module>`), as sft/cli.py's usage says it."""
    from sft.cli import USAGE

    return dict(re.findall(r"^\s*deepseek-sft (\w+) .*# = python -m (sft\.[\w.]+)", USAGE, re.M))


CLI_TOOLS = cli_tools()


def tool_step(tool: str, program: list[str], args: list[str], words: list[str], env: dict) -> Step:
    """A tool of ours (`python -m sft.<tool>` or `deepseek-sft <command>`); `program`: module and its first words."""
    if "..." in args:
        raise NoRule("`...` in a tool command (only training commands get the reader's options filled in)")
    return Step("tool", words, env, program=program, args=args, tool=tool)


def train_step(args: list[str], env: dict, launcher: list[str], program: list[str]) -> Step:
    kind = "help" if "--help" in args or "-h" in args else "train"
    return Step(kind, args, env, launcher, program, args)


def plan_block(block: Block, blocks: list[Block]) -> list[tuple[Command | None, Step | None]]:
    """What running the block means; raises NoRule for what no rule covers."""
    if block.lang in ("bash", "sh", "shell", "console"):
        out = []
        for command in bash_commands(block):
            for words in command.steps:
                try:
                    out.append((command, classify(words)))
                except NoRule as e:
                    raise NoRule(f"{command.where}: {command.text}\n    -> {e}") from None
        if not out:
            raise NoRule(f"{block.where}: an empty ```{block.lang} block")
        return out
    if block.lang == "python":
        return [(None, None)]
    if block.lang in ("yaml", "yml"):
        name = yaml_file_name(block)
        if name is None:
            raise NoRule(f"{block.where}: a ```yaml block whose first line is not `# <file>.yaml`, so the "
                         f"test cannot tell which command reads it")
        later = [b for b in blocks if b.page == block.page and b.line > block.line
                 and b.lang in ("bash", "sh", "shell", "console")]
        if not any(name in re.split(r"[\s=]", c.text) for b in later for c in bash_commands(b)):
            raise NoRule(f"{block.where}: {name} is written by this block but no later command uses it")
        return [(None, None)]
    if block.lang in ("", "text", "console-output"):
        if block.text.startswith("Data: "):
            return [(None, None)]
        raise NoRule(f"{block.where}: an output sample this test cannot produce "
                     f"(first line {block.text.splitlines()[0][:60]!r})")
    raise NoRule(f"{block.where}: a ```{block.lang} block (no rule runs this language)")


def yaml_file_name(block: Block) -> str | None:
    first = block.text.splitlines()[0] if block.text.strip() else ""
    match = re.match(r"^#\s*([\w./-]+\.ya?ml)\s*$", first)
    return match[1] if match else None


def options(words: list[str]) -> dict:
    """--key value / --key=value / --flag (True) / --key v1 v2 (a list); the last one wins, as in argparse."""
    out: dict = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            key, eq, value = word[2:].partition("=")
            key = key.replace("-", "_")
            if eq:
                out[key] = value
            else:
                values = []
                while i + 1 < len(words) and not words[i + 1].startswith("--"):
                    values.append(words[i + 1])
                    i += 1
                out[key] = values[0] if len(values) == 1 else (values or True)
        i += 1
    return out


def truthy(value) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def kind_of(words: list[str]) -> str | None:
    try:
        return classify(words).kind
    except NoRule:
        return None


def set_up_steps(command: Command) -> list[str]:
    """The install steps of a set-up command, with the project's extras left out (`.[test]` installs `.` too)."""
    return [" ".join(re.sub(r"^\.\[[\w,-]+\]$", ".", w) for w in words)
            for words in command.steps if kind_of(words) == "setup"]


def project_extras() -> list[str]:
    """The names under pyproject.toml's [project.optional-dependencies] (no tomllib: Python 3.10 has none)."""
    text = (REPO / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    return re.findall(r"^([A-Za-z0-9][\w-]*)\s*=", section[1], re.M) if section else []


def venv_commands() -> list[Command]:
    """The commands that set up a fresh environment (`python3 -m venv ... && ...`)."""
    return [c for b in BLOCKS if b.lang == "bash" for c in bash_commands(b)
            if c.steps[0][:1] and c.steps[0][0] in PYTHONS and c.steps[0][1:3] == ["-m", "venv"]]


def pages() -> list[Path]:
    """README.md, then docs/*.md by name: the order the blocks run in (a page's blocks may use what the README's
    wrote, and what its own earlier blocks wrote)."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def all_blocks() -> tuple[list[Block], list[str]]:
    blocks, problems = [], []
    for path in pages():
        found, trouble = readme_blocks(path.read_text(), str(path.relative_to(REPO)))
        blocks += found
        problems += trouble
    return blocks, problems


BLOCKS, PROBLEMS = all_blocks()


# ---- running them --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(text: str, n: int = 40) -> str:
    """The last lines, without library noise and without the launcher's report of a failed rank (which would
    push the rank's own error out of view)."""
    lines = text.splitlines()
    launcher = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")
                     and i + 1 < len(lines) and re.search(r"bin/accelerate\"", lines[i + 1])), None)
    if launcher is not None:
        lines = lines[:launcher] + ["(accelerate's own traceback for the failed rank left out)"]
    lines = [line for line in lines if not NOISE.search(line)]
    return "\n".join(lines[-n:])


def tracebacks_of_ranks(stderr: str) -> list[str]:
    """Python tracebacks in stderr other than the launcher's own (accelerate raises one when a rank exits != 0)."""
    out = []
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            first_frame = next((x for x in lines[i + 1:i + 3] if x.strip().startswith("File ")), "")
            if not re.search(r"bin/accelerate\"|accelerate/commands/", first_frame):
                out.append("\n".join(lines[i:i + 12]))
    return out


@dataclass
class Launcher:
    words: list[str]     # `accelerate launch ...` before the script; [] for one plain process
    strategy: str        # single, ddp, deepspeed, fsdp
    offload: bool
    multi_node: bool

    @classmethod
    def of(cls, words: list[str], work: Path) -> Launcher:
        opts = options(words[2:])
        config = {}
        if "config_file" in opts:
            config = yaml.safe_load((work / opts["config_file"]).read_text()) or {}
        kind = str(config.get("distributed_type", "NO")).upper()
        strategy = ("deepspeed" if "use_deepspeed" in opts or kind == "DEEPSPEED" else
                    "fsdp" if "use_fsdp" in opts or kind == "FSDP" else
                    "ddp" if "multi_gpu" in opts or kind in ("MULTI_GPU", "MULTI_CPU") else "single")
        offload = truthy((config.get("fsdp_config") or {}).get("fsdp_offload_params"))
        deepspeed = config.get("deepspeed_config") or {}
        offload |= any(str(deepspeed.get(k, "none")) in ("cpu", "nvme")
                       for k in ("offload_optimizer_device", "offload_param_device"))
        if deepspeed.get("deepspeed_config_file"):
            zero = json.loads((work / deepspeed["deepspeed_config_file"]).read_text()).get("zero_optimization", {})
            offload |= any(str((zero.get(k) or {}).get("device", "none")) in ("cpu", "nvme")
                           for k in ("offload_optimizer", "offload_param"))
        machines = int(opts.get("num_machines", config.get("num_machines", 1)))
        return cls(words, strategy, offload, machines > 1)

    def with_processes(self, processes: int) -> list[str]:
        """The same launch on this machine: `processes` local ranks on a free port, one machine."""
        if not self.words:
            return []
        dropped = {"--num_processes", "--main_process_port", "--machine_rank", "--num_machines", "--main_process_ip"}
        words, skip = [], False
        for word in self.words:
            if skip:
                skip = False
            elif word.split("=")[0] in dropped:
                skip = "=" not in word
            else:
                words.append(word)
        if self.strategy == "single":
            return words
        words += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
        if self.multi_node:
            words += ["--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1"]
        return words


def rows_split_over(args: list[str]) -> int:
    """The ranks that share each row: --sequence_parallel's value (1 when not given). Such a command trains with
    them every time (with fewer it is refused, as it should be)."""
    return int(args[args.index("--sequence_parallel") + 1]) if "--sequence_parallel" in args else 1


class ReadmeRun:
    """One working directory in which the README's blocks run in order (later blocks read earlier outputs)."""

    def __init__(self, work: Path, tmp: Path, tiny_llama: Path):
        self.work, self.tmp = work, tmp
        for entry in REPO.iterdir():  # the repository's files, reachable by the README's relative paths
            if entry.name not in (".git", ".venv", ".cache", "output", "recipe.yaml", "__pycache__"):
                (work / entry.name).symlink_to(entry)
        self.tiny = {"llama": tiny_llama}
        self.data: dict[str, Path] = {}
        self.outcome: dict[int, BaseException | None] = {}
        self.refusals: dict[tuple, str] = {}      # (needs, launcher) -> page:line where that refusal was checked
        self.multi_rank: dict[str, str] = {}      # strategy -> page:line whose command trained 2 ranks of it
        self.timings: list[tuple[str, float]] = []
        self.watched = [Path(w) for b in BLOCKS if b.lang == "bash" for c in bash_commands(b) for s in c.steps
                        if s[:1] == ["tensorboard"] for w in [options(s[1:]).get("logdir", "")] if w]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "TORCH_EXTENSIONS_DIR": EXTENSIONS,
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    # -- substitutions --
    def tiny_model(self, hub_id: str) -> Path:
        family = next((f for pattern, f in FAMILIES if re.search(pattern, hub_id)), None)
        if family is None:
            raise NoRule(f"{hub_id}: no tiny family stands in for it (add it to FAMILIES)")
        if family not in self.tiny:
            self.tiny[family] = save_tiny_model(self.tmp / f"tiny-{family}", family)
        return self.tiny[family]

    def data_file(self, name: str) -> Path:
        suffix = next(s for s in DATA_SUFFIXES if name.endswith(s))
        if suffix == ".json":
            return REPO / "data" / "alpaca_demo.json"
        if suffix not in self.data:
            records = json.loads((REPO / "data" / "alpaca_demo.json").read_text())
            path = self.tmp / f"alpaca_demo{suffix}"
            if suffix == ".jsonl":
                path.write_text("".join(json.dumps(r) + "\n" for r in records))
            else:
                from datasets import Dataset

                getattr(Dataset.from_list(records), "to_parquet" if suffix == ".parquet" else "to_csv")(str(path))
            self.data[suffix] = path
        return self.data[suffix]

    def substitute(self, text: str) -> str:
        """Hub ids -> tiny models; data files the reader would have -> the stand-in data; a relative path that
        exists from the repository root only (../shared/...) -> that path, absolute."""
        def path(match):
            word = match[1]
            if (self.work / word).exists() or Path(word).expanduser().is_absolute():
                return word
            if (REPO / word).exists():
                return str((REPO / word).resolve())
            return str(self.data_file(word)) if word.endswith(DATA_SUFFIXES) else word

        text = PATH_WORD.sub(path, text)
        return HUB_ID.sub(lambda m: str(self.tiny_model(m[0])), text)

    def substitute_words(self, words: list[str]) -> list[str]:
        """`substitute` on every word, and hub dataset names given to --dataset/--eval_dataset -> the stand-in."""
        out, datasets = [], False
        for word in words:
            if word.startswith("--"):
                datasets = word.split("=")[0] in ("--dataset", "--eval_dataset")
            elif datasets and HUB_DATASET.fullmatch(word) and not (self.work / word).exists():
                word = str(self.data_file("hub.jsonl"))
            out.append(self.substitute(word))
        return out

    def inside(self, path: str | Path, what: str) -> Path:
        """`path` in the working directory, never through a link into the repository (it must stay clean)."""
        resolved = (self.work / path).resolve()
        assert resolved.is_relative_to(self.work.resolve()), \
            f"{what} {path} would be written into the repository ({resolved}); the README should write under output/"
        return resolved

    # -- processes --
    def run(self, words: list[str], readme: str, *, env: dict | None = None, stdin: str | None = None,
            cwd: Path | None = None, what: str = "") -> subprocess.CompletedProcess:
        command = [sys.executable if w in PYTHONS else w for w in words]
        started = time.monotonic()
        result = subprocess.run(command, cwd=cwd or self.work, env={**self.env, **(env or {})}, input=stdin,
                                capture_output=True, text=True, timeout=900)
        elapsed = time.monotonic() - started
        self.timings.append((f"{what or 'run'}: {readme[:70]}", elapsed))
        print(f"[{elapsed:5.1f} s] {what}: {shlex.join(command)}")
        result.describe = (f"{readme}\nran ({what}, {elapsed:.0f} s, exit {result.returncode}) in "
                           f"{cwd or self.work}:\n  {shlex.join(command)}\n--- stdout (tail) ---\n"
                           f"{tail(result.stdout, 15)}\n--- stderr (tail, library noise left out) ---\n"
                           f"{tail(result.stderr)}")
        return result

    def run_module(self, module: str, args: list[str], readme: str, *, env: dict | None = None,
                   stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """`python -m <module> args`, run in this process by runpy as `python -m` runs it (a Python start-up with
        torch and transformers costs ~8 s of CPU here: one less per tool)."""
        out, err, code = io.StringIO(), io.StringIO(), 0
        saved = sys.argv, sys.stdin, Path.cwd(), dict(os.environ)
        started = time.monotonic()
        try:
            sys.argv, sys.stdin = [module, *args], io.StringIO(stdin or "")
            os.chdir(cwd or self.work)
            os.environ.update({k: v for k, v in self.env.items() if k != "PATH"}, **(env or {}))
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is already imported
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except Exception:  # noqa: BLE001 - reported like a process that crashed
            code = 1
            err.write(traceback.format_exc())
        finally:
            sys.argv, sys.stdin = saved[0], saved[1]
            os.chdir(saved[2])
            os.environ.clear()
            os.environ.update(saved[3])
        elapsed = time.monotonic() - started
        words = ["python", "-m", module, *args]
        self.timings.append((f"python -m {module} (in this process): {readme[:60]}", elapsed))
        result = subprocess.CompletedProcess(words, code, out.getvalue(), err.getvalue())
        result.describe = (f"{readme}\nran (python -m in this process, {elapsed:.0f} s, exit {code}) in "
                           f"{cwd or self.work}:\n  {shlex.join(words)}\n--- stdout (tail) ---\n"
                           f"{tail(result.stdout, 15)}\n--- stderr (tail) ---\n{tail(result.stderr)}")
        print(f"[{elapsed:5.1f} s] in this process: {shlex.join(words)}")
        return result

    @staticmethod
    def said(command: Command) -> str:
        return f"{command.where}: {command.text}"

    def expect_success(self, result, check=None):
        assert result.returncode == 0, result.describe
        if check:
            problem = check(result)
            assert not problem, f"{problem}\n{result.describe}"

    # -- blocks --
    def run_through(self, index: int) -> None:
        """Run the blocks before `index` that have not run (their failures are their own tests'), then this one."""
        for i in range(index + 1):
            if i in self.outcome:
                continue
            try:
                self.run_block(BLOCKS[i])
                self.outcome[i] = None
            except BaseException as e:  # noqa: BLE001 - a skip or failure is reported by that block's own test
                if isinstance(e, KeyboardInterrupt):
                    raise
                self.outcome[i] = e
        if self.outcome[index] is not None:
            raise self.outcome[index]

    def run_block(self, block: Block) -> None:
        plan = plan_block(block, BLOCKS)
        if block.lang == "python":
            return self.python_block(block)
        if block.lang in ("yaml", "yml"):
            self.inside(yaml_file_name(block), "the recipe").write_text(self.substitute(block.text))
            return None
        if block.lang == "":
            return self.summary_sample(block)
        for command, step in plan:
            getattr(self, f"step_{step.kind}")(command, step)
        return None

    def python_block(self, block: Block) -> None:
        source = "\n" * block.line + self.substitute(block.text)  # line numbers as in its page
        out = io.StringIO()
        previous = Path.cwd()
        os.chdir(self.work)
        started = time.monotonic()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(source, str(REPO / block.page), "exec"), {"__name__": "__main__"})  # noqa: S102
        finally:
            os.chdir(previous)
            self.timings.append((f"python block {block.where}", time.monotonic() - started))
        print(out.getvalue())

    def summary_sample(self, block: Block) -> None:
        """Prepare the sample's data again and compare every line (the cache line aside)."""
        expected = block.text.strip().splitlines()
        sources = [m[1] for line in expected for m in [re.match(r"^  (\S+): \d+ records read", line)] if m]
        template = re.search(r"\(template (\w+)\)", expected[0])
        length = re.search(r"\(--max_length (\d+)\)", block.text)
        if not sources or not template or not length:
            raise NoRule(f"{block.where}: a data summary that does not name its files (one line each), "
                         f"template and --max_length, so the test cannot prepare it again")
        if not all((REPO / s).exists() for s in sources):
            if not SHARED.is_dir():
                pytest.skip(f"../shared (the samples {sources} and the real tokenizer) is absent in this checkout")
            raise AssertionError(f"{block.where}: the summary names files that do not exist: {sources}")
        args = ["--model", str(DEEPSEEK_TOKENIZER), "--dataset", *sources, "--template", template[1],
                "--max_length", length[1], "--show_masks", "0", "--dataset_cache_dir", str(self.tmp / "summary-cache")]
        if "packed into" in block.text:
            args.append("--packing")
        result = self.run_module("sft.data.dataset", args, f"{block.where} (the summary sample)", cwd=REPO)
        self.expect_success(result)
        printed = [line for line in result.stdout.splitlines() if "loaded from the cache" not in line]
        start = next((i for i, line in enumerate(printed) if line.startswith("Data: ")), 0)
        printed = printed[start:start + len(expected)]
        assert printed == expected, (
            f"{block.where}: the summary sample is not what the command prints now\n"
            + "\n".join(f"  page: {e}\n  now:  {p}" for e, p in zip(expected, printed) if e != p)
            + f"\n{result.describe}")

    # -- bash steps --
    def step_setup(self, command: Command, step: Step) -> None:
        """Not re-run (CI runs it). Every command that sets up a fresh environment names the same install steps
        (extras aside); the extras exist."""
        setups = venv_commands()
        if command in setups:
            reference = set_up_steps(setups[0])
            assert set_up_steps(command) == reference, (
                f"{command.where}: the set-up steps differ from {setups[0].where}'s:\n"
                f"  {set_up_steps(command)}\n  {reference}")
        if step.words[:1] == ["pip"]:
            extras = project_extras()
            for word in step.words:
                wanted = re.match(r"^\.\[([\w,-]+)\]$", word)
                for extra in (wanted[1].split(",") if wanted else []):
                    assert extra in extras, f"{command.where}: pip install {word}: pyproject.toml has " \
                                            f"no extra {extra!r} ({sorted(extras)})"

    def step_pytest(self, command: Command, step: Step) -> None:
        """Not run here (it runs this file). .ci/run must find this exact line with its own grep and eval it."""
        ci = (REPO / ".ci" / "run").read_text()
        grep = re.search(r"test_command=\$\((grep .*?README\.md)\)", ci)
        assert grep and 'eval "$test_command"' in ci, ".ci/run no longer greps README.md for the test command"
        found = subprocess.run(["bash", "-c", grep[1]], cwd=REPO, capture_output=True, text=True).stdout.strip()
        assert found == command.text, (f".ci/run's `{grep[1]}` finds\n  {found!r}\nnot {command.where}'s\n"
                                       f"  {command.text!r}")

    def step_tensorboard(self, command: Command, step: Step) -> None:
        logdir = options(step.words[1:]).get("logdir")
        assert isinstance(logdir, str), f"{command.where}: tensorboard without --logdir"
        assert Path(sys.executable).with_name("tensorboard").exists(), "the tensorboard command is not installed"
        events = list((self.work / logdir).rglob("events.out.tfevents.*"))
        assert events, f"{command.where}: no TensorBoard event files under {logdir}"
        assert tensorboard_scalars(self.work / logdir, "train/loss"), f"no train/loss under {logdir}"

    def step_help(self, command: Command, step: Step) -> None:
        launcher = Launcher.of(step.launcher, self.work)
        result = self.run([*launcher.with_processes(1), *step.program, *step.args], self.said(command), env=step.env,
                          what="help")
        self.expect_success(result, lambda r: None if r.stdout.strip() else "the help printed nothing")

    def step_tool(self, command: Command, step: Step) -> None:
        module, args = step.tool, self.substitute_words(step.args)
        opts, stdin, check = options(args), None, None
        if module == "sft.data.dataset":
            args += [] if "dataset_cache_dir" in opts else ["--dataset_cache_dir", str(self.tmp / "cache")]
            shown = int(opts.get("show_masks", 3))
            check = lambda r: None if len(re.findall(r"^--- .*trained tokens between", r.stdout, re.M)) == shown \
                else f"expected {shown} conversations shown between [[ ]]"  # noqa: E731
        elif module == "sft.tools.chat":
            args += [] if "max_new_tokens" in opts else ["--max_new_tokens", "16"]
            if "prompt" not in opts:
                stdin = "What is the capital of Japan?\n\n"  # one question, then an empty line quits
            # one line per answer; what a 2-step model says may be empty
            check = lambda r: None if r.stdout.count("\n") >= 1 else "no answer printed"  # noqa: E731
        elif module == "sft.tools.merge":
            positional = [a for a in args if not a.startswith("--") and a not in opts.values()]
            merged = self.inside(positional[1], "the merged model") if len(positional) > 1 else None
            check = lambda r: None if merged and (merged / "model.safetensors").is_file() \
                else f"no merged model in {merged}"  # noqa: E731
        elif module == "sft.plan.planner" and "check" not in opts:
            def check(r):  # its recommendation is a training command that this file's rules run
                recommended = re.findall(r"^Recommended: (.+)$", r.stdout, re.M)
                if not recommended:
                    return "no `Recommended:` line"
                return None if kind_of(shlex.split(recommended[0])) == "train" else \
                    f"the recommendation is no training command: {recommended[0]}"
        result = self.run_module(step.program[0], [*step.program[1:], *args], self.said(command), env=step.env,
                                 stdin=stdin)
        self.expect_success(result, check)

    def step_train(self, command: Command, step: Step) -> None:
        args = []
        for word in step.args:
            if word == "...":  # the reader's other options
                args += ["--model", str(self.tiny["llama"]), "--dataset", str(self.data_file("data.jsonl")),
                         "--output_dir", command.default_output]
            else:
                args.append(word)
        args = self.substitute_words(args)
        opts = options(args)
        recipe = {}
        if "config" in opts:  # a recipe of the repository (recipes/...) names hub ids too: a substituted copy
            text = (self.work / opts["config"]).read_text()
            if self.substitute(text) != text:
                copy = self.tmp / f"{Path(command.default_output).name}-{Path(opts['config']).name}"
                copy.write_text(self.substitute(text))
                args = [str(copy) if w == opts["config"] and args[i - 1] == "--config" else
                        f"--config={copy}" if w == f"--config={opts['config']}" else w for i, w in enumerate(args)]
                text = copy.read_text()
            recipe = {k.replace("-", "_"): v for k, v in (yaml.safe_load(text) or {}).items()}
        merged = {**recipe, **opts}
        if "output_dir" not in merged and ("model" in merged or "dataset" in merged):
            args += ["--output_dir", command.default_output]
            merged["output_dir"] = command.default_output
        output = Path(merged.get("output_dir", DEMO_OUTPUT))
        self.inside(output, "--output_dir")
        watched = any(output == w or w in output.parents or output in w.parents for w in self.watched)
        caps = CAPS
        if truthy(merged.get("load_best_model_at_end")):  # its saves must fall on its evaluations: kept as given
            caps = CAPS[:CAPS.index("--save_strategy")]      # (2 steps reach none of them)
        args += caps + ["--report_to", "tensorboard" if watched else "none",
                        "--dataset_cache_dir", str(self.tmp / "cache")]
        launcher = Launcher.of(step.launcher, self.work)
        needs = self.gpu_needs(merged, launcher)

        if needs:
            key = (frozenset(needs), tuple(step.launcher[:2] or step.program[:1]))  # what and through which launcher
            if key not in self.refusals:
                self.refusals[key] = command.where
                self.expect_refusal(command, step, launcher, args, needs)
            else:
                print(f"{command.where}: the refusal for {sorted(needs)} was checked at {self.refusals[key]}")
            if not set(needs) <= PRECISION:
                return
            args = without_precision(args, recipe)
            assert not self.gpu_needs({**recipe, **options(args)}, launcher), args
        self.expect_training(command, step, launcher, args, output)

    def gpu_needs(self, opts: dict, launcher: Launcher) -> dict[str, str]:
        """What this command needs that a CPU machine lacks -> a word its refusal must contain."""
        needs = {}
        for flag in PRECISION:
            if truthy(opts.get(flag[2:])):
                needs[flag] = flag[2:]
        attn = str(opts.get("attn_implementation", ""))
        if attn == "flex_attention" or attn.startswith("flash_attention"):
            needs[f"--attn_implementation {attn}"] = attn
        if truthy(opts.get("use_liger_kernel")):
            needs["--use_liger_kernel"] = "liger"
        if truthy(opts.get("fp8")):
            needs["--fp8"] = "fp8"
        if launcher.strategy == "fsdp" or opts.get("fsdp"):
            needs["FSDP"] = "fsdp"
        if launcher.offload:
            needs["offload"] = "offload"
        if int(opts.get("tp_size", 1)) > 1:
            needs["--tp_size"] = "tp_size"
        return needs

    def expect_refusal(self, command, step, launcher, args, needs) -> None:
        """As the reader types it. The first refusal under a multi-process config runs 2 ranks (each meets the error;
        one line must come out), later ones one rank (the same path, half the start-up)."""
        processes = 1
        if launcher.strategy != "single":
            processes = 2 if self.multi_rank.setdefault("refusal", command.where) == command.where else 1
        result = self.run([*launcher.with_processes(processes), *step.program, *args], self.said(command), env=step.env,
                          what=f"refusal ({', '.join(sorted(needs))}), {processes} process(es)")
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        print(f"{command.where} refused on CPU, exit {result.returncode}: {' | '.join(errors)}")
        problems = []
        if result.returncode == 0:
            problems.append("it ran to the end on a machine without a GPU")
        elif step.launcher[:2] != ["accelerate", "launch"] and result.returncode != 2:
            problems.append(f"exit code {result.returncode}, not 2")  # accelerate launch itself exits 1
        unnamed = [need for need, word in needs.items() if word.lower() not in (errors or [""])[0].lower()]
        if not errors:
            problems.append("no `error:` line")
        elif unnamed:
            problems.append(f"the first `error:` line does not name {unnamed}")
        if len(errors) != len(set(errors)):
            problems.append("an `error:` line said twice")
        if "Training on" in result.stdout or "Loading weights" in result.stderr:
            problems.append("it went on to load the model before stopping")
        if tracebacks_of_ranks(result.stderr):
            problems.append("a traceback besides the one error line:\n" + "\n".join(tracebacks_of_ranks(result.stderr)))
        assert not problems, (f"{command.where} needs {sorted(needs)}; on CPU it must stop before loading "
                              f"any model with `error:` lines, the first naming that:\n  " + "\n  ".join(problems)
                              + f"\n{result.describe}")

    def expect_training(self, command, step, launcher, args, output: Path) -> None:
        processes = 1
        if launcher.strategy in ("ddp", "deepspeed"):
            # Two ranks the first time a strategy trains; later commands of that config check their options in one.
            processes = 2 if self.multi_rank.setdefault(launcher.strategy, command.where) == command.where else 1
            processes = max(processes, rows_split_over(args))  # --sequence_parallel N: one row over N ranks
            args = args + (["--use_cpu", "true"] if launcher.strategy == "ddp" else ["--ddp_backend", "gloo"])
        result = self.run([*launcher.with_processes(processes), *step.program, *args], self.said(command), env=step.env,
                          what=f"train ({processes} process(es), CPU)")

        def check(r):
            if f"Training on {processes} process(es)" not in r.stdout:
                return f"not trained on {processes} process(es)"
            saved = [n for n in ("model.safetensors", "adapter_model.safetensors")
                     if (self.work / output / n).is_file()]
            return None if saved else f"nothing saved in {output}"

        self.expect_success(result, check)


def without_precision(args: list[str], recipe: dict) -> list[str]:
    """The same options without --bf16/--fp16 (and a true/false after one); `--bf16 false` where a recipe sets it."""
    out = []
    for i, word in enumerate(args):
        if word.split("=")[0] in PRECISION or i and args[i - 1] in PRECISION and word.lower() in ("true", "false"):
            continue
        out.append(word)
    return out + [w for flag in sorted(PRECISION) if truthy(recipe.get(flag[2:])) for w in (flag, "false")]


# ---- the tests -------------------------------------------------------------------------------------------------

def test_rules_on_made_up_blocks():
    """What a block added later becomes: a command of a known kind gets a rule (and its GPU needs), anything
    else is refused with its README line."""
    made_up = (
        "```bash\naccelerate launch --config_file accelerate_configs/zero2.yaml sft/train.py \\\n"
        "    --model deepseek-ai/DeepSeek-V2-Lite --dataset chats.jsonl --lora --fp16   # a comment\n"
        "deepseek-sft train --num_processes 2 --model deepseek-ai/deepseek-llm-7b-base --dataset x.jsonl\n"
        "deepseek-sft data --dataset x.jsonl --show_masks 2\n"
        "python sft/train.py --help all\n```\n"
        "```bash\nnvidia-smi topo -m\n```\n"
        "```bash\naccelerate launch sft/train.py | tee log.txt\n```\n"
        "```\nstopped (Ctrl-C) at step 7\n```\n"
        "```yaml\nmodel: x\n```\n"
        "```toml\n[x]\n```\n")
    blocks, problems = readme_blocks(made_up)
    assert not problems and [b.lang for b in blocks] == ["bash", "bash", "bash", "", "yaml", "toml"]
    steps = [step for _, step in plan_block(blocks[0], blocks)]
    assert [s.kind for s in steps] == ["train", "train", "tool", "help"]
    assert steps[0].launcher[-2:] == ["--config_file", "accelerate_configs/zero2.yaml"]
    assert steps[0].args[-1] == "--fp16" and steps[1].launcher == ["deepseek-sft", "train", "--num_processes", "2"]
    assert steps[2].tool == "sft.data.dataset" and steps[2].program == ["sft.cli", "data"]
    for block, says in zip(blocks[1:], ["`nvidia-smi` is no command", "shell syntax ['|']", "an output sample",
                                        "first line is not `# <file>.yaml`", "```toml block"]):
        with pytest.raises(NoRule, match=re.escape(says)):
            plan_block(block, blocks)
    assert [f for hub in ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
                          "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct",
                          "deepseek-ai/deepseek-coder-6.7b-instruct")
            for f in [next(f for pattern, f in FAMILIES if re.search(pattern, hub))]] == \
        ["qwen2", "llama", "deepseek_v3", "deepseek_v2", "llama"]
    # a docs page: its blocks name their page; each deepseek-sft tool is the module sft/cli.py's usage says
    page, _ = readme_blocks("```bash\ndeepseek-sft chat output/demo --prompt hi\ndeepseek-sft merge a b\n"
                            "deepseek-sft plan --model deepseek-llm-7b\n```\n```bash\ndeepseek-sft nope\n```\n"
                            "```yaml\n# r.yaml\nmodel: x\n```\n", "docs/x.md")
    tools = [step for _, step in plan_block(page[0], page)]
    assert [s.tool for s in tools] == ["sft.tools.chat", "sft.tools.merge", "sft.plan.planner"]
    assert page[0].id == "docs/x.md:L1-bash" and bash_commands(page[0])[2].default_output == "output/docs-x-L4"
    with pytest.raises(NoRule, match=re.escape("docs/x.md:7: deepseek-sft nope")):
        plan_block(page[1], page)
    with pytest.raises(NoRule, match="r.yaml is written by this block but no later command"):  # only its page's
        other = Block(9, "bash", "accelerate launch sft/train.py --config r.yaml\n", "README.md")
        plan_block(page[2], [*page, other])


def test_every_block_has_a_rule():
    """A block that no rule runs (a new kind of command, a new language) fails here with all the others, instead
    of being skipped in silence."""
    unknown = list(PROBLEMS)
    for block in BLOCKS:
        try:
            plan_block(block, BLOCKS)
        except NoRule as e:
            unknown.append(str(e))
    assert BLOCKS, "README.md has no fenced blocks: is this the right file?"
    assert not unknown, "blocks of README.md and docs/*.md that no rule of tests/test_readme.py runs:\n" + \
        "\n".join(unknown)


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#{1,6} (.+)$", re.sub(r"(?ms)^\s*```.*?^\s*```", "", text), re.M)}


def test_links_between_pages():
    """Every relative link of README.md and docs/*.md names a file that exists, and a heading of it after `#`."""
    broken = []
    for path in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+://", target):
                continue
            name, _, anchor = target.partition("#")
            linked = (path.parent / name).resolve() if name else path
            where = f"{path.relative_to(REPO)}: ({target})"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked.read_text())):
                broken.append(f"{where}: no heading #{anchor} in {linked.name}")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.fixture(scope="module")
def readme(tmp_path_factory, tiny_llama):
    started = time.monotonic()
    cpu = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    run = ReadmeRun(tmp_path_factory.mktemp("readme-work"), tmp_path_factory.mktemp("readme-tmp"), tiny_llama)
    yield run
    used = sum(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime for before, after in
               zip(cpu, [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]))
    print("\nREADME runs:\n" + "\n".join(f"  {t:5.1f} s  {what}" for what, t in run.timings)
          + f"\n  {time.monotonic() - started:5.1f} s wall, {used:.0f} s CPU (this process and its children)")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b.id for b in BLOCKS])
def test_block(readme, index):
    readme.run_through(index)
