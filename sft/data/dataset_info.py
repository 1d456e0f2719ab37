"""LLaMA-Factory's dataset registry: `--dataset_dir DIR --dataset NAME[,NAME...]` reads the files that
DIR/dataset_info.json names, each with its own `formatting`, `columns` and `tags` (ShareGPT role and content keys).

An entry's keys that this toolkit reads: file_name (in DIR), hf_hub_url (with `split`), formatting (alpaca,
sharegpt; openai too), ranking (a preference dataset: trained on the preferred reply), columns (prompt, query,
response, system, history, messages, tools, chosen, rejected) and tags (role_tag, content_tag, user_tag,
assistant_tag, observation_tag, function_tag, system_tag). A name that is no entry but a file (in DIR or as given)
is read as a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sft.data.formats import is_local
from sft.errors import DataError
from sft.machine import note

INFO_FILE = "dataset_info.json"
UNSUPPORTED = ("ms_hub_url", "script_url", "cloud_file_name", "subset", "folder")


@dataclass(frozen=True)
class Source:
    """One dataset to read: a file or hub name, its format (None: detect) and LLaMA-Factory's column names."""
    spec: str
    fmt: str | None = None
    columns: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)


def load_info(dataset_dir: str) -> dict:
    path = Path(dataset_dir) / INFO_FILE
    if not path.is_file():
        raise DataError(f"--dataset_dir {dataset_dir}: holds no {INFO_FILE}; give the directory of LLaMA-Factory's "
                        f"{INFO_FILE} (its data/), or give --dataset files without --dataset_dir.")
    try:
        info = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read it as JSON ({e}).") from None
    if not isinstance(info, dict):
        raise DataError(f"{path}: expected an object of dataset name -> description, got {type(info).__name__}.")
    return info


def sources(specs: list[str], dataset_dir: str | None, fmt: str | None = None, columns: dict | None = None,
            tags: dict | None = None) -> list[Source]:
    """--dataset as given -> what to read. Without --dataset_dir, each is a file or hub name, read with the
    --dataset_format/--dataset_columns/--dataset_tags given; with it, LLaMA-Factory's comma-separated names too."""
    plain = dict(fmt=fmt, columns=dict(columns or {}), tags=dict(tags or {}))
    if not dataset_dir:
        dataset_dir = default_dir(specs)
    if not dataset_dir:
        for spec in specs:
            if "," in spec and not is_local(spec):
                raise DataError(f"--dataset {spec}: LLaMA-Factory's dataset names? Give --dataset_dir, the folder of "
                                f"its {INFO_FILE}; files or hub names are separate words (--dataset a.json b.json).")
        return [Source(spec, **plain) for spec in specs]
    info = load_info(dataset_dir)
    out = []
    for name in (n.strip() for spec in specs for n in spec.split(",") if n.strip()):
        entry = info.get(name)
        if entry is None:
            for candidate in (Path(dataset_dir) / name, Path(name)):
                if candidate.is_file():
                    out.append(Source(str(candidate), **plain))
                    break
            else:
                known = ", ".join(sorted(info)[:8]) + (", ..." if len(info) > 8 else "")
                raise DataError(f"--dataset {name}: no such entry in {Path(dataset_dir) / INFO_FILE} ({known}) and "
                                f"no such file there; add it to {INFO_FILE}, or give the file's path.")
            continue
        out.append(entry_source(name, entry, dataset_dir))
    return out


def default_dir(specs: list[str]) -> str | None:
    """LLaMA-Factory's default dataset_dir, `data`, where its dataset_info.json names every --dataset that is no
    file (a LLaMA-Factory YAML without dataset_dir reads its data so); else None."""
    names = [n.strip() for spec in specs if not is_local(spec) for n in spec.split(",") if n.strip()]
    if not names or not (Path("data") / INFO_FILE).is_file():
        return None
    try:
        info = load_info("data")
    except DataError:
        return None
    if not all(name in info for name in names):
        return None
    note(f"--dataset {' '.join(specs)}: the names of data/{INFO_FILE} (LLaMA-Factory's default --dataset_dir data)")
    return "data"


def entry_source(name: str, entry: dict, dataset_dir: str) -> Source:
    where = f"{Path(dataset_dir) / INFO_FILE}: {name}"
    if not isinstance(entry, dict):
        raise DataError(f"{where}: expected an object with file_name (or hf_hub_url), got {type(entry).__name__}.")
    unsupported = [k for k in UNSUPPORTED if entry.get(k)]
    if unsupported:
        raise DataError(f"{where}: {', '.join(unsupported)} is not read by this toolkit; download the data and "
                        f"give its file as file_name (or --dataset FILE).")
    if entry.get("hf_hub_url"):
        spec = str(entry["hf_hub_url"]) + (f":{entry['split']}" if entry.get("split") else "")
    elif entry.get("file_name"):
        spec = str(Path(dataset_dir) / str(entry["file_name"]))
    else:
        raise DataError(f"{where}: names neither file_name nor hf_hub_url.")
    formatting = str(entry.get("formatting", "alpaca")).lower()
    if formatting not in ("alpaca", "sharegpt", "openai"):
        raise DataError(f"{where}: formatting {formatting!r}; this toolkit reads alpaca and sharegpt (and openai).")
    columns, tags = entry.get("columns") or {}, entry.get("tags") or {}
    for key, value in (("columns", columns), ("tags", tags)):
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise DataError(f"{where}: {key} must be an object of names, got {value!r}.")
    return Source(spec, "alpaca" if formatting == "alpaca" else "messages", dict(columns), dict(tags))
