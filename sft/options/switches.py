"""What --fp8, --compile_layers and --chunked_loss say once settled (`auto` resolved to true or false by
sft/options/resolve.py): read alike by a run's options (sft/options/arguments.py ModelArguments) and by the planner's
description of a plan's (sft/plan/fast_paths.py), which needs no transformers."""

from __future__ import annotations


class FastPathSwitches:
    """Mixed into an options class that has `fp8`, `compile_layers` and `chunked_loss` ("auto", "true" or
    "false")."""

    fp8: str
    compile_layers: str
    chunked_loss: str

    @property
    def fp8_on(self) -> bool:
        return self.fp8 == "true"

    @property
    def compile_layers_on(self) -> bool:
        return self.compile_layers == "true"

    @property
    def chunked_loss_on(self) -> bool:
        return self.chunked_loss == "true"
