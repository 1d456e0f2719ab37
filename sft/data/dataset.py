"""Data preparation, end to end: files -> conversations -> tokens -> (packed) rows, cached, with a summary.

`read_datasets` runs first and alone (no tokenizer, no model), so bad data stops the run within seconds.
`prepare` tokenizes with a batched, multi-process `datasets.map`, packs, and caches the result under a key made
of the conversations, the options, the tokenizer and this code: a second identical run loads it.
`python -m sft.data.dataset <training options>` runs both and prints the summary and --show_masks examples, loading
no model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np

from sft.options.arguments import DataArguments
from sft.data.dataset_info import sources
from sft.data.formats import PREFERENCE, DataError, ReadOptions, ReadStats, read_conversations
from sft.data.packing import pack_rows
from sft.data.chat_templates import get_template
from sft.data.tokenization import IGNORE, NOTHING_TRAINED, render_mask, tokenize_batch, tokenize_examples, tokenizer_facts

PARALLEL_FROM = 4000  # conversations; below this, starting worker processes costs more than it saves
# Conversations per map batch (one tokenizer call each). Each distinct word of a batch is tokenized once, and a
# bigger batch shares more of its words (on Alpaca records, 13 new words per record at 1,000, 10.5 at 2,000): 2,000
# took 12-15% less CPU than 1,000 (500 was ~4% slower than 1,000).
BATCH_SIZE = 2000


@dataclass
class Conversations:
    train: list[dict]
    eval: list[dict]
    stats: ReadStats  # the training datasets' (with --eval_split, the held-out eval conversations are among them)
    eval_stats: ReadStats = field(default_factory=ReadStats)  # --eval_dataset's, counted apart


def read_options(args: DataArguments) -> ReadOptions:
    return ReadOptions(skip_bad=args.skip_bad_records, oasst_threads=args.oasst_threads,
                       languages=tuple(args.oasst_lang or ()))


def read_datasets(args: DataArguments, seed: int = 0) -> Conversations:
    """Read and validate every dataset; hold out the eval split. Raises DataError for bad data."""
    options, stats, eval_stats = read_options(args), ReadStats(), ReadStats()

    def read(specs: list[str], stats: ReadStats) -> list[dict]:
        conversations = []
        for source in sources(specs, args.dataset_dir, args.dataset_format, args.dataset_columns, args.dataset_tags):
            spec = source.spec
            part, part_stats = read_conversations(spec, source.fmt, replace(options, columns=source.columns,
                                                                            tags=source.tags))
            if args.max_samples is not None and len(part) > args.max_samples:
                part_stats.capped, part_stats.kept = len(part) - args.max_samples, args.max_samples
                part = part[: args.max_samples]
            if not part:
                raise DataError(f"{spec}: no usable conversation in it ({dict(part_stats.skipped) or 'empty'}).")
            part_stats.sources.append((spec, part_stats.read, len(part)))
            stats.merge(part_stats)
            conversations += part
        return conversations

    train = read(args.dataset, stats)
    evaluation = read(args.eval_dataset, eval_stats) if args.eval_dataset else []
    if not evaluation and args.eval_split > 0:
        random.Random(seed).shuffle(train)
        n_eval = max(1, int(len(train) * args.eval_split))
        evaluation, train = train[:n_eval], train[n_eval:]
        if not train:
            raise DataError(f"--eval_split {args.eval_split} leaves no training conversation out of "
                            f"{len(evaluation)}; give more data or a smaller split.")
    return Conversations(train, evaluation, stats, eval_stats)


def training_data_hash(args: DataArguments, tokenizer, conversations: Conversations) -> str:
    """What the training rows depend on, apart from this code: the training conversations themselves (so file
    contents, hub data, the eval split and its seed, --max_samples and the reading options are all covered), the
    tokenization options, the template and the tokenizer. A run keeps it (sft/safety/trained_on.py): a resume onto
    other data is refused, and one after an upgrade of this code that prepares the same data resumes."""
    digest = hashlib.sha256()
    digest.update(json.dumps(conversations.train, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass"))
    options = {k: getattr(args, k) for k in ("max_length", "overlong", "packing", "train_on_prompt")}
    if args.mask_history:  # only when set: a run prepared before the option keeps its hash (its resume)
        options["mask_history"] = True
    digest.update(json.dumps(options, sort_keys=True).encode())
    digest.update(get_template(args.template, tokenizer).name.encode())
    digest.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else
                  repr(tokenizer).encode())
    digest.update(str((tokenizer.bos_token, tokenizer.eos_token, getattr(tokenizer, "chat_template", None))).encode())
    return digest.hexdigest()[:20]


def cache_key(args: DataArguments, tokenizer, conversations: Conversations, data_hash: str | None = None) -> str:
    """What the prepared data depends on: the training rows' hash (training_data_hash, given when already
    computed), the eval conversations and this code."""
    digest = hashlib.sha256((data_hash or training_data_hash(args, tokenizer, conversations)).encode())
    digest.update(json.dumps(conversations.eval, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass"))
    for code in sorted(Path(__file__).parent.glob("*.py")):  # every module of the data package: a change, a new cache
        digest.update(code.name.encode() + b"\0" + code.read_bytes())
    return digest.hexdigest()[:20]


def cache_dir(args: DataArguments) -> Path:
    root = args.dataset_cache_dir or Path.home() / ".cache" / "deepseek-sft" / "datasets"
    return Path(root)


def tokenize(conversations: list[dict], args: DataArguments, tokenizer, template):
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    # Only the messages (and where each came from, for errors) go to the workers. Our own cache (prepare) decides
    # reuse, so the fingerprints are made up rather than computed: that spares datasets from hashing the whole table
    # and the tokenizer.
    fingerprint = f"sft-{os.getpid()}-{id(conversations)}"
    table = datasets.Dataset(InMemoryTable(pa.table({"messages": [c["messages"] for c in conversations],
                                                     "source": [c["source"] for c in conversations]})),
                             fingerprint=fingerprint + "-messages")
    num_proc = args.num_proc if args.num_proc is not None else (os.cpu_count() or 1)
    num_proc = num_proc if len(conversations) >= PARALLEL_FROM else None
    fn = partial(tokenize_batch, tokenizer=tokenizer, template=template, max_length=args.max_length,
                 train_on_prompt=args.train_on_prompt, overlong=args.overlong, facts=tokenizer_facts(tokenizer),
                 mask_history=args.mask_history)
    return table.map(fn, batched=True, batch_size=BATCH_SIZE, num_proc=num_proc, remove_columns=table.column_names,
                     input_columns=None, new_fingerprint=fingerprint + "-tokens", desc="Tokenizing")


def finish(rows, args: DataArguments):
    """Drop what tokenization rejected; pack if asked. -> (dataset, counts by status, kept lengths).

    Works on the Arrow columns (no Python list per token), so it stays a small part of the preparation time.
    """
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    table = rows.data.table
    status = table.column("status").value_counts()
    counts = dict(zip(status.field("values").to_pylist(), status.field("counts").to_pylist()))
    lengths = table.column("length").to_numpy()
    table = table.select(["input_ids", "labels"])
    kept = lengths[lengths > 0]
    if args.packing and len(kept):
        table = pack_rows(table.column("input_ids"), table.column("labels"), args.max_length)  # skips empty rows
    elif len(kept) < len(lengths):
        table = table.filter(pa.array(lengths > 0))
    # A made-up fingerprint: hashing the whole table would cost more than packing it.
    return datasets.Dataset(InMemoryTable(table), fingerprint=f"sft-{os.getpid()}-{id(table)}-rows"), counts, kept


def prepare(args: DataArguments, tokenizer, conversations: Conversations, training_args=None,
            data_hash: str | None = None):
    """-> (train dataset, eval dataset or None, summary text). Cached; under several ranks rank 0 builds first
    and the others load its result. `data_hash`: training_data_hash's, where the caller already has it."""
    import datasets

    template = get_template(args.template, tokenizer)
    path = cache_dir(args) / cache_key(args, tokenizer, conversations, data_hash)
    first = training_args.main_process_first(desc="dataset preparation") if training_args else _nothing()
    with first:
        if (path / "summary.txt").exists():
            prepared = datasets.load_from_disk(str(path / "data"))
            summary = (path / "summary.txt").read_text() + f"\n  (prepared data loaded from the cache {path})"
        else:
            train, train_counts, train_lengths = finish(tokenize(conversations.train, args, tokenizer, template), args)
            if not len(train):
                raise DataError(f"no training example is left after tokenization ({train_counts}). Raise "
                                f"--max_length (now {args.max_length}) or use --overlong truncate.")
            parts, evaluation = {"train": train}, None
            if conversations.eval:
                parts["eval"], eval_counts, eval_lengths = finish(
                    tokenize(conversations.eval, args, tokenizer, template), args)
                if not len(parts["eval"]):
                    raise DataError(f"no eval example is left after tokenization ({eval_counts}). Raise "
                                    f"--max_length (now {args.max_length}) or use --overlong truncate.")
                evaluation = (conversations.eval_stats, eval_counts, eval_lengths)
            prepared = datasets.DatasetDict(parts)
            summary = summarize(conversations.stats, train_counts, train_lengths, train, args, template.name,
                                evaluation)
            save(prepared, summary, path)
    if args.show_masks:
        print(show_masks(conversations.train, args, tokenizer, template), flush=True)
    return prepared["train"], prepared.get("eval"), summary


def save(prepared, summary: str, path: Path) -> None:
    """Write to a staging folder, then rename: a run killed mid-write never leaves a cache entry that looks whole."""
    staging = path.with_name(path.name + f".tmp{os.getpid()}")
    prepared.save_to_disk(str(staging / "data"))
    (staging / "summary.txt").write_text(summary)
    try:
        os.rename(staging, path)
    except OSError:  # another rank or run finished first; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def summarize(stats: ReadStats, counts: dict, lengths: np.ndarray, train, args: DataArguments,
              template_name: str = "", evaluation: tuple[ReadStats, dict, np.ndarray] | None = None) -> str:
    """The training data's counts, then the eval data's apart (evaluation: its read stats, statuses, kept
    lengths), so that neither hides in the other's numbers."""
    lines = [f"Data: {stats.read} records read, {stats.kept} conversations kept" + capped(stats, args)
             + (f" (template {template_name})" if template_name else "")]
    lines += _part_lines(stats, counts, lengths, args)
    if args.packing and len(train):
        efficiency = lengths.sum() / (len(train) * args.max_length)
        lines.append(f"  packed into {len(train)} rows of {args.max_length}: packing efficiency {efficiency:.1%} "
                     f"(real tokens / row capacity)")
    if evaluation is not None:
        eval_stats, eval_counts, eval_lengths = evaluation
        lines.append(f"Eval data: {eval_stats.read} records read, {eval_stats.kept} conversations kept"
                     f"{capped(eval_stats, args)}" if args.eval_dataset else
                     f"Eval data: {sum(eval_counts.values())} of those conversations held out (--eval_split "
                     f"{args.eval_split})")
        lines += _part_lines(eval_stats, eval_counts, eval_lengths, args)
    return "\n".join(lines)


def capped(stats: ReadStats, args: DataArguments) -> str:
    """What --max_samples left out (the kept count is what trains)."""
    return f" (--max_samples {args.max_samples}: {stats.capped} more left out)" if stats.capped else ""


def _part_lines(stats: ReadStats, counts: dict, lengths: np.ndarray, args: DataArguments) -> list[str]:
    """One part's (train or eval) sources, skipped records, tokenization statuses other than ok, and tokens."""
    lines = []
    if len(stats.sources) > 1:
        lines += [f"  {spec}: {read} records read, {used} conversations used" for spec, read, used in stats.sources]
    if stats.preferred:
        lines.append(f"  {PREFERENCE}: {stats.preferred} (preference data, for DPO or a reward model: ranked "
                     f"`output` lists or chosen/rejected pairs; SFT trains on the first / the chosen reply)")
    lines += [f"  skipped ({reason}): {n}" for reason, n in sorted(stats.skipped.items()) if n]
    lines += [f"  {status}: {n}" for status, n in sorted(counts.items()) if status != "ok"]
    if len(lengths):
        p = np.percentile(lengths, [50, 90, 99]).astype(int)
        # an example is a conversation, or one per earlier reasoning turn under the R1 templates (sft/data/templates.py)
        lines.append(f"  tokens per example: p50 {p[0]}, p90 {p[1]}, p99 {p[2]}, max {lengths.max()} "
                     f"(--max_length {args.max_length}); {len(lengths)} examples, {int(lengths.sum())} tokens")
    return lines


def show_masks(conversations: list[dict], args: DataArguments, tokenizer, template) -> str:
    """The first n conversations as the model sees them, trained tokens between [[ and ]], one per document."""
    out = []
    for conversation in conversations[: args.show_masks]:
        rows = tokenize_examples(conversation["messages"], tokenizer=tokenizer, template=template,
                                 max_length=args.max_length, train_on_prompt=args.train_on_prompt,
                                 overlong=args.overlong, mask_history=args.mask_history)
        for k, row in enumerate(rows):  # several: R1 reasoning in earlier turns (sft/data/templates.py R1.examples)
            trained = sum(label != IGNORE for label in row["labels"])
            part = f" (example {k + 1} of {len(rows)})" if len(rows) > 1 else ""
            out.append(f"--- {conversation['source']}{part}: {row['length']} tokens, {trained} trained "
                       f"({row['status']}); trained tokens between [[ and ]] ---")
            out.append(render_mask(row["input_ids"], row["labels"], tokenizer) if row["length"] else
                       f"(nothing kept: {why_empty(row['status'], args.max_length)})")
    return "\n".join(out)


SHOWN = 3  # examples shown unless --show_masks is given


def data_help(wanted: str, prog: str) -> str:
    """This tool's own --help: what it does, then the options that decide the data (`all`: every option)."""
    from dataclasses import fields

    from sft.options.arguments import PARSER_TYPES, ModelArguments
    from sft.options.argv import Parser, short_help

    if wanted == "all":
        return Parser(PARSER_TYPES, prog=prog, allow_abbrev=False).format_help()
    groups = [("Model (only its tokenizer is loaded)", ModelArguments, ("model", "tokenizer", "trust_remote_code")),
              ("Data", DataArguments, tuple(f.name for f in fields(DataArguments)))]
    return short_help(groups, usage=f"usage: {prog} [training options]", intro=[
        "  reads, checks, tokenizes and packs the data exactly as training would (and caches it for it), then prints",
        f"  the summary and the first {SHOWN} examples with the trained tokens between [[ and ]] (--show_masks N: N",
        "  of them, 0: none); loads no model. It takes the training command's options (--config recipe.yaml too)."])


def why_empty(status: str, max_length: int) -> str:
    """An example with no tokens left, said as why and what to do (--show_masks)."""
    if status == "too long (dropped)":
        return (f"dropped as longer than --max_length {max_length} with no reply that fits; raise --max_length, or "
                f"--overlong cut keeps its first {max_length} tokens")
    if status == NOTHING_TRAINED:
        return (f"no reply token is left to train on (e.g. --overlong cut kept its first {max_length} tokens, all "
                "before its first reply); it is not trained")
    # A template's note as the status of an empty example: the template trains nothing of it, and says why.
    return f"{status}, and no other reply to train on; it is not trained"


def main(argv: list[str] | None = None, prog: str = "python -m sft.data.dataset") -> int:
    """`python -m sft.data.dataset <the training options>`: read, validate, tokenize and pack the data exactly as
    training would (and cache it), print the summary and --show_masks examples (SHOWN unless given), load no
    model."""
    from sft.options.arguments import parse_args
    from sft.options.argv import help_requested
    from sft.errors import UserFacingError

    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = help_requested(argv)
    if wanted:
        print(data_help(wanted, prog))
        return 0
    try:
        if not any(a.split("=")[0] == "--show_masks" for a in argv):
            argv += ["--show_masks", str(SHOWN)]
        model_args, data_args, _, training_args = parse_args(argv, data_only=True, help_command=f"{prog} --help")
        conversations = read_datasets(data_args, training_args.seed)
        from sft.model.families import refuse_unsupported
        from sft.model.loading import load_config, load_tokenizer

        refuse_unsupported(load_config(model_args))  # DeepSeek-V3.2: training's error, not data in another layout
        tokenizer = load_tokenizer(model_args)
        _, _, summary = prepare(data_args, tokenizer, conversations)
    except UserFacingError as e:  # bad options, data, a model that cannot be found
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\nstopped (Ctrl-C) while preparing the data; nothing half-written was cached (a cache entry is "
              "written whole or not at all): run the same command again.", file=sys.stderr)
        return 130
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
