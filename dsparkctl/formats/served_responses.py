"""Response bodies with per-request speculative metrics (vLLM's `metrics.speculative_decoding`,
SGLang's `meta_info`), read into `ServedCounts` (formats/served.py says what each field is)."""

from __future__ import annotations

from typing import Any, Iterable

from dsparkctl.errors import InputError
from dsparkctl.formats.served import MAX_POSITIONS, RESPONSES_HINT, ServedCounts, _count, _histogram_counts
from dsparkctl.math.stats import AcceptanceStats


def parse_responses(objs: Iterable[tuple[str, Any]], model: str | None = None) -> ServedCounts:
    """Response bodies, one per line: vLLM's `metrics.speculative_decoding` or SGLang's `meta_info`
    (recognised by content; one engine per set). `objs` yields (where, parsed JSON)."""
    total: ServedCounts | None = None
    skipped = 0
    for where, obj in objs:
        got = _one_response(obj, where)
        if got is None:
            skipped += 1
            continue
        counts, resp_model = got
        if model is not None and resp_model is not None and resp_model != model:
            skipped += 1
            continue
        if total is not None and counts.engine != total.engine:
            raise InputError(f"{where}: a {counts.engine} response among {total.engine} ones cannot be pooled",
                             "read one engine's responses at a time")
        if total is not None and resp_model != total.model and model is None:
            raise InputError(f"{where}: a response from model {resp_model!r} among responses from {total.model!r}",
                             "read one model's responses at a time, or choose one with --model")
        counts.model = resp_model
        counts.check(where)
        total = counts if total is None else total.add(counts, where)
    if total is None:
        raise InputError("no response carries speculative-decoding metrics"
                         + (f" ({skipped} without them)" if skipped else ""), RESPONSES_HINT)
    if skipped:
        total.notes.append(f"{skipped} response(s) without speculative metrics"
                           + (f" or from another model than {model!r}" if model else "") + " were skipped")
    return total


def _one_response(obj: Any, where: str) -> tuple[ServedCounts, str | None] | None:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object (one response body per line), got {type(obj).__name__}",
                         RESPONSES_HINT)
    metrics = obj.get("metrics")
    if isinstance(metrics, dict) and "speculative_decoding" in metrics:
        sd = metrics["speculative_decoding"]
        if sd is None:
            return None
        return _vllm_response(sd, where), obj.get("model") if isinstance(obj.get("model"), str) else None
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        if "spec_verify_ct" not in meta:
            return None
        return _sglang_response(meta, where), None
    if "choices" in obj or "text" in obj or "output_ids" in obj:
        return None  # a response of the right kind, without speculative metrics
    raise InputError(f"{where}: neither a vLLM response (metrics.speculative_decoding) nor an SGLang one "
                     "(meta_info)", RESPONSES_HINT)


def _int_list(v: Any, what: str, where: str) -> list[int]:
    if not isinstance(v, list):
        raise InputError(f"{where}: {what} is not a list", "the response is damaged")
    if len(v) > 1_000_000:
        raise InputError(f"{where}: {what} has {len(v)} entries", "the response is damaged")
    return [_count(x, what, where) for x in v]


def _vllm_response(sd: Any, where: str) -> ServedCounts:
    if not isinstance(sd, dict):
        raise InputError(f"{where}: metrics.speculative_decoding is not an object", RESPONSES_HINT)
    need = ("acceptance_histogram", "num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens",
            "num_spec_tokens")
    missing = [k for k in need if k not in sd]
    if missing:
        raise InputError(f"{where}: metrics.speculative_decoding lacks {', '.join(missing)}",
                         "vLLM 0.32 or later writes them; check the server version")
    K = _count(sd["num_spec_tokens"], "num_spec_tokens", where)
    if not 1 <= K <= MAX_POSITIONS:
        raise InputError(f"{where}: num_spec_tokens {K} is outside 1..{MAX_POSITIONS}", "the response is damaged")
    hist = _int_list(sd["acceptance_histogram"], "acceptance_histogram", where)
    if len(hist) != K + 1:
        raise InputError(f"{where}: acceptance_histogram has {len(hist)} entries, num_spec_tokens {K} needs {K + 1}",
                         "the response is damaged")
    D, T = _count(sd["num_spec_steps"], "num_spec_steps", where), _count(sd["num_draft_tokens"], "num_draft_tokens",
                                                                         where)
    acc, A = _histogram_counts(hist, K)
    if sum(hist) != D or A != _count(sd["num_accepted_draft_tokens"], "num_accepted_draft_tokens", where):
        raise InputError(f"{where}: acceptance_histogram disagrees with num_spec_steps / num_accepted_draft_tokens",
                         "the response is damaged or edited")
    c = ServedCounts(engine="vllm", kind="responses", positions=K, drafts=D, draft_tokens=T, accepted_tokens=A,
                     accepted_at=acc, histogram=hist, requests=1)
    steps_a, steps_d = sd.get("per_step_accepted"), sd.get("per_step_drafted")
    if steps_a is not None or steps_d is not None:
        sa, sdr = _int_list(steps_a, "per_step_accepted", where), _int_list(steps_d, "per_step_drafted", where)
        if len(sa) != len(sdr) or len(sa) != D or sum(sdr) != T or any(not a <= d <= K for a, d in zip(sa, sdr)):
            raise InputError(f"{where}: per_step_accepted / per_step_drafted disagree with the totals (one entry per "
                             "step, accepted ≤ drafted ≤ num_spec_tokens)", "the response is damaged or edited")
        stats = AcceptanceStats(block_size=K)
        stats.add_rounds(sdr, sa)
        if stats.histogram != hist:
            raise InputError(f"{where}: per_step_accepted disagrees with acceptance_histogram",
                             "the response is damaged or edited")
        c.reached = stats.reached
        c.length_at_least = [sum(1 for d in sdr if d >= k) for k in range(1, K + 1)]
    elif T == K * D:
        c.length_at_least = [D] * K
    else:
        c.length_at_least = [D] + [None] * (K - 1)  # every counted step drafted ≥ 1 token
    return c


def _sglang_response(meta: dict[str, Any], where: str) -> ServedCounts:
    D = _count(meta.get("spec_verify_ct"), "spec_verify_ct", where)
    if D == 0:
        raise InputError(f"{where}: spec_verify_ct is 0", "the request ran no speculative step")
    A = _count(meta.get("spec_num_correct_drafts"), "spec_num_correct_drafts", where)
    proposed = _count(meta.get("spec_num_proposed_drafts"), "spec_num_proposed_drafts", where)
    if proposed % D:
        raise InputError(f"{where}: spec_num_proposed_drafts {proposed} is not a multiple of spec_verify_ct {D}",
                         "the response is damaged or edited")
    K = proposed // D
    if not 1 <= K <= MAX_POSITIONS:
        raise InputError(f"{where}: a block of {K} drafts", "the response is damaged or edited")
    hist = meta.get("spec_correct_drafts_histogram")
    c = ServedCounts(engine="sglang", kind="responses", positions=K, drafts=D, accepted_tokens=A, requests=1)
    if hist is not None:
        h = _int_list(hist, "spec_correct_drafts_histogram", where)
        if len(h) > K + 1:
            raise InputError(f"{where}: spec_correct_drafts_histogram has {len(h)} entries for a block of {K}",
                             "the response is damaged or edited")
        h = h + [0] * (K + 1 - len(h))
        acc, A2 = _histogram_counts(h, K)
        if sum(h) != D or A2 != A:
            raise InputError(f"{where}: spec_correct_drafts_histogram disagrees with spec_verify_ct / "
                             "spec_num_correct_drafts", "the response is damaged or edited")
        c.histogram, c.accepted_at = h, acc
    caps = meta.get("spec_cap_lens_histogram")
    if caps is not None:  # verify windows of n tokens (bonus slot included): ℓ = n - 1 drafts
        cap = _int_list(caps, "spec_cap_lens_histogram", where)
        if len(cap) > K + 2 or sum(cap) != D:
            raise InputError(f"{where}: spec_cap_lens_histogram does not describe {D} steps of at most {K} drafts",
                             "the response is damaged or edited")
        cap = cap + [0] * (K + 2 - len(cap))
        c.length_at_least = [sum(cap[k + 1:]) for k in range(1, K + 1)]
        c.draft_tokens = sum((n - 1) * m for n, m in enumerate(cap) if n >= 1)
    else:  # static verification: every step verified the whole block
        c.length_at_least, c.draft_tokens = [D] * K, K * D
    return c
