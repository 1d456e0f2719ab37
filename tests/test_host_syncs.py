"""No host wait left in a LoRA training micro-batch (SFTTrainer.training_step: forward, loss, backward) on the paths
that run on CPU; docs/speed.md (Host waits) says which remain elsewhere.

A host wait is an op whose result's value or size the host must read from the device before it can go on: a
tensor read as a Python number (`.item()`, `bool(t)`, `int(t)`: aten._local_scalar_dense) or a boolean-mask index
(aten.index with a bool index, aten.nonzero, masked_select). On a GPU each makes the host wait until the queue
drains, and the GPU then idles while the host issues what follows. A TorchDispatchMode counts them here on CPU,
where the same ops run. Liger's fused loss (`--use_liger_kernel`, GPU only: its Triton kernels) cannot run here;
it reads its labelled-token count with `.item()` in its own forward, which these tests do not see.

Also: the real-token count under DDP (two gloo processes) is summed across ranks only when a log or a checkpoint
reads it, and equals the Trainer's own count at every log and in the checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_config

REPO = Path(__file__).resolve().parents[1]
BOOLEAN_RESULT_SIZE = (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default)


class HostWaits(TorchDispatchMode):
    """Counts the ops that make the host wait for the device's result, by op and by the innermost frame of our code
    or of the library that ran them (what the failure message names)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            index is not None and index.dtype == torch.bool for index in args[1])
        if func is torch.ops.aten._local_scalar_dense.default or boolean_index or func in BOOLEAN_RESULT_SIZE:
            self.seen[(str(func), where())] += 1
        return func(*args, **kwargs)


def where() -> str:
    import traceback

    frames = [f for f in traceback.extract_stack()
              if "torch/" not in f.filename and "test_host_syncs" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def lora_trainer(tmp_path, attention: str, loss):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, TrainingArguments

    from sft.trainer import SFTTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=128), attn_implementation=attention)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, labelled_token_loss=loss)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before its micro-batches
    return trainer


def packed_batch(**collator_options) -> dict:
    """Two packed rows (two documents and padding; one document): prompts unlabelled, as the tokenizer leaves them."""
    from sft.data.packing import Collator

    rows = [{"input_ids": list(range(1, 20)),
             "labels": [-100] * 5 + list(range(6, 12)) + [-100] * 2 + list(range(14, 20)), "seq_lengths": [11, 8]},
            {"input_ids": list(range(3, 17)), "labels": [-100] * 3 + list(range(6, 17)), "seq_lengths": [14]}]
    return Collator(0, counts_tokens=True, **collator_options)(rows)


def waits_in_training_step(trainer, batch) -> Counter:
    with HostWaits() as waits:
        trainer.training_step(trainer.model, batch, None)
    return waits.seen


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("loss", ["chunked", "model's own"])
def test_a_lora_micro_batch_leaves_the_host_free(tmp_path, attention, loss):
    """With the collator's host-made keys (labelled positions, documents, token count), a packed micro-batch's
    forward, loss and backward never wait for the device."""
    from sft.speed.chunked_loss import chunked_causal_lm_loss

    trainer = lora_trainer(tmp_path, attention, chunked_causal_lm_loss if loss == "chunked" else None)
    waits = waits_in_training_step(trainer, packed_batch(labelled_positions=True, document_ids=True))
    assert not waits, f"host waits left: {dict(waits)}"


def test_without_the_host_made_keys_the_waits_are_there(tmp_path):
    """The counter sees the waits that the collator's keys remove: transformers finding the packed documents at the
    start of the forward, and the labelled tokens' boolean mask (twice: states and targets)."""
    from sft.speed.chunked_loss import chunked_causal_lm_loss

    trainer = lora_trainer(tmp_path, "sdpa", chunked_causal_lm_loss)
    waits = waits_in_training_step(trainer, packed_batch())
    places = Counter()
    for (op, frame), n in waits.items():
        places[(op, Path(frame.split(":")[0]).name)] += n
    assert places == {("aten._local_scalar_dense.default", "masking_utils.py"): 1,
                      ("aten.index.Tensor", "chunked_loss.py"): 2}, dict(waits)


# ---- the real-token count under DDP: two gloo processes ----------------------------------------------------------

COUNT_WORKER = textwrap.dedent("""
    import json, sys
    import datasets, torch
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments
    from sft.data.packing import Collator
    from sft.parallel.distributed import exit_process
    from sft.trainer import SFTTrainer


    class PadOnly:  # the Trainer's own count reads the pad id; its checkpoints save the processing class
        pad_token_id = 0

        def save_pretrained(self, directory):
            pass


    def run(out, ours):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
        model = AutoModelForCausalLM.from_config(config)
        lengths = (11, 21, 31, 41, 15, 27, 33, 9, 12, 19, 25, 7, 30, 14, 22, 17)
        rows = [{"input_ids": list(range(1, n)), "labels": list(range(1, n))} for n in lengths]
        args = TrainingArguments(output_dir=out, max_steps=5, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, logging_steps=2, save_strategy="steps", save_steps=3,
                                 save_only_model=True, use_cpu=True, ddp_backend="gloo", report_to=[],
                                 remove_unused_columns=False, disable_tqdm=True,
                                 include_num_input_tokens_seen="non_padding", seed=0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             data_collator=Collator(0, counts_tokens=ours), processing_class=PadOnly())
        gathers = []
        gather = trainer.accelerator.gather
        trainer.accelerator.gather = lambda tensor: gathers.append(sys._getframe(1).f_code.co_name) or gather(tensor)
        trainer.train()
        logged = [(log["step"], log["num_input_tokens_seen"]) for log in trainer.state.log_history]
        saved = json.loads(open(out + "/checkpoint-3/trainer_state.json").read())["num_input_tokens_seen"]
        return {"logged": logged, "saved": saved, "count_gathers": gathers.count("_track_num_input_tokens"),
                "rank": trainer.args.process_index}


    results = {name: run(sys.argv[1] + "/" + name, name == "ours") for name in ("ours", "trainer")}
    if results["ours"]["rank"] == 0:
        print("RESULT " + json.dumps(results), flush=True)
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen in CI: -6)
""")



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_runs(out: Path) -> dict:
    port = str(free_port())
    workers = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        workers.append(subprocess.Popen([sys.executable, "-c", COUNT_WORKER, str(out)], env=env, cwd=REPO,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_the_token_count_under_ddp_is_the_trainers_own(tmp_path):
    """Under DDP each rank keeps the collator's count on the host and one all-reduce sums the ranks' counts when a
    log or a checkpoint reads it (here a checkpoint at step 3, between the logs at 2 and 4): every logged count and
    the checkpoint's equal the Trainer's own, which gathers each micro-batch's count (and reads it back)."""
    runs = two_rank_runs(tmp_path)
    ours, trainers = runs["ours"], runs["trainer"]
    assert ours["logged"] == trainers["logged"]
    assert [step for step, _ in ours["logged"]] == [2, 4, 5] and ours["logged"][-1][1] > 0  # 5: the train metrics
    assert ours["saved"] == trainers["saved"] > ours["logged"][0][1]
    assert ours["count_gathers"] == 0 and trainers["count_gathers"] == 5 * 2  # one per micro-batch
