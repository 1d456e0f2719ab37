"""--compile_layers: each decoder layer compiled in place gives the eager model's loss and gradients (LoRA, packed
rows, activation checkpointing), one graph serves every layer, names and adapters stay as they were; the option is
refused where it is not supported and keeps only Liger's fused loss beside it."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO, tiny_config
from sft.options.arguments import ConfigError, LoraArguments, ModelArguments, parse_args, validate_setup
from sft.machine import Launch, Machine

DATA = str(REPO / "data" / "alpaca_demo.json")


def packed_batch(vocab: int) -> dict:
    """Two rows of two packed documents each (position_ids restart), a prompt and padding labelled -100."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 32), generator=generator)
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 28:] = -100
    return {"input_ids": ids, "labels": labels,
            "position_ids": torch.cat([torch.arange(12), torch.arange(20)]).repeat(2, 1)}


def loss_and_grads(model, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("four-layers")
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=300, num_hidden_layers=4)).save_pretrained(path)
    return path


@pytest.mark.slow
def test_compiled_layers_train_as_the_eager_model(four_layers):
    from torch._dynamo.utils import counters

    from sft.model.loading import load_model

    def lora_model(compile_layers: bool):
        torch.manual_seed(0)  # the same LoRA init
        model = load_model(ModelArguments(model=str(four_layers), compile_layers=str(compile_layers).lower()),
                           LoraArguments(lora=True, lora_dropout=0.0))
        return model.train()

    eager, compiled = lora_model(False), lora_model(True)
    batch = packed_batch(eager.config.vocab_size)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for checkpointing in (False, True):  # the Trainer's --activation_checkpointing: each layer recomputed in backward
        if checkpointing:
            for model in (eager, compiled):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        expected, expected_grads = loss_and_grads(eager, batch)
        got, grads = loss_and_grads(compiled, batch)
        assert got == pytest.approx(expected, rel=1e-5), checkpointing
        assert grads.keys() == expected_grads.keys() and any("lora_B" in n for n in grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # The four layers share their graphs: one for the first layer, whose input (the frozen embedding's output) needs
    # no gradient under LoRA, one for the other three; one for the final norm (out of the checkpoints); and the
    # layers' two again with checkpointing.
    assert graphs[0] == 3 and graphs[1] - graphs[0] <= 2, graphs
    assert compiled.get_base_model().model.norm._compiled_call_impl is not None
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # saves and adapters see the same names
    # A save's check (sft/safety/verify.py) compiles nothing: the compiled layers run eagerly there, to the eager
    # model's logits (was: a new graph for the no-grad forward at every save, which failed in inductor on an H100)
    from sft.safety.verify import logits_of

    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(logits_of(compiled, batch["input_ids"]), logits_of(eager, batch["input_ids"]))


def box(gpus: int = 1, **launch) -> Machine:
    return Machine(gpu_names=("NVIDIA GeForce RTX 4090",) * gpus, gpu_memory_gib=(23.5,) * gpus, bf16=True,
                   host_ram_gib=64, host_ram_available_gib=60, launch=Launch(**launch),
                   packages=frozenset({"liger_kernel"}))


def parsed(*extra: str):
    return parse_args(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", "--compile_layers",
                       "true", *extra])


def test_refused_where_it_is_not_supported():
    with pytest.raises(ConfigError, match="--compile_layers with --torch_compile: keep one"):
        validate_setup(*parsed("--torch_compile", "true"), machine=box())
    with pytest.raises(ConfigError, match="--compile_layers with DeepSpeed ZeRO-3"):
        validate_setup(*parsed("--lora"), machine=box(2, world_size=2, zero_stage="3"))
    validate_setup(*parsed("--lora"), machine=box(2, world_size=2))  # DDP
    validate_setup(*parsed(), machine=box(2, world_size=2, fsdp=True))  # FSDP


def test_liger_keeps_only_its_fused_loss_unless_told_otherwise():
    """Under --compile_layers Liger runs its fused loss alone, and that on the labelled tokens only
    (sft/speed/chunked_loss.py: Liger's own forward is switched off for it)."""
    from sft.speed.regional_compile import LIGER_WITH_COMPILED_LAYERS

    def with_liger(args):  # parse_args checks against this CPU machine, which has no Liger: set after
        args[3].use_liger_kernel = True
        args[0].chunked_loss = "auto"  # as typed: parse_args settled it for a run without Liger
        validate_setup(*args, machine=box())
        return args[3].liger_kernel_config, args[3].liger_loss_on_labels

    assert [k for k, on in LIGER_WITH_COMPILED_LAYERS.items() if on] == ["fused_linear_cross_entropy"]
    assert with_liger(parsed("--lora")) == ({**LIGER_WITH_COMPILED_LAYERS, "fused_linear_cross_entropy": False}, True)
    given = parsed("--lora", "--liger_kernel_config", '{"rms_norm": true}')
    assert with_liger(given) == ({"rms_norm": True, "fused_linear_cross_entropy": False}, True)  # yours wins
    plain = parse_args(["--model", "m", "--dataset", DATA, "--output_dir", "/nonexistent/out", "--lora"])
    assert with_liger(plain) == ({"fused_linear_cross_entropy": False}, True)  # Liger's layer kernels as it sets


def test_liger_kernel_config_is_json_on_the_command_line():
    """transformers' own field is a dict its parser cannot read from argv (nor from a recipe's mapping)."""
    with pytest.raises(ConfigError, match="--liger_kernel_config .rms: not JSON"):
        parsed("--liger_kernel_config", "{rms")
    with pytest.raises(ConfigError, match="give a JSON object of kernel names and true/false"):
        parsed("--liger_kernel_config", '{"rms_norm": 1}')


@pytest.mark.slow
def test_deepseek_moe_layers_compile_to_the_same_loss_and_gradients():
    """DeepSeek-V2's layers (MLA, a dense first layer, routed and shared experts): no graph break, one graph per
    layer kind and one for the final norm, the eager model's loss and gradients."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from sft.speed.regional_compile import compile_decoder_layers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v2", vocab_size=300, num_hidden_layers=3)).train()
    batch = packed_batch(model.config.vocab_size)
    expected, expected_grads = loss_and_grads(model, batch)
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(model) == 3
    got, grads = loss_and_grads(model, batch)
    assert got == pytest.approx(expected, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


def test_under_flex_attention_compiled_layers_follow_each_batchs_document_mask():
    """flex_attention's mask follows the documents of each batch: a compiled layer must not keep the first one's.
    Forward only (flex_attention has no backward on CPU); bench/compile_check.py --attn flex_attention trains."""
    from transformers import AutoModelForCausalLM

    from sft.speed.regional_compile import compile_decoder_layers

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=256)
    config._attn_implementation = "flex_attention"
    eager = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    compiled = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compile_decoder_layers(compiled)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, 64), generator=generator)
    losses = []
    for cut in (32, 10, 50):
        batch = {"input_ids": ids, "labels": ids,
                 "position_ids": torch.cat([torch.arange(cut), torch.arange(64 - cut)]).repeat(2, 1)}
        with torch.no_grad():
            losses.append([eager(**batch, use_cache=False).loss.item(), compiled(**batch, use_cache=False).loss.item()])
    assert all(mine == pytest.approx(want, rel=1e-5) for want, mine in losses), losses
    assert len({round(want, 6) for want, _ in losses}) == 3  # the cut changes the loss: the mask is in effect


def test_deepseeks_lora_on_mlp_weights_gets_a_traceable_low_rank_forward_with_peft_s_numbers(tmp_path):
    """sft/speed/traced_param_lora.py: peft's ParamWrapper on the dense and shared-experts MLP weights (its
    parametrization breaks a compiled layer's graph) computes the same loss and gradients without it, low-rank (no
    weight-sized W + B @ A: peft's parametrization never runs), and keeps peft's class name: peft's checks read it
    when a second adapter loads beside the trained one, as the save check does (refused under another name)."""
    import torch.nn.utils.parametrize as parametrize
    from transformers import AutoModelForCausalLM

    from peft.tuners.lora.layer import ParamWrapper

    from sft.model.loading import load_model
    from sft.speed.traced_param_lora import TracedLinearParamLora, trace_param_lora

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("deepseek_v2", vocab_size=300)).save_pretrained(tmp_path / "v2")
    model = load_model(ModelArguments(model=str(tmp_path / "v2")), LoraArguments(lora=True, lora_dropout=0.0)).train()
    for name, p in model.named_parameters():  # lora_B starts at 0: give the adapter a delta to add
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    # the wrappers as loaded: gate, up, down of the dense layer's MLP and of the shared experts
    loaded = [m for m in model.modules() if isinstance(m, TracedLinearParamLora)]
    assert len(loaded) == 6
    for module in loaded:
        module.__class__ = ParamWrapper  # peft's own forward, for its numbers
    batch = packed_batch(300)
    expected, expected_grads = loss_and_grads(model, batch)
    assert trace_param_lora(model) == 6
    assert trace_param_lora(model) == 0  # once
    weight_sized = []
    with pytest.MonkeyPatch.context() as patch:  # peft's B @ A the size of the weight, parametrized or not
        patch.setattr(ParamWrapper, "get_delta_weight", lambda self, *a, **k: weight_sized.append(self))
        patch.setattr(parametrize, "register_parametrization", lambda *a, **k: weight_sized.append(a[0]))
        got, grads = loss_and_grads(model, batch)
    assert weight_sized == []
    assert got == pytest.approx(expected, rel=1e-6) and grads.keys() == expected_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], expected_grads[n], rtol=1e-5, atol=1e-7)
    traced = [m for m in model.modules() if isinstance(m, TracedLinearParamLora)]
    assert len(traced) == 6 and all(type(m).__name__ == "ParamWrapper" for m in traced)
    model.save_pretrained(tmp_path / "adapter")
    model.load_adapter(str(tmp_path / "adapter"), adapter_name="_saved")
    model.set_adapter("_saved")
    assert model(**batch, use_cache=False).loss.item() == pytest.approx(got, rel=1e-6)


@pytest.mark.parametrize("users", [None, "0"])
def test_compiled_layers_take_inductors_multi_kernel_reductions_unless_the_user_set_them(users, monkeypatch):
    """Persistent row reductions benchmarked against looped ones (1.017x a 7B LoRA step on an H100); a
    TORCHINDUCTOR_MULTI_KERNEL of the user's stays as inductor read it."""
    import torch._inductor.config as inductor

    from sft.machine import read_launch
    from sft.speed.regional_compile import compile_decoder_layers

    env = {} if users is None else {"TORCHINDUCTOR_MULTI_KERNEL": users}
    monkeypatch.setattr("sft.machine.launch", lambda: read_launch(env))
    with inductor.patch({"triton.multi_kernel": 0}):  # restored after
        compile_decoder_layers(torch.nn.Linear(2, 2))  # no decoder layer: nothing compiled, the settings made
        assert inductor.triton.multi_kernel == (1 if users is None else 0)
