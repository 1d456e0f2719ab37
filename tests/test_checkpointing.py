"""--activation_checkpointing_skip_layers: the last K layers keep their activations, the gradients stay the same."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from sft.options.arguments import ConfigError, LoraArguments, ModelArguments, parse_args
from sft.model.loading import PartialCheckpointing, load_model


def test_last_layers_leave_checkpointing_and_gradients_do_not_change(tiny_llama):
    model = load_model(ModelArguments(model=str(tiny_llama), dtype="float32"), LoraArguments(lora=True, lora_dropout=0),
                       gradient_checkpointing=True)
    model.train()
    batch = {"input_ids": torch.randint(0, 100, (2, 24)), "labels": torch.randint(0, 100, (2, 24))}

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(**batch, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = model.base_model.model.model.layers
    assert all(layer.gradient_checkpointing for layer in layers)
    checkpointed = gradients()
    callback = PartialCheckpointing(1)
    callback.on_train_begin(SimpleNamespace(process_index=0), None, None, model=model)
    assert [layer.gradient_checkpointing for layer in layers] == [True] * (len(layers) - 1) + [False]
    assert callback.unchecked == [callback.unchecked[0]] and callback.unchecked[0].endswith(f"layers.{len(layers) - 1}")
    partial = gradients()
    assert partial.keys() == checkpointed.keys() and partial
    for name in partial:
        torch.testing.assert_close(partial[name], checkpointed[name], rtol=1e-5, atol=1e-7, msg=name)
    PartialCheckpointing(99).on_train_begin(SimpleNamespace(process_index=1), None, None, model=model)
    assert not any(layer.gradient_checkpointing for layer in layers)  # more than there are: none checkpointed


def test_skip_layers_needs_checkpointing():
    data = str(REPO / "data" / "alpaca_demo.json")
    with pytest.raises(ConfigError, match="needs --activation_checkpointing"):
        parse_args(["--model", "m", "--dataset", data, "--activation_checkpointing_skip_layers", "2"])
    with pytest.raises(ConfigError, match="0 or more"):
        parse_args(["--model", "m", "--dataset", data, "--activation_checkpointing", "true",
                    "--activation_checkpointing_skip_layers", "-1"])
