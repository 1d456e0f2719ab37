"""Readers: records on disk or on the hub -> conversations.

A conversation is a plain dict, `{"messages": [{"role", "content"}, ...], "source": "file:line"}`, with roles
system/user/assistant, and for conversations with tools (OpenAI `tools`/`tool_calls`/`tool`, ShareGPT
`function_call`/`observation`) the tool-call form of sft/data/tool_calls.py: assistant turns with `tool_calls`, `tool`
results and a leading `tools` message that holds the definitions. The source travels with it so that any later error can name where the record came from.
Every reader validates as it goes: a bad record raises `DataError` naming the file, line, field and what was
expected, or (with `skip_bad=True`) is counted under its reason in `ReadStats` and left out.
"""

from __future__ import annotations

import csv
import gc
import io
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from sft.errors import DataError
from sft.data.tool_calls import TOOLS_ROLE, dump_arguments

FORMATS = ("alpaca", "oasst", "messages")
# Other trainers' names for our readers: LLaMA-Factory's `formatting: sharegpt` (and the OpenAI layout it reads with
# role/content tags), Axolotl's `type: sharegpt` / `chat_template`.
FORMAT_NAMES = {"sharegpt": "messages", "openai": "messages", "chat_template": "messages", "chatml": "messages",
                "conversations": "messages", "oasst1": "oasst", "oasst2": "oasst"}
# LLaMA-Factory's dataset_info.json `columns` and `tags` keys that this reader takes (sft/data/dataset_info.py).
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                  "history": "history"}
MESSAGES_COLUMNS = ("messages", "system", "tools")
TAGS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")
PREFERENCE = "preference records, trained on the preferred reply"  # the summary's count of ranked records


def format_name(fmt: str | None) -> str | None:
    """--dataset_format as given -> our reader's name (an unknown name stays, for read_conversations to refuse)."""
    return None if fmt is None else FORMAT_NAMES.get(fmt.lower(), fmt.lower())
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
# Values that real Alpaca-style data uses for "this record has no input", compared after lower-casing and
# removing spaces, a trailing full stop and surrounding brackets ("<No Input>", "< noinput >", "No input.").
NO_INPUT = {"", "noinput", "n/a", "na", "none", "null", "nan", "-", "empty", "noinputrequired", "noinputneeded",
            "noinputprovided", "notapplicable"}


def is_no_input(text: str) -> bool:
    return text.strip().lower().rstrip(".").strip("<>[]() ").replace(" ", "") in NO_INPUT


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool"}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass
class ReadStats:
    """What was read, kept and skipped (by reason), for the summary printed before training."""

    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    sources: list = field(default_factory=list)  # (dataset, records read, conversations used), per dataset

    preferred: int = 0  # preference records (ranked replies, chosen/rejected) read as their preferred reply
    capped: int = 0  # conversations kept but left out by --max_samples (not in `kept`)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def merge(self, other: ReadStats) -> None:
        self.read += other.read
        self.kept += other.kept
        self.skipped.update(other.skipped)
        self.sources += other.sources
        self.preferred += other.preferred
        self.capped += other.capped


@dataclass
class ReadOptions:
    skip_bad: bool = False  # count and drop bad records instead of stopping
    oasst_threads: str = "best"  # "best": follow the best-ranked reply; "all": every root-to-leaf path
    languages: tuple[str, ...] = ()  # OASST language filter; empty keeps all
    columns: dict = field(default_factory=dict)  # LLaMA-Factory's dataset_info.json `columns` (our keys: see TAGS)
    tags: dict = field(default_factory=dict)  # and its `tags` (ShareGPT role and content keys, role names)


# --------------------------------------------------------------------------------------------- raw records


def is_local(spec: str) -> bool:
    return os.path.exists(spec) or spec.lower().endswith(LOCAL_SUFFIXES)


class BadLine:
    """Stands for a JSON Lines line that does not parse, when bad records are skipped rather than fatal."""


def iter_records(spec: str, skip_bad: bool = False) -> Iterator[tuple[Any, str]]:
    """Yield (record, where) from a local file or a hub dataset name (`name` or `name:split`). With `skip_bad`, a
    JSON Lines line that does not parse is yielded as a `BadLine` (for the caller to count) instead of raising."""
    if not is_local(spec):
        yield from _iter_hub(spec)
        return
    path = Path(spec)
    if path.is_dir():  # e.g. a downloaded hub dataset: its files, which --dataset takes several of
        files = sorted(str(f) for f in path.rglob("*") if f.suffix.lower() in LOCAL_SUFFIXES)
        raise DataError(f"{spec}: a directory; --dataset takes data files" + (
            f", e.g. {' '.join(files[:3])}{' ...' if len(files) > 3 else ''} ({len(files)} in it)." if files else
            " (.json, .jsonl, .parquet or .csv), and it holds none."))
    if not path.is_file():
        raise DataError(f"{spec}: no such file. Give a .json, .jsonl, .parquet or .csv file, or a hub dataset name.")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _iter_parquet(path)
    elif suffix == ".csv":
        yield from _iter_csv(path)
    elif suffix in (".json", ".jsonl"):
        yield from _iter_json(path, skip_bad)
    else:
        raise DataError(f"{spec}: unknown file type '{suffix}'. Use .json, .jsonl, .parquet or .csv.")


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read the file ({e.strerror}).") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte {e.start}: {e.reason}). "
                        f"Re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).") from None


def _iter_json(path: Path, skip_bad: bool = False) -> Iterator[tuple[Any, str]]:
    """A JSON list of records, or JSON Lines; each record is reported with its line number."""
    text = _read_text(path)
    if not text.strip():
        raise DataError(f"{path}: the file is empty. Give a file with at least one record.")
    decoder = json.JSONDecoder()
    start = len(text) - len(text.lstrip())
    try:
        if text[start] == "[":  # a JSON list: decode element by element to know each one's line
            yield from _iter_json_list(path, text, start, decoder)
            return
        if path.suffix.lower() == ".json" and text[start] == "{":  # one pretty-printed record, or JSON Lines
            try:
                record, end = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                record, end = None, -1
            if end >= 0 and not text[end:].strip():
                yield record, f"{path}:{text.count(chr(10), 0, start) + 1}"
                return
        # Lines end at "\n" only: str.splitlines() would also cut at U+2028 and other separators that JSON
        # allows raw inside strings (json.dumps(..., ensure_ascii=False) writes them), breaking valid records.
        for number, raw in enumerate(text.split("\n"), start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, RecursionError) as e:
                if skip_bad:
                    yield BadLine(), f"{path}:{number}"
                    continue
                if isinstance(e, RecursionError):
                    raise DataError(f"{path}:{number}: JSON nested too deeply to read.") from None
                raise DataError(f"{path}:{number}: invalid JSON ({e.msg}, column {e.colno}). "
                                f"Each line of a .jsonl file must be one JSON object.") from None
            yield record, f"{path}:{number}"
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to read.") from None


def _iter_json_list(path: Path, text: str, start: int, decoder: json.JSONDecoder) -> Iterator[tuple[Any, str]]:
    pos, line = start + 1, text.count("\n", 0, start) + 1
    while True:
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == "]":
            if text[pos + 1:].strip():
                raise _json_error(path, text, pos + 1, "unexpected text after the closing ']'")
            return
        line += text.count("\n", start, pos)
        start = pos
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise _json_error(path, text, e.pos, e.msg) from None
        except RecursionError:
            raise DataError(f"{path}:{line}: JSON nested too deeply to read.") from None
        yield record, f"{path}:{line}"
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos >= len(text) or text[pos] != "]":
            raise _json_error(path, text, pos, "expected ',' or ']' between records")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _json_error(path: Path, text: str, pos: int, msg: str) -> DataError:
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return DataError(f"{path}:{line}: invalid JSON ({msg}, column {column}). "
                     f"A .json file must be a list of records or one JSON object per line.")


def _iter_parquet(path: Path) -> Iterator[tuple[Any, str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises many types for a damaged file
        raise DataError(f"{path}: cannot read as Parquet ({e}).") from None
    for number, record in enumerate(table.to_pylist(), start=1):
        yield record, f"{path}:row {number}"


def _iter_csv(path: Path) -> Iterator[tuple[Any, str]]:
    csv.field_size_limit(2**31 - 1)  # the default (128 KiB) would reject long but valid texts
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    try:
        for record in reader:
            yield record, f"{path}:{reader.line_num}"
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: invalid CSV ({e}).") from None


def _iter_hub(spec: str) -> Iterator[tuple[Any, str]]:
    import datasets

    name, _, split = spec.partition(":")
    try:
        data = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # network, missing dataset, bad split: all end the same way for the user
        raise DataError(f"{spec}: cannot load from the hub ({type(e).__name__}: {e}). "
                        f"Check the name (and `name:split`), or give a local file.") from None
    for number, record in enumerate(data, start=1):
        yield record, f"{spec}:row {number}"


# --------------------------------------------------------------------------------------------- formats


def detect_format(record: Any, where: str) -> str:
    """Guess the format from the keys of the first record."""
    if isinstance(record, dict):
        if "instruction" in record and ("output" in record or "chosen" in record):
            return "alpaca"
        if "messages" in record or "conversations" in record or "chosen" in record and "rejected" in record:
            return "messages"
        if "message_id" in record and "role" in record or "prompt" in record and "message_tree_id" in record:
            return "oasst"
    keys = sorted(map(str, record)) if isinstance(record, dict) else type(record).__name__
    raise DataError(f"{where}: cannot tell the dataset format from the record's keys {keys}. Expected alpaca "
                    f"(instruction/input/output), oasst (message_id/parent_id/role/text) or messages "
                    f"(messages or conversations; ShareGPT too); pass --dataset_format, or for other column names "
                    f"--dataset_columns (LLaMA-Factory's dataset_info.json `columns`).")


def read_conversations(spec: str, fmt: str | None, options: ReadOptions) -> tuple[list[dict], ReadStats]:
    """Read one dataset (file or hub name) in the given format (None: detect) into conversations."""
    stats = ReadStats()
    records = _drop_bad_lines(iter_records(spec, options.skip_bad), stats)
    first = next(records, None)
    if first is None:
        raise DataError(f"{spec}: holds no records" + (" that parse." if stats.read else "."))
    given = fmt
    fmt = format_name(fmt) or _format_by_columns(options.columns) or detect_format(*first)
    if fmt not in FORMATS:
        raise DataError(f"--dataset_format {given!r} is unknown; use one of {', '.join(FORMATS)} (messages reads "
                        f"OpenAI messages and ShareGPT conversations; also named {', '.join(FORMAT_NAMES)}).")
    all_records = _chain([first], records)
    if fmt == "oasst":
        conversations = list(oasst_conversations(all_records, stats, options))
    else:
        conversations = convert_records(all_records, fmt, stats, options)
    stats.kept = len(conversations)
    return conversations, stats


def convert_records(records: Iterable[tuple[Any, str]], fmt: str, stats: ReadStats,
                    options: ReadOptions) -> list[dict]:
    """alpaca or messages records, each with where it comes from -> conversations; a bad record raises DataError
    or (skip_bad) is counted, a well-formed one with nothing to train on is counted under its reason."""
    convert = partial(alpaca_conversation if fmt == "alpaca" else messages_conversation,
                      columns=options.columns, tags=options.tags)
    conversations = []
    with gc_paused():
        for record, where in records:
            stats.read += 1
            try:
                conversation = convert(record, where)
            except DataError:
                if not options.skip_bad:
                    raise
                stats.skip("invalid record")
                continue
            if isinstance(conversation, str):  # a reason to skip a well-formed record
                stats.skip(conversation)
                continue
            if conversation.pop("preferred", False):
                stats.preferred += 1
            conversations.append(conversation)
    return conversations


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a bulk conversion that makes many containers and no cycles
    (conversations, a tokenizer batch, packing bins): now and then a collection they set off walks every object of
    the process (with torch and transformers loaded, a quarter to half a million), which made such loops 2-4 times
    slower. Cycles made meanwhile, if any, are collected once it is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _drop_bad_lines(records: Iterator[tuple[Any, str]], stats: ReadStats) -> Iterator[tuple[Any, str]]:
    for record, where in records:
        if isinstance(record, BadLine):
            stats.read += 1
            stats.skip("invalid JSON line")
        else:
            yield record, where


def _chain(head: list, tail: Iterable) -> Iterator:
    yield from head
    yield from tail


def _expect_str(record: dict, key: str, where: str, required: bool = True) -> str:
    value = record.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        got = "missing" if key not in record else f"{type(value).__name__} {_short(value)}"
        raise DataError(f"{where}: field '{key}' must be a string, got {got}. "
                        f"Fix the record, or pass --skip_bad_records to skip it.")
    return _valid_text(value, key, where)


def _valid_text(value: str, key: str, where: str) -> str:
    """JSON may spell lone UTF-16 surrogates (\\ud800), which are not text: no tokenizer or Arrow column takes them."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{where}: field '{key}' holds an unpaired surrogate \\u{ord(value[e.start]):04x} at "
                            f"character {e.start}, which is not text. Fix the record, or pass --skip_bad_records "
                            f"to skip it.") from None
    return value


def _expect_dict(record: Any, where: str, what: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object ({what}), got {type(record).__name__}. "
                        f"Fix the record, or pass --skip_bad_records to skip it.")
    return record


def _format_by_columns(columns: dict) -> str | None:
    """The reader that dataset_info.json's `columns` name: messages/tools -> messages, prompt/query/response ->
    alpaca; None: detect from the records."""
    if any(k in columns for k in ("messages", "tools")):
        return "messages"
    if any(k in columns for k in ("prompt", "query", "response", "history")):
        return "alpaca"
    return None


def _ranked(value: Any) -> bool:
    """LLaMA-Factory's ranked replies: `output` as a list of replies, the preferred one first."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def alpaca_conversation(record: Any, where: str, columns: dict | None = None, tags: dict | None = None) -> dict | str:
    """instruction/input/output (+ optional system and history pairs, as LLaMA-Factory allows); `columns`: its
    dataset_info.json names for them (prompt, query, response, system, history). A preference record (`output` a
    list of ranked replies, or `chosen`/`rejected`) trains on the preferred reply: the first, or the chosen one."""
    record = _expect_dict(record, where, "instruction/input/output")
    if columns:
        record = {**record, **{ALPACA_COLUMNS.get(k, k): record[v] for k, v in columns.items()
                               if isinstance(v, str) and v in record and k in (*ALPACA_COLUMNS, "chosen", "rejected")}}
    preferred = False
    if _ranked(record.get("output")):
        record, preferred = {**record, "output": record["output"][0]}, True
    elif record.get("output") is None and "chosen" in record:
        chosen = record["chosen"]
        if isinstance(chosen, dict):  # ShareGPT-style turn
            chosen = chosen.get("value", chosen.get("content"))
        record, preferred = {**record, "output": chosen}, True
    instruction = _expect_str(record, "instruction", where)
    context = _expect_str(record, "input", where, required=False)
    output = _expect_str(record, "output", where)
    system = _expect_str(record, "system", where, required=False)
    if not output.strip():
        return "empty output"
    if context and is_no_input(context):  # (most inputs are empty: no need to look)
        context = ""
    if not instruction.strip() and not context.strip():
        return "empty instruction"
    messages = [{"role": "system", "content": system}] if system and not system.isspace() else []
    history = record.get("history") or []
    if history and (not isinstance(history, list) or not all(
            isinstance(turn, list | tuple) and len(turn) == 2 and all(isinstance(t, str) for t in turn)
            for turn in history)):
        raise DataError(f"{where}: field 'history' must be a list of [user, assistant] string pairs.")
    for user, assistant in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    # The input stays apart so that the Alpaca template can place it; every other template joins the two.
    messages += [{"role": "user", "content": instruction, "input": context}, {"role": "assistant", "content": output}]
    return {"messages": messages, "source": where, **({"preferred": True} if preferred else {})}


def _preference_turns(record: dict, where: str) -> tuple[str, list] | None:
    """A preference record without a messages list (TRL's prompt/chosen/rejected, as text or as turns) -> (the key
    its turns are reported under, the turns up to the chosen reply); None when it is none."""
    chosen, prompt = record.get("chosen"), record.get("prompt")
    if "chosen" not in record:
        return None
    if isinstance(chosen, str) and isinstance(prompt, str):
        return "chosen", [{"role": "user", "content": prompt}, {"role": "assistant", "content": chosen}]
    if isinstance(chosen, list):  # the whole conversation, or its replies after a `prompt` list
        return "chosen", (prompt if isinstance(prompt, list) else []) + chosen
    raise DataError(f"{where}: a preference record (chosen/rejected) whose 'chosen' is {_short(chosen)}; expected "
                    f"a reply (with a 'prompt' text) or a list of turns. Fix the record, or pass --skip_bad_records.")


def messages_conversation(record: Any, where: str, columns: dict | None = None, tags: dict | None = None) -> dict | str:
    """OpenAI-style `messages` (role/content) or ShareGPT `conversations` (from/value); `columns` and `tags`: the
    other names of LLaMA-Factory's dataset_info.json (the list, system and tools columns; the role and content keys
    and the role names). A preference record trains on its chosen reply (ShareGPT's `chosen` turn after the
    conversation, or TRL's chosen turns)."""
    record = _expect_dict(record, where, "with 'messages' or 'conversations'")
    columns, tags = columns or {}, tags or {}
    key = columns.get("messages") or next((k for k in ("messages", "conversations") if k in record), None)
    preferred = False
    if key in record:
        turns = record[key]
        chosen = record.get(columns.get("chosen", "chosen"))
        if isinstance(chosen, dict) and isinstance(turns, list):  # ShareGPT ranking: one chosen, one rejected turn
            turns, preferred = turns + [chosen], True
    else:
        found = _preference_turns(record, where)
        if found is None:
            raise DataError(f"{where}: expected a '{key or 'messages'}' list"
                            + ("" if key else " (role/content) or 'conversations' (from/value)")
                            + f", found keys {sorted(record)}"
                            + (" (--dataset_columns names the list's column)." if key else "."))
        (key, turns), preferred = found, True
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
    role_key = tags.get("role_tag", "from" if "from" in first else "role" if "role" in first or key != "conversations"
                        else "from")
    text_key = tags.get("content_tag", "content" if role_key == "role" else "value")
    roles = {**SHAREGPT_ROLES, **OPENAI_ROLES}
    call_role = tags.get("function_tag", "function_call").lower()
    for tag, role in (("user_tag", "user"), ("assistant_tag", "assistant"), ("observation_tag", "tool"),
                      ("system_tag", "system"), ("function_tag", "assistant")):
        if isinstance(tags.get(tag), str):
            roles[tags[tag].lower()] = role
    if not isinstance(turns, list):
        raise DataError(f"{where}: field '{key}' must be a list of turns, got {type(turns).__name__}. "
                        f"Fix the record, or pass --skip_bad_records to skip it.")
    messages = []
    thinking = _thinking(record.get("thinking"), where)
    system = _expect_str(record, columns.get("system", "system"), where, required=False)
    if system.strip():
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        turn = _expect_dict(turn, f"{where}: {key}[{i}]", f"{role_key}/{text_key}")
        role = turn.get(role_key)
        if not isinstance(role, str) or role.lower() not in roles:
            raise DataError(f"{where}: {key}[{i}].{role_key} is {_short(role)}; expected one of {sorted(roles)}. "
                            f"Fix the record, name the roles with --dataset_tags, or pass --skip_bad_records to "
                            f"skip it.")
        turn_where = f"{where}: {key}[{i}]"
        if role.lower() == call_role:  # ShareGPT (LLaMA-Factory): value is {"name", "arguments"} or a list
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": _sharegpt_calls(_expect_str(turn, text_key, turn_where), turn_where)})
            continue
        content = turn.get(text_key)
        if role.lower() == "assistant" and turn.get("tool_calls") and not content:  # OpenAI: null text with calls
            content = ""
        elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                               isinstance(p.get("text"), str) for p in content):
            content = _valid_text("".join(p["text"] for p in content), text_key, turn_where)
        else:
            content = _expect_str(turn, text_key, turn_where)
        message = {"role": roles[role.lower()], "content": content}
        if role_key == "role" and message["role"] == "assistant" and turn.get("tool_calls"):
            message["tool_calls"] = _openai_calls(turn["tool_calls"], turn_where)  # text beside: the template's
        turn_thinking = _thinking(turn.get("thinking"), turn_where) if role_key == "role" else None
        if message["role"] == "assistant" and (turn_thinking, thinking) != (None, None):
            message["thinking"] = thinking if turn_thinking is None else turn_thinking  # V3.1 (thinking_templates.py)
        messages.append(message)
    tools = _tools(record.get(columns.get("tools", "tools")), where)
    if tools:
        messages.insert(0, {"role": TOOLS_ROLE, "content": json.dumps(tools, ensure_ascii=False)})
    conversation = _finish_thread(messages, where)
    if preferred and isinstance(conversation, dict):
        conversation["preferred"] = True
    return conversation


def _thinking(value: Any, where: str) -> bool | None:
    """A record's (or an assistant turn's) `thinking`: whether DeepSeek-V3.1 writes its replies thinking."""
    if value is None or isinstance(value, bool):
        return value
    raise DataError(f"{where}: field 'thinking' must be true or false, got {_short(value)}. Fix the record, or pass "
                    f"--skip_bad_records to skip it.")


def _openai_calls(calls: Any, where: str) -> list[dict]:
    """OpenAI `tool_calls` -> [{"type", "function": {"name", "arguments" (JSON text)}}] (ids are not rendered). Text
    beside the calls stays the turn's content: R1's template writes it (sft/data/tool_calls.py), V3's refuses it."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise DataError(f"{where}.tool_calls must be a list of {{\"type\": \"function\", \"function\": {{\"name\", "
                        f"\"arguments\"}}}}, got {_short(calls)}. Fix the record, or pass --skip_bad_records.")
    return [_call(c["function"], c.get("type", "function"), f"{where}.tool_calls[{n}]") for n, c in enumerate(calls)]


def _sharegpt_calls(value: str, where: str) -> list[dict]:
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: a function_call value must be JSON ({e.msg}, column {e.colno}): "
                        f'{{"name": ..., "arguments": {{...}}}} or a list of those.') from None
    calls = calls if isinstance(calls, list) else [calls]
    return [_call(c, "function", f"{where}[{n}]") for n, c in enumerate(calls)]


def _call(function: Any, kind: Any, where: str) -> dict:
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"] \
            or not isinstance(kind, str) or not isinstance(function.get("arguments", {}), str | dict):
        raise DataError(f"{where}: a tool call needs a non-empty string 'name' and 'arguments' as an object or JSON "
                        f"text, got {_short(function)}. Fix the record, or pass --skip_bad_records to skip it.")
    arguments = dump_arguments(function.get("arguments", {}))
    return {"type": kind, "function": {"name": _valid_text(function["name"], "name", where),
                                       "arguments": _valid_text(arguments, "arguments", where)}}


def _tools(tools: Any, where: str) -> list[dict]:
    """`tools` as a list or as JSON text (LLaMA-Factory), each an OpenAI {"type": "function", "function": {...}} or
    a bare function {"name", "description", "parameters"} (glaive), which is wrapped into the OpenAI form."""
    if isinstance(tools, str):
        if not tools.strip():
            return []
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field 'tools' is not valid JSON ({e.msg}, column {e.colno}). Fix the record, "
                            f"or pass --skip_bad_records to skip it.") from None
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and (isinstance(t.get("function"), dict) or
                                                                       isinstance(t.get("name"), str)) for t in tools):
        raise DataError(f"{where}: field 'tools' must be a list of function definitions (with a 'name', or OpenAI's "
                        f"'function'), got {_short(tools)}. Fix the record, or pass --skip_bad_records to skip it.")
    return [t if isinstance(t.get("function"), dict) else {"type": "function", "function": t} for t in tools]


def _finish_thread(messages: list[dict], where: str) -> dict | str:
    """Drop trailing user turns and tool results (nothing to learn from them); a thread needs an assistant reply.
    System texts after the last reply are kept: DeepSeek-V3's and R1's templates put every system text first."""
    trailing = []
    while messages and messages[-1]["role"] != "assistant":
        message = messages.pop()
        if message["role"] == "system":
            trailing.insert(0, message)
    messages += trailing
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        return "no assistant reply"
    return {"messages": messages, "source": where}


def oasst_conversations(records: Iterable[tuple[Any, str]], stats: ReadStats,
                        options: ReadOptions) -> Iterator[dict]:
    """OASST1/OASST2 message trees, flat (one message per record) or nested (`prompt` with `replies`).

    Deleted and failed-review messages drop with their subtrees; orphans (missing parent), duplicate ids and
    cycles are counted, never fatal. `best` follows the best-ranked reply at every step (one thread per tree);
    `all` gives every root-to-leaf thread, where a thread that ends in an unanswered prompt is cut back to its last
    reply and kept only if that reply is a leaf (otherwise it would repeat the start of a longer thread).
    """
    nodes: dict[str, dict] = {}
    for record, where in records:
        for message in _flatten_tree(record, where, options, stats):
            stats.read += 1
            if message["message_id"] in nodes:
                stats.skip("duplicate message_id")
                continue
            nodes[message["message_id"]] = message
    children: dict[str | None, list[dict]] = {}
    for node in nodes.values():
        if node["parent_id"] is not None and node["parent_id"] not in nodes:
            stats.skip("orphan message (parent missing)")
            continue
        if node["deleted"] or node["review_result"] is False:
            stats.skip("deleted or failed review")
            continue
        if options.languages and node["lang"] not in options.languages:
            stats.skip("language filtered out")
            continue
        children.setdefault(node["parent_id"], []).append(node)
    for siblings in children.values():  # best rank first; unranked after ranked, in file order
        siblings.sort(key=lambda n: (n["rank"] is None, n["rank"] if n["rank"] is not None else 0))
    roots = [r for r in children.get(None, []) if r["role"] == "prompter"]
    if len(children.get(None, [])) > len(roots):
        stats.skipped["tree root is not a prompt"] += len(children.get(None, [])) - len(roots)
    kept = sum(len(v) for v in children.values())
    unreachable = kept - _count_reachable(roots, children)
    if unreachable:  # below a skipped message, or in a parent_id cycle that no root leads into
        stats.skipped["below a skipped message, or in a cycle"] += unreachable
    for root in roots:
        threads: dict[tuple, dict] = {}
        for path in _threads(root, children, options.oasst_threads):
            messages = [{"role": "user" if n["role"] == "prompter" else "assistant", "content": n["text"]}
                        for n in path]
            conversation = _finish_thread(messages, path[0]["where"])
            if isinstance(conversation, str):
                stats.skip(conversation)
                continue
            ids = tuple(n["message_id"] for n in path[: len(conversation["messages"])])
            if ids in threads:  # two unanswered prompts under one reply cut back to the same thread
                stats.skip("unanswered prompt (its thread is part of a longer one)")
                continue
            threads[ids] = conversation
        prefixes = {ids[:k] for ids in threads for k in range(1, len(ids))}
        for ids, conversation in threads.items():
            if ids in prefixes:
                stats.skip("unanswered prompt (its thread is part of a longer one)")
            else:
                yield conversation


def _flatten_tree(record: Any, where: str, options: ReadOptions, stats: ReadStats) -> Iterator[dict]:
    if options.skip_bad and not isinstance(record, dict):
        stats.skip("invalid record")
        return
    record = _expect_dict(record, where, "an OASST message or tree")
    if isinstance(record.get("prompt"), dict):  # nested *.trees.jsonl export
        stack = [(record["prompt"], None)]
        while stack:
            node, parent = stack.pop()
            message = _oasst_message(node, parent, where, options)
            if message is None:  # skipped as invalid, with everything below it
                lost = _count_nodes(node)
                stats.skip("invalid record")
                if lost > 1:
                    stats.skipped["below a skipped message, or in a cycle"] += lost - 1
                continue
            yield message
            replies = node.get("replies") or []
            if not isinstance(replies, list):
                if not options.skip_bad:
                    raise DataError(f"{where}: 'replies' of message {message['message_id']} must be a list, got "
                                    f"{type(replies).__name__}. Fix the tree, or pass --skip_bad_records.")
                stats.skip("invalid record")
                continue
            stack.extend((reply, message["message_id"]) for reply in reversed(replies))
        return
    message = _oasst_message(record, _MISSING, where, options)
    if message is None:
        stats.skip("invalid record")
    else:
        yield message


_MISSING = object()  # flat records carry their own parent_id


def _count_nodes(node: Any) -> int:
    count, stack = 0, [node]
    while stack:
        item = stack.pop()
        count += 1
        replies = item.get("replies") if isinstance(item, dict) else None
        if isinstance(replies, list):
            stack.extend(replies)
    return count


def _oasst_message(record: Any, parent: Any, where: str, options: ReadOptions) -> dict | None:
    try:
        record = _expect_dict(record, where, "an OASST message")
        message_id = _expect_str(record, "message_id", where)
        text = _expect_str(record, "text", where)
        role = record.get("role")
        if role not in ("prompter", "assistant"):
            raise DataError(f"{where}: field 'role' is {_short(role)}; OASST roles are 'prompter' and 'assistant'. "
                            f"Fix the record, or pass --skip_bad_records to skip it.")
        if parent is _MISSING:
            parent = record.get("parent_id")
            if parent is not None and not isinstance(parent, str):
                raise DataError(f"{where}: field 'parent_id' must be a string or null, got {type(parent).__name__}. "
                                f"Fix the record, or pass --skip_bad_records to skip it.")
        rank = record.get("rank")
        if rank is not None and (not isinstance(rank, int | float) or isinstance(rank, bool)):
            raise DataError(f"{where}: field 'rank' must be a number or null, got {type(rank).__name__}. "
                            f"Fix the record, or pass --skip_bad_records to skip it.")
        for key in ("deleted", "review_result"):
            if record.get(key) is not None and not isinstance(record.get(key), bool):
                raise DataError(f"{where}: field '{key}' must be true, false or null, got "
                                f"{type(record.get(key)).__name__}. Fix the record, or pass --skip_bad_records.")
    except DataError:
        if options.skip_bad:
            return None
        raise
    return {"message_id": message_id, "parent_id": parent, "role": role, "text": text, "rank": rank,
            "lang": record.get("lang"), "deleted": bool(record.get("deleted")),
            "review_result": record.get("review_result", True), "where": where}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _count_reachable(roots: list[dict], children: dict[str | None, list[dict]]) -> int:
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node["message_id"] in seen:
            continue
        seen.add(node["message_id"])
        stack.extend(children.get(node["message_id"], []))
    return len(seen)


def _threads(root: dict, children: dict[str | None, list[dict]], mode: str) -> Iterator[list[dict]]:
    """Root-to-leaf paths: only the best-ranked one, or all of them. Iterative (deep trees cannot overflow the
    stack) and cycle-safe (a message already on the path is never followed again)."""
    stack = [([root], {root["message_id"]})]
    while stack:
        path, on_path = stack.pop()
        kids = [k for k in children.get(path[-1]["message_id"], []) if k["message_id"] not in on_path]
        if not kids:
            yield path
        elif mode == "best":
            stack.append((path + [kids[0]], on_path | {kids[0]["message_id"]}))
        else:
            stack.extend((path + [kid], on_path | {kid["message_id"]}) for kid in reversed(kids))
