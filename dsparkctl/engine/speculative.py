"""The speculative round loop, batched over requests with ragged lengths.

    prefill(prompt) ─► anchor x0 (sampled by the target)
    repeat:  draft block x1..xγ (one parallel forward + serial Markov loop)
             ℓ_r = policy(confidences)              (capped by the request's remaining budget)
             target forward over [x0, x1..xℓ]        (one call for the whole batch)
             verify → accepted a_r, one recovered/bonus token
             commit a_r+1 tokens to both caches; the emitted token is the next anchor
Each round emits `accepted + 1` tokens per request. Finished requests (EOS or budget) leave
the batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dsparkctl.engine.clock import Clock
from dsparkctl.errors import UsageError
from dsparkctl.math.sampling import SamplingParams, sample, warp_probs
from dsparkctl.math.stats import AcceptanceStats
from dsparkctl.math.verify import verify
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.target import TargetAdapter
from dsparkctl.trace import TraceRound


@dataclass
class RequestOutput:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (EOS included when hit)
    finish_reason: str = "length"  # "stop" | "length"
    rounds: int = 0


@dataclass
class RunReport:
    outputs: list[RequestOutput]
    stats: AcceptanceStats
    times_ms: dict[str, float]  # prefill, draft, draft_backbone, markov, schedule, verify, accept, total
    rounds: int  # batched rounds (engine steps)

    @property
    def generated(self) -> int:
        return sum(len(o.tokens) for o in self.outputs)


def _first_stop(tokens: torch.Tensor, n: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """tokens [R, T] (first n[r] valid) -> index+1 of the first stop token, or n if none.  [R]"""
    T = tokens.shape[1]
    ar = torch.arange(T, device=tokens.device)
    is_stop = torch.isin(tokens, stop_ids) & (ar[None, :] < n[:, None])
    big = torch.full_like(n, T + 1)
    first = torch.where(is_stop, ar[None, :].expand_as(tokens), big[:, None]).min(dim=1).values
    return torch.where(first <= T, first + 1, n)


class SpeculativeEngine:
    def __init__(self, target: TargetAdapter, draft: DSparkDraft, policy,
                 sampling: SamplingParams, stop_token_ids: Sequence[int] = (),
                 draft_sampling: SamplingParams | None = None):
        self.target, self.draft, self.policy = target, draft, policy
        self.sampling = sampling
        self.draft_sampling = draft_sampling or sampling
        self.stop_ids = torch.tensor(sorted(set(int(t) for t in stop_token_ids)) or [-1],
                                     device=target.device)
        k = getattr(policy, "k", None)
        if k is not None and not 0 <= int(k) <= draft.block_size:
            raise UsageError(f"policy {policy.spec} verifies {k} drafts but the draft's block size is "
                             f"{draft.block_size}", f"use static:K with K <= {draft.block_size}")

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 generator: torch.Generator | None = None,
                 on_round: Callable[[list[TraceRound]], None] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> RunReport:
        """Generate for all prompts in one batch. Returns outputs in prompt order."""
        if max_new_tokens < 1:
            raise UsageError("max_new_tokens must be >= 1")
        tgt, drf, dev = self.target, self.draft, self.target.device
        gamma = drf.block_size
        greedy = self.sampling.greedy
        outputs = [RequestOutput(prompt_tokens=list(p)) for p in prompts]
        stats = AcceptanceStats(block_size=gamma)
        clock = Clock(dev)
        clock.start()
        R = len(prompts)
        pre = tgt.prefill(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        state = drf.new_state(R, dev, next(drf.fc.parameters()).dtype,
                              capacity=int(lengths.max()) + max_new_tokens + gamma + 2)
        drf.append_context(state, pre.features, lengths)
        last = pre.logits[torch.arange(R, device=dev), lengths - 1]  # [R, V]
        anchors = sample(warp_probs(last, self.sampling), generator) if not greedy else last.argmax(-1)
        clock.lap("prefill")
        if hasattr(self.policy, "reset"):
            self.policy.reset()

        rows = torch.arange(R, device=dev)  # request index of each live row
        produced = torch.ones(R, dtype=torch.long, device=dev)  # anchor counts as generated
        for r in range(R):
            outputs[r].tokens.append(int(anchors[r]))
            if on_tokens:
                on_tokens(r, [int(anchors[r])])
        done = torch.isin(anchors, self.stop_ids) | (produced >= max_new_tokens)
        for r in done.nonzero().flatten().tolist():
            outputs[r].finish_reason = "stop" if bool(torch.isin(anchors[r], self.stop_ids)) else "length"
        round_no = [0] * R
        steps = 0
        live = ~done
        while True:
            if not bool(live.all()):
                keep = live.nonzero().flatten()
                if keep.numel() == 0:
                    break
                rows, anchors, produced = rows[keep], anchors[keep], produced[keep]
                tgt.keep_rows(keep)
                state.keep_rows(keep)
            n = rows.numel()
            clock.lap("accept")
            # ---- draft
            prop = drf.propose(state, anchors, self.draft_sampling, generator)
            draft_ms = clock.lap("draft")
            # ---- schedule
            conf = prop.confidence_logits
            ell = self.policy.choose(conf, block_size=gamma, num_requests=n).to(dev)
            budget = (max_new_tokens - produced - 1).clamp(min=0)  # a round emits ℓ+1 at most
            capped = (ell > budget).tolist()  # trace: ℓ cut by the budget, not the policy's choice
            ell = torch.minimum(ell, budget)
            clock.lap("schedule")
            # ---- verify: feed [anchor, x1..xℓ]
            T = int(ell.max()) + 1
            ids = torch.cat([anchors[:, None], prop.block.tokens[:, : T - 1]], dim=1)  # [n, T]
            out = tgt.extend(ids, ell + 1)
            verify_ms = clock.lap("verify")
            p = warp_probs(out.logits, self.sampling)  # [n, T, V]
            q = None if greedy else prop.block.full_probs(p.shape[-1])[:, : T - 1]  # [n, T-1, V]
            res = verify(p, q, prop.block.tokens[:, : T - 1], ell, generator, greedy)
            emitted, num = res.emitted, res.num_emitted
            cut = _first_stop(emitted, num, self.stop_ids)  # tokens kept this round per row
            tgt.commit(res.accepted + 1)
            drf.append_context(state, out.features, res.accepted + 1)
            anchors = emitted[torch.arange(n, device=dev), res.accepted]
            produced = produced + cut
            stopped = cut < num
            stopped |= torch.isin(emitted.gather(1, (cut - 1)[:, None]).squeeze(1), self.stop_ids)
            live = ~(stopped | (produced >= max_new_tokens))
            stats.add_rounds(ell.tolist(), res.accepted.tolist())
            steps += 1
            batch_tokens = int((ell + 1).sum())
            em, cl, ac, el = emitted.tolist(), cut.tolist(), res.accepted.tolist(), ell.tolist()
            conf_l = conf.tolist() if conf is not None else None
            trace_rows = []
            for i, req in enumerate(rows.tolist()):
                toks = em[i][: cl[i]]
                outputs[req].tokens.extend(toks)
                outputs[req].rounds += 1
                if on_tokens:
                    on_tokens(req, toks)
                trace_rows.append(TraceRound(
                    request=req, round=round_no[req], block_size=gamma,
                    confidence_logits=conf_l[i] if conf_l is not None else None,
                    verify_length=el[i], accepted=ac[i], batch_tokens=batch_tokens,
                    draft_ms=round(draft_ms, 3), verify_ms=round(verify_ms, 3), budget_capped=capped[i]))
                round_no[req] += 1
                if not bool(live[i]):
                    outputs[req].finish_reason = "stop" if bool(stopped[i]) else "length"
            if on_round:
                on_round(trace_rows)
        clock.lap("accept")
        times = dict(clock.totals)
        times["total"] = sum(clock.totals.values())
        return RunReport(outputs=outputs, stats=stats, times_ms=times, rounds=steps)


@torch.no_grad()
def plain_generate(target: TargetAdapter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   sampling: SamplingParams, stop_token_ids: Sequence[int] = (),
                   generator: torch.Generator | None = None) -> RunReport:
    """Plain (non-speculative) batched decoding with the same adapter: the baseline."""
    dev = target.device
    stop_set = {int(t) for t in stop_token_ids}
    outputs = [RequestOutput(prompt_tokens=list(p)) for p in prompts]
    clock = Clock(dev)
    clock.start()
    R = len(prompts)
    pre = target.prefill(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    logits = pre.logits[torch.arange(R, device=dev), lengths - 1]
    clock.lap("prefill")
    rows = torch.arange(R, device=dev)
    steps = 0
    while True:
        tok = logits.argmax(-1) if sampling.greedy else sample(warp_probs(logits, sampling), generator)
        live = []
        for i, req in enumerate(rows.tolist()):
            t = int(tok[i])
            outputs[req].tokens.append(t)
            if t in stop_set:
                outputs[req].finish_reason = "stop"
            elif len(outputs[req].tokens) >= max_new_tokens:
                outputs[req].finish_reason = "length"
            else:
                live.append(i)
        if not live:
            break
        if len(live) < rows.numel():
            keep = torch.tensor(live, device=dev)
            rows, tok = rows[keep], tok[keep]
            target.keep_rows(keep)
        one = torch.ones(rows.numel(), dtype=torch.long, device=dev)
        out = target.extend(tok[:, None], one)
        target.commit(one)
        logits = out.logits[:, 0]
        steps += 1
    clock.lap("decode")
    times = dict(clock.totals)
    times["total"] = sum(clock.totals.values())
    return RunReport(outputs=outputs, stats=AcceptanceStats(block_size=1), times_ms=times, rounds=steps)
