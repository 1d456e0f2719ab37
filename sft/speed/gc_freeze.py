"""Python's full garbage collections out of the training steps.

The cyclic collector's oldest generation is walked whole now and then, and after the first step the process holds
a great many long-lived objects (torch.compile's graphs, guards and kernels, the model's modules, the dataset's
rows), so one such walk can hold the host for a large part of a step while the GPU runs dry. On one H200 a
compiled LoRA step of deepseek-llm-7b, 0.56-0.61 s in steady state, took 0.82-0.97 s once in the ten steps of each
of two rows of run 20261205T0550Z-lora2x (step 7 in both); whether a collection made it is not measured yet
(bench/train_throughput.py now records the collector's pauses per row: gc_ms). After the first step has made what
lives for the whole run, `gc.freeze()` moves every object the collector tracks into its permanent generation:
later collections walk only what training allocates since. The cost: a reference cycle among the frozen objects
that becomes garbage later is not collected until the run ends (`gc.unfreeze()` then). torchtitan and Megatron-LM
take the collector out of the step too (a collection every N steps, or by hand).
"""

from __future__ import annotations

import gc

from transformers import TrainerCallback


class FreezeLongLivedObjects(TrainerCallback):
    """After the first optimizer step of this run (compiled, set up): collect once, then freeze what is left."""

    def __init__(self) -> None:
        self.frozen = False

    def on_step_end(self, args, state, control, **kwargs):
        if not self.frozen:
            gc.collect()  # garbage of the set-up goes, not into the permanent generation
            gc.freeze()
            self.frozen = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.frozen:  # a later run in this process (tests, notebooks) starts from the collector as it was
            gc.unfreeze()
            self.frozen = False
