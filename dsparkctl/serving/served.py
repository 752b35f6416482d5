"""`served`: read what a running engine reports about speculation and say what each number is.

Sources (formats/served.py): a saved Prometheus scrape (one: the totals since the server started;
two, earlier first: the window between them), a metrics URL, or files of response bodies (JSON
lines: vLLM's per-request metrics or SGLang's meta_info), recognised by content.

The report (`served_report`) gives τ (exact: 1 + accepted / drafted steps) with an interval where
the source carries the histogram of accepted counts, and per position k:
    accepted_share     accepted at k / all drafted steps: vLLM's documented "per-position
                       acceptance rate"; under full-length drafts it is the survival a_k
    conditional        P(k accepted | 1..k-1 accepted, k proposed): exact where the source says
                       how many steps tested k (per-step data, or every draft of full length);
                       otherwise only bounded (`conditional_bounds`), never called conditional
    survival           Π of the conditionals (exact or bounded alike)
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from dsparkctl.errors import InputError, UsageError
from dsparkctl.formats.served import RESPONSES_HINT, SCRAPE_HINT, ServedCounts
from dsparkctl.formats.served_responses import parse_responses
from dsparkctl.formats.served_scrape import parse_scrape, scrape_window
from dsparkctl.math.stats import AcceptanceStats, mean_interval, reached_bounds, wilson_interval
from dsparkctl.provenance import provenance
from dsparkctl.strict_json import StrictJSONError, loads

FORMAT = "dsparkctl-served/1"
MAX_SCRAPE_BYTES = 64 << 20
URL_TIMEOUT_S = 10.0
QUANTITIES = {
    "tau": "mean tokens per drafted verify step, the bonus token included (1 + accepted / drafted steps)",
    "accepted_share": "drafted steps that accepted position k / all drafted steps (vLLM's documented per-position "
                      "rate); the survival a_k only when every draft had full length",
    "conditional": "P(position k accepted | positions 1..k-1 accepted and k proposed): exact, or null with "
                   "conditional_bounds when drafts of different lengths are mixed",
    "survival": "P(first k drafts accepted) for a draft of length ≥ k: the product of the conditionals",
}


def is_url(source: str) -> bool:
    return source[:8].lower().startswith(("http://", "https://"))


def printable(text: str) -> str:
    """Text a server sent, safe to show: control characters (terminal escapes) written as \\xNN."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def shown(source: str) -> str:
    """A source as messages and documents show it: a URL without its credentials or query values
    (tokens travel there), a path as given."""
    if not is_url(source):
        return source
    try:
        parts = urllib.parse.urlsplit(source)
        host = parts.netloc.rpartition("@")[2]
    except ValueError:
        return source.split("?", 1)[0].split("@")[-1]
    user = "***@" if "@" in parts.netloc else ""
    query = "?" + "&".join(f"{k}=***" for k, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)) \
        if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, user + host, parts.path, "", "")) + query


def _check_url(url: str, form: str = "http://HOST:PORT/metrics") -> None:
    """A URL's shape, before anything is fetched (a bad port or host is named, not a traceback);
    `form`: what the fix says a right one looks like."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
        host = parts.hostname
    except ValueError as exc:
        raise UsageError(f"{shown(url)} is not a valid URL ({exc})", f"give {form}") from None
    if not host or any(c.isspace() for c in url) or (port is not None and not 0 < port < 65536):
        raise UsageError(f"{shown(url)} is not a valid URL (a host, no spaces, a port in 1..65535)", f"give {form}")


def _once(source: str, seen: dict[str, str]) -> None:
    """A source named twice (the same URL, or the same file by any path) would count its steps twice."""
    key = source if is_url(source) else str(Path(source).expanduser().resolve())
    if key in seen:
        raise UsageError(f"{shown(source)} is given twice (as {shown(seen[key])!r} before): its steps would be "
                         "counted twice",
                         "pass each scrape or responses file once")
    seen[key] = source


def _once_content(where: str, body: bytes, seen: dict[str, str]) -> None:
    """Two sources with the same bytes: a copy of one file, or two scrapes with nothing served between."""
    key = "sha256:" + hashlib.sha256(body).hexdigest()
    if key in seen:
        raise UsageError(f"{where} holds exactly what {seen[key]} holds: the same evidence twice (a copy, or two "
                         "scrapes with no traffic between them)", "pass each scrape or responses file once; a window "
                         "needs traffic between its two scrapes")
    seen[key] = where


def check_sources(sources: Sequence[str]) -> None:
    """Before anything is read: the count and the local files exist."""
    if not sources:
        raise UsageError("no source given", "pass a scrape file, a metrics URL or a responses file")
    for s in sources:
        if is_url(s):
            _check_url(s)
            continue
        p = Path(s).expanduser()
        if not p.exists():
            raise InputError(f"{s} does not exist", "pass a saved scrape, a metrics URL (http://HOST:PORT/metrics) "
                             "or a responses file")
        if not p.is_file():
            raise InputError(f"{s} is not a regular file", "pass a saved scrape or a responses file")


def fetch_url(url: str, timeout: float | None = None) -> str:
    """GET a metrics page within `timeout` seconds in all (default URL_TIMEOUT_S; a server that
    accepts and never answers, or trickles its bytes, is given up on); one line on any failure."""
    timeout = URL_TIMEOUT_S if timeout is None else timeout
    box: dict[str, Any] = {}

    def get() -> None:
        try:
            box["body"] = _get(url, timeout)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread)
            box["error"] = exc
    worker = threading.Thread(target=get, name="served-fetch", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise InputError(f"{shown(url)} did not finish answering within {timeout:g} s", "check that the server runs, "
                         "answers /metrics, and the port is right")
    if "error" in box:
        raise box["error"]
    body = box["body"]
    if len(body) > MAX_SCRAPE_BYTES:
        raise InputError(f"{shown(url)} sent more than {MAX_SCRAPE_BYTES >> 20} MB", "point at the /metrics page")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{shown(url)} did not send UTF-8 text", SCRAPE_HINT) from None


def split_credentials(url: str) -> tuple[str, dict[str, str]]:
    """user:password@host in a URL is sent as HTTP basic authentication, not as part of the host:
    (the URL without it, the header that carries it)."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, {}
    cred, _, host = parts.netloc.rpartition("@")
    return (urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, "")),
            {"Authorization": "Basic " + base64.b64encode(urllib.parse.unquote(cred).encode()).decode()})


def _get(url: str, timeout: float) -> bytes:
    url, auth = split_credentials(url)
    req = urllib.request.Request(url, headers={"Accept": "text/plain", **auth})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (http(s) only, checked by is_url)
            body = resp.read(MAX_SCRAPE_BYTES + 1)
            declared = resp.headers.get("Content-Length")
    except urllib.error.HTTPError as exc:
        raise InputError(f"{shown(url)} answered HTTP {exc.code}",
                         "check the URL (vLLM: http://HOST:PORT/metrics)") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        reason = str(reason).replace(url, shown(url))
        if "@" in url:  # the reason may quote the credentials
            reason = reason.replace(urllib.parse.urlsplit(url).netloc, urllib.parse.urlsplit(shown(url)).netloc)
        raise InputError(f"{shown(url)} did not answer ({type(exc).__name__}: {reason[:80]})",
                         "check that the server runs and the port is right") from None
    if declared is not None and declared.strip().isdigit() and len(body) < int(declared) <= MAX_SCRAPE_BYTES:
        raise InputError(f"{shown(url)} was cut short: {len(body)} of the {int(declared)} bytes it announced",
                         "scrape again (the connection closed early)")
    return body


BOM = b"\xef\xbb\xbf"


def _is_json_lines(path: Path) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(4096).removeprefix(BOM).lstrip()
    return head[:1] in (b"{", b"[")


def _json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, object) per non-empty line, strict JSON; a file holding one JSON array is read whole."""
    with open(path, "rb") as fh:
        first = fh.read(4096).removeprefix(BOM).lstrip()[:1]
    if first == b"[":
        try:
            arr = loads(path.read_bytes().removeprefix(BOM))
        except (StrictJSONError, ValueError) as exc:
            raise InputError(f"{path}: not valid JSON ({str(exc)[:80]})", RESPONSES_HINT) from None
        if not isinstance(arr, list):
            raise InputError(f"{path}: expected a list of responses", RESPONSES_HINT)
        yield from ((f"{path}: item {i + 1}", o) for i, o in enumerate(arr))
        return
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, start=1):
            raw = raw.removeprefix(BOM) if n == 1 else raw
            if not raw.strip():
                continue
            try:
                yield f"{path}:{n}", loads(raw)
            except (StrictJSONError, ValueError) as exc:
                raise InputError(f"{path}:{n}: not valid JSON ({str(exc)[:80]})", RESPONSES_HINT) from None


def read_sources(sources: Sequence[str], model: str | None = None,
                 fetch: Callable[[str], str] = fetch_url) -> ServedCounts:
    """Every source read and pooled: scrapes (one, or two as a window) or response files."""
    check_sources(sources)
    scrapes, responses = [], []
    for s in sources:
        if is_url(s):
            scrapes.append((shown(s), fetch(s)))
            continue
        p = Path(s).expanduser()
        if _is_json_lines(p):
            responses.append(p)
            continue
        if p.stat().st_size > MAX_SCRAPE_BYTES:
            raise InputError(f"{s} is {p.stat().st_size >> 20} MB, too large for a scrape", SCRAPE_HINT)
        try:
            scrapes.append((s, p.read_text(encoding="utf-8").removeprefix("\ufeff")))
        except UnicodeDecodeError:
            raise InputError(f"{s}: not UTF-8 text", SCRAPE_HINT) from None
    if scrapes and responses:
        raise UsageError("scrapes and response files cannot be pooled: they may count the same steps twice",
                         "pass either one or two scrapes, or response files")
    if len(scrapes) > 2:
        raise UsageError(f"{len(scrapes)} scrapes: pass one (totals) or two (the window between them, earlier first)",
                         "counters are cumulative; more scrapes add nothing")
    seen: dict[str, str] = {}
    for s in sources:
        _once(s, seen)
    for where, text in scrapes:
        _once_content(where, text.encode("utf-8"), seen)
    for p in responses:
        _once_content(str(p), p.read_bytes(), seen)
    if responses:
        return parse_responses((item for p in responses for item in _json_lines(p)), model)
    counts = [parse_scrape(text, where, model) for where, text in scrapes]
    for i, (c, (where, _)) in enumerate(zip(counts, scrapes)):
        c.check(where, allow_empty=len(counts) == 2 and i == 0)  # a window may start before any request
    if len(counts) == 1:
        return counts[0]
    window = scrape_window(counts[0], counts[1], f"{scrapes[0][0]} → {scrapes[1][0]}")
    window.check(f"the window {scrapes[0][0]} → {scrapes[1][0]}")
    return window


def lengths_kind(c: ServedCounts) -> str:
    """per-step (exact), fixed (every draft of K tokens), mixed (bounded) or unknown (gauges)."""
    if c.kind == "gauges":
        return "unknown"
    if c.reached is not None:
        return "per-step"
    if c.length_at_least is not None and all(v == c.drafts for v in c.length_at_least):
        return "fixed"
    if c.draft_tokens is not None and c.draft_tokens == c.positions * c.drafts:
        return "fixed"
    return "mixed"


def _per_position(c: ServedCounts, kind: str) -> list[dict[str, Any]]:
    if c.accepted_at is None:
        return []
    K, D, acc = c.positions, c.drafts, c.accepted_at
    if kind == "per-step":
        bounds = [(n, n) for n in c.reached or []]
    elif kind == "fixed":
        bounds = [(n, n) for n in [D, *acc[:-1]]]
    else:
        bounds = reached_bounds(acc, D, c.length_at_least, c.draft_tokens)
    exact = None
    if all(lo == hi for lo, hi in bounds):
        exact = AcceptanceStats(block_size=K, rounds=D, tokens=D + c.accepted_tokens, verified=c.draft_tokens or 0,
                                histogram=c.histogram or [0] * (K + 1), reached=[lo for lo, _ in bounds],
                                accepted_at=list(acc))
    rows: list[dict[str, Any]] = []
    surv_lo = surv_hi = 1.0
    for k in range(K):
        lo, hi = bounds[k]
        a = acc[k]
        b_lo, b_hi = (a / hi if hi else None), (a / lo if lo else 1.0)  # none surely tested: up to 1
        if b_lo is not None and b_hi is not None and surv_lo is not None and surv_hi is not None:
            surv_lo, surv_hi = surv_lo * b_lo, surv_hi * b_hi
        else:
            surv_lo = surv_hi = None
        identified = lo == hi
        ci = None
        if hi:
            ci = [wilson_interval(a, hi)[0], wilson_interval(a, lo)[1] if lo else 1.0]
        row = {"position": k + 1, "accepted": a, "accepted_share": a / D if D else None,
               "tested": lo if identified else None, "tested_bounds": [lo, hi],
               "conditional": b_lo if identified else None, "conditional_bounds": [b_lo, b_hi] if hi else None,
               "conditional_interval": ci, "identified": identified,
               "survival": surv_lo if (identified and surv_lo == surv_hi) else None,
               "survival_bounds": [surv_lo, surv_hi] if surv_lo is not None else None}
        if exact is not None:
            s_ci = exact.survival_interval()[k]
            row["survival_interval"] = list(s_ci) if s_ci else None
        rows.append(row)
    return rows


def served_report(c: ServedCounts, sources: Sequence[str]) -> dict[str, Any]:
    """The served document: τ, the acceptance rate and the per-position figures, each named."""
    kind = lengths_kind(c)
    notes = list(c.notes)
    if kind == "mixed":
        notes.append("drafts of different lengths are mixed (a per-batch-size length table, confidence-scheduled "
                     "verification, or requests ending): the engine does not say how many steps tested each "
                     "position past the first, so those conditionals are bounded, not measured; vLLM's "
                     "--per-request-spec-decode-metrics detailed gives them exactly")
    if c.kind == "gauges":
        tau, tau_ci = c.gauge_tau, None
    else:
        tau = 1.0 + c.accepted_tokens / c.drafts
        tau_ci = list(mean_interval(c.histogram)) if c.histogram else None
    return {
        "format": FORMAT, "engine": c.engine, "source": {"kind": c.kind, "paths": [shown(x) for x in sources]}, "model": c.model,
        "positions": c.positions or None, "lengths": kind, "drafts": c.drafts or None,
        "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens if c.kind != "gauges" else None,
        "requests": c.requests, "histogram": c.histogram,
        "tau": tau, "tau_interval": tau_ci,
        "draft_acceptance_rate": (c.accepted_tokens / c.draft_tokens) if c.draft_tokens else None,
        "per_position": _per_position(c, kind), "quantities": QUANTITIES, "notes": notes,
        "provenance": provenance(inputs=[shown(x) for x in sources]),
    }


def prompt_tokens(obj: Any) -> int | None:
    """A response body's prompt length: vLLM's usage.prompt_tokens, SGLang's meta_info.prompt_tokens."""
    for holder in (obj.get("usage"), obj.get("meta_info")) if isinstance(obj, dict) else ():
        n = holder.get("prompt_tokens") if isinstance(holder, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            return n
    return None


def check_bucket_sources(sources: Sequence[str]) -> None:
    if any(is_url(s) or not _is_json_lines(Path(s).expanduser()) for s in sources):
        raise UsageError("context buckets need response files: a scrape does not say which request a step served",
                         "save the response bodies (JSON lines) and pass those")


def by_context(sources: Sequence[str], edges: Sequence[int], model: str | None = None) -> list[dict[str, Any]]:
    """The served acceptance per context-length bucket (response files only: a scrape does not say
    which request a step served). Bucket i holds prompts of edges[i-1] < length ≤ edges[i] tokens, the
    last one everything longer. Empty buckets are listed with no figures."""
    check_bucket_sources(sources)
    items = [item for s in sources for item in _json_lines(Path(s).expanduser())]
    lengths = [prompt_tokens(obj) for _, obj in items]
    if any(n is None for n in lengths):
        where = next(w for (w, _), n in zip(items, lengths) if n is None)
        raise InputError(f"{where}: the response does not say its prompt length (usage.prompt_tokens)",
                         "use responses as the server returned them, or drop the context buckets")
    bounds = [0, *edges, None]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        mine = [item for item, n in zip(items, lengths) if n > lo and (hi is None or n <= hi)]
        entry: dict[str, Any] = {"prompt_tokens": [lo + 1, hi], "responses": len(mine)}
        if mine:
            try:
                report = served_report(parse_responses(mine, model), sources)
            except InputError as exc:  # a bucket of responses without speculative metrics
                entry["note"] = exc.message
            else:
                entry |= {k: report[k] for k in ("drafts", "tau", "tau_interval", "lengths", "per_position")}
        out.append(entry)
    return out
