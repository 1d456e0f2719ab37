"""No host wait left in a LoRA training micro-batch (SFTTrainer.training_step: forward, loss, backward) on the paths
that run on CPU; docs/speed.md (Host waits) says which remain elsewhere.

A host wait is an op whose result's value or size the host must read from the device before it can go on: a
tensor read as a Python number (`.item()`, `bool(t)`, `int(t)`: aten._local_scalar_dense), a boolean-mask index
(aten.index with a bool index, aten.nonzero, masked_select), or an op whose CUDA kernel sizes its result from the
data (torch.unique, bincount, repeat_interleave without output_size). On a GPU each makes the host wait until the
queue drains, and the GPU then idles while the host issues what follows. A TorchDispatchMode counts them here on
CPU, where the same ops run. It sees the ops that Python and the dispatcher call, not what a CUDA kernel's own C++
does inside one op: docs/speed.md (Host waits) names the waits of that kind that remain in a MoE step (torch's
grouped_mm off Hopper). Liger's fused loss (`--use_liger_kernel`, GPU only: its Triton kernels) cannot run here;
it reads its labelled-token count with `.item()` in its own forward, which these tests do not see.

The MoE micro-batch (a tiny deepseek_v2 with the default LoRA, the balance loss on, transformers' default
grouped_mm experts) has none either: the balance loss takes the real tokens and their sequences from the collator,
and the load statistics are read on the host only when a log asks for them.

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
# sized from the data on CUDA: unique's output; bincount reads the input's largest value to size its result
DATA_SIZED_RESULT = (torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default,
                     torch.ops.aten.unique_consecutive.default, torch.ops.aten._unique.default,
                     torch.ops.aten.bincount.default)


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
        unsized_repeat = func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func is torch.ops.aten._local_scalar_dense.default or boolean_index or unsized_repeat or \
                func in BOOLEAN_RESULT_SIZE or func in DATA_SIZED_RESULT:
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


# ---- a MoE micro-batch: tiny DeepSeek-V2, LoRA, the routers' balance loss ---------------------------------------

def moe_lora_trainer(tmp_path, loss, experts_implementation: str = "grouped_mm"):
    """A tiny deepseek_v2 (two MoE layers) with the default MoE LoRA (MLA, the dense MLP, the shared experts) and
    the balance loss on, in SFTTrainer as sft/train.py builds it."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from sft.model.loading import attach_lora
    from sft.model.moe import install_moe
    from sft.options.arguments import LoraArguments
    from sft.trainer import SFTTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v2", vocab_size=128, num_hidden_layers=3),
                                             attn_implementation="sdpa", dtype=torch.float32,
                                             experts_implementation=experts_implementation)
    model = attach_lora(model, LoraArguments(lora=True, lora_r=4, lora_dropout=0.0), gradient_checkpointing=False)
    balance = install_moe(model, coefficient=0.01, pad_token_id=0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, labelled_token_loss=loss, balance=balance)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def moe_batch(**options) -> dict:
    return packed_batch(labelled_positions=True, document_ids=True, **options)


def waits_by_file(waits: Counter) -> dict:
    places = Counter()
    for (op, frame), n in waits.items():
        places[(op, Path(frame.split(":")[0]).name)] += n
    return dict(places)


@pytest.mark.parametrize("loss", ["chunked", "model's own"])
def test_a_moe_lora_micro_batch_leaves_the_host_free(tmp_path, loss):
    """With the collator's token groups, two MoE micro-batches' forward, balance loss and backward never wait for
    the device; the load statistics are read once, at the log (MoeLoadLogger.on_log), not per micro-batch."""
    from types import SimpleNamespace

    from sft.model.moe import MoeLoadLogger
    from sft.speed.chunked_loss import chunked_causal_lm_loss

    trainer = moe_lora_trainer(tmp_path, chunked_causal_lm_loss if loss == "chunked" else None)
    batch = moe_batch(token_sequences=True)
    with HostWaits() as waits:
        for _ in range(2):
            trainer.training_step(trainer.model, batch, None)
    assert not waits.seen, f"host waits left: {dict(waits.seen)}"
    # What the window kept is still on the device, as tensors: the log reads it (`tolist`, which the counter does
    # not see: a copy to the host, outside the dispatcher) and restarts the window.
    balance = trainer.balance
    assert balance.micro_batches == 2 and all(isinstance(v, torch.Tensor) for v in
                                              (balance.counts, balance.loss_sum, balance.balance_sum))
    logs = {"loss": 1.0}
    args = SimpleNamespace(device=torch.device("cpu"), output_dir=str(tmp_path), process_index=0)
    MoeLoadLogger(balance).on_log(args, SimpleNamespace(global_step=1), None, logs=logs)
    assert logs["moe/aux_loss"] > 0 and logs["moe/balance"] > 0 and balance.micro_batches == 0


def test_without_the_token_groups_the_moe_waits_are_there(tmp_path):
    """The counter sees the waits that the collator's token groups remove: the balance loss finding the real tokens
    and their sequences in the batch (a boolean index and torch.unique) and picking them (nonzero, once for all
    layers: each layer's boolean index before)."""
    trainer = moe_lora_trainer(tmp_path, None)
    waits = waits_by_file(waits_in_training_step(trainer, moe_batch()))
    assert waits == {("aten.index.Tensor", "moe.py"): 1, ("aten._unique2.default", "moe.py"): 1,
                     ("aten.nonzero.default", "moe.py"): 1}, waits


def test_training_a_moe_model_batches_the_token_groups(tmp_path, capsys):
    """sft/train.py on a MoE model asks the collator for the token groups (a balance is in use): the batches the
    Trainer hands its steps carry them, and the balance loss ran (`moe/aux_loss` logged)."""
    import sft.train
    from conftest import save_tiny_model
    from sft.data.packing import REAL_TOKENS, SEQUENCE_COUNT

    trainers = []
    code = sft.train.main(["--model", str(save_tiny_model(tmp_path / "v2", "deepseek_v2")), "--dataset",
                           str(REPO / "data" / "alpaca_demo.json"), "--max_samples", "16", "--max_length", "64",
                           "--packing", "true", "--lora", "true", "--max_steps", "1", "--logging_steps", "1",
                           "--report_to", "none", "--save_strategy", "no", "--output_dir", str(tmp_path / "out"),
                           "--dataset_cache_dir", str(tmp_path / "cache")], save=False, on_trainer=trainers.append)
    assert code == 0, capsys.readouterr().err[-2000:]
    trainer = trainers[0]
    assert trainer.data_collator.token_sequences and trainer.balance is not None
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch[REAL_TOKENS].numel() > 0 and batch[SEQUENCE_COUNT] > 1  # packed: several documents
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert any(row.get("moe/aux_loss", 0) > 0 for row in log), log


def test_transformers_eager_experts_wait_where_docs_say(tmp_path):
    """transformers' eager experts loop (`experts_implementation="eager"`, not the default grouped_mm) waits in
    modeling_deepseek_v2.py: the experts hit (nonzero), each expert's index compared on the host, and each
    expert's tokens (torch.where: nonzero); docs/speed.md names the lines. The grouped_mm default has none here."""
    trainer = moe_lora_trainer(tmp_path, None, experts_implementation="eager")
    waits = waits_by_file(waits_in_training_step(trainer, moe_batch(token_sequences=True)))
    assert set(waits) == {("aten.nonzero.default", "modeling_deepseek_v2.py"),
                          ("aten._local_scalar_dense.default", "modeling_deepseek_v2.py")}, waits


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
