"""One streamed completion from an OpenAI-compatible server (vLLM, SGLang), timed chunk by chunk.

`profile-sps --server` sends prompts as token ids (`/v1/completions` takes a list of ids: the
context length is exact, no tokenizer is needed here) with a fixed output length (`max_tokens`
with `ignore_eos`, which both engines accept) and `stream_options.include_usage`, and records
when each chunk arrived. An engine emits one chunk per request per engine step (a drafted step
that accepted m drafts emits m + 1 tokens in one chunk), so the gaps between chunks are step
times and `usage.completion_tokens / chunks` is tokens per step.

Every failure is one line (`InputError`): the server does not answer, answers HTTP ≥ 400, is not
an OpenAI server (no event stream), reports an error inside the stream, stalls longer than the
read timeout, drops the connection before `[DONE]`, or never sends usage.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from dsparkctl.errors import InputError, option
from dsparkctl.serving.served import printable, shown, split_credentials

STALL_S = 60.0  # longest silence inside one stream before the server is called stalled
MAX_LINE = 1 << 20  # one SSE line; a server sending more is not an OpenAI stream


@dataclass
class Streamed:
    """What one streamed request brought: chunk arrival times (s, monotonic) of chunks that
    carried text, and the server's own count of completion tokens."""
    sent: float
    chunks: list[float] = field(default_factory=list)
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens per chunk where the server says (token_ids)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None

    @property
    def tokens_per_chunk(self) -> float | None:
        return self.completion_tokens / len(self.chunks) if self.chunks and self.completion_tokens else None


def endpoint(url: str) -> tuple[str, str, int, str, dict[str, str]]:
    """(scheme, host, port, base path, headers) of a server URL such as http://HOST:PORT or
    http://HOST:PORT/v1; credentials in the URL become basic authentication."""
    bare, headers = split_credentials(url)
    parts = urllib.parse.urlsplit(bare)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, parts.hostname or "", port, parts.path.rstrip("/").removesuffix("/v1"), headers


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    scheme, host, port, base, headers = endpoint(url)
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    return cls(host, port, timeout=timeout), base, headers


def _failed(url: str, exc: BaseException) -> InputError:
    reason = str(getattr(exc, "reason", exc)).replace(url, shown(url))[:80]
    return InputError(f"{shown(url)} did not answer ({type(exc).__name__}: {reason})",
                      "check that the server runs and the URL's host and port are right")


def get_json(url: str, path: str, timeout: float = 10.0) -> Any:
    """GET `path` under the server's base URL as JSON; None where the server answers 404 (an
    endpoint this engine lacks); one line for everything else that goes wrong."""
    conn, base, headers = _connection(url, timeout)
    try:
        conn.request("GET", base + path, headers={"Accept": "application/json", **headers})
        resp = conn.getresponse()
        body = resp.read(MAX_LINE + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise _failed(url, exc) from None
    finally:
        conn.close()
    if resp.status == 404:
        return None
    if resp.status >= 400:
        raise InputError(f"{shown(url)}{path} answered HTTP {resp.status}", _NOT_OPENAI)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"{shown(url)}{path} did not answer JSON", _NOT_OPENAI) from None


_NOT_OPENAI = f"point {option('server')} at an OpenAI-compatible vLLM or SGLang server (http://HOST:PORT)"


def stream_completion(url: str, model: str, prompt: list[int] | str, max_tokens: int,
                      stall_s: float = STALL_S, extra: dict[str, Any] | None = None,
                      opened: list[http.client.HTTPConnection] | None = None) -> Streamed:
    """Send one streamed completion of exactly `max_tokens` tokens after `prompt` (token ids, or
    text the server tokenizes) and time its chunks. Greedy (temperature 0): the draft's acceptance
    is the engine's greedy one. `extra`: more request fields (e.g. vLLM's return_token_ids);
    `opened`: the connection is added to it, so the caller can cut a round short (`abort`)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}, **(extra or {})}).encode()
    conn, base, headers = _connection(url, stall_s)
    if opened is not None:
        opened.append(conn)
    got = Streamed(sent=time.monotonic())
    done = False
    try:
        conn.request("POST", base + "/v1/completions", body=body,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream", **headers})
        resp = _stream_response(url, conn)
        while True:
            line = resp.readline(MAX_LINE + 1)
            now = time.monotonic()
            if not line:
                break
            if len(line) > MAX_LINE:
                raise InputError(f"{shown(url)} sent an event longer than {MAX_LINE >> 20} MB", _NOT_OPENAI)
            text = line.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue
            data = text[5:].strip()
            if data == "[DONE]":
                done = True
                break
            _chunk(url, data, now, got)
    except InputError:
        raise
    except (socket.timeout, TimeoutError):
        raise InputError(f"{shown(url)} stalled: no chunk for {stall_s:g} s in a stream",
                         f"check the server's load and log; a slower server needs a smaller {option('requests')} grid") from None
    except (OSError, http.client.HTTPException) as exc:
        if got.chunks:
            raise InputError(f"{shown(url)} dropped the connection mid-stream after {len(got.chunks)} chunks "
                             f"({type(exc).__name__})", "check the server's log (did it restart or run out "
                             "of memory?)") from None
        raise _failed(url, exc) from None
    finally:
        conn.close()
    return _whole(url, got, done, max_tokens)


def _stream_response(url: str, conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
    """The response to a streamed request, refused unless it is an event stream."""
    resp = conn.getresponse()
    if resp.status == 404:
        raise InputError(f"{shown(url)}/v1/completions answered HTTP 404", _NOT_OPENAI)
    if resp.status >= 400:
        raise InputError(f"{shown(url)} refused the request (HTTP {resp.status}): {_said(resp.read(8192))}",
                         "see the server's message; a prompt plus output beyond its max-model-len needs a "
                         f"smaller {option('context_len')} or {option('output_tokens')}")
    if "text/event-stream" not in (resp.getheader("Content-Type") or ""):
        raise InputError(f"{shown(url)}/v1/completions did not stream (Content-Type "
                         f"{(resp.getheader('Content-Type') or 'none')[:40]!r})", _NOT_OPENAI)
    return resp


def _whole(url: str, got: Streamed, done: bool, max_tokens: int) -> Streamed:
    """A finished stream, refused unless it ended with [DONE], said its usage and made every token asked."""
    if not done:
        raise InputError(f"{shown(url)} dropped the connection mid-stream (after {len(got.chunks)} chunks, before [DONE])",
                         "check the server's log (did it restart or run out of memory?)")
    if got.completion_tokens is None:
        raise InputError(f"{shown(url)} streamed without usage (no completion_tokens in any chunk)",
                         "use a server that honours stream_options.include_usage (vLLM, SGLang)")
    if got.completion_tokens != max_tokens:
        raise InputError(f"{shown(url)} produced {got.completion_tokens} tokens where {max_tokens} were asked "
                         "(it ignored ignore_eos/min_tokens, or its context is too short)",
                         f"use vLLM or SGLang, and a {option('context_len')} plus {option('output_tokens')} within "
                         "the model's length")
    return got


def abort(opened: list[http.client.HTTPConnection]) -> None:
    """Cut every stream of a round: their blocked reads fail at once (Ctrl-C, SIGTERM, the time limit)."""
    for conn in list(opened):
        try:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _said(body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    try:
        err = json.loads(text)
        text = str(err.get("error", {}).get("message", err.get("message", text))
                   if isinstance(err.get("error"), dict) else err.get("error") or err.get("message") or text)
    except (ValueError, AttributeError):
        pass
    return printable(" ".join(text.split())[:400])


def _chunk(url: str, data: str, now: float, got: Streamed) -> None:
    try:
        obj = json.loads(data)
    except ValueError:
        raise InputError(f"{shown(url)} sent an event that is not JSON", _NOT_OPENAI) from None
    if not isinstance(obj, dict):
        raise InputError(f"{shown(url)} sent an event that is not a JSON object", _NOT_OPENAI)
    if "error" in obj:
        raise InputError(f"{shown(url)} reported an error mid-stream: {_said(data.encode())}",
                         "check the server's log")
    choices = obj.get("choices") or []
    if any(isinstance(c, dict) and c.get("text") for c in choices):
        got.chunks.append(now)
        ids = choices[0].get("token_ids") if isinstance(choices[0], dict) else None
        got.chunk_tokens.append(len(ids) if isinstance(ids, list) else None)
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        got.completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            got.prompt_tokens = usage["prompt_tokens"]
