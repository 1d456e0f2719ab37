"""--offload_activations: what the forward saves for the backward outside the checkpointed layers (each layer's
checkpoint: its input, 0.23 GB at 32k tokens of hidden 3,584) waits in pinned host RAM, and its copies there and
back run on a side stream, beside the compute, instead of between its kernels.

torch's `save_on_cpu` copies on the compute stream: the forward's next kernels queue behind each copy to host, and
in the backward each layer's behind its checkpoint's copy back, which starts only when the backward asks for it
(the long rows of bench/RESULTS.md: 2 x 0.23 GB per layer per step in which the GPU computes nothing). Here (the way
torchtune's OffloadActivations works; a smaller one):

- pack: the copy stream waits for the compute stream (the tensor is written), copies the tensor into pinned host
  memory (non_blocking), and the tensor's GPU memory is marked in use by the copy stream (`record_stream`): the
  caching allocator hands it to no one until the copy has finished, however soon the forward lets go of it;
- unpack: the tensor comes back on the copy stream into memory of the compute stream, and the compute stream waits
  for that copy only; a tensor's first unpack also starts bringing back the `prefetch` tensors saved just before it
  (the backward asks for them in reverse order), so the next layer's checkpoint crosses PCIe while this one computes.

Left as they are, on the GPU: tensors under `min_bytes` (the copy would cost more than it frees), tensors of other
devices, parameters and their views (their memory stays on the GPU anyway), the model's other tensors (`model`:
its buffers and the tensors its modules hold as plain attributes, such as `--fp8`'s transposed e4m3 weights; a
compiled layer saves those for its backward, where eager checkpointing saved only the layer's input: copied to host
and back at every step they freed nothing, took host RAM and PCIe time, and each came back as a new GPU copy),
tensor subclasses and sparse tensors.
A tensor saved twice (a norm's input by two of its ops) is copied once, and comes back once for all its unpacks.
autograd stops checking saved tensors' versions once hooks are set (saved_variable.cpp: "we can't track versions
through the hooks"), so the unpack checks them: a saved tensor still alive and changed in place since stops the
backward with autograd's own error.

On a machine without CUDA nothing is offloadable and the hooks hand every tensor back as it is. `HostCopies` runs
the same bookkeeping with plain CPU copies, so tests exercise it on CPU (tests/test_activation_offload.py).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.autograd.graph import saved_tensors_hooks

from sft.safety.private_names import TENSOR_BASE, TENSOR_VERSION, expect

MIN_BYTES = 1 << 20  # a smaller tensor frees little GPU memory for two copies (torchtune's threshold is 1 KiB)
# Saved tensors brought back ahead of the backward's asking: the next layer's checkpoint, on the GPU while this
# layer's backward runs (0.23 GB at 32k tokens of R1-Distill-Qwen-7B). The planner counts it (sft/plan/long_rows.py
# CHECKPOINTS_ON_GPU = 1 + PREFETCH; tests/test_activation_offload.py keeps the two equal).
PREFETCH = 1


class Copies(Protocol):
    """How a saved tensor goes to host memory and back."""

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
        """The tensor back on `device`, and what the compute stream must wait for before reading it."""

    def wait(self, ready: object) -> None: ...


@functools.cache
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU, made once for the process."""
    return torch.cuda.Stream(device)


class SideStreamCopies:
    """CUDA: copies on a side stream, ordered against the compute stream by waits on both sides."""

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        stream = copy_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the forward has written it
        with torch.cuda.stream(stream):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is reused only after this copy, whenever the forward drops it
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
        compute, stream = torch.cuda.current_stream(device), copy_stream(device)
        # Allocated on the compute stream, which frees it when the backward is done with it; the copy waits for
        # what the compute stream has queued, which may still read the memory this allocation reuses.
        back = torch.empty_like(host, device=device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            back.copy_(host, non_blocking=True)
            ready = stream.record_event()
        back.record_stream(stream)  # a prefetched tensor the backward never asks for is freed without a wait
        return back, ready

    def wait(self, ready: torch.cuda.Event) -> None:
        torch.cuda.current_stream().wait_event(ready)


@dataclass
class HostCopies:
    """CPU stand-in for tests: plain copies into new memory (no streams to order), counted."""

    to_host_count: int = 0
    to_device_count: int = 0

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        self.to_host_count += 1
        return torch.empty_like(tensor, device="cpu").copy_(tensor)

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, None]:
        self.to_device_count += 1
        return torch.empty_like(host, device=device).copy_(host), None

    def wait(self, ready: None) -> None:
        pass


@dataclass(eq=False)
class Offloaded:
    """One saved tensor in host memory: what autograd keeps in its place until the backward unpacks it."""

    host: torch.Tensor
    device: torch.device
    source: weakref.ref  # the saved tensor, while something else keeps it alive
    version: int  # its version counter when saved
    position: int  # in the order of saving, for the prefetch
    saves: int = 1  # how many saves share this copy
    unpacks: int = 0
    back: tuple[torch.Tensor, object] | None = field(default=None, repr=False)  # on the GPU again, or on its way


class OffloadedActivations(saved_tensors_hooks):
    """Context manager: saved tensors of `device_type` of at least `min_bytes` wait in host memory (see the module
    docstring). `copies`: SideStreamCopies where CUDA is available, else none are made."""

    def __init__(self, copies: Copies | None = None, device_type: str = "cuda", min_bytes: int = MIN_BYTES,
                 prefetch: int = PREFETCH, model: torch.nn.Module | None = None):
        expect(TENSOR_VERSION)
        expect(TENSOR_BASE)
        self.copies = copies if copies is not None else SideStreamCopies()
        self.device_type = device_type if copies is not None or torch.cuda.is_available() else "none"
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.model_storages = model_storages(model) if model is not None else frozenset()
        self.order: list[weakref.ref] = []  # every Offloaded of this forward, weakly: autograd owns them
        self.by_id: dict[int, weakref.ref] = {}  # id(saved tensor) -> its Offloaded, for a tensor saved again
        super().__init__(self.pack, self.unpack)

    def offloadable(self, tensor: torch.Tensor) -> bool:
        return (type(tensor) is torch.Tensor and tensor.device.type == self.device_type  # noqa: E721 (no subclass)
                and tensor.layout == torch.strided and not isinstance(tensor._base, torch.nn.Parameter)
                and tensor.numel() * tensor.element_size() >= self.min_bytes
                and tensor.untyped_storage().data_ptr() not in self.model_storages)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | Offloaded:
        if not self.offloadable(tensor):
            return tensor
        known = self.by_id.get(id(tensor), lambda: None)()
        if known is not None and known.source() is tensor and known.version == tensor._version:
            known.saves += 1
            return known
        saved = Offloaded(self.copies.to_host(tensor), tensor.device, weakref.ref(tensor), tensor._version,
                          len(self.order))
        self.order.append(weakref.ref(saved))
        self.by_id[id(tensor)] = weakref.ref(saved)
        return saved

    def unpack(self, saved: torch.Tensor | Offloaded) -> torch.Tensor:
        if not isinstance(saved, Offloaded):
            return saved
        source = saved.source()
        if source is not None and source._version != saved.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a tensor of shape {list(source.shape)} saved at version {saved.version} is at version "
                f"{source._version} (--offload_activations held it in host memory; sft/speed/activation_offload.py)")
        back, ready = saved.back or self.copies.to_device(saved.host, saved.device)
        self.copies.wait(ready)
        saved.unpacks += 1
        # Kept on the GPU while more saves of it are still to be unpacked in this backward, else handed over.
        saved.back = (back, ready) if saved.unpacks < saved.saves else None
        if saved.unpacks == 1:
            self.bring_back_before(saved.position)
        return back

    def bring_back_before(self, position: int) -> None:
        """Start copying back the tensors saved just before `position`: the backward asks for them next."""
        for ref in reversed(self.order[max(0, position - self.prefetch):position]):
            earlier = ref()
            if earlier is not None and earlier.back is None and earlier.unpacks < earlier.saves:
                earlier.back = self.copies.to_device(earlier.host, earlier.device)


def model_storages(model: torch.nn.Module) -> frozenset[int]:
    """The storages of every tensor `model` holds: parameters, buffers and plain tensor attributes of its modules.
    A saved tensor in one of them stays where the model keeps it anyway. Read at each forward: cheap next to it
    (one pass over the modules' attributes), and right if a tensor was replaced since."""
    held = [*model.parameters(), *model.buffers(),
            *(v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor))]
    return frozenset(t.untyped_storage().data_ptr() for t in held if t.device.type != "meta")
