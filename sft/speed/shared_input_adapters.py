"""Under --compile_layers with LoRA: the adapters that read the same input share one down-projection matmul.

q_proj, k_proj and v_proj read the same normed hidden states, and so do gate_proj and up_proj: peft gives each its
own `lora_A`, so a layer's forward reads each of those [tokens, hidden] inputs 3 (or 2) times for rank-16 matmuls
that are all memory traffic, and its backward reads them as often again for the A gradients and writes as many
[tokens, hidden] input gradients, summed afterwards. Here the A weights of the adapters that read one input are
concatenated in the compiled graph and applied as one matmul (x @ [A_q; A_k; A_v]^T, split into the three rank-r
results): one read of x each way and one input gradient. What each adapter computes is unchanged but for the
rounding of bf16 sums (the input gradient is summed inside one matmul instead of after three); its parameters,
state dict and saved adapter are peft's own.

An inductor graph pass (`torch._inductor.config.pre_grad_custom_pass`, inductor's hook for passes of one's own on the
graph before autograd is traced; checked as a private name, sft/safety/private_names.py), so the backward follows
from autograd; eager runs are untouched.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Hashable

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from sft.safety.private_names import PRE_GRAD_CUSTOM_PASS, expect

LINEAR = torch.nn.functional.linear  # what dynamo records for nn.Linear's forward too
MAX_RANK = 256  # a weight of at most this many rows, and fewer than its columns: an adapter's down-projection


def _low_rank_weight(node: object) -> torch.Tensor | None:
    """The example value of a trained 2-D weight that is a graph input (a parameter), else None."""
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return None
    value = node.meta.get("example_value", None)
    return value if isinstance(value, torch.Tensor) and value.requires_grad and value.dim() == 2 else None


def _bias_free_linear(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is LINEAR and len(node.args) >= 2
            and (node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")) is None)


def down_projection(node: fx.Node) -> torch.dtype | None:
    """An adapter's down-projection: a bias-free linear of a trained weight [r, in] (r <= MAX_RANK, r < in) whose
    only use is the adapter's up-projection, a bias-free linear of a trained weight [out, r] (LoRA's A, then B).
    -> A's dtype (adapters share a matmul only with adapters of their dtype); None for anything else, such as a
    model's own k/v projections under grouped-query attention, which are narrow too."""
    if not _bias_free_linear(node) or not isinstance(node.args[0], fx.Node):
        return None
    a = _low_rank_weight(node.args[1])
    if a is None or not a.shape[0] <= min(MAX_RANK, a.shape[1] - 1) or len(node.users) != 1:
        return None
    up = next(iter(node.users))
    b = _low_rank_weight(up.args[1]) if _bias_free_linear(up) and up.args[0] is node else None
    return a.dtype if b is not None and b.shape[1] == a.shape[0] else None


def same_input(x: fx.Node) -> Hashable:
    """What the input is: the node, or for a cast `x.to(dtype)` the cast's source and arguments. Adapters that
    cast their input each (sft/speed/traced_param_lora.py, as peft does) read one input through casts of their own."""
    if x.op == "call_method" and x.target == "to" and all(isinstance(a, Hashable) for a in x.args):
        return "to", x.args, tuple(sorted(x.kwargs.items()))
    return x


def share_inputs(graph: fx.Graph) -> int:
    """Fuse the down-projections that read one input; -> how many matmuls were removed."""
    by_input: dict[tuple[Hashable, torch.dtype], list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if (dtype := down_projection(node)) is not None:
            by_input[same_input(node.args[0]), dtype].append(node)
    removed = 0
    for nodes in by_input.values():
        if len(nodes) < 2:
            continue
        x = nodes[0].args[0]  # defined before the first down-projection, which comes first in the graph
        others = {node.args[0] for node in nodes} - {x}  # the other casts, unused once their matmuls are gone
        weights = [node.args[1] for node in nodes]
        ranks = [w.meta["example_value"].shape[0] for w in weights]
        with graph.inserting_before(nodes[0]):  # weights are placeholders and x comes first: all defined here
            stacked = graph.call_function(torch.cat, (weights,), {"dim": 0})
            fused = graph.call_function(LINEAR, (x, stacked))
            parts = graph.call_function(torch.split, (fused, ranks), {"dim": -1})
            for i, node in enumerate(nodes):
                node.replace_all_uses_with(graph.call_function(operator.getitem, (parts, i)))
        for node in nodes:
            graph.erase_node(node)
        for cast in others:
            if not cast.users:
                graph.erase_node(cast)
        removed += len(nodes) - 1
    return removed


class SharedInputAdapters(CustomGraphPass):
    """share_inputs as inductor's pre-grad pass; its uuid (this file's hash) keys inductor's compile cache."""

    def __call__(self, graph: fx.Graph) -> None:
        share_inputs(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def install() -> None:
    """Set the pass on inductor's config for the compiles that follow, unless a pass of the user's own is set
    there: theirs is kept."""
    current = expect(PRE_GRAD_CUSTOM_PASS)
    if current is None or isinstance(current, SharedInputAdapters):
        torch._inductor.config.pre_grad_custom_pass = SharedInputAdapters()
