"""Two gloo ranks with raw fully_shard in the units accelerate builds for FSDP2 (its FSDP becomes DDP on CPU), run
once per test session by conftest's `fsdp_two_ranks` fixture for three tests that each paid a 2-rank start of their
own: `python tests/fsdp_two_ranks_worker.py <rendezvous file> <rank> <folder>`. Each part builds its own models
from its own seed; rank 0 writes what each part found to <folder>/found.json, {part: found}, and a part that raised
(on every rank: its collectives stay in step) records its traceback as {"error": ...} so the others still report.

- "embedding_backward" (tests/test_fsdp_embedding.py): sft/parallel/fsdp.py runs the input embedding's backward
  without all-gathering its weight; the all-gathers counted, the weights compared with the default path.
- "lora_checkpoint_wrappers" (tests/test_distributed.py): FSDP2 + FSDP's activation checkpointing + LoRA: the
  adapter saved from the consolidated state dict as is, and after remove_checkpoint_wrappers.
- "modules_to_save" (tests/test_modules_to_save.py): --lora_modules_to_save's fp32 copies on a bf16 base train as
  unsharded, the embedding's backward still skips its all-gather, the consolidated adapter holds them.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from sft.parallel.fsdp import skip_embedding_unshard_in_backward

RENDEZVOUS, RANK, FOLDER = sys.argv[1], int(sys.argv[2]), sys.argv[3]

gathers = [0]
all_gather = _fsdp_param_group.foreach_all_gather


def counting(*args, **kwargs):
    gathers[0] += 1
    return all_gather(*args, **kwargs)


_fsdp_param_group.foreach_all_gather = counting


def embedding_backward() -> dict:
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
    return {"applied": applied, "tied_applied": skip_embedding_unshard_in_backward(build(True)),
            "gathers": [default_gathers, skipped_gathers],
            "equal": all(torch.equal(a, b) for a, b in zip(default, skipped))}


def lora_checkpoint_wrappers() -> dict:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    from sft.parallel.fsdp import remove_checkpoint_wrappers

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, vocab_size=128)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    # What accelerate does for fsdp.yaml + activation checkpointing: wrap each layer, then shard each layer.
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    for module in list(model.modules()):
        if isinstance(module, LlamaDecoderLayer):
            fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = {n.replace("_checkpoint_wrapped_module.", "").replace(".default", ""): p.full_tensor().detach()
               for n, p in model.named_parameters() if p.requires_grad}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    counts = {}
    for case in ("as_is", "unwrapped"):
        if case == "unwrapped":
            counts["removed"] = remove_checkpoint_wrappers(model)
        state = get_model_state_dict(model, options=options)  # what Trainer.save_model gathers under FSDP2
        if dist.get_rank() == 0:
            model.save_pretrained(FOLDER + "/" + case, state_dict=state)
            adapter = load_file(FOLDER + "/" + case + "/adapter_model.safetensors")
            counts[case] = len(adapter)
            if adapter:
                counts["equal"] = all(torch.equal(adapter[k], v) for k, v in trained.items())
    return counts


def modules_to_save() -> dict:
    from safetensors.torch import load_file

    from sft.model.loading import attach_lora
    from sft.options.arguments import LoraArguments

    def build():
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=256, tie_word_embeddings=False)
        lora = LoraArguments(lora=True, lora_r=4, lora_dropout=0.0, lora_modules_to_save=["embed_tokens", "lm_head"])
        return attach_lora(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), lora, False)

    def train(model):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))  # one batch on both ranks
        for _ in range(3):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    reference = build()
    train(reference)
    model = build()  # the units of accelerate 1.15's fsdp2_prepare_model: layers, embedding, tail, root
    for module in list(model.modules()):
        if isinstance(module, LlamaDecoderLayer):
            fully_shard(module)
    inner = model.get_base_model()
    fully_shard(inner.get_input_embeddings())
    fully_shard([inner.model.norm, inner.lm_head], reshard_after_forward=False)
    fully_shard(model)
    applied = skip_embedding_unshard_in_backward(model)
    train(model)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    gaps = {n: (full[n] - p).abs().max().item() for n, p in reference.named_parameters() if p.requires_grad}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    found = {"applied": applied, "gap": max(gaps.values()), "copies": sorted(n for n in gaps if "modules_to_save" in n)}
    if dist.get_rank() == 0:  # the consolidated save, as Trainer.save_model writes it under FSDP2
        model.save_pretrained(FOLDER + "/modules_to_save_adapter", state_dict=state)
        saved = load_file(FOLDER + "/modules_to_save_adapter/adapter_model.safetensors")
        found["saved"] = {k: torch.equal(v, full[k.replace(".weight", ".modules_to_save.default.weight")])
                          for k, v in saved.items() if ".lora_" not in k}
    return found


dist.init_process_group("gloo", init_method="file://" + RENDEZVOUS, rank=RANK, world_size=2)
found = {}
for part in (embedding_backward, lora_checkpoint_wrappers, modules_to_save):
    try:
        found[part.__name__] = part()
    except Exception:
        found[part.__name__] = {"error": traceback.format_exc()}
    dist.barrier()  # no rank starts the next part (or leaves) while another still works
if dist.get_rank() == 0:
    with open(FOLDER + "/found.json", "w") as f:
        json.dump(found, f)
dist.barrier()
from sft.parallel.distributed import exit_process  # noqa: E402

exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen in CI: -6)
