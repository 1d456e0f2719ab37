"""Convergence check (issue 15, item 4): does a fast path LEARN as well as fp32-master AdamW? A random-init 7B run
cannot tell; a ~134M-parameter model of the deepseek-llm shape trained from scratch on real text can.

Every variant trains the same LlamaForCausalLM (hidden 768, 12 layers, 12 heads, intermediate 2048, the real
DeepSeek-Coder vocabulary: 134,499,072 parameters, 84.9M of them in the decoder layers) from the same init, on the
same batches in the same order, with the same LR schedule, in one process, one variant after another:

  ref        fp32 weights, torch AdamW (fused), bf16 autocast                    the reference
  ref-seed1  the same with seed + 1 (another init and data order)             the seed-to-seed noise
  sr8        bf16 weights, torchao 8-bit AdamW, bf16 stochastic rounding      --optim adamw_torch_8bit
  sr4        the same with 4-bit states (block 128, as sft/plan/planner.py gives it)  --optim adamw_torch_4bit
  sr16       bf16 weights, bf16 states, stochastic rounding (torchao _AdamW)
  sr16ours   the same with ours (bf16 states rounded stochastically too)  --optim adamw_bf16_sr
  bf16plain  bf16 weights, torch AdamW (fused): what TRL does                 the negative control
  fp8        fp32 weights, torchao float8 training (tensorwise) on every Linear but lm_head, bf16 autocast
  fp8rw      the same with the rowwise recipe
  fp8sr16    bf16 weights, adamw_bf16_sr, FP8 as sft/speed/fp8_training.py    --fp8 true (full), the default path
  fp8sr4     bf16 weights, the planner's lowbit4 (torchao 4-bit AdamW, block 128, stochastic rounding), FP8 as
             fp8sr16: the box's full plan (FSDP + lowbit4 + --fp8), here on one device and without compiled layers

The optimizers are built as our trainer builds them: `sft.speed.lowbit.prepare_optimizer` (torchao patches), then
`SFTTrainer.get_optimizer_cls_and_kwargs` (sft/trainer.py) and the Trainer's weight-decay grouping. A new optimizer is one entry in
OPTIMIZERS (by name) and one in VARIANTS.

Data: ../shared/datasets (alpaca_sample.json, oasst1_sample.jsonl) read by sft.data.formats (an OASST tree: one
document, each message once), each conversation rendered as plain text (turns joined by a blank line) + EOS.
Every 10th document (file order, fixed whatever the seed) is held out for eval; the rest is concatenated and cut
into rows of --seq_len, shuffled per epoch by the seed. 303,832 tokens in all, 269 training rows and 26 eval rows
of 1024: at batch 1, 500 steps are 1.86 epochs (more would measure memorisation; `epochs` is in every row, and
the train and eval curves show it).

    python bench/convergence.py --tiny --eager_optimizers --results /tmp/c.jsonl   # CPU: plumbing, all variants
    python bench/convergence.py --prepare .cache/convergence       # copy data + tokenizer for a GPU machine
    python bench/convergence.py --data_dir .cache/convergence --run_id R --results bench/results.jsonl
    python bench/convergence.py --report R --png bench/convergence.png --update_md   # table, curves, RESULTS.md
    python bench/convergence.py --report R1,R2,R3 --curves R1,R3 --png bench/convergence.png --update_md
        # the tables of several runs; the curves of R1 and R3 (default: of every run named) in one figure
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared"
RESULTS = REPO / "bench" / "results.jsonl"
RESULTS_MD = REPO / "bench" / "RESULTS.md"
DATA_FILES = ("alpaca_sample.json", "oasst1_sample.jsonl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
MD_BEGIN, MD_END = "<!-- convergence-table:begin -->", "<!-- convergence-table:end -->"
PASS_REL = 0.01  # the bar: final eval loss within 1% of ref

# deepseek-llm's architecture (LlamaForCausalLM, untied embeddings, MHA, rope 10000) at ~100M scale; vocab_size comes
# from the tokenizer's config.json (32256 for DeepSeek-Coder: its 32022 tokens padded, as the real models have it).
SHAPES = {
    "conv-134m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=12, rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-6,
                      tie_word_embeddings=False),
    # hidden 16: the 32k-wide lm_head is most of a tiny model's work, and CPUs without bf16 units run it slowly
    # under autocast; 16 is the smallest width float8's matmuls take.
    "tiny": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 tie_word_embeddings=False),
}


# ------------------------------------------------------------------------------------------------- optimizers

@dataclass(frozen=True)
class Hyper:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float


OptimizerFactory = Callable[["torch.nn.Module", Hyper], "torch.optim.Optimizer"]  # noqa: F821


def decay_groups(model, weight_decay: float) -> list[dict]:
    """The Trainer's two parameter groups (no decay on norms and biases), from its own name filter."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))  # uses no state of the Trainer
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def trainer_optimizer(optim: str, optim_args: str | None = None) -> OptimizerFactory:
    """What `sft/train.py --optim OPTIM --optim_args ARGS` builds: sft.speed.lowbit's patches, then SFTTrainer's class
    and keyword arguments for that name."""
    def build(model, hp: Hyper):
        from sft.options.arguments import SFTTrainingArguments as TrainingArguments  # ours: it also takes adamw_bf16_sr
        from sft.speed.lowbit import prepare_optimizer
        from sft.trainer import SFTTrainer

        prepare_optimizer(optim)
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, optim=optim, optim_args=optim_args, learning_rate=hp.lr,
                                     weight_decay=hp.weight_decay, adam_beta1=hp.betas[0], adam_beta2=hp.betas[1],
                                     adam_epsilon=hp.eps, report_to=[])
            cls, kwargs = SFTTrainer.get_optimizer_cls_and_kwargs(args, model)
        return cls(decay_groups(model, hp.weight_decay), **kwargs)
    return build


def torchao_adamw_sr(model, hp: Hyper):
    """bf16 states, update in fp32, written back to bf16 weights with stochastic rounding (no sft option yet)."""
    from torchao.optim import _AdamW

    return _AdamW(decay_groups(model, hp.weight_decay), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                  weight_decay=hp.weight_decay, bf16_stochastic_round=True)


def planned_optimizer(precision: str) -> OptimizerFactory:
    """What the planner's full fine-tune `precision` trains with: its options in sft/parallel/strategies.py
    PRECISION_OPTIONS (the ones its commands and the recipes give), built as `sft/train.py` builds them."""
    def build(model, hp: Hyper):
        from sft.parallel.strategies import PRECISION_OPTIONS

        options = PRECISION_OPTIONS[precision]
        return trainer_optimizer(options["optim"], options.get("optim_args"))(model, hp)
    return build


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw_torch_fused": trainer_optimizer("adamw_torch_fused"),
    "adamw_torch_8bit+sr": planned_optimizer("lowbit8"),  # --optim_args bf16_stochastic_round=True
    "adamw_torch_4bit+sr": planned_optimizer("lowbit4"),  # --optim_args bf16_stochastic_round=True,block_size=128
    "torchao_adamw_bf16+sr": torchao_adamw_sr,
    "adamw_bf16_sr": trainer_optimizer("adamw_bf16_sr"),  # ours: sft/speed/sr_adamw.py
}


def describe(optimizer) -> str:
    """What was built, for the row: class and the settings that decide the numerics."""
    settings = {k: v for k, v in optimizer.defaults.items() if k == "fused"}
    if hasattr(optimizer, "bf16_stochastic_round"):  # transformers passes strtobool's 1
        settings["bf16_stochastic_round"] = bool(optimizer.bf16_stochastic_round)
    if getattr(optimizer, "block_size", None):
        settings["block_size"] = optimizer.block_size
    listed = ", ".join(f"{k}={v}" for k, v in settings.items())
    return f"{type(optimizer).__module__}.{type(optimizer).__name__}({listed})"


@dataclass(frozen=True)
class Variant:
    weights: str  # the master weights' dtype
    optimizer: str  # a key of OPTIMIZERS
    role: str  # reference, seed (noise), candidate (must pass), control (expected to fail)
    fp8: str | None = None  # torchao float8 recipe on every Linear but lm_head
    seed_offset: int = 0


VARIANTS: dict[str, Variant] = {
    "ref": Variant("float32", "adamw_torch_fused", "reference"),
    "ref-seed1": Variant("float32", "adamw_torch_fused", "seed", seed_offset=1),
    "sr8": Variant("bfloat16", "adamw_torch_8bit+sr", "candidate"),
    "sr4": Variant("bfloat16", "adamw_torch_4bit+sr", "candidate"),
    "sr16": Variant("bfloat16", "torchao_adamw_bf16+sr", "candidate"),
    "sr16ours": Variant("bfloat16", "adamw_bf16_sr", "candidate"),
    "bf16plain": Variant("bfloat16", "adamw_torch_fused", "control"),
    "fp8": Variant("float32", "adamw_torch_fused", "candidate", fp8="tensorwise"),
    "fp8rw": Variant("float32", "adamw_torch_fused", "candidate", fp8="rowwise"),
    "fp8sr16": Variant("bfloat16", "adamw_bf16_sr", "candidate", fp8="tensorwise"),
    "fp8sr4": Variant("bfloat16", "adamw_torch_4bit+sr", "candidate", fp8="tensorwise"),
}


# ------------------------------------------------------------------------------------------------------- data

def documents(data_dir: Path, max_docs: int | None) -> list[str]:
    """Plain-text documents of both files, in file order: a conversation's turns joined by a blank line. An OASST
    tree becomes one document: our reader gives every root-to-leaf thread of it, and each message is kept once, so
    no text is repeated, within the training data or across the train/eval boundary."""
    from sft.data.formats import ReadOptions, read_conversations
    from sft.data.templates import user_text

    docs = []
    for name in DATA_FILES:
        conversations, _ = read_conversations(str(data_dir / name), None, ReadOptions(oasst_threads="all"))
        trees: dict[str, list[str]] = {}  # source (the record, or an OASST tree's root) -> its turns
        for conv in conversations:
            turns = trees.setdefault(conv["source"], [])
            texts = [user_text(m) if m["role"] == "user" else m["content"] for m in conv["messages"]]
            turns += [t for t in texts if t not in turns]
        docs += ["\n\n".join(turns) for turns in trees.values()][:max_docs]
    return docs


@dataclass
class Data:
    train: "torch.Tensor"  # [rows, seq_len]  # noqa: F821
    eval: "torch.Tensor"  # noqa: F821
    tokens: int
    vocab_size: int


def load_data(data_dir: Path, tokenizer_dir: Path, seq_len: int, eval_every: int, max_docs: int | None,
              max_eval_rows: int | None = None, compact_vocab: bool = False) -> Data:
    """compact_vocab (the CPU check): number only the token ids the data uses, densely; the same text and token
    boundaries with an embedding and lm_head a fraction of the 32k-row ones (most of a tiny model's CPU time)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    docs = documents(data_dir, max_docs)
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    vocab_size, eos = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"], tokenizer.eos_token_id
    if compact_vocab:
        used = sorted({t for doc in ids for t in doc} | {eos})
        number = {t: i for i, t in enumerate(used)}
        ids, vocab_size, eos = [[number[t] for t in doc] for doc in ids], len(used), number[eos]
    streams: dict[bool, list[int]] = {True: [], False: []}
    for i, doc in enumerate(ids):
        streams[i % eval_every == 0] += doc + [eos]

    def rows(stream: list[int]) -> torch.Tensor:
        n = len(stream) // seq_len
        return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)

    data = Data(rows(streams[False]), rows(streams[True])[:max_eval_rows], len(streams[False]) + len(streams[True]),
                vocab_size)
    if len(data.train) == 0 or len(data.eval) == 0:
        raise SystemExit(f"error: {len(docs)} documents give no full {seq_len}-token row for training or eval")
    return data


def batches(train: "torch.Tensor", batch: int, seed: int):  # noqa: F821
    """Rows in a new order every epoch (a generator seeded by seed and epoch), `batch` at a time, forever."""
    import torch

    epoch, queue = 0, []
    while True:
        while len(queue) < batch:
            g = torch.Generator().manual_seed(seed * 1000 + epoch)
            queue += torch.randperm(len(train), generator=g).tolist()
            epoch += 1
        yield train[queue[:batch]]
        queue = queue[batch:]


# ------------------------------------------------------------------------------------------------------ model

def build_model(shape: dict, vocab_size: int, variant: Variant, seed: int, device: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, attn_implementation="sdpa", use_cache=False, **shape)
    torch.manual_seed(seed)  # the init on the CPU, then cast: every variant starts from the same weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(device=device, dtype=getattr(torch, variant.weights))
    if variant.fp8:  # as `sft/train.py --fp8 true` converts: the decoder layers' Linears (lm_head stays bf16)
        from sft.speed.fp8_training import use_fp8_training

        use_fp8_training(model, variant.fp8)
    return model


def eval_loss(model, rows: "torch.Tensor", device: str, eval_batch: int) -> float:  # noqa: F821
    """Mean next-token loss over every eval row (all rows have the same length, so a mean of row-weighted means)."""
    import torch

    model.eval()
    total = 0.0
    with torch.no_grad(), torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
        for start in range(0, len(rows), eval_batch):
            chunk = rows[start:start + eval_batch].to(device)
            total += model(input_ids=chunk, labels=chunk).loss.float().item() * len(chunk)
    model.train()
    return total / len(rows)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def variant_fields(name: str, variant: Variant, seed: int) -> dict:
    return dict(variant=name, role=variant.role, seed=seed, weights=variant.weights, optimizer=variant.optimizer,
                fp8=variant.fp8)


def failed_row(name: str, variant: Variant, seed: int, exc: BaseException) -> dict:
    """The row of a variant that raised: the others still run and are recorded (one GPU call, one chance)."""
    import gc

    import torch

    traceback.print_exc()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(variant_fields(name, variant, seed), error=f"{type(exc).__name__}: {exc}"[:1000],
                final_eval_loss=None, eval_curve=[], train_curve=[], tok_s=None, wall_s=None, finite=False)


def train_variant(name: str, variant: Variant, args, data: Data, vocab_size: int) -> dict:
    """Train one variant; -> its row (without the fields that compare it to ref)."""
    import torch
    from transformers import get_scheduler

    seed = args.seed + variant.seed_offset
    model = build_model(SHAPES[args.shape], vocab_size, variant, seed, args.device)
    hp = Hyper(args.lr, args.weight_decay, (0.9, 0.95), 1e-8)
    optimizer = OPTIMIZERS[variant.optimizer](model, hp)
    scheduler = get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=args.warmup,
                              num_training_steps=args.steps, scheduler_specific_kwargs={"min_lr_rate": 0.1})
    forward = torch.compile(model) if args.compile else model
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    order = batches(data.train, args.batch, seed)
    device_type = args.device.split(":")[0]
    curve, train_curve = [[0, round(eval_loss(model, data.eval, args.device, args.eval_batch), 5)]], []
    step_time, first_interval_s, running = 0.0, None, torch.zeros((), device=args.device)
    start_wall = time.perf_counter()
    for step in range(1, args.steps + 1):
        if step % args.eval_every == 1 or args.eval_every == 1:
            sync(args.device)
            interval_start = time.perf_counter()
        rows = next(order).to(args.device, non_blocking=True)
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            loss = forward(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.detach().float()
        if step % args.eval_every == 0 or step == args.steps:
            sync(args.device)
            seconds = time.perf_counter() - interval_start
            if first_interval_s is None:
                first_interval_s = seconds  # compiles (torchao's update, torch.compile) land here: not in tok/s
            else:
                step_time += seconds
            done = step - (curve[-1][0])
            train_curve.append([step, round(running.item() / done, 5)])
            running.zero_()
            curve.append([step, round(eval_loss(model, data.eval, args.device, args.eval_batch), 5)])
            print(f"[{name}] step {step}: train {train_curve[-1][1]:.4f} eval {curve[-1][1]:.4f}", flush=True)
    wall = time.perf_counter() - start_wall
    timed_steps = args.steps - min(args.eval_every, args.steps)
    tokens_per_step = args.batch * args.seq_len
    tok_s = round(timed_steps * tokens_per_step / step_time, 1) if timed_steps and step_time else None
    row = dict(variant_fields(name, variant, seed), optimizer_built=describe(optimizer), final_eval_loss=curve[-1][1],
               eval_curve=curve, train_curve=train_curve, tok_s=tok_s,
               first_interval_s=round(first_interval_s or 0.0, 2), wall_s=round(wall, 1),
               finite=all(math.isfinite(v) for _, v in curve + train_curve))
    if args.device.startswith("cuda"):
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del model, optimizer, forward
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def compare(rows: list[dict]) -> None:
    """Add each row's ratio to ref (same seed) and the ref seed spread, the noise to judge 1% against."""
    ref = next((r for r in rows if r["role"] == "reference"), None)
    seeds = [r for r in rows if r["role"] == "seed" and r["final_eval_loss"]]
    spread = (max(abs(s["final_eval_loss"] / ref["final_eval_loss"] - 1) for s in seeds)
              if ref and ref["final_eval_loss"] and seeds else None)
    for row in rows:
        ratio = (row["final_eval_loss"] / ref["final_eval_loss"]
                 if ref and ref["final_eval_loss"] and row["final_eval_loss"] else None)
        row["ratio_to_ref"] = round(ratio, 5) if ratio else None
        row["ref_seed_spread"] = round(spread, 5) if spread is not None else None
        row["pass"] = bool(ratio and row["finite"] and abs(ratio - 1) <= PASS_REL)
        if spread is not None and ratio:  # beside the 1% bar: is it within what another seed moves ref?
            row["within_seed_spread"] = abs(ratio - 1) <= spread


# ------------------------------------------------------------------------------------------ report and files

def table(rows: list[dict]) -> str:
    head = ["variant", "role", "weights", "optimizer", "fp8", "final eval loss", "x ref", "within 1%",
            "within seed spread", "tok/s", "peak GiB", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        spread = r.get("within_seed_spread")
        cells = [r["variant"], r["role"], r["weights"], r["optimizer"], r["fp8"] or "-",
                 f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] else f"error: {r.get('error', '?')[:80]}",
                 f"{r['ratio_to_ref']:.4f}" if r.get("ratio_to_ref") else "-", "yes" if r["pass"] else "NO",
                 "-" if spread is None else "yes" if spread else "no",
                 f"{r['tok_s']:,.0f}" if r.get("tok_s") else "-", str(r.get("peak_allocated_gib", "-")),
                 str(r.get("wall_s") or "-")]
        lines.append("| " + " | ".join(cells) + " |")
    first = rows[0]
    spread = first.get("ref_seed_spread")
    lines.append("")
    lines.append(f"run {first['run_id']}: {first['date']}, commit {first['commit']}, {first['gpu']}, torch "
                 f"{first['torch']}, torchao {first['torchao']}; {first['params']:,} parameters, {first['steps']} "
                 f"steps of {first['batch']} x {first['seq_len']} tokens ({first['epochs']:.2f} epochs of "
                 f"{first['train_tokens']:,} training tokens), eval on {first['eval_tokens']:,} held-out tokens "
                 f"every {first['eval_every']} steps; lr {first['lr']} cosine to 10%, {first['warmup']} warm-up "
                 f"steps; compile {first['compile']}; {'cold' if first['cold_cache'] else 'warm'} compile cache. "
                 f"Ref seed-to-seed spread of the final eval loss: "
                 + (f"{spread:.2%}." if spread is not None else "not measured."))
    return "\n".join(lines)


@dataclass
class Curve:
    row: dict  # the first run's row of this curve
    ref: dict | None  # that run's reference row: the right panel's ratio is to it
    runs: list[str]  # every run named whose row has this variant and this eval curve


def curves(runs: list[list[dict]]) -> list[Curve]:
    """One curve per variant and eval curve over the runs' rows: a row that an earlier run recorded identically
    (the same variant, seed and steps give the same curve: ref in a run that reran it to compare against) is
    drawn once, and its label names both runs."""
    found: dict[tuple[str, str], Curve] = {}
    for rows in runs:
        ref = next((r for r in rows if r["role"] == "reference"), None)
        for r in rows:
            if not r["eval_curve"]:
                continue
            key = (r["variant"], json.dumps(r["eval_curve"]))
            if key in found:
                found[key].runs.append(r["run_id"])
            else:
                found[key] = Curve(r, ref, [r["run_id"]])
    return list(found.values())


def curves_text(runs: list[list[dict]], png: str) -> str:
    """What RESULTS.md says under the tables: which runs the curves come from, and the ones drawn once."""
    names = [rows[0]["run_id"] for rows in runs]
    shared = [f"{c.row['variant']} ({', '.join(c.runs)})" for c in curves(runs) if len(c.runs) > 1]
    text = f"The curves: run{'s' if len(names) > 1 else ''} {', '.join(names)}"
    text += (f"; each variant against its own run's ref; the same curve in several runs is drawn once: "
             f"{'; '.join(shared)}." if shared else ".")
    return f"{text}\n\n![eval curves of {', '.join(names)}]({png})"


def plot(runs: list[list[dict]], path: Path) -> None:
    """The eval curves of every run in `runs` (each a run's rows) in one figure, and each against its run's ref."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    several = len(runs) > 1
    drawn = curves(runs)
    for i, c in enumerate(drawn):
        r, ref = c.row, c.ref
        steps, losses = zip(*r["eval_curve"])
        label = f"{r['variant']} ({', '.join(c.runs)})" if several else r["variant"]
        style = dict(color=f"C{i % 10}", linestyle="--" if r["role"] in ("seed", "control") else "-",
                     marker="." if i >= 10 else None, label=label)
        left.plot(steps, losses, **style)
        if ref and r is not ref and len(r["eval_curve"]) == len(ref["eval_curve"]) > 1:
            right.plot(steps[1:], [a / b for (_, a), (_, b) in zip(r["eval_curve"][1:], ref["eval_curve"][1:])],
                       **style)
    left.set(xlabel="step", ylabel="eval loss (held-out)", title="eval loss", yscale="log")
    right.axhspan(1 - PASS_REL, 1 + PASS_REL, color="0.9", label="within 1%")
    right.set(xlabel="step", ylabel="eval loss / ref's", title="against ref (fp32 masters, its run's seed)")
    last = [r["ratio_to_ref"] for rows in runs for r in rows if r.get("ratio_to_ref")]
    if last:
        right.set_ylim(min(0.97, min(last) - 0.01), max(1.03, max(last) + 0.01))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7 if several else 8)
    first = runs[0][0]
    fig.suptitle(f"convergence, run{'s' if several else ''} {', '.join(rows[0]['run_id'] for rows in runs)} "
                 f"({first['gpu']}, {first['params'] / 1e6:.1f}M params)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_md(path: Path, text: str) -> None:
    """Replace what lies between the section's markers in RESULTS.md with `text`."""
    md = path.read_text()
    begin, end = md.find(MD_BEGIN), md.find(MD_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"error: {path} has no {MD_BEGIN} ... {MD_END} block")
    path.write_text(md[: begin + len(MD_BEGIN)] + "\n" + text + "\n" + md[end:])


def run_rows(path: Path, run_id: str) -> list[dict]:
    """The convergence rows of one run already in `path`."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("bench") == "convergence" and r.get("run_id") == run_id]


def report(args) -> int:
    """The table of each run named (comma-separated); the curves of those --curves names (default: all of them)
    in one figure."""
    names = [n for n in args.report.split(",") if n]
    drawn = [n for n in args.curves.split(",") if n] if args.curves else names
    if set(drawn) - set(names):
        print(f"error: --curves {args.curves}: name only runs that --report names", file=sys.stderr)
        return 1
    runs = {}
    for run_id in names:
        rows = run_rows(Path(args.results), run_id)
        if not rows:
            print(f"error: no convergence rows for run_id {run_id} in {args.results}", file=sys.stderr)
            return 1
        compare(rows)  # over every row of the run: a run split over several calls compares against its one ref
        runs[run_id] = rows
    text = "\n\n".join(table(rows) for rows in runs.values())
    if args.png:
        plot([runs[n] for n in drawn], Path(args.png))
        text += "\n\n" + curves_text([runs[n] for n in drawn], Path(args.png).name)
    print(text)
    if args.update_md:
        update_md(Path(args.results_md), text)
    return 0


def prepare(target: Path, data_dir: Path, tokenizer_dir: Path) -> None:
    """Copy what a run reads into one folder (a GPU machine has no ../shared): the two files and the tokenizer."""
    (target / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in DATA_FILES:
        shutil.copy(data_dir / name, target / name)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, target / "tokenizer" / name)
    print(f"copied {', '.join(DATA_FILES)} and the tokenizer to {target}: pass --data_dir {target}")


def cold_cache() -> bool:
    """True when no compile cache exists yet (inductor's and triton's): the run compiles everything."""
    inductor = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or f"/tmp/torchinductor_{os.environ.get('USER', 'root')}")
    return not inductor.exists() and not (Path.home() / ".triton" / "cache").exists()


def git_commit() -> str:
    return os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--data_dir", type=Path, default=SHARED / "datasets", help="holds " + ", ".join(DATA_FILES))
    p.add_argument("--tokenizer", type=Path, help="default: DATA_DIR/tokenizer when it exists (--prepare makes "
                                                  "it), else ../shared/tokenizers/deepseek-coder-6.7b-instruct")
    p.add_argument("--prepare", type=Path, metavar="DIR", help="copy the data and tokenizer into DIR, then exit")
    p.add_argument("--tiny", action="store_true", help="CPU check: tiny shape, 40 documents per file with the "
                   "vocabulary numbered down to the tokens they use, rows of 32, batch 2, 4 steps, eval every 2 "
                   "on 4 rows")
    p.add_argument("--shape", default="conv-134m", choices=SHAPES)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="rows per step (the data holds ~0.32M training tokens)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--eval_batch", type=int, default=8)
    p.add_argument("--eval_docs_every", type=int, default=10, help="every Nth document is held out for eval")
    p.add_argument("--max_docs", type=int, help="documents per file (default all)")
    p.add_argument("--max_eval_rows", type=int, help="eval on the first N held-out rows only (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (off: see RESULTS.md)")
    p.add_argument("--eager_optimizers", action="store_true",
                   help="run torchao's update without torch.compile: a CPU check of the plumbing (inductor's C++ "
                        "compile of each parameter shape takes minutes on 2 cores); not for measurements")
    p.add_argument("--run_id", default=dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%MZ-conv"))
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--results_md", type=Path, default=RESULTS_MD)
    p.add_argument("--png", help="write the curves here (after a run, or with --report)")
    p.add_argument("--report", metavar="RUN_ID[,RUN_ID]", help="print the tables of recorded runs (no training)")
    p.add_argument("--curves", metavar="RUN_ID[,RUN_ID]", help="with --report and --png: draw these of its runs "
                   "(default: every run it names)")
    p.add_argument("--update_md", action="store_true", help="with --report: put the table into RESULTS.md")
    args = p.parse_args(argv)
    if args.tokenizer is None:
        args.tokenizer = (args.data_dir / "tokenizer" if (args.data_dir / "tokenizer").is_dir()
                          else SHARED / "tokenizers" / "deepseek-coder-6.7b-instruct")
    if args.report:
        return report(args)
    missing = [str(f) for f in [*(args.data_dir / n for n in DATA_FILES), args.tokenizer] if not f.exists()]
    if missing:
        p.error(f"missing {', '.join(missing)}: give --data_dir (a folder made by --prepare) or run next to ../shared")
    if args.prepare:
        prepare(args.prepare, args.data_dir, args.tokenizer)
        return 0
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.tiny:
        args.shape, args.seq_len, args.batch, args.steps, args.eval_every, args.warmup = "tiny", 32, 2, 4, 2, 1
        args.max_docs, args.max_eval_rows, args.lr = args.max_docs or 40, args.max_eval_rows or 4, 3e-3

    cold = cold_cache()
    import torch
    import torchao
    import transformers

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.eager_optimizers:  # torchao calls torch.compile(fullgraph=True) at every step: hand back the function
        torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda fn: fn)
    start = time.perf_counter()
    data = load_data(args.data_dir, args.tokenizer, args.seq_len, args.eval_docs_every, args.max_docs,
                     args.max_eval_rows, compact_vocab=args.tiny)
    vocab_size = data.vocab_size
    print(f"data: {data.tokens:,} tokens, {len(data.train)} training rows and {len(data.eval)} eval rows of "
          f"{args.seq_len} ({time.perf_counter() - start:.1f} s)", flush=True)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM, LlamaConfig

        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
            LlamaConfig(vocab_size=vocab_size, **SHAPES[args.shape])).parameters())
    common = dict(bench="convergence", run_id=args.run_id, commit=git_commit(),
                  gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  torch=torch.__version__, torchao=torchao.__version__, transformers=transformers.__version__,
                  shape=args.shape, params=params, steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                  train_tokens=data.train.numel(), eval_tokens=data.eval.numel(),
                  epochs=round(args.steps * args.batch / len(data.train), 3), lr=args.lr, warmup=args.warmup,
                  eval_every=args.eval_every, compile=args.compile, cold_cache=cold)
    print(f"{params:,} parameters ({args.shape}), {args.steps} steps of {args.batch} x {args.seq_len} "
          f"({common['epochs']:.2f} epochs), device {args.device}, variants {', '.join(names)}", flush=True)
    rows, earlier = [], run_rows(args.results, args.run_id)  # a run split over calls: ref may be in an earlier one
    args.results.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        try:
            row = train_variant(name, VARIANTS[name], args, data, vocab_size)
        except Exception as exc:  # noqa: BLE001 (recorded in its row)
            row = failed_row(name, VARIANTS[name], args.seed + VARIANTS[name].seed_offset, exc)
        rows.append({**common, "date": date, **row})
        compare(earlier + rows)
        with open(args.results, "a") as f:  # row by row: a run cut short by a time limit keeps what it finished
            f.write(json.dumps(rows[-1]) + "\n")
    compare(earlier + rows)  # ref's row was written before the seed spread was known; --report recomputes it
    print(table(rows))
    if args.png:
        plot([earlier + rows], Path(args.png))
    return 0 if all(r["pass"] for r in rows if r["role"] == "candidate") else 3


if __name__ == "__main__":
    sys.exit(main())
