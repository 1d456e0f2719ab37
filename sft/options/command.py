"""The command the user typed, and every command a message suggests from it (resume, train longer, start over,
resume as the run was trained): the user's own command with a few options set, so that it runs as typed.

What was typed: under a launcher (accelerate launch, deepseek-sft train, torchrun; sft/machine.py tells from the
variables they set), the launcher's command line, which is this process's parent's and holds the launcher's own
options and the training options. In one process, this process's own command (`python sft/train.py ...`,
`python -m sft.train ...`, with the interpreter as it was typed). Anything else (a test, a script that calls
sft.train.main) gets `python -m sft.train` and the options it passed, which runs from any directory where the
package is installed. The run lock records the same command (sft/safety/run_lock.py), and an option error points
at the help of the same program (`deepseek-sft train --help`, `python -m sft.train --help`, ...).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from sft.options.argv import ALIASES

MODULE_PROGRAM = ("python", "-m", "sft.train")
# The options that say what a run trains (sft/safety/run_dir.py method_name), with other trainers' names for them.
METHOD_OPTIONS = ("lora", "qlora")


def typed_command(argv: list[str] | None = None) -> list[str]:
    """The command that started this run, word by word, as the user typed it. `argv`: the training options main()
    was given (None: this process's own), used where no launcher's command line holds them."""
    from sft.machine import launch

    if launch().launched:
        words = launcher_command(os.getppid())
        if words:
            return words
    return [*own_program(), *(sys.argv[1:] if argv is None else argv)]


def launcher_command(pid: int) -> list[str] | None:
    """The command line of the launcher `pid`, when it is one that starts training (sft/train.py, sft.train or
    `deepseek-sft train`); None where it cannot be read or is something else (then this process's own is used)."""
    try:
        words = [w.decode(errors="replace") for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if w]
    except OSError:
        return None
    if len(words) > 1 and Path(words[0]).name.startswith("python") and not words[1].startswith("-"):
        words = words[1:]  # a console script (accelerate, deepseek-sft, torchrun) that its #! line ran under python
    if not words:
        return None
    words[0] = as_typed(words[0])
    trains = any(w.endswith("train.py") or w == "sft.train" for w in words) or \
        (Path(words[0]).name == "deepseek-sft" and "train" in words[1:2])
    return words if trains else None


def own_program() -> list[str]:
    """This process's interpreter and script (or `-m sft.train`) as typed; `python -m sft.train` when this process
    runs something else (a test runner, `python -c`)."""
    orig = list(getattr(sys, "orig_argv", []))
    program = orig[:len(orig) - len(sys.argv) + 1] if len(orig) >= len(sys.argv) else []
    if program and (program[-1].endswith("train.py") or program[-2:] == ["-m", "sft.train"]):
        return program
    return list(MODULE_PROGRAM)


def help_command() -> str:
    """The command that lists the training options, started as this run was: `deepseek-sft train --help`,
    `python -m sft.train --help`, `python sft/train.py --help` (under accelerate launch or torchrun: the script or
    module it ran, in one process: the help needs no launcher)."""
    from sft.machine import launch

    words = launcher_command(os.getppid()) if launch().launched else None
    if not words:
        program = own_program()
    elif Path(words[0]).name == "deepseek-sft":
        program = [words[0], "train"]
    elif "sft.train" in words:
        program = list(MODULE_PROGRAM)
    else:
        program = ["python", next(w for w in words if w.endswith("train.py"))]
    return shlex.join([*program, "--help"])


def as_typed(program: str) -> str:
    """A program by its name where the shell finds that same program by it (`accelerate`), else its path."""
    name = Path(program).name
    found = shutil.which(name)
    return name if found and os.path.realpath(found) == os.path.realpath(program) else program


def command_with(argv: list[str] | None, *, method: str | None = None, this_method: str | None = None,
                 **options: str | list[str] | None) -> str:
    """The typed command (typed_command(argv)) with `options` set, ready to paste: a value replaces the typed one
    in its place (also one typed under another trainer's name for it), or is appended; a list gives several values
    (--dataset a b); None removes the option. `method` ("full", "lora", "qlora"): what the command must train,
    where that differs from `this_method`, what the typed command trains (a suggestion for a run's own checkpoint
    carries that run's method, never this command's)."""
    if method and this_method and method != this_method:
        options = {**options, **_method_options(method, this_method)}
    words = typed_command(argv)
    out: list[str] = []
    done: set[str] = set()
    i = 0
    while i < len(words):
        word = words[i]
        name = _option_name(word)
        end = i + 1
        if name in options:
            while "=" not in word and end < len(words) and not words[end].startswith("--"):
                end += 1  # its values
            if name not in done:
                done.add(name)
                out += _option_words(name, options[name])
        else:
            out.append(word)
        i = end
    for name, value in options.items():
        if name not in done:
            out += _option_words(name, value)
    return shlex.join(out)


def _option_name(word: str) -> str | None:
    """The option a word names, ours for another trainer's (--model_name_or_path -> model); None: not an option."""
    if not word.startswith("--"):
        return None
    name = word[2:].split("=", 1)[0].replace("-", "_")
    alias = ALIASES.get(name)
    return alias.ours if alias else name


def _option_words(name: str, value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [f"--{name}", *([value] if isinstance(value, str) else value)]


def _method_options(method: str, this_method: str) -> dict[str, str | None]:
    """The --lora/--qlora words that turn a command training `this_method` into one training `method`: the typed
    ones removed, the values that differ given explicitly (a recipe or another trainer's name may set them)."""
    change: dict[str, str | None] = {name: None for name in METHOD_OPTIONS}
    if method == "qlora":
        change["qlora"] = "true"
    elif method == "lora":
        change.update(lora="true", qlora="false" if this_method == "qlora" else None)
    else:
        change.update(lora="false", qlora="false" if this_method == "qlora" else None)
    return change
