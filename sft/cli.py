"""`deepseek-sft`: one command for the toolkit, in the same flag style as training.

    deepseek-sft train [launch options] [training options]   # = accelerate launch sft/train.py ...: train
    deepseek-sft data [training options]                      # = python -m sft.data.dataset: the data's summary
                                                              #   and first 3 examples, trained tokens marked
    deepseek-sft chat OUTPUT_DIR [--prompt TEXT]              # = python -m sft.tools.chat: talk to a trained run
    deepseek-sft merge ADAPTER_DIR OUTPUT_DIR [--dtype bfloat16]  # = python -m sft.tools.merge: adapter -> model
    deepseek-sft plan --model M [--gpus 3 --gpu_mem 24 --lora]  # = python -m sft.plan.planner: which strategy fits
  `deepseek-sft COMMAND --help`: each command's options (`deepseek-sft train --help all`: every training option).

`train --config_file` takes a file or the name of a shipped strategy config (ddp.yaml, zero3.yaml, ...: the
repository's accelerate_configs/, shipped in sft/configs/), from any directory, a wheel install included; `--config`
likewise a recipe file or a shipped recipe's name (deepseek-llm-7b-lora.yaml, ...: the repository's recipes/).

`train` runs accelerate's own launcher in this process, so that the launch is exactly `accelerate launch`'s, but
exits with the training's exit code and nothing more: `accelerate launch` itself follows every failed run (even
one that printed a clean `error:` line) with its launcher's traceback, which nothing inside the training
process can prevent.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from sft.configs import ACCELERATE_CONFIGS, deepspeed_file, shipped_config, shipped_names

TRAIN_SCRIPT = str(Path(__file__).resolve().parent / "train.py")
# accelerate launch's options that `deepseek-sft train` takes (value-taking: True); everything else is training's.
LAUNCH_OPTIONS = {"--config_file": True, "--num_processes": True, "--num_machines": True, "--machine_rank": True,
                  "--main_process_ip": True, "--main_process_port": True, "--gpu_ids": True, "--multi_gpu": False,
                  "--cpu": False}
LAUNCH_DEFAULTS = {"--num_processes": "1", "--num_machines": "1", "--mixed_precision": "no", "--dynamo_backend": "no"}
USAGE = __doc__.split("\n\n")[1]


def split_launch_options(argv: list[str]) -> tuple[list[str], list[str]]:
    launch, rest = [], []
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        takes_value = LAUNCH_OPTIONS.get(name)
        if takes_value is None:
            rest.append(argv[i])
        elif takes_value and "=" not in argv[i]:
            launch += argv[i:i + 2]
            i += 1
        else:
            launch.append(argv[i])
        i += 1
    return launch, rest


def launch_training(argv: list[str]) -> int:
    """accelerate launch sft/train.py, with the training's exit code."""
    launch, rest = split_launch_options(argv)
    if "-h" in rest or "--help" in rest:
        print("launch options (accelerate launch's): " + " ".join(LAUNCH_OPTIONS) + "\n  --config_file: a file, or a "
              "shipped config's name from any directory: " + ", ".join(shipped_names()) + "\n")
        return subprocess.call([sys.executable, TRAIN_SCRIPT, *rest])
    if not any(o.split("=")[0] == "--config_file" for o in launch):
        # accelerate's defaults for a launch without a config, given explicitly (else it warns about each one)
        given = {o.split("=")[0] for o in launch}
        for option, value in LAUNCH_DEFAULTS.items():
            launch += [] if option in given else [option, value]
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the failure is reported by rank 0
    launch, error = resolve_config(launch)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    parser = launch_command_parser()
    parser.error = _launch_option_error  # one line, not accelerate's 60-line usage block
    args = parser.parse_args([*launch, TRAIN_SCRIPT, *rest])
    try:
        launch_command(args)
    except subprocess.CalledProcessError as e:
        return e.returncode if e.returncode > 0 else 128 - e.returncode
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c > 0), 128 - min(codes))
    except KeyboardInterrupt:
        return 130
    return 0


def resolve_config(launch: list[str]) -> tuple[list[str], str | None]:
    """(the launch options, an error): --config_file as given when it is a file, else the shipped config of that
    name (`ddp.yaml`, `ddp`, `accelerate_configs/ddp.yaml`: from any directory, a wheel install included); plus
    --deepspeed_config_file when the config's DeepSpeed json is one that accelerate would not find from here."""
    at = next((i for i, o in enumerate(launch) if o.split("=")[0] == "--config_file"), None)
    if at is None:
        return launch, None
    inline = "=" in launch[at]
    given = launch[at].split("=", 1)[1] if inline else (launch[at + 1:at + 2] or [""])[0]
    config = Path(given).expanduser() if given and Path(given).expanduser().is_file() else shipped_config(given)
    if config is None:
        names = ", ".join(shipped_names())
        return launch, (f"--config_file {given}: no such file; give a file or a shipped config's name ({names}, "
                        f"in {ACCELERATE_CONFIGS})." if given else
                        f"--config_file needs a file or a shipped config's name ({names}).")
    deepspeed, error = deepspeed_file(config)
    resolved = launch[:at] + ["--config_file", str(config)] + launch[at + (1 if inline else 2):]
    return resolved + (["--deepspeed_config_file", str(deepspeed)] if deepspeed else []), error


def _launch_option_error(message: str):
    print(f"error: {message} (launch options: {' '.join(LAUNCH_OPTIONS)}; `deepseek-sft train --help`)", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "train":
        return launch_training(rest)
    if command == "data":
        from sft.data.dataset import main as data
        return data(rest, prog="deepseek-sft data")
    if command == "chat":
        from sft.tools.chat import main as chat
        return chat(rest, prog="deepseek-sft chat")
    if command == "merge":
        from sft.tools.merge import main as merge
        return merge(rest, prog="deepseek-sft merge")
    if command == "plan":
        from sft.plan.planner import main as plan
        return plan(rest)
    print(USAGE, file=sys.stderr if command not in ("-h", "--help") else sys.stdout)
    if command in ("-h", "--help"):
        return 0
    print(f"error: {'a command is missing' if not command else f'unknown command {command!r}'}: use train, data, "
          f"chat, merge or plan.", file=sys.stderr)
    return 2


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
