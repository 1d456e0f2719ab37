"""sft/parallel/fsdp.py: FSDP2 runs the input embedding's backward without all-gathering its weight, on two gloo
ranks with raw fully_shard in the units accelerate 1.15 builds (accelerate's FSDP becomes DDP on CPU): the ranks of
conftest's fsdp_two_ranks, shared with two other FSDP2 tests."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_embedding_backward_without_all_gather_trains_the_same(fsdp_two_ranks):
    """3 steps: the same weights, one all-gather fewer per step (7 units gathered in forward and backward, except
    the tail, kept from forward); a tied embedding (one unit with lm_head) is left alone. The ranks: conftest's
    fsdp_two_ranks (tests/fsdp_two_ranks_worker.py, part embedding_backward)."""
    found = fsdp_two_ranks["embedding_backward"]
    assert "error" not in found, found.get("error")
    assert found["applied"] is True and found["tied_applied"] is False, found
    assert found["equal"] and found["gathers"][1] == found["gathers"][0] - 3, found


def test_no_fsdp_callbacks_without_fsdp():
    from sft.parallel.fsdp import fsdp_callbacks
    from sft.machine import Launch

    assert fsdp_callbacks(Launch()) == []
    assert [type(c).__name__ for c in fsdp_callbacks(Launch(fsdp=True))] == ["EmbeddingBackwardWithoutAllGather"]
