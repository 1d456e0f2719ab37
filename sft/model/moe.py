"""MoE training for DeepSeek-V2/V3: the router's load-balancing loss, expert-load logging, ZeRO-3 leaves.

What transformers 5.24 does for these models (models/deepseek_v2, models/deepseek_v3, modeling files): the router
(`mlp.gate`, a TopkRouter) scores the experts -- V2 with a softmax, V3 with a sigmoid plus the aux-loss-free bias
`e_score_correction_bias` (a buffer, used only to choose the experts; nothing updates it) -- and returns
`(router_logits, topk_weights, topk_indices)`. The CausalLM forward computes the cross-entropy and nothing else:
no balance loss in training, whatever the config says. `output_router_logits=True` only returns the raw logits
(DeepSeek's configs do not even have `router_aux_loss_coef`; trl's `router_aux_loss_coef` fails on V3). The
hub configs carry `aux_loss_alpha` (0.001) and `seq_aux` (true) for DeepSeek's own remote code, which kept them as
extra attributes; transformers' config keeps them too, and ignores them.

So this module adds the balance loss of DeepSeek's own training code (modeling_deepseek.py `MoEGate`, V2 paper
eq. 12-14, V3 paper eq. 17-20), per MoE layer and summed over the layers as that code does:

    L_bal = alpha * sum_layers  mean_sequences  sum_i f_i * P_i
    f_i = E / (K * T) * (tokens of the sequence routed to expert i among their top K)    (no gradient)
    P_i = 1/T * sum_t p_i,t      p = softmax(logits) (V2), sigmoid(logits) / sum_j sigmoid(logits_j) (V3)

E routed experts, K experts per token, T tokens of the sequence. A perfectly even router gives sum_i f_i P_i = 1
per layer. `seq_aux` true (DeepSeek's setting) takes the sums per sequence and averages the sequences; false takes
them over the whole micro-batch. Two choices here where DeepSeek's code has none to make:
- padding is left out (DeepSeek's code counted it), and
- a "sequence" is a document: in a packed row each document (position_ids restarting at 0) is its own sequence,
  the row's padding tail none. So the loss of a packed batch equals that of the same documents unpacked
  (tests/test_moe.py), as the cross-entropy does (tests/test_packing.py).
The gradient flows into P (the router's weights and, through the hidden states, everything below); f and the
choice of experts are constants. V3's bias stays as loaded: DeepSeek set its update speed to 0 for the last 500B
pre-training tokens, and a fine-tune that moved it would change routing outside the gradient.

How it is wired: forward hooks on each MoE block's router keep (logits, chosen experts) of one training forward
(`RouterBalance.capture`); after the forward the loss is computed from them and added to the Trainer's loss
(SFTTrainer.compute_loss, sft/trainer.py). Which tokens are real and each one's sequence come from the collator,
worked out on the host (sft/data/packing.py REAL_TOKENS, TOKEN_SEQUENCES, SEQUENCE_COUNT), and the loss picks and
counts with index_select and index_add_ into sizes the host knows: finding them on the device (token_groups: a
boolean mask, torch.unique), picking with a boolean mask per layer and counting with bincount each made the host wait
for the GPU, the first of them for the whole forward. Batches without those keys (evaluation, other callers) still
take token_groups' way, with the same results. The hooks do nothing outside `capture`, so evaluation, and
the recomputation of activation checkpointing in backward, cost nothing and count nothing. Only the models that
have DeepSeek MoE routers get hooks at all (`install_moe` returns None for dense models). Statistics since the
last log are running sums on the device (one [layers, experts] count tensor), never kept tensors, read on the host only
when a log asks for them; `MoeLoadLogger` adds them to the
Trainer's logs (hence TensorBoard) and appends each window's per-expert counts to `<output_dir>/moe_load.jsonl`.

Remote code (`--trust_remote_code`) brings DeepSeek's own MoE classes, whose V2 gate already adds its balance loss in
training: their class names differ from transformers', so no hook is installed there (no double counting).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import TrainerCallback

from sft.data.packing import REAL_TOKENS, SEQUENCE_COUNT, TOKEN_SEQUENCES
from sft.data.tokenization import IGNORE
from sft.machine import is_first_process
from sft.safety.run_dir import MOE_LOAD

# transformers' MoE blocks (V2 spells it Moe) and DeepSeek's remote-code one (ZeRO-3 leaves: all of them).
MOE_BLOCK_CLASSES = ("DeepseekV2Moe", "DeepseekV3MoE", "DeepseekV2MoE")
ROUTER_CLASSES = ("DeepseekV2TopkRouter", "DeepseekV3TopkRouter")  # transformers' routers, whose output we read
CAPTURED = "_sft_balance_capture"  # where a router keeps its output of one training forward (RouterBalance._keep)
DEFAULT_COEFFICIENT = 0.001  # DeepSeek-V2's aux_loss_alpha (the V2/V2-Lite/V3 hub configs all say 0.001)


# What DeepSpeed AutoEP puts in each MoE block's place (sft/parallel/expert_parallel.py)
AUTOEP_LAYER_CLASS = "AutoEPMoELayer"


def expert_parallel_layers(model) -> list[torch.nn.Module]:
    """The model's DeepSpeed AutoEP layers that hold a share of the experts (ep size > 1), in layer order."""
    return [m for m in model.modules() if type(m).__name__ == AUTOEP_LAYER_CLASS and getattr(m, "ep_size", 1) > 1]


def expert_parallel_line(layers: list[torch.nn.Module]) -> str:
    """One line for the first screen: what each GPU holds of the routed experts."""
    layer = layers[0]
    return (f"DeepSpeed AutoEP: {len(layers)} MoE layers, each GPU holds {layer.num_local_experts} of their "
            f"{layer.num_experts} routed experts (ep size {layer.ep_size}; tokens cross by all-to-all)")


def moe_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of every MoE block whose router is transformers' TopkRouter, in layer order."""
    return [(name, module) for name, module in model.named_modules()
            if type(module).__name__ in MOE_BLOCK_CLASSES
            and type(getattr(module, "gate", None)).__name__ in ROUTER_CLASSES]


def default_coefficient(config) -> float:
    """The config's `aux_loss_alpha` (DeepSeek's hub configs have it), else 0.001."""
    alpha = getattr(config, "aux_loss_alpha", None)
    return DEFAULT_COEFFICIENT if alpha is None else float(alpha)


def mark_moe_leaves(model) -> list[torch.nn.Module]:
    """Under DeepSpeed ZeRO-3, make each MoE block a ZeRO-3 leaf: its parameters (router, routed and shared experts)
    are gathered once when the block starts, instead of module by module as each is called. Call it right after
    the model is built, before the Trainer creates the DeepSpeed engine. -> the blocks marked ([] without ZeRO-3),
    said in one line by the first process.

    Why: ZeRO-3 gathers a module's parameters in its pre-forward hook and, in backward, expects every rank to have
    run the same modules in the same order. With one module per expert (DeepSeek's remote code), an expert that
    gets no token on one rank is never called there while another rank gathers it: the ranks wait on each other
    for ever. transformers 5 fuses each layer's experts into one module (one call whatever the routing), so its
    own classes would not hang, but the leaf still fetches the block in one go; DeepSeek's remote-code block is
    marked as well."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return []
    from deepspeed.utils import set_z3_leaf_modules

    leaves = set_z3_leaf_modules(model, list(MOE_BLOCK_CLASSES), raise_if_not_found=False)
    if leaves and is_first_process():
        print(f"ZeRO-3: {len(leaves)} MoE blocks ({type(leaves[0]).__name__}) are leaf modules: each gathered whole",
              flush=True)
    return leaves


def token_groups(inputs: dict, pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For the batch's B*L tokens (row-major, as the router sees them): which are real (not padding), and the
    sequence (document) each real one belongs to, numbered 0..S-1, and S.

    A padded batch (attention_mask): each row is a sequence, its masked positions padding. A packed batch
    (position_ids, no attention_mask; sft/data/packing.py): a document starts wherever position_ids is 0. Otherwise
    every row is one sequence. Without an attention_mask, a row's padding is its trailing run of pad ids whose labels
    are all ignored (the Collator's padding continues the row's last document: trailing_padding)."""
    ids = inputs["input_ids"]
    rows, length = ids.shape
    mask, positions, labels = inputs.get("attention_mask"), inputs.get("position_ids"), inputs.get("labels")
    if mask is not None:
        real = mask.bool()
    elif pad_token_id is not None and labels is not None:
        real = ~trailing_padding(ids, labels, pad_token_id)
    else:
        real = torch.ones(rows, length, dtype=torch.bool, device=ids.device)
    if mask is None and positions is not None:
        starts = positions.expand(rows, length) == 0
    else:
        starts = torch.zeros_like(real)
    starts[:, 0] = True
    sequence = starts.flatten().cumsum(0) - 1
    real = real.flatten()
    found, sequence = torch.unique(sequence[real], return_inverse=True)  # dense numbers over the real tokens
    return real, sequence, len(found)


def trailing_padding(ids: torch.Tensor, labels: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Each row's trailing run of pad ids with ignored labels (bool, ids' shape): the Collator's padding."""
    pad_like = (ids == pad_token_id) & (labels == IGNORE)
    return pad_like.flip(1).int().cummin(1).values.flip(1).bool()


def collated_token_groups(inputs: dict, pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """token_groups' answer with the real tokens as flat indices: from the collator's host-made keys
    (sft/data/packing.py REAL_TOKENS, TOKEN_SEQUENCES, SEQUENCE_COUNT) where the batch has them, which costs no
    wait for the device; else found from the batch (evaluation, callers with their own batches), which waits.
    The two agree but where a row's real tokens end with pad ids whose labels are ignored: the collator knows they
    are real, token_groups takes them for the row's padding."""
    if REAL_TOKENS in inputs:
        return inputs[REAL_TOKENS], inputs[TOKEN_SEQUENCES], inputs[SEQUENCE_COUNT]
    real, sequence, sequences = token_groups(inputs, pad_token_id)
    return real.nonzero().squeeze(1), sequence, sequences


def tokens_per_group(groups: torch.Tensor, size: int) -> torch.Tensor:
    """torch.bincount(groups, minlength=size) for groups in 0..size-1, without its wait: on CUDA bincount reads
    the input's largest value on the host to size its result; here the size is known."""
    return torch.zeros(size, dtype=torch.long, device=groups.device).index_add_(0, groups, torch.ones_like(groups))


def balance_loss(logits: torch.Tensor, chosen: torch.Tensor, sequence: torch.Tensor, sequences: int,
                 num_experts: int, sigmoid: bool, tokens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer: mean over sequences of sum_i f_i * P_i (module docstring), and the tokens per expert.
    `logits` [T, E] and `chosen` [T, K] of the real tokens only, `sequence` [T] numbered 0..sequences-1;
    `tokens` [S]: the tokens of each sequence (tokens_per_group(sequence, sequences): the same for every layer)."""
    top_k = chosen.shape[1]
    scores = logits.float().sigmoid() if sigmoid else logits.float().softmax(dim=-1)
    if sigmoid:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    tokens = tokens_per_group(sequence, sequences) if tokens is None else tokens
    per_sequence = tokens.clamp(min=1).to(scores.dtype)[:, None]  # [S, 1]
    probability = scores.new_zeros(sequences, num_experts).index_add_(0, sequence, scores) / per_sequence
    with torch.no_grad():
        slots = (sequence[:, None] * num_experts + chosen).flatten()
        counts = tokens_per_group(slots, sequences * num_experts).view(sequences, num_experts)
        fraction = counts.to(scores.dtype) * num_experts / (top_k * per_sequence)
    loss = (fraction * probability).sum(dim=1).mean() if sequences else scores.sum() * 0
    return loss, counts.sum(dim=0)


class RouterBalance:
    """The balance loss and the expert-load statistics of one MoE model (module docstring).

    `coefficient`: the loss's weight alpha (None: the config's aux_loss_alpha, else 0.001; 0: no loss, the load
    statistics are still kept); `per_sequence`: DeepSeek's `seq_aux` (None: the config's, else True)."""

    def __init__(self, model, coefficient: float | None = None, per_sequence: bool | None = None,
                 pad_token_id: int | None = None):
        config = model.config
        self.blocks = moe_blocks(model)
        if not self.blocks:
            raise ValueError(f"{type(model).__name__} has no DeepSeek MoE router (transformers' TopkRouter)")
        self.coefficient = default_coefficient(config) if coefficient is None else float(coefficient)
        self.per_sequence = bool(getattr(config, "seq_aux", True)) if per_sequence is None else per_sequence
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
        self.num_experts = self.blocks[0][1].gate.num_experts
        self.sigmoid = hasattr(self.blocks[0][1].gate, "e_score_correction_bias")  # V3 scores with a sigmoid
        self.layer_names = [name for name, _ in self.blocks]
        self.layer_index = [int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name)) else i
                            for i, name in enumerate(self.layer_names)]
        self._active = False
        self._captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._warned = False
        self.reset()
        self.handles = [block.gate.register_forward_hook(self._keep) for _, block in self.blocks]

    def reset(self) -> None:
        """Start a new logging window."""
        self.counts: torch.Tensor | None = None  # [layers, experts] tokens routed (top-K slots), real tokens only
        self.loss_sum = 0.0  # sums over the micro-batches of the window, as 0-d tensors (no device sync per step)
        self.balance_sum = 0.0
        self.micro_batches = 0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _keep(self, module, args, output) -> None:
        """The routers' hook: router_logits [B*L, E], topk_indices [B*L, K], kept on the router itself. One hook
        for every layer, so that a compiled decoder layer (--compile_layers) is one graph for all MoE layers: a
        hook per layer holding its index made dynamo compile each layer anew (the index is a constant to it), and
        past the cache limit (16; V2-Lite has 26 MoE layers) run the rest eagerly."""
        if self._active:
            module.__dict__[CAPTURED] = (output[0], output[2])

    def _taken(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """What the forward under `capture` kept, by MoE layer; and forget it."""
        captured, self._captured = self._captured, {}  # AutoEP's hooks (follow_expert_parallel)
        for index, (_, block) in enumerate(self.blocks):
            kept = block.gate.__dict__.pop(CAPTURED, None)
            if kept is not None:
                captured[index] = kept
        return captured

    def follow_expert_parallel(self, model) -> int:
        """Under DeepSpeed AutoEP the engine has replaced each MoE block (and its router) by an AutoEPMoELayer
        (sft/parallel/expert_parallel.py): hook its router instead, whose `gate` (a Linear) gives the logits and
        whose output the chosen experts `(top_scores, selected_experts, tokens_per_expert)`. -> the layers hooked
        (0: no AutoEP layer, the hooks stay where they were)."""
        layers = expert_parallel_layers(model)
        if not layers:
            return 0
        if len(layers) != len(self.blocks):
            raise RuntimeError(f"AutoEP replaced {len(layers)} MoE blocks of {len(self.blocks)}: the balance loss "
                               f"would miss some; this DeepSpeed version lays the model out otherwise.")
        self.remove()
        logits: dict[int, torch.Tensor] = {}

        def on_gate(index: int):
            def hook(module, args, output):
                if self._active:
                    logits[index] = output  # [B*L, E]
            return hook

        def on_router(index: int):
            def hook(module, args, output):
                if self._active:
                    self._captured[index] = (logits.pop(index), output[1])  # chosen experts [B*L, K]
            return hook

        for index, layer in enumerate(layers):
            self.handles += [layer.router.gate.register_forward_hook(on_gate(index)),
                             layer.router.register_forward_hook(on_router(index))]
        return len(layers)

    @contextmanager
    def capture(self):
        """Keep the routers' outputs of the forward passes run inside (one per micro-batch)."""
        self._taken()
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def loss(self, inputs: dict) -> torch.Tensor | None:
        """After a forward under `capture`: the balance loss to add (coefficient x sum over layers), or None when the
        coefficient is 0. Adds the micro-batch to the window's statistics either way."""
        captured = self._taken()
        if not captured:
            return None
        real, sequence, sequences = collated_token_groups(inputs, self.pad_token_id)
        if not self.per_sequence:
            sequence, sequences = torch.zeros_like(sequence), min(sequences, 1)
        tokens = tokens_per_group(sequence, sequences)
        total, layer_counts = 0.0, []
        with torch.set_grad_enabled(self.coefficient > 0 and torch.is_grad_enabled()):
            for index in range(len(self.blocks)):
                logits, chosen = captured[index]
                here = logits.device  # each layer's own under a model split over devices (`.to` of the same: no copy)
                real_here = real.to(here)  # picked by index_select: a boolean mask's result size waits for the device
                loss, counts = balance_loss(logits.index_select(0, real_here), chosen.index_select(0, real_here),
                                            sequence.to(here), sequences, self.num_experts, self.sigmoid,
                                            tokens.to(here))
                total = total + loss
                layer_counts.append(counts)
        counts = torch.stack([c.to(layer_counts[0].device) for c in layer_counts])
        self.counts = counts if self.counts is None else self.counts + counts.to(self.counts.device)
        self.balance_sum = self.balance_sum + total.detach() / len(self.blocks)
        self.micro_batches += 1
        if self.coefficient == 0:
            return None
        if not total.requires_grad and not self._warned:
            self._warned = True
            print("warning: the MoE balance loss has no gradient (routers frozen and nothing trainable below them, "
                  "or reentrant activation checkpointing): it is logged but changes nothing.", flush=True)
        aux = self.coefficient * total
        self.loss_sum = self.loss_sum + aux.detach()
        return aux

    def window(self, device=None) -> dict | None:
        """The window's numbers, summed over the ranks when torch.distributed runs (every rank must call it), then
        reset: {"aux_loss", "balance", "counts" [layers][experts]}; None when no micro-batch was seen anywhere."""
        device = device if device is not None else (self.counts.device if self.counts is not None else "cpu")
        counts = self.counts if self.counts is not None else torch.zeros(len(self.blocks), self.num_experts,
                                                                          dtype=torch.long, device=device)
        packed = torch.cat([counts.to(device=device, dtype=torch.float64).flatten(),
                            torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                                         for v in (self.loss_sum, self.balance_sum, self.micro_batches)])])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(packed)
        self.reset()
        loss_sum, balance_sum, micro_batches = packed[-3:].tolist()
        if micro_batches == 0:
            return None
        return {"aux_loss": loss_sum / micro_batches, "balance": balance_sum / micro_batches,
                "counts": packed[:-3].view(len(self.blocks), self.num_experts).round().long().tolist()}


def imbalance(counts: list[int]) -> float:
    """max/mean tokens per expert (1: even; E/K: every token on the same K experts)."""
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else 0.0


class MoeLoadLogger(TrainerCallback):
    """Adds the MoE numbers to each training log (so TensorBoard and every `report_to` logger get them):
    `moe/aux_loss` (the balance loss added to the loss, per micro-batch; only when its coefficient is not 0),
    `moe/balance` (sum_i f_i P_i per layer: 1 is even), `moe/load_imbalance_max` and `moe/load_imbalance_mean`
    (max/mean tokens per expert, the worst layer and the mean over layers), `moe/idle_experts` (experts of all
    layers that got no token), and `moe/load_imbalance/layer_<i>` per MoE layer; all over the steps since the last
    log and all ranks. The tokens per expert per layer go to `<output_dir>/moe_load.jsonl`, one line per log."""

    def __init__(self, balance: RouterBalance, write_counts: bool = True):
        self.balance = balance
        self.write_counts = write_counts

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """The engine exists now: under DeepSpeed AutoEP the routers hooked at load time have been replaced."""
        if model is not None and self.balance.follow_expert_parallel(model) and is_first_process():
            print(expert_parallel_line(expert_parallel_layers(model)), flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:  # training logs only (all ranks log them: the all-reduce is safe)
            return
        numbers = self.balance.window(device=args.device)
        if numbers is None:
            return
        if self.balance.coefficient:
            logs["moe/aux_loss"] = round(numbers["aux_loss"], 6)
        logs["moe/balance"] = round(numbers["balance"], 4)
        ratios = [imbalance(c) for c in numbers["counts"]]
        logs["moe/load_imbalance_max"] = round(max(ratios), 3)
        logs["moe/load_imbalance_mean"] = round(sum(ratios) / len(ratios), 3)
        logs["moe/idle_experts"] = sum(c == 0 for layer in numbers["counts"] for c in layer)
        for layer, ratio in zip(self.balance.layer_index, ratios):
            logs[f"moe/load_imbalance/layer_{layer}"] = round(ratio, 3)
        if self.write_counts and is_first_process() and args.output_dir:
            path = Path(args.output_dir) / MOE_LOAD
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, "tokens_per_expert":
                                    dict(zip(self.balance.layer_names, numbers["counts"]))}) + "\n")


def install_moe(model, coefficient: float | None = None, per_sequence: bool | None = None,
                pad_token_id: int | None = None) -> RouterBalance | None:
    """The RouterBalance of a DeepSeek MoE model (hooks on its routers), None for any other model (no hook)."""
    if not moe_blocks(model):
        return None
    return RouterBalance(model, coefficient, per_sequence, pad_token_id)
