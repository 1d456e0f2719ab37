"""MoE training (sft/model/moe.py): transformers computes no balance loss for DeepSeek V2/V3; ours is in the training loss
(coefficient x balance; 0 turns it off), reaches the routers, equals DeepSeek's formula, excludes padding, is the
same packed and unpacked; the load statistics reach the logs (and TensorBoard); dense models get no hook; ZeRO-3
marks the MoE blocks as leaves."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import save_tiny_model, tensorboard_scalars, tiny_config
from sft.model.moe import (DEFAULT_COEFFICIENT, MoeLoadLogger, RouterBalance, balance_loss,
                     default_coefficient, install_moe, mark_moe_leaves, moe_blocks, token_groups)
from sft.data.packing import (REAL_TOKENS, SEQUENCE_COUNT, TOKEN_SEQUENCES, COLLATOR_KEYS, Collator,
                              pack_rows)
from sft.data.tokenization import IGNORE
from test_packing import assert_same_loss_and_gradients, documents

MOE = ["deepseek_v2", "deepseek_v3"]


def tiny_moe(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, num_hidden_layers=3, **overrides),
                                             dtype=torch.float32)
    return model.train()


def packed_batch(vocab: int, pad: int = 0):
    docs = documents(vocab)
    rows = pack_rows([d[0] for d in docs], [d[1] for d in docs], 40).to_pylist()
    return docs, Collator(pad_token_id=pad)(rows)


def balanced_forward(model_type: str, coefficient: float):
    """A tiny MoE model with our balance loss installed and one forward of a packed batch captured:
    -> (model, docs, batch, balance, output)."""
    model = tiny_moe(model_type)
    docs, batch = packed_batch(model.config.vocab_size)
    balance = install_moe(model, coefficient=coefficient, pad_token_id=0)
    with balance.capture():
        out = model(**batch)
    return model, docs, batch, balance, out


def reference_balance(model, batch_docs: list[list[int]], per_sequence: bool = True) -> torch.Tensor:
    """DeepSeek's MoEGate formula written out with loops, from the routers' own outputs: each document run alone
    (no padding anywhere), f_i = E/(K T) * count_i, P_i = mean score; per sequence, averaged; summed over layers."""
    outputs = {}
    hooks = [block.gate.register_forward_hook(lambda m, a, o, name=name: outputs.setdefault(name, []).append(o))
             for name, block in moe_blocks(model)]
    for ids in batch_docs:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    total = 0.0
    for name, block in moe_blocks(model):
        experts, k = block.gate.num_experts, block.gate.top_k
        sigmoid = hasattr(block.gate, "e_score_correction_bias")
        per_doc = []
        logits_all = torch.cat([o[0] for o in outputs[name]])
        chosen_all = torch.cat([o[2] for o in outputs[name]])
        groups = [(o[0], o[2]) for o in outputs[name]] if per_sequence else [(logits_all, chosen_all)]
        for logits, chosen in groups:
            scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
            if sigmoid:
                scores = scores / scores.sum(-1, keepdim=True)
            tokens = logits.shape[0]
            value = 0.0
            for i in range(experts):
                f = experts / (k * tokens) * float((chosen == i).sum())
                value = value + f * scores[:, i].mean()
            per_doc.append(value)
        total = total + sum(per_doc) / len(per_doc)
    return total


def test_transformers_adds_no_balance_loss():
    """What transformers 5 computes: the cross-entropy only, even with output_router_logits (so adding ours does not
    count anything twice). If this fails, transformers started adding one: drop ours for that model."""
    for model_type in MOE:
        model = tiny_moe(model_type)
        _, batch = packed_batch(model.config.vocab_size)
        out = model(**batch, output_router_logits=True)
        logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=IGNORE)
        torch.testing.assert_close(out.loss, ce)
        assert len(out.router_logits) == 2 and getattr(out, "aux_loss", None) is None
        assert not hasattr(model.config, "router_aux_loss_coef")


@pytest.mark.parametrize("model_type", MOE)
def test_balance_loss_is_deepseeks_formula_per_document(model_type):
    model, docs, batch, balance, _ = balanced_forward(model_type, coefficient=1.0)
    ours = balance.loss(batch)
    expected = reference_balance(model, [ids for ids, _ in docs])
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # Per micro-batch instead (seq_aux false): the tokens of all documents pooled.
    balance.per_sequence = False
    with balance.capture():
        model(**batch)
    torch.testing.assert_close(balance.loss(batch), reference_balance(model, [ids for ids, _ in docs],
                                                                      per_sequence=False), rtol=1e-5, atol=1e-6)


def test_a_perfectly_even_router_scores_one_per_layer():
    logits = torch.zeros(8, 4)  # every expert equally likely
    chosen = torch.tensor([[0, 1], [2, 3]] * 4)  # every expert chosen equally often
    loss, counts = balance_loss(logits, chosen, torch.zeros(8, dtype=torch.long), 1, 4, sigmoid=False)
    assert loss.item() == pytest.approx(1.0) and counts.tolist() == [4, 4, 4, 4]
    skewed, _ = balance_loss(torch.tensor([[5.0, 5.0, 0, 0]] * 8), torch.tensor([[0, 1]] * 8),
                             torch.zeros(8, dtype=torch.long), 1, 4, sigmoid=False)
    assert skewed.item() > 1.9  # all tokens on two experts that also take the probability: E/K at the limit


def test_token_groups_leave_out_padding_and_split_documents():
    batch = Collator(pad_token_id=0)([
        {"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, 6, 7, IGNORE, 9], "seq_lengths": [3, 2]},
        {"input_ids": [6, 7], "labels": [IGNORE, 7], "seq_lengths": [2]},
    ])
    real, sequence, count = token_groups(batch, pad_token_id=0)
    assert real.tolist() == [True] * 5 + [True, True, False, False, False]
    assert sequence.tolist() == [0, 0, 0, 1, 1, 2, 2] and count == 3
    plain = Collator(pad_token_id=0)([{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]},
                                      {"input_ids": [4], "labels": [IGNORE]}])
    real, sequence, count = token_groups(plain, pad_token_id=0)
    assert real.tolist() == [True, True, True, True, False, False] and sequence.tolist() == [0, 0, 0, 1]
    assert count == 2


BATCH_KINDS = ["padded", "packed", "single document"]


def batch_of(kind: str, vocab: int, **collator_options) -> dict:
    """One batch of each layout the collator makes: rows padded with an attention_mask; packed rows (several
    documents, padding tails); one document alone (no padding: neither attention_mask nor position_ids)."""
    docs = documents(vocab)
    if kind == "padded":
        rows = [{"input_ids": ids, "labels": labels} for ids, labels in docs[:4]]
    elif kind == "packed":
        rows = pack_rows([d[0] for d in docs], [d[1] for d in docs], 40).to_pylist()
    else:
        rows = pack_rows([docs[0][0]], [docs[0][1]], 40).to_pylist()
        collator_options = {**collator_options, "document_ids": True}  # one document: no position_ids kept
    return Collator(pad_token_id=0, **collator_options)(rows)


@pytest.mark.parametrize("options", [{}, {"pad_to_multiple_of": 16}, {"positions": True}], ids=str)
@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_collated_token_groups_are_the_ones_found_in_the_batch(kind, options):
    """The collator's host-made REAL_TOKENS / TOKEN_SEQUENCES / SEQUENCE_COUNT say what token_groups finds on the
    device: the real tokens (as flat indices), each one's sequence, the count."""
    batch = batch_of(kind, 128, token_sequences=True, **options)
    real, sequence, count = token_groups(batch, pad_token_id=0)
    assert batch[REAL_TOKENS].tolist() == real.nonzero().squeeze(1).tolist()
    assert batch[TOKEN_SEQUENCES].tolist() == sequence.tolist()
    assert batch[SEQUENCE_COUNT] == count and isinstance(batch[SEQUENCE_COUNT], int)
    assert count == {"padded": 4, "packed": 6, "single document": 1}[kind]
    assert set(COLLATOR_KEYS) >= {REAL_TOKENS, TOKEN_SEQUENCES, SEQUENCE_COUNT}  # SFTTrainer takes them out
    assert REAL_TOKENS not in batch_of(kind, 128, **options)  # only where asked (a MoE balance in use)


def previous_balance(outputs, batch: dict, per_sequence: bool, num_experts: int, sigmoid: bool):
    """The balance loss and the per-layer tokens per expert as sft/model/moe.py computed them before the collator's
    token groups (commit 53a7c51), kept here as the reference: token_groups' boolean mask picking each layer's router
    outputs, torch.bincount for the tokens per sequence and per expert."""
    real, sequence, sequences = token_groups(batch, pad_token_id=0)
    if not per_sequence:
        sequence, sequences = torch.zeros_like(sequence), min(sequences, 1)
    total, layer_counts = 0.0, []
    for logits, chosen in outputs:
        logits, chosen = logits[real], chosen[real]
        scores = logits.float().sigmoid() if sigmoid else logits.float().softmax(dim=-1)
        if sigmoid:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        tokens = torch.bincount(sequence, minlength=sequences).clamp(min=1).to(scores.dtype)[:, None]
        probability = scores.new_zeros(sequences, num_experts).index_add_(0, sequence, scores) / tokens
        with torch.no_grad():
            slots = (sequence[:, None] * num_experts + chosen).flatten()
            counts = torch.bincount(slots, minlength=sequences * num_experts).view(sequences, num_experts)
            fraction = counts.to(scores.dtype) * num_experts / (chosen.shape[1] * tokens)
        total = total + (fraction * probability).sum(dim=1).mean()
        layer_counts.append(counts.sum(dim=0))
    return total, torch.stack(layer_counts)


def balance_of_one_forward(model, balance: RouterBalance, forward_batch: dict, loss_batch: dict):
    """One forward under capture: -> (the routers' outputs [(logits, chosen)] per MoE layer, RouterBalance.loss of
    `loss_batch`, the window's counts [layers, experts])."""
    outputs = []
    hooks = [block.gate.register_forward_hook(lambda m, a, o: outputs.append((o[0], o[2])))
             for _, block in moe_blocks(model)]
    balance.reset()
    with balance.capture():
        model(**forward_batch)
    for hook in hooks:
        hook.remove()
    return outputs, balance.loss(loss_batch), balance.counts


@pytest.mark.parametrize("kind", BATCH_KINDS)
@pytest.mark.parametrize("model_type", MOE)
def test_collated_token_groups_give_the_previous_loss_gradients_and_counts(model_type, kind):
    """With the collator's token groups (no host wait: index_select, index_add_ into sizes known on the host) the
    balance loss, its gradient w.r.t. every MoE layer's router logits and the tokens per expert are bit for bit
    the previous implementation's (boolean masks, torch.unique, bincount), per sequence and pooled, with V2's
    softmax and V3's sigmoid scores; and so is the fallback without the keys (evaluation, other callers)."""
    model = tiny_moe(model_type)
    batch = batch_of(kind, model.config.vocab_size, token_sequences=True)
    plain = {k: v for k, v in batch.items() if k not in COLLATOR_KEYS}
    balance = install_moe(model, coefficient=1.0, pad_token_id=0)
    assert balance.sigmoid == (model_type == "deepseek_v3")
    for per_sequence in (True, False):
        balance.per_sequence = per_sequence
        for loss_batch in (batch, plain):  # the collator's keys; found in the batch (the fallback)
            outputs, ours, counts = balance_of_one_forward(model, balance, plain, loss_batch)
            reference, reference_counts = previous_balance(outputs, plain, per_sequence, balance.num_experts,
                                                           balance.sigmoid)
            logits = [o[0] for o in outputs]
            assert len(logits) == 2 and torch.equal(ours, reference)
            for got, expected in zip(torch.autograd.grad(ours, logits, retain_graph=True),
                                     torch.autograd.grad(reference, logits)):
                assert torch.equal(got, expected) and got.abs().sum() > 0
            assert torch.equal(counts, reference_counts)
            assert int(counts.sum()) == int(batch[REAL_TOKENS].numel()) * model.config.num_experts_per_tok * 2


@pytest.mark.parametrize("model_type", MOE)
def test_packed_balance_loss_and_gradients_equal_per_document(model_type):
    """Extends tests/test_packing.py to the loss we add: a packed batch (padding tail included) gives the same
    CE + alpha x balance, and the same gradient for every parameter, as the documents run one by one (CE weighted
    by their trained tokens, the balance loss averaged over documents: DeepSeek's per-sequence form)."""
    model, docs, batch, balance, out = balanced_forward(model_type, coefficient=0.05)
    packed = out.loss + balance.loss(batch)
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    ce, count, aux = 0.0, 0, 0.0
    for ids, labels in docs:
        single = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]), "use_cache": False}
        with balance.capture():
            out = model(**single)
        n = sum(label != IGNORE for label in labels[1:])
        ce, count, aux = ce + out.loss * n, count + n, aux + balance.loss(single)
    per_document = ce / count + aux / len(docs)
    assert_same_loss_and_gradients(model, packed, packed_grads, per_document)
    assert any("gate.weight" in n for n in packed_grads)


@pytest.mark.parametrize("model_type", MOE)
def test_pooled_balance_loss_equals_the_padded_batch(model_type):
    """seq_aux false pools the micro-batch's tokens: packed rows and the same documents padded one per row give
    the same value (padding left out in both), but not the per-document average."""
    model = tiny_moe(model_type)
    docs, packed = packed_batch(model.config.vocab_size)
    padded = Collator(pad_token_id=0)([{"input_ids": ids, "labels": labels} for ids, labels in docs])
    balance = install_moe(model, coefficient=1.0, per_sequence=False, pad_token_id=0)
    values = []
    for batch in (packed, padded):
        with balance.capture(), torch.no_grad():
            model(**batch)
        values.append(balance.loss(batch).item())
    assert values[0] == pytest.approx(values[1], rel=1e-5)
    balance.per_sequence = True
    with balance.capture(), torch.no_grad():
        model(**packed)
    assert balance.loss(packed).item() != pytest.approx(values[0], rel=1e-3)


def make_trainer(model, tmp_path, balance=None, **args):
    from transformers import TrainingArguments

    from sft.trainer import SFTTrainer

    targs = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **args)
    return SFTTrainer(model=model, args=targs, balance=balance)


@pytest.mark.parametrize("model_type", MOE)
def test_trainer_loss_includes_coefficient_times_balance(model_type, tmp_path):
    model = tiny_moe(model_type)
    _, batch = packed_batch(model.config.vocab_size)
    plain = make_trainer(model, tmp_path).compute_loss(model, batch)
    balance = install_moe(model, coefficient=1.0, pad_token_id=0)
    with balance.capture(), torch.no_grad():
        model(**batch)
    balance_value = balance.loss(batch).item()
    balance.remove()

    losses = {}
    for coefficient in (0.0, 0.01, 0.1):
        balance = install_moe(model, coefficient=coefficient, pad_token_id=0)
        trainer = make_trainer(model, tmp_path, balance=balance)
        losses[coefficient] = trainer.compute_loss(model, batch)
        balance.remove()
    assert losses[0.0].item() == plain.item()  # 0 turns it off
    assert losses[0.01].item() - plain.item() == pytest.approx(0.01 * balance_value, rel=1e-4)
    assert losses[0.1].item() - plain.item() == pytest.approx(0.1 * balance_value, rel=1e-4)

    # Evaluation (model.eval()) is left alone.
    balance = install_moe(model, coefficient=0.1, pad_token_id=0)
    trainer = make_trainer(model, tmp_path, balance=balance)
    model.eval()
    assert trainer.compute_loss(model, batch).item() == pytest.approx(plain.item(), abs=1e-6)
    assert balance.micro_batches == 0
    model.train()

    # A loss already normalised over the accumulated batch (num_items_in_batch): the Trainer will not divide by the
    # accumulation steps, so the balance loss is divided here.
    trainer.current_gradient_accumulation_steps = 4
    items = int((batch["labels"][:, 1:] != IGNORE).sum())
    scaled = trainer.compute_loss(model, batch, num_items_in_batch=items)
    unscaled = make_trainer(model, tmp_path).compute_loss(model, batch, num_items_in_batch=items)
    assert scaled.item() - unscaled.item() == pytest.approx(0.1 * balance_value / 4, rel=1e-4)


@pytest.mark.parametrize("model_type", MOE)
def test_balance_loss_gradient_reaches_the_routers(model_type):
    model, _, batch, balance, _ = balanced_forward(model_type, coefficient=0.01)
    balance.loss(batch).backward()
    routers = [block.gate.weight for _, block in moe_blocks(model)]
    assert len(routers) == 2 and all(w.grad is not None and w.grad.abs().sum() > 0 for w in routers)
    # Only the routers and what lies below them: the LM head and the last layer's experts get nothing from it.
    assert model.lm_head.weight.grad is None
    assert moe_blocks(model)[-1][1].experts.gate_up_proj.grad is None


def test_gradient_survives_activation_checkpointing(tmp_path):
    """transformers 5 checkpoints with use_reentrant=False: the routers' logits kept from the forward still carry
    their graph, and the recomputation in backward records nothing (the hooks are idle outside capture)."""
    model = tiny_moe("deepseek_v2")
    model.activation_checkpointing_enable()
    _, batch = packed_batch(model.config.vocab_size)
    balance = install_moe(model, coefficient=0.01, pad_token_id=0)
    with balance.capture():
        out = model(**batch)
    (out.loss + balance.loss(batch)).backward()
    assert balance.micro_batches == 1 and int(balance.counts.sum()) == 72 * 2 * 2  # tokens x K x layers
    assert all(block.gate.weight.grad.abs().sum() > 0 for _, block in moe_blocks(model))


def test_default_coefficient_comes_from_the_config():
    assert default_coefficient(tiny_config("deepseek_v2")) == DEFAULT_COEFFICIENT == 0.001
    assert default_coefficient(tiny_config("deepseek_v3", aux_loss_alpha=0.0003)) == 0.0003
    model = tiny_moe("deepseek_v2", aux_loss_alpha=0.002, seq_aux=False)
    balance = install_moe(model)
    assert balance.coefficient == 0.002 and balance.per_sequence is False
    assert install_moe(tiny_moe("deepseek_v3")).per_sequence is True  # DeepSeek's seq_aux default


def test_dense_models_get_no_hooks():
    from transformers import AutoModelForCausalLM

    for model_type in ("llama", "qwen2"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        assert install_moe(model) is None
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    moe = tiny_moe("deepseek_v2")
    balance = install_moe(moe)
    assert sum(bool(m._forward_hooks) for m in moe.modules()) == 2  # one per MoE layer's router
    balance.remove()
    assert not any(m._forward_hooks for m in moe.modules())


def test_logged_keys_and_load_file(tmp_path):
    model = tiny_moe("deepseek_v3")
    _, batch = packed_batch(model.config.vocab_size)
    balance = install_moe(model, coefficient=0.01, pad_token_id=0)
    for _ in range(2):
        with balance.capture(), torch.no_grad():
            model(**batch)
        balance.loss(batch)
    logger = MoeLoadLogger(balance)
    args = SimpleNamespace(device=torch.device("cpu"), process_index=0, output_dir=str(tmp_path))
    logs = {"loss": 7.0}
    logger.on_log(args, SimpleNamespace(global_step=5), None, logs=logs)
    assert {"moe/aux_loss", "moe/balance", "moe/load_imbalance_max", "moe/load_imbalance_mean", "moe/idle_experts",
            "moe/load_imbalance/layer_1", "moe/load_imbalance/layer_2"} <= logs.keys()
    assert logs["moe/load_imbalance_max"] >= logs["moe/load_imbalance_mean"] >= 1.0
    line = json.loads((tmp_path / "moe_load.jsonl").read_text())
    assert line["step"] == 5
    assert {k: sum(v) for k, v in line["tokens_per_expert"].items()} == {"model.layers.1.mlp": 2 * 72 * 2,
                                                                         "model.layers.2.mlp": 2 * 72 * 2}
    # The window restarts; evaluation logs (no "loss") are left alone; coefficient 0 logs no aux_loss.
    assert balance.micro_batches == 0 and balance.counts is None
    eval_logs = {"eval_loss": 1.0}
    logger.on_log(args, SimpleNamespace(global_step=6), None, logs=eval_logs)
    assert eval_logs == {"eval_loss": 1.0}
    balance.coefficient = 0.0
    with balance.capture(), torch.no_grad():
        model(**batch)
    assert balance.loss(batch) is None
    logs = {"loss": 7.0}
    logger.on_log(args, SimpleNamespace(global_step=7), None, logs=logs)
    assert "moe/aux_loss" not in logs and "moe/balance" in logs


def test_zero3_marks_moe_blocks_as_leaves(monkeypatch):
    import transformers.integrations
    from deepspeed.utils import z3_leaf_module

    model = tiny_moe("deepseek_v2")
    assert mark_moe_leaves(model) == []  # ZeRO-3 off: nothing marked
    assert not any(z3_leaf_module(m) for m in model.modules())

    calls = []
    import deepspeed.utils

    real = deepspeed.utils.set_z3_leaf_modules
    monkeypatch.setattr(deepspeed.utils, "set_z3_leaf_modules",
                        lambda m, classes, **kw: calls.append(classes) or real(m, classes, **kw))
    monkeypatch.setattr(transformers.integrations, "is_deepspeed_zero3_enabled", lambda: True)
    marked = mark_moe_leaves(model)
    assert len(calls) == 1 and "DeepseekV2Moe" in calls[0]
    assert marked == [block for _, block in moe_blocks(model)]
    assert {type(m).__name__ for m in model.modules() if z3_leaf_module(m)} == {"DeepseekV2Moe"}
    from transformers import AutoModelForCausalLM

    assert mark_moe_leaves(AutoModelForCausalLM.from_config(tiny_config("llama"))) == []  # dense: nothing to mark


@pytest.mark.slow
def test_training_logs_moe_numbers_to_tensorboard(tmp_path, monkeypatch):
    """A real Trainer run (its batches with the collator's token groups): the balance loss trains, the numbers reach
    TensorBoard's event files."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from sft.trainer import SFTTrainer

    model_dir = save_tiny_model(tmp_path / "model", "deepseek_v2")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    docs = documents(model.config.vocab_size)
    rows = pack_rows([d[0] for d in docs] * 4, [d[1] for d in docs] * 4, 40).to_pylist()
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=["tensorboard"], use_cpu=True,
                             per_device_train_batch_size=2, max_steps=4, logging_steps=2, save_strategy="no",
                             remove_unused_columns=False, learning_rate=1e-3)
    balance = install_moe(model, pad_token_id=0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, callbacks=[MoeLoadLogger(balance)],
                         data_collator=Collator(pad_token_id=0, token_sequences=True),  # as sft/train.py's for MoE
                         balance=balance)  # TensorBoard after ours
    trainer.train()
    assert len(tensorboard_scalars(tmp_path / "tb", "train/moe/aux_loss")) == 2
    assert len(tensorboard_scalars(tmp_path / "tb", "train/moe/load_imbalance/layer_1")) == 2
    assert len((tmp_path / "out" / "moe_load.jsonl").read_text().splitlines()) == 2
    assert isinstance(balance, RouterBalance) and balance.coefficient == DEFAULT_COEFFICIENT


@pytest.mark.parametrize("model_type", MOE)
def test_mfu_counts_the_routed_experts_a_token_runs(model_type):
    """MFU on ACTIVE parameters: of each MoE layer's routed experts, num_experts_per_tok of n_routed_experts (on
    DeepSeek-V2-Lite, counting all 64 experts overstated MFU 6.2x: 7.0% logged against 1.1% measured)."""
    from sft.report.callbacks import flops_per_token

    model = tiny_moe(model_type)
    config = model.config
    routed = sum(p.numel() for _, block in moe_blocks(model) for p in block.experts.parameters())
    assert routed > 0
    embeddings = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters()) - embeddings
    active = total - routed + routed * config.num_experts_per_tok / config.n_routed_experts
    assert flops_per_token(model, lora=True) == pytest.approx(4 * active)
    assert flops_per_token(model, lora=False) == pytest.approx(6 * active)
