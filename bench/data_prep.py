"""Data preparation speed: ours vs TRL 1.16 SFTTrainer's, on 52,000 Alpaca records, in the same run.

Both sides start from the same records in memory and end with packed training rows (input_ids, labels and
document boundaries) of at most --max_length tokens, with the DeepSeek-Coder chat template (the tokenizer's own),
assistant-only labels, best-fit-decreasing packing and 2 worker processes:

- ours: records -> conversations (sft.data.formats) -> template + tokenize + mask (sft.data.tokenization, datasets.map)
  -> pack (sft.data.packing), i.e. what `sft.data.dataset.prepare` runs, without its cache;
- TRL: records -> `messages` -> `SFTTrainer._prepare_dataset` with SFTConfig(packing=True, max_length=...,
  assistant_only_loss=True, dataset_num_proc=2): the preparation SFTTrainer.__init__ runs before training. It needs
  `{% generation %}` markers for assistant_only_loss, so it gets the same template with those markers added (the
  rendered text is identical; checked below).

    python bench/data_prep.py                 # prints timings; the last line is speedup_vs_trl=X.XX
    python bench/data_prep.py --record        # also appends to bench/results.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared"
ALPACA = SHARED / "datasets" / "alpaca_sample.json"
TOKENIZER = SHARED / "tokenizers" / "deepseek-coder-6.7b-instruct"


def with_generation_markers(template: str) -> str:
    """The coder template with TRL's `{% generation %}` markers around what the assistant writes."""
    turn = "{{'### Response:\\n' + message['content'] + '\\n<|EOT|>\\n'}}"
    assert turn in template, "unexpected deepseek-coder chat template"
    marked = ("{{'### Response:\\n'}}{% generation %}{{message['content'] + '\\n<|EOT|>'}}{% endgeneration %}"
              "{{'\\n'}}")
    return template.replace(turn, marked)


def trl_messages(records: list) -> list[dict]:
    """Alpaca records as TRL's conversational rows: the conversations our reader makes of them (an Alpaca input
    joins its instruction; placeholders dropped), as `messages` (also bench/train_throughput.py's TRL rows)."""
    from sft.data.formats import alpaca_conversation
    from sft.data.templates import user_text

    return [{"messages": [{"role": m["role"], "content": user_text(m) if m["role"] == "user" else m["content"]}
                          for m in alpaca_conversation(r, "")["messages"]]} for r in records]


def distinct_copy(record: dict, i: int, period: int) -> dict:
    """Record i of the repeated list, made distinct from every other copy: the same words (so the same kind of
    text for the tokenizer), in another order in each field; the first copy is left as it is."""
    import random

    if i < period:
        return record
    rng = random.Random(i)

    def shuffled(text: str) -> str:
        words = text.split(" ")
        rng.shuffle(words)
        return " ".join(words)

    return {key: shuffled(value) if isinstance(value, str) else value for key, value in record.items()}


def ours_prepare(records: list, tokenizer, max_length: int, num_proc: int):
    from sft.options.arguments import DataArguments
    from sft.data.dataset import finish, tokenize
    from sft.data.formats import ReadOptions, ReadStats, convert_records
    from sft.data.chat_templates import get_template

    args = DataArguments(dataset=["bench"], template="deepseek_coder", max_length=max_length, packing=True,
                         num_proc=num_proc)
    # What the reader does with the records of a file (sft.data.formats.read_conversations), from memory.
    conversations = convert_records(((r, f"bench:{i}") for i, r in enumerate(records)), "alpaca", ReadStats(),
                                    ReadOptions())
    template = get_template(args.template, tokenizer)
    rows, counts, lengths = finish(tokenize(conversations, args, tokenizer, template), args)
    return rows


def trl_prepare(messages: list, tokenizer, max_length: int, num_proc: int, workdir: str):
    import datasets
    from trl import SFTConfig, SFTTrainer

    dataset = datasets.Dataset.from_list(messages)
    config = SFTConfig(output_dir=workdir, packing=True, max_length=max_length, assistant_only_loss=True,
                       dataset_num_proc=num_proc, bf16=False, report_to=[], shuffle_dataset=False)

    class Stub:  # the three attributes _prepare_dataset reads from a constructed SFTTrainer
        _tokenizer = tokenizer
        chat_template = None  # the template already has generation markers
        completion_only_loss = False

    return SFTTrainer._prepare_dataset(Stub(), dataset, tokenizer, config, packing=True, formatting_func=None,
                                       dataset_name="train")


def totals(rows) -> tuple[int, int]:
    """(tokens, trained tokens): both sides must do the same work and train on the same tokens."""
    table = rows.with_format("arrow")[:]
    ids = table.column("input_ids").combine_chunks().flatten()
    labels = table.column("labels").combine_chunks().flatten().to_numpy()
    return len(ids), int((labels != -100).sum())


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished workers: the work done, whatever else runs."""
    import resource

    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=26, help="copies of the 2,000 shared records (26: 52,000)")
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--num_proc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of each side; the best counts")
    parser.add_argument("--record", action="store_true", help="append the result to bench/results.jsonl")
    parser.add_argument("--distinct", action="store_true",
                        help="make every record distinct (in copies after the first, the words of each field are "
                             "shuffled, differently per record): checks that no speed-up depends on repetition")
    args = parser.parse_args()

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    # Parallelism comes from the 2 worker processes on both sides, not from extra tokenizer threads.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load_before = os.getloadavg()[0]
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_caching()  # neither side may reuse an earlier run's map results
    records = json.loads(ALPACA.read_text()) * args.repeat
    if args.distinct:
        records = [distinct_copy(r, i, len(records) // args.repeat) for i, r in enumerate(records)]
    n_distinct = len({json.dumps(r, sort_keys=True) for r in records})
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    trl_tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    trl_tokenizer.chat_template = with_generation_markers(tokenizer.chat_template)
    sample = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert trl_tokenizer.apply_chat_template(sample, tokenize=False) == tokenizer.apply_chat_template(
        sample, tokenize=False)

    messages = trl_messages(records)
    import sft.data.dataset  # noqa: F401  (imports are not preparation: both sides import before the clock starts)
    import trl

    our_times, trl_times, our_cpu, trl_cpu = [], [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.rounds):  # interleaved, so that load from other processes hits both sides alike
            start, cpu = time.perf_counter(), cpu_seconds()
            our_rows = ours_prepare(records, tokenizer, args.max_length, args.num_proc)
            our_times.append(time.perf_counter() - start)
            our_cpu.append(cpu_seconds() - cpu)
            start, cpu = time.perf_counter(), cpu_seconds()
            trl_rows = trl_prepare(messages, trl_tokenizer, args.max_length, args.num_proc, workdir)
            trl_times.append(time.perf_counter() - start)
            trl_cpu.append(cpu_seconds() - cpu)
    our_s, trl_s = min(our_times), min(trl_times)
    load_after = os.getloadavg()[0]
    our_tokens, our_trained = totals(our_rows)
    trl_tokens, trl_trained = totals(trl_rows)
    assert (our_tokens, our_trained) == (trl_tokens, trl_trained), "the two sides did not prepare the same data"

    print(f"records: {len(records)} ({n_distinct} distinct), max_length {args.max_length}, num_proc {args.num_proc}, "
          f"cores {os.cpu_count()}, "
          f"best of {args.rounds} interleaved rounds; 1-min load average {load_before:.1f} -> {load_after:.1f}")
    print(f"ours: {our_s:.2f} s (rounds: {', '.join(f'{t:.2f}' for t in our_times)}; CPU "
          f"{', '.join(f'{t:.1f}' for t in our_cpu)} s), {len(our_rows)} packed rows, {our_tokens} tokens, "
          f"{our_trained} trained")
    print(f"trl:  {trl_s:.2f} s (rounds: {', '.join(f'{t:.2f}' for t in trl_times)}; CPU "
          f"{', '.join(f'{t:.1f}' for t in trl_cpu)} s), {len(trl_rows)} packed rows, {trl_tokens} tokens, "
          f"{trl_trained} trained")
    print(f"median wall-clock ratio {statistics.median(trl_times) / statistics.median(our_times):.2f}, "
          f"CPU-time ratio {statistics.median(trl_cpu) / statistics.median(our_cpu):.2f}")
    speedup = trl_s / our_s
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        now = datetime.datetime.now(datetime.timezone.utc)
        line = {"bench": "data_prep", "date": now.isoformat(timespec="seconds"),
                "commit": commit, "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}",
                "records": len(records), "max_length": args.max_length, "num_proc": args.num_proc,
                "rounds": args.rounds, "ours_s": round(our_s, 2), "trl_s": round(trl_s, 2),
                "ours_rows": len(our_rows), "trl_rows": len(trl_rows), "tokens": our_tokens,
                "trained_tokens": our_trained, "trl_version": trl.__version__,
                "ours_all_s": [round(t, 2) for t in our_times], "trl_all_s": [round(t, 2) for t in trl_times],
                "ours_cpu_s": [round(t, 1) for t in our_cpu], "trl_cpu_s": [round(t, 1) for t in trl_cpu],
                "median_wall_ratio": round(statistics.median(trl_times) / statistics.median(our_times), 2),
                "cpu_ratio": round(statistics.median(trl_cpu) / statistics.median(our_cpu), 2),
                "load_avg_1min": [round(load_before, 2), round(load_after, 2)], "distinct_records": n_distinct,
                "speedup_vs_trl": round(speedup, 2)}
        with open(REPO / "bench" / "results.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
    print(f"speedup_vs_trl={speedup:.2f}")


if __name__ == "__main__":
    main()
