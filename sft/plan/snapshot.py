"""The planner's snapshot of what it fits from bench/results.jsonl (sft/plan/fitted.json, package data): the numbers
every plan reads (the MFU of each kind of plan, the fast paths' memory, the routed experts' cost), so that a wheel
plans as a checkout does. Read here, once; fitted and written by sft/plan/refit.py (`--write_snapshot`).

Low in the planner: the memory model (sft/plan/memory.py) and the speed model (sft/plan/speed.py) read it, and what
fits it reads them. Readers call `snapshot.fitted()` through this module, so that one patch of it (a test's other
numbers) reaches every reader.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

# What the planner fits from bench/results.jsonl, snapshotted as package data: plans read this, so that a wheel plans
# as a checkout
FITTED = Path(__file__).resolve().with_name("fitted.json")
SNAPSHOT_COMMAND = "python -m sft.plan.planner --write_snapshot"
ANY_MODEL = "*"  # the snapshot's MFU table for a model that has no bench row of its own


@functools.lru_cache(maxsize=1)
def fitted() -> dict:
    return json.loads(FITTED.read_text())
