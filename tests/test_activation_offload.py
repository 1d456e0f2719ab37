"""--offload_activations' saved-tensor hooks (sft/speed/activation_offload.py): on CPU through `HostCopies`, which
makes the same copies and bookkeeping as the CUDA side stream without streams; the same checks on a GPU where one
is present. Loss and gradients are the plain path's bit for bit: the copies move bytes, they compute nothing."""

from __future__ import annotations

import contextlib

import pytest
import torch

from sft.speed.activation_offload import HostCopies, Offloaded, OffloadedActivations, SideStreamCopies
from test_long_rows import loss_and_grads, tiny_lora_llama

DEVICES = ["cpu"] + ["cuda"] * torch.cuda.is_available()


def hooks(device: str, **options) -> tuple[OffloadedActivations, HostCopies | SideStreamCopies]:
    copies = HostCopies() if device == "cpu" else SideStreamCopies()
    return OffloadedActivations(copies, device_type=device, **options), copies


class Logged(OffloadedActivations):
    """Which saved tensors were unpacked, in order, and whether each was already back on the device."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unpacked: list[tuple[int, bool]] = []

    def unpack(self, saved):
        if isinstance(saved, Offloaded):
            self.unpacked.append((saved.position, saved.back is not None))
        return super().unpack(saved)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpointed_lora_model_gets_the_same_loss_and_gradients_bit_for_bit(device):
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1)).to(device)
    plain, offloaded = tiny_lora_llama(True).to(device), tiny_lora_llama(True).to(device)
    want_loss, want = loss_and_grads(plain, ids)
    offload = Logged(HostCopies() if device == "cpu" else SideStreamCopies(), device_type=device, min_bytes=10_000)
    with offload:
        offloaded.train()
        loss = offloaded(input_ids=ids, labels=ids).loss
    loss.backward()
    got = {n: p.grad for n, p in offloaded.named_parameters() if p.requires_grad}
    assert loss.item() == want_loss
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # Offloaded: the three layers' checkpoints (2 x 100 x 64 fp32, 51 kB) and the final norm's input and the logits,
    # each saved twice and copied once; only the first unpack waits for its copy, the others find theirs back.
    positions = [position for position, _ in offload.unpacked]
    assert sorted(set(positions)) == list(range(len(offload.order))) and len(offload.order) >= 4
    assert len(positions) > len(offload.order)  # tensors saved twice, copied once
    assert [already for _, already in offload.unpacked] == [False] + [True] * (len(positions) - 1)


@pytest.mark.slow
def test_compiled_layers_with_tiled_mlps_and_offloaded_checkpoints_give_the_plain_gradients(monkeypatch):
    """The long-row plan as the planner and recipes/r1-distill-qwen-7b-long.yaml run it (--compile_layers auto is on
    on GPUs): each checkpointed decoder layer compiled in place (sft/speed/regional_compile.py, the MLP tiled inside
    it: sft/speed/tiled_mlp.py) under the offloading hooks. The layers compile to one graph without a break (a
    break under checkpointing runs the whole layer eagerly) and give the plain model's loss and gradients."""
    from torch._dynamo.utils import counters

    from sft.speed.regional_compile import compile_decoder_layers
    from sft.speed.tiled_mlp import tile_mlps

    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))
    want_loss, want = loss_and_grads(tiny_lora_llama(True), ids)
    model = tiny_lora_llama(True)
    assert tile_mlps(model, 32) == (3, 0)  # before compiling, as sft/model/loading.py orders them
    torch._dynamo.reset()
    counters.clear()
    # dynamo's trace and AOTAutograd's graphs as --compile_layers makes them, without inductor's code generation
    # (1-2 minutes on 2 CPU cores with an empty cache): the graph break this guards against is dynamo's
    compile_layer = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_layer(self, backend="aot_eager", **kw))
    assert compile_decoder_layers(model) == 3
    offload = Logged(HostCopies(), device_type="cpu", min_bytes=10_000)
    model.train()
    with offload:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert not counters["graph_break"], list(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert offload.unpacked and offload.copies.to_host_count == offload.copies.to_device_count >= 3
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_each_checkpoint_comes_back_before_the_backward_asks_for_it():
    """A chain of sin: each saves its input; the backward unpacks them last first, and each unpack starts the copy
    of the one saved before it, so only the first comes back on demand."""
    offload = Logged(HostCopies(), device_type="cpu", min_bytes=1)
    x = torch.randn(8, 8, requires_grad=True)
    with offload:
        y = x
        for _ in range(5):
            y = y.sin()
    y.sum().backward()
    assert offload.unpacked == [(4, False), (3, True), (2, True), (1, True), (0, True)]
    assert offload.copies.to_host_count == offload.copies.to_device_count == 5
    expected = torch.ones(8, 8)
    for depth in range(5):  # d/dx of sin^5(x), by hand
        z = x.detach()
        for _ in range(depth):
            z = z.sin()
        expected = expected * z.cos()
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_small_tensors_parameters_and_their_views_stay_as_they_are(device):
    offload, copies = hooks(device, min_bytes=1024)
    big, small = torch.randn(16, 16, device=device), torch.randn(4, device=device)
    weight = torch.nn.Parameter(torch.randn(16, 16, device=device))
    view = weight.t()
    assert offload.pack(small) is small and offload.pack(weight) is weight and offload.pack(view) is view
    if device == "cuda":
        host = torch.randn(16, 16)
        assert offload.pack(host) is host  # not the watched device's
    assert isinstance(offload.pack(big), Offloaded)
    assert offload.pack(big) is offload.pack(big)  # saved again: one copy


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only passthrough")
def test_without_cuda_nothing_is_copied():
    offload = OffloadedActivations()
    big = torch.randn(1024, 1024)
    assert offload.pack(big) is big


@pytest.mark.parametrize("device", DEVICES)
def test_a_saved_tensor_changed_in_place_stops_the_backward_as_without_hooks(device):
    """autograd checks no version once hooks are set; ours do, for a saved tensor still alive."""
    for offload in (contextlib.nullcontext(), hooks(device, min_bytes=1)[0]):
        x = torch.randn(8, 8, device=device, requires_grad=True)
        y = x * 2
        with offload:
            z = y.sin()
        y.mul_(3)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_a_view_and_a_tensor_saved_by_two_ops_give_the_same_gradients(device):
    base = torch.randn(32, 64, device=device)

    def grads(offload):
        x = base.clone().requires_grad_()
        with offload:
            half = x[:, ::2]  # a strided view: its own elements go to host memory, not its base's
            out = (half.sin() * half.cos()).sum() + (half * half).sum()  # `half` saved by several ops
        out.backward()
        return x.grad

    offload, copies = hooks(device, min_bytes=1)
    assert torch.equal(grads(offload), grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)))
    if isinstance(copies, HostCopies):
        assert copies.to_host_count >= 1 and copies.to_device_count <= copies.to_host_count


def test_the_trainer_offloads_its_training_forward(tmp_path):
    """SFTTrainer.compute_loss under --offload_activations: the forward and the labelled-token loss run under the
    hooks (here copying on CPU), with the plain trainer's loss and LoRA gradients bit for bit."""
    from sft.options.arguments import SFTTrainingArguments
    from sft.speed.chunked_loss import chunked_causal_lm_loss
    from sft.trainer import SFTTrainer

    made: list[HostCopies] = []

    class CopyingOnCPU(SFTTrainer):
        def activation_offload(self):
            made.append(HostCopies())
            return OffloadedActivations(made[-1], device_type="cpu", min_bytes=10_000)

    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    results = []
    for trainer_class, offload in ((SFTTrainer, False), (CopyingOnCPU, True)):
        model = tiny_lora_llama(True)
        args = SFTTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                    activation_checkpointing=True, offload_activations=offload)
        trainer = trainer_class(model=model, args=args, labelled_token_loss=chunked_causal_lm_loss)
        model.train()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (want_loss, want), (got_loss, got) = results
    assert len(made) == 1 and made[0].to_host_count >= 3 and made[0].to_device_count == made[0].to_host_count
    assert got_loss == want_loss and got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # the trainer's own hooks know the model's tensors (their storages), which they leave where they are
    held = SFTTrainer.activation_offload(trainer).model_storages
    assert all(p.untyped_storage().data_ptr() in held for p in model.parameters())


def test_the_planner_counts_the_checkpoints_the_offload_keeps_on_the_gpu():
    """The layer's own checkpoint and those brought back ahead of it (sft/plan/long_rows.py has no torch import)."""
    from sft.plan.long_rows import CHECKPOINTS_ON_GPU
    from sft.speed.activation_offload import PREFETCH

    assert CHECKPOINTS_ON_GPU == 1 + PREFETCH


class HeldTranspose(torch.nn.Module):
    """A frozen linear layer that keeps its transposed weight as a plain tensor attribute and saves it for the
    backward, as --fp8's Fp8Linear does (a compiled layer saves such tensors where eager checkpointing did not)."""

    def __init__(self, n: int):
        super().__init__()
        w = torch.randn(n, n, generator=torch.Generator().manual_seed(n))
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.weight_t = w.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MatmulSavingHeld.apply(x, self.weight, self.weight_t)


class _MatmulSavingHeld(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, weight_t):
        ctx.save_for_backward(weight_t)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        (weight_t,) = ctx.saved_tensors
        return grad @ weight_t.t(), None, None


def test_the_models_own_tensors_stay_where_the_model_keeps_them():
    """What the model holds (here a transposed weight held as an attribute, as --fp8's) is not copied to host and
    back: it frees nothing. Without the model the same tensor is offloaded (the hooks' old behaviour, the control);
    the activations are offloaded either way, and the gradients are the same."""
    model = torch.nn.Sequential(HeldTranspose(64), torch.nn.ReLU(), HeldTranspose(64))
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grads, offloaded = [], []
    for given in (model, None):
        hooks = OffloadedActivations(HostCopies(), device_type="cpu", min_bytes=0, model=given)
        with hooks:
            out = model(x)
        offloaded.append(sorted(tuple(r().host.shape) for r in hooks.order if r() is not None))
        out.sum().backward()
        grads.append(x.grad.clone())
        x.grad = None
    assert offloaded[0] == [(128, 64)]  # the ReLU's output only; the held weights stay
    assert offloaded[1] == [(64, 64), (64, 64), (128, 64)]
    assert torch.equal(grads[0], grads[1])
