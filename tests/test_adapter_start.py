"""--lora_from (sft/model/adapter_start.py): a LoRA run that starts from a saved adapter trains it on, in its own shape,
on the base it names; what it cannot take is one error line before any model loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from conftest import REPO, train_here
from sft.errors import ConfigError
from sft.machine import Launch, Machine
from sft.options.arguments import read_options, settle

DATA = str(REPO / "data" / "alpaca_demo.json")


def short_run(output, *extra: str) -> list[str]:
    return ["--dataset", DATA, "--output_dir", str(output), "--max_steps", "2", "--max_length", "128",
            "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--logging_steps", "1",
            "--report_to", "none", "--save_strategy", "no", "--seed", "0", *extra]


class FirstWeights(TrainerCallback):
    """Test-only: the adapter's weights as training begins."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def adapter_weights(output) -> dict[str, torch.Tensor]:
    return load_file(output / "adapter_model.safetensors")


@pytest.mark.slow
def test_a_saved_adapter_is_trained_on_in_its_own_shape_on_the_base_it_names(tmp_path, tiny_llama):
    from sft.train import main

    first, second = tmp_path / "first", tmp_path / "second"
    result = train_here(["--model", str(tiny_llama), *short_run(first, "--lora", "--lora_r", "4", "--lora_alpha",
                                                                 "8", "--lora_dropout", "0")])
    assert result.returncode == 0, result.stderr[-2000:]
    start = FirstWeights()
    assert main(short_run(second, "--lora_from", str(first)), callbacks=[start]) == 0  # no --model: the adapter's base
    saved, trained = adapter_weights(first), adapter_weights(second)
    assert saved.keys() == trained.keys()
    # it began with the saved weights (lora_B is zero in a new adapter), and trained them on
    began = {n.replace(".default", ""): w for n, w in start.weights.items()}
    assert all(torch.equal(began[n], saved[n]) for n in saved) and any(saved[n].abs().max() > 0 for n in saved
                                                                         if "lora_B" in n)
    assert any(not torch.equal(trained[n], saved[n]) for n in saved)
    config = json.loads((second / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.0)
    assert config["base_model_name_or_path"] == str(tiny_llama)


def test_what_a_run_from_an_adapter_cannot_take_is_one_line_before_loading(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                             "base_model_name_or_path": "base"}))

    def refused(*argv: str, machine: Machine = Machine(launch=Launch())) -> str:
        with pytest.raises(ConfigError) as e:
            settle(read_options(["--dataset", DATA, "--output_dir", str(tmp_path / "out"), *argv]), machine)
        return str(e.value)

    assert "no adapter_model.safetensors" in refused("--lora_from", str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"x")
    assert "leave --lora_r and --lora_alpha out" in refused("--lora_from", str(adapter), "--lora_r", "8",
                                                            "--lora_alpha", "16")
    assert "no such directory" in refused("--lora_from", str(tmp_path / "nowhere"))
    assert "with DeepSpeed ZeRO-3" in refused("--lora_from", str(adapter),
                                              machine=Machine(launch=Launch(zero_stage="3")))
    options = settle(read_options(["--dataset", DATA, "--lora_from", str(adapter), "--lora_dropout", "0.1"]),
                     Machine(launch=Launch()))  # the adapter's rank, the dropout given, its base
    assert options.lora.lora and options.model.model == "base" and (options.lora.lora_r, options.lora.lora_dropout) \
        == (4, 0.1)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "base",
                                                             "target_parameters": ["mlp.experts.gate_up_proj"]}))
    assert "adapts the routed experts" in refused("--lora_from", str(adapter))
