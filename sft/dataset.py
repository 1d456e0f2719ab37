"""Data preparation, end to end: files -> conversations -> tokens -> (packed) rows, cached, with a summary.

`read_datasets` runs first and alone (no tokenizer, no model), so bad data stops the run within seconds.
`prepare` tokenizes with a batched, multi-process `datasets.map`, packs, and caches the result under a key made
of the data files' contents, the options, the tokenizer and this code: a second identical run loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

from sft.config import DataArguments
from sft.formats import DataError, ReadOptions, ReadStats, is_local, read_conversations
from sft.packing import pack_rows
from sft.templates import get_template
from sft.tokenization import render_mask, tokenize_batch

CODE = ("formats.py", "templates.py", "tokenization.py", "packing.py", "dataset.py")
PARALLEL_FROM = 4000  # conversations; below this, starting worker processes costs more than it saves


@dataclass
class Conversations:
    train: list[dict]
    eval: list[dict]
    stats: ReadStats


def read_options(args: DataArguments) -> ReadOptions:
    return ReadOptions(skip_bad=args.skip_bad_records, oasst_threads=args.oasst_threads,
                       languages=tuple(args.oasst_lang or ()))


def read_datasets(args: DataArguments, seed: int = 0) -> Conversations:
    """Read and validate every dataset; hold out the eval split. Raises DataError for bad data."""
    options, stats = read_options(args), ReadStats()

    def read(specs: list[str]) -> list[dict]:
        conversations = []
        for spec in specs:
            part, part_stats = read_conversations(spec, args.dataset_format, options)
            if args.max_samples is not None:
                part = part[: args.max_samples]
            if not part:
                raise DataError(f"{spec}: no usable conversation in it ({dict(part_stats.skipped) or 'empty'}).")
            stats.merge(part_stats)
            conversations += part
        return conversations

    train = read(args.dataset)
    evaluation = read(args.eval_dataset) if args.eval_dataset else []
    if not evaluation and args.eval_split > 0:
        random.Random(seed).shuffle(train)
        n_eval = max(1, int(len(train) * args.eval_split))
        evaluation, train = train[:n_eval], train[n_eval:]
    return Conversations(train, evaluation, stats)


def cache_key(args: DataArguments, tokenizer, template_name: str) -> str:
    digest = hashlib.sha256()
    for spec in [*(args.dataset or []), "|eval|", *(args.eval_dataset or [])]:
        digest.update(spec.encode())
        if is_local(spec) and os.path.isfile(spec):
            digest.update(hashlib.sha256(Path(spec).read_bytes()).digest())
    options = {k: v for k, v in asdict(args).items() if k not in ("num_proc", "dataset_cache_dir", "show_masks")}
    digest.update(json.dumps(options, sort_keys=True).encode())
    digest.update(template_name.encode())
    digest.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else
                  repr(tokenizer).encode())
    digest.update(str((tokenizer.bos_token, tokenizer.eos_token, getattr(tokenizer, "chat_template", None))).encode())
    here = Path(__file__).parent
    for name in CODE:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:20]


def cache_dir(args: DataArguments) -> Path:
    root = args.dataset_cache_dir or Path.home() / ".cache" / "deepseek-sft" / "datasets"
    return Path(root)


def tokenize(conversations: list[dict], args: DataArguments, tokenizer, template):
    import datasets

    table = datasets.Dataset.from_list(conversations)
    num_proc = args.num_proc if args.num_proc is not None else (os.cpu_count() or 1)
    num_proc = num_proc if len(conversations) >= PARALLEL_FROM else None
    fn = partial(tokenize_batch, tokenizer=tokenizer, template=template, max_length=args.max_length,
                 train_on_prompt=args.train_on_prompt, overlong=args.overlong)
    return table.map(fn, batched=True, batch_size=500, num_proc=num_proc, remove_columns=table.column_names,
                     desc="Tokenizing")


def finish(rows, args: DataArguments):
    """Drop what tokenization rejected; pack if asked. -> (dataset, counts by status, kept lengths)."""
    import datasets

    statuses = rows["status"]
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    lengths = np.asarray(rows["length"])
    rows = rows.select(np.flatnonzero(lengths > 0)).remove_columns(["status", "length"])
    kept = lengths[lengths > 0]
    if args.packing and len(rows):
        rows = datasets.Dataset.from_dict(pack_rows(rows["input_ids"], rows["labels"], args.max_length))
    return rows, counts, kept


def prepare(args: DataArguments, tokenizer, conversations: Conversations, training_args=None):
    """-> (train dataset, eval dataset or None, summary text). Cached; under several ranks rank 0 builds."""
    import datasets

    template = get_template(args.template, tokenizer)
    path = cache_dir(args) / cache_key(args, tokenizer, template.name)
    first = training_args.main_process_first(desc="dataset preparation") if training_args else _nothing()
    with first:
        if (path / "summary.txt").exists():
            prepared = datasets.load_from_disk(str(path / "data"))
            summary = (path / "summary.txt").read_text() + f"\n(prepared data loaded from the cache {path})"
        else:
            train, train_counts, train_lengths = finish(tokenize(conversations.train, args, tokenizer, template), args)
            parts = {"train": train}
            if conversations.eval:
                parts["eval"], _, _ = finish(tokenize(conversations.eval, args, tokenizer, template), args)
            prepared = datasets.DatasetDict(parts)
            summary = summarize(conversations.stats, train_counts, train_lengths, train, args)
            if not len(train):
                raise DataError(f"no training example is left after tokenization: {train_counts}. "
                                f"Raise --max_length or use --overlong truncate.")
            staging = path.with_name(path.name + f".tmp{os.getpid()}")
            prepared.save_to_disk(str(staging / "data"))
            (staging / "summary.txt").write_text(summary)
            try:
                os.rename(staging, path)
            except OSError:
                pass  # an identical copy is already there
    if args.show_masks:
        print(show_masks(prepared["train"], tokenizer, args.show_masks))
    return prepared["train"], prepared.get("eval"), summary


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def summarize(stats: ReadStats, counts: dict, lengths: np.ndarray, train, args: DataArguments) -> str:
    lines = [f"Data: {stats.read} records read, {stats.kept} conversations kept"]
    lines += [f"  skipped ({reason}): {n}" for reason, n in sorted(stats.skipped.items())]
    lines += [f"  {status}: {n}" for status, n in counts.items() if status != "ok"]
    if len(lengths):
        p = np.percentile(lengths, [50, 90, 99]).astype(int)
        lines.append(f"  tokens per conversation: p50 {p[0]}, p90 {p[1]}, p99 {p[2]}, max {lengths.max()} "
                     f"(--max_length {args.max_length})")
    if args.packing and len(train):
        efficiency = lengths.sum() / (len(train) * args.max_length)
        lines.append(f"  packed {len(lengths)} conversations into {len(train)} rows: {efficiency:.1%} of tokens real")
    return "\n".join(lines)


def show_masks(rows, tokenizer, n: int) -> str:
    out = []
    for i in range(min(n, len(rows))):
        row = rows[i]
        out.append(f"--- example {i} ({len(row['input_ids'])} tokens; trained tokens between [[ and ]]) ---")
        out.append(render_mask(row["input_ids"], row["labels"], tokenizer))
    return "\n".join(out)
