"""`sweep-scheduler`: replay recorded rounds under each policy and load level.

Replay model. Traces must come from full verification (`static:γ`, every `verify_length == γ`),
so each recorded round tells how many drafts WOULD have been accepted (`accepted_if_full`).
Rounds the engine marked `budget_capped` (ℓ cut by the token budget at the end of a request)
are skipped: they do not say how many of γ drafts would have been accepted, and the cut depends
only on the token count, not on the drafts, so skipping them biases nothing.
At concurrency C the engine runs steps of C requests; each request's round is drawn uniformly
(with replacement, seeded) from the pooled trace rounds. The policy sees the recorded
confidence logits (with the calibration temperatures, if given) and picks ℓ; the round then
accepts `min(accepted_if_full, ℓ)` drafts and always emits the bonus token, and the policy
observes that before the next step, as in the engine (`Policy.observe`). A drafted step of C
requests takes `SPSTable.lengths_seconds(ℓ)`: in a padded table (dsparkctl's engine verifies a
`[C, 1 + max ℓ]` rectangle) what C × (1 + max ℓ) tokens cost, in a ragged one what
`B = Σ(1 + ℓ)` batch tokens cost (the table's grid, or 1 / SPS(B) for a table without one).
A policy may skip the draft for a whole step
(`Policy.run_steps`; static:0 always does): that step emits one token per request and takes the
table's plain-step time (a table without one: the drafted step at B = C, an upper bound).

Per policy and concurrency:
  tokens_per_step   mean over request-rounds of 1 + accepted (τ, bonus included)
  mean_verify       mean ℓ
  drafted_share     share of steps that ran the draft
  throughput        total tokens / total time (tokens/s, all users)
  per_user          throughput / C (tokens/s one user sees)
Each cell replays `ceil(rounds / C)` steps (so ≈ `rounds` request-rounds per cell).

Steady state (the default) keeps C requests in every step, as a server under constant load does.
With `max_new_tokens` N the sweep replays what `generate --batch-size C --max-new-tokens N` runs
instead: batches of C requests that each need N tokens (the first comes from the prefill), ℓ
capped by what a request still needs, finished requests leaving the batch (so its last steps
run fewer requests), the policy's memory reset per batch; throughput counts the tokens after the
first over the decode steps' time, as `generate` reports decode tokens/s. Stop tokens are not
modelled (every request runs to N).
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import torch

from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.formats.calibration import calibration_draft_notes, load_survival_prior, load_temperatures
from dsparkctl.formats.sps import check_block_size, cost_note, cost_source, load_sps_table, table_for_context
from dsparkctl.formats.trace import describe_rounds, recording_fix, recording_hint
from dsparkctl.formats.trace_scan import Progress, read_round_table
from dsparkctl.math.admission import survival_from_logits
from dsparkctl.math.policy_spec import check_spec_fits, parse_policy
from dsparkctl.math.sps import SPSTable
from dsparkctl.provenance import provenance
from dsparkctl.strict_json import read

SERVED_FORMAT = "dsparkctl-served/1"
SERVED_POOL = 100_000  # rounds in a pool built from served acceptance (exact proportions, no sampling)

SWEEP_FORMAT = "dsparkctl-sweep/1"
DEFAULT_POLICIES = ("static:0", "static:1", "static:3", "threshold:0.5", "survival:0.4", "budget:256", "dspark",
                    "dspark-async")
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MAX_CANDIDATES = 20_000_000  # request-rounds × γ held at once per cell (~70 bytes each: ~1.4 GB)


def load_replay_rounds(trace_paths: Sequence[str | os.PathLike], progress: Progress | None = None) -> dict[str, Any]:
    """Pool full-verification rounds (streamed, `read_round_table`): {"logits" [N, γ] (NaN rows when
    absent), "accepted" [N], "gamma", "skipped" (budget-capped rounds and plain steps left out),
    "fingerprints" (the drafts that recorded them), "unsigned" (traces that do not say)}.
    `progress(done, total)` counts bytes read."""
    table = read_round_table(trace_paths, "sweep", progress)
    keep = ~table.budget_capped
    partial = (keep & (table.verify_length != table.gamma)).nonzero()
    if partial.numel():
        i = int(partial[0])
        path, request, rnd = table.where(i)
        header = table.headers[int(table.source[i])]
        raise InputError(f"{path}: request {request} round {rnd} verified {int(table.verify_length[i])} of "
                         f"{table.gamma} drafts; the sweep needs traces recorded with full verification",
                         _full_hint(header, table.gamma))
    skipped = table.plain_steps + int(table.budget_capped.sum())
    if not bool(keep.any()):
        causes = [describe_rounds(c, h, p) for c, h, p in zip(table.counts, table.headers, table.paths)]
        capped_only = table.rows and not table.plain_steps  # drafted full rounds, every one cut by the budget
        raise InputError("the traces hold no full-verification round to replay: " + "; ".join(causes[:3])
                         + (f"; and {len(causes) - 3} more" if len(causes) > 3 else ""),
                         "record longer requests (a larger --max-new-tokens) so that rounds verify all "
                         f"{table.gamma} drafts before the budget cuts them" if capped_only else
                         recording_fix(table.counts[0], table.headers[0], table.paths[0] if len(table.paths) == 1
                                       else None))
    logits = table.logits[keep]
    return {"logits": logits, "accepted": table.accepted[keep], "gamma": table.gamma,
            "has_confidence": not bool(torch.isnan(logits).any()), "skipped": skipped,
            "fingerprints": sorted({h["draft_fingerprint"] for h in table.headers
                                    if isinstance(h.get("draft_fingerprint"), str)}),
            "unsigned": [p for p, h in zip(table.paths, table.headers)
                         if not isinstance(h.get("draft_fingerprint"), str)]}


def served_pool(path: str | os.PathLike, context_len: int | None = None) -> dict[str, Any]:
    """A replay pool from served acceptance (`dsparkctl served --out`): rounds whose accepted count
    under full verification follows the served survival a_k = Π c_i exactly. Without confidences
    only static:K policies can replay it; mixed-length counts that merely bound a conditional are
    refused. `context_len`: the acceptance of the document's context bucket holding it (`served
    --context-buckets`), where it has one with drafted steps; else every request's."""
    doc = read(path, "served acceptance", "write one with `dsparkctl served SOURCE --out FILE`")
    rows = doc.get("per_position") if isinstance(doc, dict) and doc.get("format") == SERVED_FORMAT else None
    bucket = _bucket(doc, context_len) if context_len is not None and rows else None
    if bucket is not None:
        rows = bucket["per_position"]
    if not isinstance(rows, list) or not rows:
        raise InputError(f"{path} is not a served-acceptance document with per-position counts",
                         "write one with `dsparkctl served SOURCE --out FILE` from a source with per-position counts")
    surv, s = [], 1.0
    for r in rows:
        if not isinstance(r, dict) or not isinstance(r.get("identified"), bool):
            raise InputError(f"{path}: malformed per-position row {str(r)[:60]}", "write it again with dsparkctl served")
        c = r.get("conditional")
        if not r["identified"]:
            b = r.get("conditional_bounds") or [None, None]
            bounds = "..".join("?" if x is None else f"{x:.3f}" for x in b)
            raise InputError(f"{path}: position {r.get('position')}'s conditional acceptance is only bounded "
                             f"({bounds}: drafts of different lengths are mixed), too loose to plan with",
                             "serve with vLLM's --per-request-spec-decode-metrics detailed and pass the responses, "
                             "or scrape a window where every draft had full length")
        if c is None:
            c = 0.0  # never tested: no draft survived to it
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0:
            raise InputError(f"{path}: position {r.get('position')} has conditional {c!r}", "write it again")
        s *= float(c)
        surv.append(s)
    gamma = len(surv)
    shares = [1.0 - surv[0]] + [surv[j - 1] - surv[j] for j in range(1, gamma)] + [surv[-1]]
    counts = [round(SERVED_POOL * x) for x in shares]
    counts[0] += SERVED_POOL - sum(counts)
    accepted = torch.repeat_interleave(torch.arange(gamma + 1), torch.tensor(counts))
    src = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    return {"logits": torch.full((SERVED_POOL, gamma), math.nan, dtype=torch.float64), "accepted": accepted,
            "gamma": gamma, "has_confidence": False, "skipped": 0,
            "source": {"kind": "served", "file": str(path), "engine": doc.get("engine"), "from": src.get("kind"),
                       "drafts": (bucket or doc).get("drafts"), "lengths": (bucket or doc).get("lengths"),
                       **({"prompt_tokens": bucket["prompt_tokens"]} if bucket else {})}}


def _bucket(doc: dict[str, Any], context_len: int) -> dict[str, Any] | None:
    """The context bucket of a served document holding `context_len`, if it has drafted steps."""
    for b in doc.get("by_context") or []:
        lo, hi = b.get("prompt_tokens", [None, None]) if isinstance(b, dict) else (None, None)
        if isinstance(lo, int) and lo <= context_len and (hi is None or context_len <= hi):
            return b if b.get("drafts") and isinstance(b.get("per_position"), list) else None
    return None


def _full_hint(header: dict[str, Any], gamma: int) -> str:
    """How to get a usable trace; not the command that produced this one."""
    if header.get("policy") == f"static:{gamma}":
        return (f"this trace was recorded with static:{gamma} but its shortened rounds are not marked "
                "budget_capped (an older dsparkctl, or an edited file); record it again with this version")
    return recording_hint({**header, "block_size": gamma}, None)


def replay(pool: dict[str, Any], policy_specs: Sequence[str], concurrency: Sequence[int], sps: SPSTable,
           temperatures: Sequence[float] | None = None, rounds: int = 20_000, seed: int = 0,
           prior: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """Run every (policy, concurrency) cell; returns one row per cell. `prior`: the calibration's
    survival profile, where dspark/dspark-async start their skip decision."""
    policies, surv_all = _policies_and_survivals(pool, policy_specs, sps, temperatures, prior)
    logits, acc_full = pool["logits"], pool["accepted"]
    rows = []
    for ci, C in enumerate(concurrency):
        steps = max(1, math.ceil(rounds / C))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + ci)  # same draws for every policy
        idx = torch.randint(0, logits.shape[0], (steps, C), generator=gen)  # [G, C]
        surv = surv_all[idx]  # [G, C, γ]
        acc_if_full = acc_full[idx]  # [G, C]
        plain_s = sps.plain_seconds(C)
        for pol in policies:
            ell, drafted = pol.run_steps(surv, pol.new_state(), acc_if_full)  # [G, C], [G]
            acc = torch.minimum(acc_if_full, ell)
            tokens = (1 + acc).sum(1).double()  # [G]
            btok = sps.step_tokens(ell)  # [G] what the engine processes
            step_s = sps.lengths_seconds(ell)  # [G]
            if plain_s is not None:
                step_s = torch.where(drafted, step_s, torch.full_like(step_s, plain_s))
            thr = float(tokens.sum() / step_s.sum())
            beyond = float((btok > sps.measured_tokens).double().mean())
            rows.append({"policy": pol.spec, "concurrency": C, "steps": steps, "request_rounds": steps * C,
                         "tokens_per_step": float(tokens.sum()) / (steps * C),
                         "mean_verify": float(ell.double().mean()),
                         "mean_batch_tokens": float(btok.double().mean()),
                         "drafted_share": float(drafted.double().mean()), "beyond_profile": beyond,
                         "throughput_tok_s": thr, "per_user_tok_s": thr / C})
    return rows


def replay_batches(pool: dict[str, Any], policy_specs: Sequence[str], concurrency: Sequence[int], sps: SPSTable,
                   max_new_tokens: int, temperatures: Sequence[float] | None = None, rounds: int = 20_000,
                   seed: int = 0, prior: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """Like `replay`, but batches of C requests of `max_new_tokens` tokens each run to the end (see
    the module doc); ≈ `rounds` generated tokens per cell, at least one batch. One row per cell."""
    check_max_new_tokens(max_new_tokens, rounds)
    policies, surv_all = _policies_and_survivals(pool, policy_specs, sps, temperatures, prior)
    acc_full, N = pool["accepted"], int(max_new_tokens)
    rows = []
    for ci, C in enumerate(concurrency):
        batches = max(1, math.ceil(rounds / (C * (N - 1))))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + ci)
        # the same round for (batch, step, request) under every policy: a request emits at least
        # one token per step, so a batch ends within N - 1 steps
        draws = torch.randint(0, surv_all.shape[0], (batches, N - 1, C), generator=gen)
        for pol in policies:
            tokens = seconds = 0.0
            steps = drafted_steps = request_rounds = beyond = 0
            ell_sum = btok_sum = 0.0
            for b in range(batches):
                state = pol.new_state()
                produced = torch.ones(C, dtype=torch.long)
                alive = torch.arange(C)  # the batch rows still decoding
                for step in range(N - 1):
                    if not produced.numel():
                        break
                    R = produced.numel()
                    idx = draws[b, step, alive][None]  # [1, R]
                    ell, drafted = pol.run_steps(surv_all[idx], state)  # [1, R], [1]
                    ell = torch.minimum(ell, (N - produced - 1).clamp(min=0))
                    acc = torch.minimum(acc_full[idx], ell)[0]
                    if bool(drafted[0]):
                        pol.observe(ell[0], acc, state)  # as the engine does, with ℓ capped by the budget
                        seconds += float(sps.lengths_seconds(ell)[0])
                        btok = float(sps.step_tokens(ell)[0])
                        drafted_steps += 1
                    else:
                        seconds += _plain_seconds(sps, R)
                        btok = R
                    btok_sum += btok
                    beyond += btok > sps.measured_tokens
                    tokens += float((1 + acc).sum())
                    ell_sum += float(ell.sum())
                    steps += 1
                    request_rounds += R
                    produced = produced + 1 + acc
                    alive, produced = alive[produced < N], produced[produced < N]
            thr = tokens / seconds
            rows.append({"policy": pol.spec, "concurrency": C, "steps": steps, "request_rounds": request_rounds,
                         "batches": batches, "max_new_tokens": N,
                         "tokens_per_step": tokens / request_rounds, "mean_verify": ell_sum / request_rounds,
                         "mean_batch_tokens": btok_sum / steps, "drafted_share": drafted_steps / steps,
                         "beyond_profile": beyond / steps,
                         "throughput_tok_s": thr, "per_user_tok_s": thr / C})
    return rows


def _policies_and_survivals(pool, policy_specs, sps, temperatures, prior):
    """Every policy parsed (all validated before any replay) and the pool's survivals `[N, γ]`
    (zeros when no policy reads them)."""
    policies = [parse_policy(s, sps=sps, temperatures=temperatures, prior=prior) for s in policy_specs]
    need_conf = [p.spec for p in policies if p.requires_confidence]
    if need_conf and not pool["has_confidence"]:
        raise InputError(f"policies {', '.join(need_conf)} need confidence logits but the "
                         + ("served counts have none" if pool.get("source", {}).get("kind") == "served"
                            else "traces have none"),
                         "use static:K policies, or record traces with a DSpark draft")
    logits = pool["logits"]
    return policies, (survival_from_logits(logits, temperatures) if need_conf else torch.zeros_like(logits))


def _input_notes(pool: dict[str, Any], calibration: str | os.PathLike | None) -> list[str]:
    """A calibration for the drafts that recorded the pool, or refused (`calibration_draft_notes`, the
    check generate and serve-config make); what cannot be checked is said."""
    if calibration is None:
        return []
    fps = pool.get("fingerprints") or []
    if not fps:
        what = "the served counts" if pool.get("source", {}).get("kind") == "served" else "the traces"
        return [f"{what} do not say which draft recorded them; make sure {calibration} was fitted for it"]
    notes = calibration_draft_notes(calibration, fps)
    if pool.get("unsigned"):
        notes.append(f"{', '.join(pool['unsigned'])} do not say which draft recorded them; make sure "
                     f"{calibration} was fitted for it")
    return notes


def _plain_seconds(sps: SPSTable, R: int) -> float:
    """A plain step's price: the table's, or (without one) a drafted step verifying nothing, an upper bound."""
    t = sps.plain_seconds(R)
    return t if t is not None else float(sps.step_seconds(R, torch.tensor(float(R))))


def check_max_new_tokens(max_new_tokens: int | None, rounds: int) -> None:
    """A finite batch's new tokens per request: at least 2 (the first comes from the prefill), and
    few enough that a batch fits the cell's `rounds` request-rounds."""
    if max_new_tokens is not None and not 2 <= max_new_tokens <= rounds + 1:
        raise UsageError(f"{option('max_new_tokens')} must be in [2, {option('rounds')} + 1 = {rounds + 1}] (a "
                         "request's first token comes from the prefill; a batch replays at least N / (γ + 1) "
                         f"steps), got {max_new_tokens}", "give the new tokens per request of the batches to "
                         f"replay; raise {option('rounds')} for longer ones")


def _check_grid(policy_specs, concurrency) -> None:
    """Before any file is read: the policies' names (a placeholder table: names are checked, not
    costs), and each policy and load level once (a repeat would give rows under one label)."""
    for s in policy_specs or ():
        parse_policy(s, sps=SPSTable([1, 2], [1.0, 1.0]))
    for what, given in ((option("policies"), [str(p).strip() for p in policy_specs or ()]),
                        (option("concurrency"), list(concurrency))):
        if twice := sorted({str(x) for x in given if given.count(x) > 1}):
            raise UsageError(f"{what} names {twice[0]} twice: its rows would repeat under one label",
                             f"give each of {what} once")


def sweep_traces(trace_paths, sps_path, policy_specs=DEFAULT_POLICIES, concurrency=DEFAULT_CONCURRENCY,
              calibration=None, rounds: int = 20_000, seed: int = 0,
              max_new_tokens: int | None = None, served: str | os.PathLike | None = None,
              progress: Progress | None = None, context_len: int | None = None) -> dict[str, Any]:
    """Read the traces (or the served acceptance), the SPS table and the calibration, replay every
    cell, return the sweep document. `max_new_tokens`: replay finite batches (`replay_batches`)
    instead of the steady state. `policy_specs` None: the defaults, or static:0..γ for `served`.
    `progress(done, total)` counts the trace bytes read."""

    check_max_new_tokens(max_new_tokens, rounds)
    if rounds < 1:
        raise UsageError(f"{option('rounds')} must be ≥ 1, got {rounds}", f"e.g. {option('rounds')} 200")
    if (trace_paths and served) or not (trace_paths or served):
        raise UsageError(f"give {option('trace')} files or {option('served')}, not both" if served else
                         f"give {option('trace')} files (full-verification rounds) or {option('served')} "
                         "(served acceptance)", "recorded rounds and served counts are two sources of one thing")
    if (policy_specs is not None and not policy_specs) or not concurrency:
        raise UsageError("nothing to sweep: no policies or no load levels",
                         "give at least one policy and one load level")
    if max(concurrency) > rounds:  # a cell replays ≈ rounds request-rounds, and at least one step of C
        raise UsageError(f"{option('concurrency')} {max(concurrency)} is more than {option('rounds')} {rounds}: one "
                         "step of it replays more request-rounds than a whole cell may",
                         f"raise {option('rounds')} or lower {option('concurrency')}")
    _check_grid(policy_specs, concurrency)
    sps = load_sps_table(sps_path)
    if context_len is not None:  # one context's costs (and, served, its bucket's acceptance)
        sps = table_for_context(sps, context_len)
    pool = served_pool(served, context_len) if served else load_replay_rounds(trace_paths, progress)
    if policy_specs is None:
        policy_specs = [f"static:{k}" for k in range(pool["gamma"] + 1)] if served else list(DEFAULT_POLICIES)
    if rounds * pool["gamma"] > MAX_CANDIDATES:  # a cell is replayed in one batch of [steps, C, γ]
        raise UsageError(f"{option('rounds')} {rounds} × block size {pool['gamma']} is more than the "
                         f"{MAX_CANDIDATES:,} candidates one cell may hold in memory",
                         f"use {option('rounds')} ≤ {MAX_CANDIDATES // pool['gamma']:,}; the default 20000 is plenty")
    check_block_size(sps, pool["gamma"])  # a whole-step table priced another draft's steps
    for s in policy_specs:
        check_spec_fits(s, pool["gamma"])  # static:9 on γ = 5 would replay static:5 under another name
    notes = _input_notes(pool, calibration) + [cost_note(cost_source(sps, sps_path))]
    temps = load_temperatures(calibration, pool["gamma"]) if calibration else None
    prior = load_survival_prior(calibration, pool["gamma"]) if calibration else None
    if max_new_tokens is None:
        rows = replay(pool, policy_specs, concurrency, sps, temps, rounds, seed, prior=prior)
    else:
        rows = replay_batches(pool, policy_specs, concurrency, sps, max_new_tokens, temps, rounds, seed, prior=prior)
    if beyond := sorted({r["concurrency"] for r in rows if r["beyond_profile"] > 0}):
        notes.append(f"steps at concurrency {', '.join(map(str, beyond))} go beyond the {sps.measured_tokens} batch "
                     f"tokens {sps_path} measured: priced by extending its step time linearly (ours and the SGLang "
                     "twin alike; each row's beyond_profile says how many steps); profile larger batches to measure "
                     "them")
    return {"format": SWEEP_FORMAT, "block_size": pool["gamma"], "pooled_rounds": int(pool["accepted"].numel()),
            "draft_fingerprints": pool.get("fingerprints", []), "notes": notes,
            "mode": "steady" if max_new_tokens is None else "batches", "max_new_tokens": max_new_tokens,
            "verify_layout": "padded" if sps.padded else "ragged",
            "budget_capped_rounds_skipped": pool["skipped"], "rounds_per_cell": rounds, "temperatures": temps,
            "policies": list(policy_specs), "concurrency": list(concurrency), "rows": rows,
            "acceptance_source": pool.get("source") or {"kind": "traces", "files": [str(p) for p in trace_paths]},
            "cost_source": cost_source(sps, sps_path),
            "provenance": provenance(inputs=[str(p) for p in (trace_paths or [served])], sps_table=str(sps_path),
                                     calibration=str(calibration) if calibration else None, seed=seed)}
