"""Hub access through huggingface_hub: headers by HTTP range request, draft-only downloads.

`open_remote` reads `config.json`, the index and each shard's safetensors header (two small
ranged GETs per shard: the 8-byte length, then the header) and never tensor data. `download`
fetches config, index, tokenizer files and only the shards that hold draft tensors, through
`hf_hub_download` (resumable, honours HF_TOKEN, HF_HOME/cache, HF_HUB_OFFLINE, HF_ENDPOINT).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import huggingface_hub
from huggingface_hub import constants, hf_hub_url
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status, validate_repo_id

from dsparkctl.checkpoint.safetensors_io import header_length, parse_header
from dsparkctl.checkpoint.source import (INDEX, SINGLE, Checkpoint, check_consistent, load_config, open_local,
                                         parse_index)
from dsparkctl.errors import CheckpointError, InputError, UsageError, option

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "tokenizer.model")  # a model's tokenizer files, fetched and copied beside a draft
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def endpoint() -> str:
    """HF_ENDPOINT read now (huggingface_hub freezes it at import), else the library's setting."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host takes a TCP connection within `timeout` seconds (never under
    HF_HUB_OFFLINE). Asked before the hub is used (once per endpoint and process): an offline
    machine reads its cache at once and is told in one line, not after half a minute of retries."""
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return False
    return _answers(endpoint(), timeout)


@functools.lru_cache(maxsize=8)
def _answers(url: str, timeout: float) -> bool:
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)),
                                      timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def looks_like_repo(source: str) -> bool:
    return bool(source) and not Path(source).exists() and _REPO_ID.match(source) is not None


def check_repo_id(repo: str) -> None:
    """Refuse what the hub could never hold ("", "../../etc/passwd", "a/b/c", "x--y") before any lookup,
    so an invalid id is reported as invalid, not as missing from the cache or the hub."""
    try:
        validate_repo_id(repo)
    except Exception:  # noqa: BLE001 - HFValidationError, or a non-str
        raise UsageError(f"{repo!r} is not a valid hub repo id",
                         hint="use org/name (letters, digits, '-', '_', '.'; no '..' or '--'), or an existing "
                              "local folder") from None


def open_checkpoint(source: str, revision: str | None = None) -> Checkpoint:
    """A local checkpoint folder (or file), or a hub repo read by its headers (`open_remote`)."""
    if not source:
        raise UsageError("the source is empty", hint="pass a checkpoint folder or a hub repo id (org/name)")
    if Path(source).exists():
        if revision:
            raise UsageError(f"{option('revision')} applies to hub repos only",
                             hint=f"drop {option('revision')} for a local folder")
        return open_local(Path(source))
    if looks_like_repo(source):
        return open_remote(source, revision)
    raise UsageError(f"{source}: no such folder and not a repo id", hint="pass a folder or org/name")


@contextlib.contextmanager
def hub_errors(repo: str) -> Iterator[None]:
    """Map huggingface_hub/HTTP failures inside the block to one-line domain errors naming `repo`."""
    try:
        yield
    except RepositoryNotFoundError:
        raise InputError(f"{repo}: repository not found (or private)",
                         hint="check the repo id, or set HF_TOKEN for a private/gated repo") from None
    except RevisionNotFoundError:
        raise InputError(f"{repo}: revision not found", hint="check the revision (a branch, tag or commit)") from None
    except HfHubHTTPError as exc:
        raise CheckpointError(f"{repo}: hub request failed: {str(exc).splitlines()[0]}",
                              hint="check the network, HF_ENDPOINT and HF_TOKEN") from None
    except OSError as exc:  # connection refused, DNS, timeouts (httpx errors are not OSError; see below)
        raise CheckpointError(f"{repo}: cannot reach the hub: {exc}", hint="check the network or HF_ENDPOINT") from None
    except Exception as exc:  # httpx transport errors
        if type(exc).__module__.startswith(("httpx", "httpcore")):
            raise CheckpointError(f"{repo}: cannot reach the hub ({type(exc).__name__})",
                                  hint="check the network or HF_ENDPOINT; set HF_HUB_OFFLINE=1 to use the cache") from None
        raise


class _Remote:
    """Ranged reads of one repo at one revision, counting what it transfers."""

    def __init__(self, repo: str, revision: str | None, token: str | bool | None = None):
        self.repo, self.revision = repo, revision or "main"
        self.endpoint = endpoint()
        self.headers = build_hf_headers(token=token)
        self.session = get_session()
        self.bytes_read = 0

    def url(self, file: str) -> str:
        return hf_hub_url(self.repo, file, revision=self.revision, endpoint=self.endpoint)

    def get(self, file: str, start: int = 0, length: int | None = None) -> tuple[bytes, int] | None:
        """`length` bytes from `start` (all when None); returns (data, file size) or None on 404."""
        headers = dict(self.headers)
        if length is not None:
            headers["Range"] = f"bytes={start}-{start + length - 1}"
        with self.session.stream("GET", self.url(file), headers=headers, follow_redirects=True) as resp:
            if resp.status_code == 404 and resp.headers.get("X-Error-Code") in (None, "EntryNotFound"):
                return None
            if resp.status_code >= 400:
                resp.read()
                hf_raise_for_status(resp)
            commit = resp.headers.get("X-Repo-Commit")
            if commit and self.revision != commit:
                self.revision = commit  # pin: every later read sees the same commit
            size = _file_size(resp.headers)
            data = bytearray()
            want = length if length is not None else None
            for chunk in resp.iter_bytes():
                data += chunk
                if want is not None and resp.status_code == 200 and len(data) >= start + want:
                    break  # server ignored Range: stop reading the body early
            if resp.status_code == 200 and length is not None:
                data = data[start:start + length]
            self.bytes_read += len(data)
            return bytes(data), size


def _file_size(headers: dict) -> int:
    rng = headers.get("Content-Range")
    if rng and "/" in rng and rng.rsplit("/", 1)[1].isdigit():
        return int(rng.rsplit("/", 1)[1])
    return int(headers.get("X-Linked-Size") or headers.get("Content-Length") or 0)


def open_remote(repo: str, revision: str | None = None, token: str | bool | None = None) -> Checkpoint:
    """A Checkpoint of a hub repo from config + index + shard headers only."""
    check_repo_id(repo)
    if not hub_reachable():
        with hub_errors(repo):
            try:
                folder = huggingface_hub.snapshot_download(repo, revision=revision, local_files_only=True)
            except Exception:  # noqa: BLE001 - any cache miss
                raise CheckpointError(f"{repo}: no such local folder, the hub cannot be reached (offline, or "
                                      "HF_HUB_OFFLINE) and it is not in the local hub cache",
                                      hint="check the folder's path, or connect (unset HF_HUB_OFFLINE) and run "
                                      "again") from None
        return open_local(Path(folder))
    remote = _Remote(repo, revision, token)
    with hub_errors(repo):
        cfg = remote.get("config.json")
        index = remote.get(INDEX)
        if index is not None:
            weight_map = parse_index(index[0], f"{repo}/{INDEX}")
            files = sorted(set(weight_map.values()))
        else:
            weight_map, files = {}, [SINGLE]
        headers = {}
        for file in files:
            first = remote.get(file, 0, 8)
            if first is None:
                raise CheckpointError(f"{repo}/{file}: shard is missing on the hub", hint="check the repo and revision")
            n = header_length(first[0], file, first[1])
            raw = remote.get(file, 8, n) if n else (b"", first[1])
            headers[file] = parse_header(raw[0], file, first[1])  # type: ignore[index]
    if not weight_map:
        weight_map = {n: SINGLE for n in headers[SINGLE].tensors}
    check_consistent(weight_map, headers, repo)
    return Checkpoint(source=repo, revision=remote.revision, config=load_config(cfg[0] if cfg else None, repo),
                      weight_map=weight_map, headers=headers, total_size=sum(h.file_size for h in headers.values()),
                      bytes_transferred=remote.bytes_read)


@dataclass
class DownloadResult:
    folder: Path
    revision: str | None
    fetched: list[tuple[str, int]] = field(default_factory=list)  # (file, bytes)
    skipped: list[tuple[str, int]] = field(default_factory=list)


def download(repo: str, revision: str | None = None, local_dir: Path | None = None, with_head: bool = False,
             token: str | bool | None = None, on_file: Callable[[str, int], None] | None = None) -> DownloadResult:
    """Fetch config, index, tokenizer files and the draft shards (+ head shards) of `repo`."""
    ckpt = open_remote(repo, revision, token)
    names = ckpt.draft_names(with_head)
    if not names:
        raise CheckpointError(f"{repo}: no draft tensors", hint="check the repo with `dsparkctl inspect`")
    wanted = sorted({ckpt.weight_map[n] for n in names})
    sizes = {f: h.file_size for f, h in ckpt.headers.items()}
    result = DownloadResult(folder=Path(), revision=ckpt.revision)
    meta = ["config.json"] + ([INDEX] if len(ckpt.headers) > 1 or SINGLE not in ckpt.headers else [])
    with hub_errors(repo):
        for file in meta + list(TOKENIZER_FILES) + wanted:
            if on_file:
                on_file(file, sizes.get(file, 0))
            try:
                path = huggingface_hub.hf_hub_download(repo, file, revision=ckpt.revision, local_dir=local_dir,
                                                       token=token, endpoint=endpoint())
            except EntryNotFoundError:
                if file in TOKENIZER_FILES:
                    continue
                raise
            result.fetched.append((file, Path(path).stat().st_size))
            if file == "config.json":
                result.folder = Path(path).parent
    result.skipped = [(f, s) for f, s in sizes.items() if f not in wanted]
    return result
