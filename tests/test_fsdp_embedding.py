"""sft/parallel/fsdp.py: FSDP2 runs the input embedding's backward without all-gathering its weight, on two gloo
ranks with raw fully_shard in the units accelerate 1.15 builds (accelerate's FSDP becomes DDP on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from sft.parallel.fsdp import skip_embedding_unshard_in_backward

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)
    gathers = [0]
    all_gather = _fsdp_param_group.foreach_all_gather

    def counting(*args, **kwargs):
        gathers[0] += 1
        return all_gather(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counting

    def build(tied):  # the units of accelerate 1.15's fsdp2_prepare_model: layers, embedding, tail, root
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=256, tie_word_embeddings=tied)
        model = AutoModelForCausalLM.from_config(config)
        for module in list(model.modules()):
            if isinstance(module, LlamaDecoderLayer):
                fully_shard(module)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if not tied:
            fully_shard(embed)
        fully_shard([model.model.norm, embed, head] if tied else [model.model.norm, head], reshard_after_forward=False)
        fully_shard(model)
        return model

    def train(skip):
        model = build(False)
        applied = skip_embedding_unshard_in_backward(model) if skip else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
        gathers[0] = 0
        for _ in range(3):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return applied, gathers[0], [p.full_tensor() for p in model.parameters()]

    _, default_gathers, default = train(False)
    applied, skipped_gathers, skipped = train(True)
    found = {"applied": applied, "tied_applied": skip_embedding_unshard_in_backward(build(True)),
             "gathers": [default_gathers, skipped_gathers],
             "equal": all(torch.equal(a, b) for a, b in zip(default, skipped))}
    if dist.get_rank() == 0:
        print(json.dumps(found))
    from sft.parallel.distributed import exit_process
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run
""")


@pytest.mark.slow
def test_embedding_backward_without_all_gather_trains_the_same(tmp_path):
    """3 steps: the same weights, one all-gather fewer per step (7 units gathered in forward and backward, except
    the tail, kept from forward); a tied embedding (one unit with lm_head) is left alone. ~20 s."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "rendezvous"), str(rank)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [out[-3000:] for out in outputs]
    found = json.loads(next(line for line in outputs[0].splitlines() if line.startswith("{")))
    assert found["applied"] is True and found["tied_applied"] is False, found
    assert found["equal"] and found["gathers"][1] == found["gathers"][0] - 3, found


def test_no_fsdp_callbacks_without_fsdp():
    from sft.parallel.fsdp import fsdp_callbacks
    from sft.machine import Launch

    assert fsdp_callbacks(Launch()) == []
    assert [type(c).__name__ for c in fsdp_callbacks(Launch(fsdp=True))] == ["EmbeddingBackwardWithoutAllGather"]
