"""The garbage collector's permanent generation holds what the first step made, for the rest of the run."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from sft.speed.gc_freeze import FreezeLongLivedObjects


def test_the_first_step_end_freezes_and_the_run_end_gives_back(monkeypatch):
    """Frozen once, at the first step's end. (The permanent generation's count is not compared between steps: a
    frozen object that dies leaves it, so the count can fall by itself.)"""
    freezes = []
    freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), freeze())[-1])
    callback = FreezeLongLivedObjects()
    state, control = SimpleNamespace(global_step=1), SimpleNamespace()
    before = gc.get_freeze_count()  # 0, unless a run that failed earlier in this process froze and never ended
    try:
        callback.on_step_end(None, state, control)
        assert gc.get_freeze_count() > before and len(freezes) == 1
        callback.on_step_end(None, state, control)  # once per run
        assert len(freezes) == 1
    finally:
        callback.on_train_end(None, state, control)
    assert gc.get_freeze_count() == 0
