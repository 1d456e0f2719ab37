"""--activation_checkpointing_keep_attention (sft/speed/kept_attention.py): the checkpointed layers keep sdpa's
outputs for the backward instead of recomputing them. The same loss and gradients as plain checkpointing; the
attention's forward runs once per layer per step inside compiled layers, and its kept outputs go to host RAM with
the checkpoints under --offload_activations; refused where it would keep nothing; planned where it lives."""

from __future__ import annotations

import json

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from sft.speed.kept_attention import attention_ops, checkpoints_inside_forward, offload_prefetch
from sft.speed.layer_checkpoint import checkpoint_kwargs
from test_activation_offload import Logged
from test_long_rows import loss_and_grads, tiny_lora_model

COMPILE = torch.nn.Module.compile
CPU_ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"  # sdpa's kernel on CPU, as the profiler names it


def keep_attention(model) -> None:
    """As the Trainer applies --activation_checkpointing_kwargs (sft/options/resolve.py
    layer_checkpoints_get_their_contexts)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(keep_attention=True))


def compiled(model, monkeypatch) -> None:
    """--compile_layers' regional compile through dynamo and AOTAutograd (its partitioner applies the policy),
    without inductor's code generation (minutes on 2 CPU cores): test_activation_offload.py does the same."""
    from sft.speed.regional_compile import compile_decoder_layers

    torch._dynamo.reset()
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: COMPILE(self, backend="aot_eager", **kw))
    assert compile_decoder_layers(model) == 3


def attention_runs(model, ids) -> int:
    """How many times sdpa's kernel ran in one training step (forward and the backward's recompute), after a first
    step that compiles (tracing runs the ops on fake tensors, which the profiler records too)."""
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    return sum(event.name == CPU_ATTENTION for event in prof.events())


def assert_same(loss: float, grads: dict, want_loss: float, want: dict) -> None:
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert grads.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


IDS = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "deepseek_v2"])
def test_compiled_layers_run_attention_once_per_layer_and_give_the_plain_gradients(model_type, monkeypatch):
    """Plain checkpointing runs each layer's attention twice a step (the forward, the recompute); kept, once. The
    loss and gradients are plain checkpointing's: the backward reads the same attention output it would recompute.
    qwen2 with its MLPs tiled too, as bench row long-r1-32k-sdpa-keep runs R1-Distill-Qwen-7B (the tile's own
    checkpoints nest inside the layer's)."""
    from torch._dynamo.utils import counters

    want_loss, want = loss_and_grads(tiny_lora_model(model_type, True), IDS)
    if model_type == "llama":  # what the count below is against: plain checkpointing in compiled layers
        plain = tiny_lora_model(model_type, True)
        compiled(plain, monkeypatch)
        assert attention_runs(plain, IDS) == 2 * 3
    model = tiny_lora_model(model_type, True)
    if model_type == "qwen2":
        from sft.speed.tiled_mlp import tile_mlps

        assert tile_mlps(model, 32) == (3, 0)
    keep_attention(model)
    compiled(model, monkeypatch)
    counters.clear()
    loss, grads = loss_and_grads(model, IDS)
    assert not counters["graph_break"], list(counters["graph_break"])  # a break runs the layer eagerly
    assert_same(loss, grads, want_loss, want)
    model.zero_grad()
    assert attention_runs(model, IDS) == 3


class AttentionCount(TorchDispatchMode):
    """Counts sdpa's kernel as it reaches the dispatcher below torch's checkpoint: selective checkpointing's own mode
    (pushed later, so asked first) runs it in the forward, and serves the backward's recompute from its cache."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func in attention_ops()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep", [False, True])
def test_eager_layers_keep_attention_from_the_forward_and_give_the_plain_gradients(keep):
    want_loss, want = loss_and_grads(tiny_lora_model("llama", True), IDS)
    model = tiny_lora_model("llama", True)
    if keep:
        keep_attention(model)
    with AttentionCount() as count:
        result = loss_and_grads(model, IDS)
    assert_same(*result, want_loss, want)
    assert count.runs == 3 if keep else 2 * 3


@pytest.mark.slow
def test_under_offload_the_kept_outputs_wait_in_host_ram_and_come_back_a_layer_ahead(monkeypatch):
    """Compiled layers save the attention output and its log-sum-exp beside the checkpoint, through the offload's
    hooks: to host RAM, and, with the prefetch sft/train.py gives the Trainer for this run, each back before the
    backward asks for it (RoPE's cos and sin, saved once for all layers, come back at their first unpack)."""
    from sft.speed.activation_offload import HostCopies

    model = tiny_lora_model("llama", True)
    keep_attention(model)
    compiled(model, monkeypatch)
    shapes: dict[int, tuple[int, ...]] = {}  # position in the offload's order -> the saved tensor's shape

    class Shapes(Logged):
        def pack(self, tensor):
            saved = super().pack(tensor)
            if saved is not tensor:
                shapes.setdefault(saved.position, tuple(tensor.shape))
            return saved

    offload = Shapes(HostCopies(), device_type="cpu", min_bytes=1000, prefetch=offload_prefetch(True, True))
    model.train()
    with offload:
        loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    heads, head_dim = 4, 16  # tiny_lora_llama: 4 heads of 64 / 4
    layer_saves = {(2, 100, 64): "checkpoint", (2, heads, 100, head_dim): "attention output",
                   (2, heads, 100): "log-sum-exp"}
    kinds = [layer_saves[shape] for shape in shapes.values() if shape in layer_saves]
    assert kinds.count("attention output") == kinds.count("log-sum-exp") == 3 and kinds.count("checkpoint") >= 3
    waited = {shapes[position] for position, already in offload.unpacked if not already}
    assert not waited & layer_saves.keys(), waited


def test_one_layer_ahead_counts_the_kept_tensors_only_where_they_are_offloaded():
    from sft.speed.activation_offload import PREFETCH
    from sft.speed.kept_attention import KEPT_PER_LAYER

    assert offload_prefetch(False, True) == offload_prefetch(True, False) == offload_prefetch(False, False) == PREFETCH
    assert offload_prefetch(True, True) == PREFETCH * (1 + KEPT_PER_LAYER)


def test_transformers_checkpoints_inside_the_compiled_forward():
    """transformers >= 5.23 checkpoints each layer's forward (inside --compile_layers' compiled call); 5.17-5.22
    overrode __call__, where the checkpoint wrapped the compiled layer and kept outputs could not be offloaded."""

    class CallWrapping(torch.nn.Module):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    assert checkpoints_inside_forward()  # the installed transformers (constraints.txt)
    assert not checkpoints_inside_forward(CallWrapping)


@pytest.mark.parametrize("argv, message", [
    (["--activation_checkpointing_keep_attention", "true"], "needs --activation_checkpointing true"),
    (["--activation_checkpointing", "true", "--activation_checkpointing_keep_attention", "true",
      "--attn_implementation", "eager"], "under --attn_implementation eager it would keep nothing"),
    (["--activation_checkpointing", "true", "--activation_checkpointing_keep_attention", "true",
      "--activation_checkpointing_kwargs", '{"use_reentrant": true}'], "needs the non-reentrant checkpoint"),
])
def test_where_it_would_keep_nothing_it_is_refused_before_loading(argv, message):
    from sft.errors import ConfigError
    from sft.options.arguments import parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_with_compiled_layers_an_older_transformers_is_refused():
    from types import SimpleNamespace as NS

    from sft.errors import ConfigError
    from sft.options.checks import kept_attention_needs

    training = NS(activation_checkpointing_keep_attention=True, activation_checkpointing=True,
                  activation_checkpointing_kwargs=checkpoint_kwargs(keep_attention=True))
    o = NS(training=training, model=NS(attn_implementation="sdpa", compile_layers_on=True), lora=NS(lora=True),
           fsdp=lambda m: False)
    kept_attention_needs(o, None, inside_forward=lambda: True)
    with pytest.raises(ConfigError, match=r"needs transformers >= 5.23 .* or add --compile_layers false"):
        kept_attention_needs(o, None, inside_forward=lambda: False)


def test_the_options_are_written_as_json_with_the_policy_by_name(tmp_path):
    """The loggers write the options as JSON (TensorBoard's `args` text): the policy function by its name."""
    from sft.options.arguments import parse_args

    *_, training = parse_args(["--activation_checkpointing", "true", "--activation_checkpointing_keep_attention",
                               "true", "--output_dir", str(tmp_path / "run")])
    kwargs = training.activation_checkpointing_kwargs
    assert kwargs["context_fn"] is checkpoint_kwargs(keep_attention=True)["context_fn"]
    written = json.loads(training.to_json_string())
    assert written["activation_checkpointing_kwargs"] == {
        "use_reentrant": False, "context_fn": "sft.speed.kept_attention.keep_attention_contexts"}


def test_the_planner_counts_the_kept_outputs_where_they_wait():
    """Eager layers keep every layer's outputs on the GPU; compiled layers under --offload_activations send them to
    host RAM and bring back one layer's ahead (R1-Distill-Qwen-7B at 32k: 28 heads x (2 x 128 + 4) bytes a token)."""
    import dataclasses

    from sft.plan.long_rows import CHECKPOINTS_ON_GPU, kept_attention_bytes
    from sft.plan.memory import predict
    from sft.parallel.strategies import Setup
    from sft.plan.shapes import resolve_shape
    from sft.plan.workload import Workload

    shape = resolve_shape("r1-distill-qwen-7b")
    layer = kept_attention_bytes(shape, 32768)
    assert layer == 32768 * 28 * 260
    gib = 2 ** 30
    for compiled in (False, True):
        base = Workload("single_gpu", Setup("lora"), 1, 1, 32768, True, mlp_tile_tokens=4096,
                        offload_activations=True, compiled=compiled)
        plain, kept = predict(shape, base), predict(shape, dataclasses.replace(base, keep_attention=True))
        on_gpu = CHECKPOINTS_ON_GPU * layer if compiled else shape.layers * layer
        assert kept.allocated_gib - plain.allocated_gib == pytest.approx(on_gpu / gib, rel=1e-6)
        assert kept.parts["kept_attention"] == pytest.approx(on_gpu / gib, rel=1e-6)
        assert kept.host_gib > plain.host_gib if compiled else kept.host_gib == plain.host_gib


@pytest.mark.slow
def test_the_demo_trains_the_same_with_kept_attention_and_says_so(tmp_path, plain_lora_demo_losses):
    from conftest import lora_demo_run

    kept, stdout = lora_demo_run(tmp_path, "kept", "--activation_checkpointing_keep_attention", "true")
    assert "attention outputs kept for the backward, not recomputed (on the CPU" in stdout
    assert kept == pytest.approx(plain_lora_demo_losses, rel=1e-5)


def test_the_first_screens_memory_line_counts_the_kept_outputs():
    """The run's own prediction (sft/plan/this_run.py) keeps attention where the run does, though no plan does."""
    from types import SimpleNamespace as NS

    from sft.machine import Launch, Machine
    from sft.plan.this_run import predict_this_run

    box = Machine(gpu_names=("NVIDIA GeForce RTX 4090",), gpu_memory_gib=(23.99,), bf16=True, host_ram_gib=128,
                  launch=Launch(world_size=1, local_world_size=1, launched=True))
    lora, data = NS(qlora=False, lora=True, lora_r=16), NS(max_length=32768)
    training = NS(per_device_train_batch_size=1, gradient_accumulation_steps=1, activation_checkpointing=True,
                  torch_compile=False, offload_activations=True, activation_checkpointing_keep_attention=False)
    model = NS(model="r1-distill-qwen-7b", quantize_experts="none", fp8="false", compile_layers="false",
               mlp_tile_tokens=4096)
    plain = predict_this_run(model, lora, data, training, box)
    kept = predict_this_run(model, lora, data, NS(**{**vars(training), "activation_checkpointing_keep_attention": True}),
                            box)
    assert (plain.w.keep_attention, kept.w.keep_attention) == (False, True)
    assert kept.prediction.allocated_gib - plain.prediction.allocated_gib == pytest.approx(
        28 * 32768 * 28 * 260 / 2 ** 30, rel=1e-6)  # eager layers: every layer's outputs on the GPU
