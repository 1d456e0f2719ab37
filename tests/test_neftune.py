"""NEFTune (--neftune_noise_alpha, sft/model/neftune.py): the noise each training forward adds to the input
embeddings, scaled by each token's own conversation in a packed row, never in evaluation, and once (ours, not the
Trainer's hook beside it)."""

from __future__ import annotations

import torch
from datasets import Dataset

from sft.data.packing import NOISE_LENGTHS, Collator
from test_long_rows import tiny_lora_llama

ALPHA = 5.0
HIDDEN = 64  # tiny_lora_llama's


def packed_rows() -> list[dict]:
    """Two packed rows: documents of 10, 30 and 24 tokens, then one of 40 (the collator pads it to 64)."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 256, (64,), generator=g).tolist(), torch.randint(3, 256, (40,), generator=g).tolist()]
    return [{"input_ids": ids[0], "labels": ids[0], "seq_lengths": [10, 30, 24]},
            {"input_ids": ids[1], "labels": ids[1], "seq_lengths": [40]}]


def test_the_collator_gives_each_token_its_own_sequences_length():
    batch = Collator(pad_token_id=0, noise_lengths=True)(packed_rows())
    assert batch[NOISE_LENGTHS].tolist() == [[10] * 10 + [30] * 30 + [24] * 24, [40] * 40 + [24] * 24]
    padded = Collator(pad_token_id=0, noise_lengths=True)([{"input_ids": [5] * 7, "labels": [5] * 7},
                                                          {"input_ids": [5] * 3, "labels": [5] * 3}])
    assert padded[NOISE_LENGTHS].tolist() == [[7] * 7, [3] * 3 + [4] * 4]  # a padded row: its real length
    assert NOISE_LENGTHS not in Collator(pad_token_id=0)(packed_rows())


def trainer(tmp_path, alpha: float | None):
    from sft.options.arguments import SFTTrainingArguments
    from sft.trainer import SFTTrainer

    rows = packed_rows()
    args = SFTTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1,
                                per_device_train_batch_size=2, neftune_noise_alpha=alpha, save_strategy="no")
    return SFTTrainer(model=tiny_lora_llama(False), args=args, train_dataset=Dataset.from_list(rows),
                      data_collator=Collator(pad_token_id=0, noise_lengths=alpha is not None))


def first_layer_input(trainer, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the first decoder layer read, the embeddings without noise) of one compute_loss on the packed rows,
    with the hook attached as train() attaches it."""
    model = trainer.model
    model.train(training)
    batch = trainer.data_collator(packed_rows())
    seen = []
    layer = model.get_base_model().model.layers[0]
    handle = layer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get(
        "hidden_states", args[0] if args else None)), with_kwargs=True)
    try:
        with torch.no_grad():
            clean = model.get_input_embeddings()(batch["input_ids"])
            with trainer.noise.attached(model.get_input_embeddings()):
                trainer.compute_loss(model, batch)
    finally:
        handle.remove()
    return seen[0], clean


def test_each_conversation_gets_the_papers_noise_in_training_and_none_in_evaluation(tmp_path):
    t = trainer(tmp_path, ALPHA)
    noisy, clean = first_layer_input(t, training=True)
    noise = (noisy - clean).abs()
    # each document's noise reaches alpha / sqrt(L x d) and never passes it: uniform in [-1, 1] x that scale
    for row, start, length in ((0, 0, 10), (0, 10, 30), (0, 40, 24), (1, 0, 40)):
        scale = ALPHA / (length * HIDDEN) ** 0.5
        top = noise[row, start:start + length].max().item()
        assert 0.95 * scale < top <= scale * (1 + 1e-6), (row, start, length, top, scale)
    # transformers' hook would give every token of a row alpha / sqrt(64 x d): the 10-token document gets 2.5x that
    assert noise[0, :10].max() > 2 * ALPHA / (64 * HIDDEN) ** 0.5
    evaluated, clean = first_layer_input(t, training=False)
    assert torch.equal(evaluated, clean)


def test_one_hook_adds_the_noise_during_training(tmp_path):
    """Ours replaces the Trainer's (which train() registers when its attribute is set): noise added twice would be
    sqrt(2) x the paper's and scaled by the packed row."""
    t = trainer(tmp_path, ALPHA)
    hooks = []
    layer = t.model.get_base_model().model.layers[0]
    layer.register_forward_pre_hook(lambda *_: hooks.append(len(t.model.get_input_embeddings()._forward_hooks)))
    t.train()
    assert hooks and set(hooks) == {1}
    assert not t.model.get_input_embeddings()._forward_hooks  # gone after the training: the saved model is clean
