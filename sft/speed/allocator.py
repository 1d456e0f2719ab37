"""The CUDA caching allocator as every measured run had it: expandable segments, unless the user chose a setting.

A training step allocates and frees activations of many sizes. In fixed-size segments the cache fragments: a
request that finds no free block large enough makes the allocator release cached segments (a device synchronize
each) and try again, and a plan that fits by the planner's count can still run out of memory. With expandable
segments one segment grows by mapping more pages instead. Every row in bench/results.jsonl and so every memory fit
of the planner ran with it (bench/train_throughput.py --alloc_conf), as Axolotl's runs do by default; a user's run
gets the same unless PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF says otherwise. torch reads the variable once,
when CUDA starts: this runs before the machine is read (sft/machine.py runs a matmul on the GPU).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from importlib.metadata import version

SETTING = "expandable_segments:True"
# torch 2.9 and later read the first (the second only where the first is not set); older ones only the second
VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def variable_for(torch_version: str) -> str:
    """The variable this torch reads ("2.13.0+cpu" -> PYTORCH_ALLOC_CONF)."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return VARIABLES[0] if (major, minor) >= (2, 9) else VARIABLES[1]


def expandable_segments_unless_chosen(gpu: bool, environ: MutableMapping[str, str] = os.environ,
                                      torch_version: str | None = None) -> str | None:
    """On a GPU machine where neither variable is set, set expandable segments; -> the first screen's line for it,
    None where nothing was set (no GPU, or the user's setting stands)."""
    if not gpu or any(environ.get(name) for name in VARIABLES):
        return None
    name = variable_for(torch_version or version("torch"))
    environ[name] = SETTING  # written for torch's CUDA allocator, which reads it when CUDA starts
    return f"CUDA allocator with expandable segments, as every measured run ({name}=... sets another)"
