"""The speculative round loop, batched over requests with ragged lengths.

    prefill(prompt) ─► anchor x0 (sampled by the target)
    repeat:  draft block x1..xγ (one parallel forward + serial Markov loop)
             ℓ_r = policy(confidences)              (capped by the request's remaining budget)
             target forward over [x0, x1..xℓ]        (one call for the whole batch; greedy may add
                                                      siblings of x1 as a tree: engine/siblings.py)
             verify → accepted a_r, one recovered/bonus token
             commit a_r+1 tokens to both caches; the emitted token is the next anchor
Each round emits `accepted + 1` tokens per request. Finished requests (EOS or budget) leave
the batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dsparkctl.checks import check_positive
from dsparkctl.engine import siblings as sib
from dsparkctl.engine.clock import Clock
from dsparkctl.engine.lookup import History
from dsparkctl.engine.rounds import RequestOutput, Round, RunReport, Streams, trace_rows
from dsparkctl.errors import UsageError, option
from dsparkctl.formats.trace import TraceRound
from dsparkctl.math.draft_sampling import DraftBlock
from dsparkctl.math.policies import Policy
from dsparkctl.math.policy_spec import check_fits
from dsparkctl.math.sampling import SamplingParams, draw, warp_probs
from dsparkctl.math.stats import AcceptanceStats
from dsparkctl.math.verify import VerifyResult, verify
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_inference import DraftState
from dsparkctl.models.target import TargetAdapter


def _first_stop(tokens: torch.Tensor, n: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """tokens [R, T] (first n[r] valid) -> index+1 of the first stop token, or n if none.  [R]"""
    T = tokens.shape[1]
    ar = torch.arange(T, device=tokens.device)
    is_stop = torch.isin(tokens, stop_ids) & (ar[None, :] < n[:, None])
    big = torch.full_like(n, T + 1)
    first = torch.where(is_stop, ar[None, :].expand_as(tokens), big[:, None]).min(dim=1).values
    return torch.where(first <= T, first + 1, n)


@dataclass
class LiveRows:
    """The requests still decoding, one row each, and what the next round starts from."""

    requests: torch.Tensor  # [n] long, request index of each row
    anchors: torch.Tensor  # [n] long, x0 of the next block (the last emitted token)
    produced: torch.Tensor  # [n] long, tokens emitted so far
    context: DraftState  # the draft's per-row context K/V
    history: History | None = None  # every row's tokens, for context lookup (None: lookup off)

    def keep(self, rows: torch.Tensor, target: TargetAdapter) -> None:
        self.requests, self.anchors, self.produced = self.requests[rows], self.anchors[rows], self.produced[rows]
        self.context.keep_rows(rows)
        if self.history is not None:
            self.history.keep(rows)
        target.keep_rows(rows)


class SpeculativeEngine:
    """Batched lossless speculative decoding: one function per stage of a round."""

    def __init__(self, target: TargetAdapter, draft: DSparkDraft, policy: Policy,
                 sampling: SamplingParams, stop_token_ids: Sequence[int] = (),
                 draft_sampling: SamplingParams | None = None, siblings: int | str = 0, lookup: bool = False):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a dsparkctl Policy, got {type(policy).__name__}")
        self.target, self.draft, self.policy = target, draft, policy
        self.sampling = sampling
        self.draft_sampling = draft_sampling or sampling
        self.stop_ids = torch.tensor(sorted(set(int(t) for t in stop_token_ids)) or [-1],
                                     device=target.device)
        check_fits(policy, draft.block_size)
        self.siblings = sib.parse_siblings(siblings, greedy=sampling.greedy and self.draft_sampling.greedy)
        if self.siblings not in (0, sib.AUTO) and not target.takes_trees:
            raise UsageError(f"{option('siblings')} {self.siblings} needs a target on SDPA attention (this one runs "
                             f"{getattr(target.model.config, '_attn_implementation', None)!r}): a tree's mask is "
                             "boolean", f"use {option('siblings')} 0 (auto leaves such a target its chain)")
        self.sibling_rate = sib.SiblingRate()  # what runners-up realised this batch (`auto`; reset per batch)
        self.lookup = lookup and sampling.greedy and self.draft_sampling.greedy and not policy.never_drafts

    @property
    def effective_siblings(self) -> int | str:
        """What the siblings setting comes to in this engine: 0 where it cannot apply (sampling, a
        target without tree attention, `auto` without an SPS table)."""
        if not (self.sampling.greedy and self.draft_sampling.greedy) or not self.target.takes_trees \
                or self.policy.never_drafts:  # no chain to verify them beside
            return 0
        if self.siblings == sib.AUTO:
            return sib.AUTO if self.policy.sps is not None else 0
        return int(self.siblings)

    def _proposed_siblings(self) -> int:
        """How many runners-up the draft keeps (`auto`: as many as `plan` may price)."""
        eff = self.effective_siblings
        return sib.MAX_SIBLINGS if eff == sib.AUTO else int(eff)

    def sibling_feed(self, block, conf: torch.Tensor | None,
                     ell: torch.Tensor) -> tuple[sib.SiblingFeed | None, torch.Tensor]:
        """This round's siblings and the verify lengths beside them: a fixed count (the policy's
        lengths kept), or `auto`'s plan, which may shorten the chain to make room (needs confidences)."""
        if block.alternatives is None:
            return None, ell
        n = int(block.alternatives.shape[1])
        if self.siblings == sib.AUTO:
            if conf is None:
                return None, ell
            cap, n = sib.plan(self.policy.survival(conf.detach().cpu()), ell, block.first_probs, self.policy.sps, n,
                              self.sibling_rate.scale)
            ell = ell.clamp(max=cap)
        return sib.sibling_feed(block.alternatives, ell, n), ell

    # ------------------------------------------------------------------ stages
    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                generator: torch.Generator | None) -> LiveRows:
        """Feed every prompt to the target and its features to the draft; draw the first anchors."""
        dev, drf = self.target.device, self.draft
        R = len(prompts)
        pre = self.target.prefill(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        context = drf.new_state(R, dev, next(drf.fc.parameters()).dtype,
                                capacity=int(lengths.max()) + max_new_tokens + drf.block_size + 2)
        drf.append_context(context, pre.features, lengths)
        anchors = draw(pre.last_logits, self.sampling, generator)  # [R]
        history = History.start(prompts, anchors, int(lengths.max()) + max_new_tokens + 2) if self.lookup else None
        return LiveRows(requests=torch.arange(R, device=dev), anchors=anchors,
                        produced=torch.ones(R, dtype=torch.long, device=dev), context=context, history=history)

    def schedule(self, confidence: torch.Tensor | None, live: LiveRows,
                 max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ℓ per row from the policy, capped so a round never emits past the token budget.
        Returns (ℓ [n], capped [n] bool)."""
        n = live.requests.numel()
        ell = self.policy.choose(confidence, block_size=self.draft.block_size, num_requests=n).to(live.anchors.device)
        budget = (max_new_tokens - live.produced - 1).clamp(min=0)  # a round emits ℓ+1 at most
        return torch.minimum(ell, budget), ell > budget

    def verify(self, live: LiveRows, block, ell: torch.Tensor, generator: torch.Generator | None,
               feed: sib.SiblingFeed | None = None):
        """One target forward over [x0, x1..xℓ] per row (and x1's siblings, greedy), then the
        lossless acceptance rule. Returns (VerifyResult, TargetOutput, sibling taken [n] or None)."""
        T = int(ell.max()) + 1
        ids = torch.cat([live.anchors[:, None], block.tokens[:, : T - 1]], dim=1)  # [n, T]
        if feed is None:
            out = self.target.extend(ids, ell + 1)
        else:
            chain = torch.arange(T, device=ids.device)[None, :] < (ell + 1)[:, None]
            out = self.target.extend(torch.cat([ids, feed.tokens], dim=1), ell + 1,
                                     tree=lambda cached, seq_len: sib.tree_layout(feed, chain, cached, seq_len))
        greedy = self.sampling.greedy
        p = out.logits[:, :T] if greedy else warp_probs(out.logits, self.sampling)  # greedy: argmax of the logits
        q = None if greedy else block.full_probs(p.shape[-1])[:, : T - 1]  # [n, T-1, V]
        res = verify(p, q, block.tokens[:, : T - 1], ell, generator, greedy)
        if feed is None:
            return res, out, None
        res, taken = sib.rescue(res, out.logits, feed)
        if block.first_probs is not None:
            self.sibling_rate.add(block.first_probs, feed, taken)
        return res, out, taken

    def plain_step(self, live: LiveRows, generator: torch.Generator | None):
        """A step without a draft: one target forward over the anchors, one token drawn from p
        (greedy: its argmax), exactly what plain decoding does. Returns (VerifyResult, TargetOutput)."""
        n = live.requests.numel()
        one = torch.ones(n, dtype=torch.long, device=live.anchors.device)
        out = self.target.extend(live.anchors[:, None], one)
        tok = draw(out.logits[:, 0], self.sampling, generator)  # [n]
        zero = torch.zeros_like(one)
        return VerifyResult(accepted=zero, emitted=tok[:, None], num_emitted=one), out

    def commit(self, live: LiveRows, res, out, feed: sib.SiblingFeed | None = None,
               taken: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the accepted drafts + one token in both caches; the emitted token is the next anchor.
        The draft's context update waits for its next proposal, which takes it into its own first
        products (models/draft_inference.py). A tree feed keeps x0 and the sibling a row took
        (`taken`), the draft reading their features. Returns (kept [n], stopped [n])."""
        n = live.requests.numel()
        kept = _first_stop(res.emitted, res.num_emitted, self.stop_ids)  # tokens kept this round per row
        features = out.features
        if feed is not None and bool((taken >= 0).any()):  # the sibling takes x1's column in both caches
            rows, cols = sib.taken_columns(taken, feed)
            self.target.relocate(rows, cols, torch.ones_like(cols))
            if features is not None:
                features = features.clone()
                features[rows, 1] = features[rows, cols]
        self.target.commit(res.accepted + 1)
        self.draft.defer_context(live.context, features, res.accepted + 1)
        live.anchors = res.emitted[torch.arange(n, device=live.anchors.device), res.accepted]
        live.produced = live.produced + kept
        if live.history is not None:
            live.history.append(res.emitted, kept)
        last = res.emitted.gather(1, (kept - 1)[:, None]).squeeze(1)
        return kept, (kept < res.num_emitted) | torch.isin(last, self.stop_ids)

    def round(self, live: LiveRows, max_new_tokens: int, generator: torch.Generator | None, clock: Clock) -> Round:
        """plan → draft → schedule → verify → commit for every live row; a step the policy plans
        without a draft is a plain step (ℓ = 0, no draft cost)."""
        n = live.requests.numel()
        if not self.policy.plan(n):
            clock.lap("schedule")
            res, out = self.plain_step(live, generator)
            verify_ms = clock.lap("verify")
            kept, stopped = self.commit(live, res, out)
            zero = torch.zeros(n, dtype=torch.long, device=live.anchors.device)
            return Round(verify_lengths=zero, budget_capped=torch.zeros_like(zero, dtype=torch.bool),
                         accepted=res.accepted, emitted=res.emitted, kept=kept, stopped=stopped,
                         confidence_logits=None, draft_ms=0.0, verify_ms=verify_ms, drafted=False)
        copies = live.history.proposals(self.draft.block_size) if live.history is not None else None
        if copies is not None and n == 1 and bool(copies[1].all()):
            return self.copied_round(live, copies, max_new_tokens, generator, clock)
        prop = self.draft.propose(live.context, live.anchors, self.draft_sampling, generator,
                                  need_probs=not self.sampling.greedy,  # greedy verification never reads q
                                  alternatives=self._proposed_siblings())
        draft_ms = clock.lap("draft")
        ell, capped = self.schedule(prop.confidence_logits, live, max_new_tokens)
        looked = self.look_up(live, prop.block, ell, capped, max_new_tokens, copies)
        feed, ell = self.sibling_feed(prop.block, prop.confidence_logits, ell) if looked is None else (None, ell)
        clock.lap("schedule")
        res, out, taken = self.verify(live, prop.block, ell, generator, feed)
        verify_ms = clock.lap("verify")
        # what this drafted step brought, for later skip decisions: a taken sibling counts as position 1
        # accepted (the round emitted two tokens, as if x1 had been), since the gate's question is whether
        # drafting pays, siblings and all
        self.policy.observe(*self._the_drafts(ell, res.accepted, looked))
        kept, stopped = self.commit(live, res, out, feed, taken)
        chain = res.accepted if taken is None else res.accepted - (taken >= 0).long()  # a taken sibling is not the chain's
        return Round(verify_lengths=ell, budget_capped=capped, accepted=chain, emitted=res.emitted, kept=kept,
                     stopped=stopped, confidence_logits=prop.confidence_logits, draft_ms=draft_ms, verify_ms=verify_ms,
                     siblings=0 if feed is None else int(feed.tokens.shape[1]), sibling_taken=taken, looked_up=looked)

    def copied_round(self, live: LiveRows, copies: tuple[torch.Tensor, torch.Tensor], max_new_tokens: int,
                     generator: torch.Generator | None, clock: Clock) -> Round:
        """A lone row whose context repeats itself verifies the lookup's block (`look_up` sets its
        length) without running the draft, whose block it would replace; the draft takes the
        round's tokens into its context at its next proposal, as after a plain step."""
        tokens = copies[0]
        block = DraftBlock(tokens=torch.zeros_like(tokens), probs=None, markov_embeds=None)
        ell, capped = torch.zeros_like(live.produced), torch.zeros_like(live.produced, dtype=torch.bool)
        looked = self.look_up(live, block, ell, capped, max_new_tokens, copies)
        clock.lap("schedule")
        res, out, _ = self.verify(live, block, ell, generator)
        verify_ms = clock.lap("verify")
        kept, stopped = self.commit(live, res, out)
        return Round(verify_lengths=ell, budget_capped=capped, accepted=res.accepted, emitted=res.emitted, kept=kept,
                     stopped=stopped, confidence_logits=None, draft_ms=0.0, verify_ms=verify_ms, looked_up=looked)

    def look_up(self, live: LiveRows, block, ell: torch.Tensor, capped: torch.Tensor, max_new_tokens: int,
                copies: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """Rows whose context repeats itself (`copies`: History.proposals) take the lookup's block in
        place of the draft's; a round with any such row feeds no siblings. Alone, a row verifies all
        γ of it (within the budget); in a batch, where the widest row sets every row's verify width,
        no wider than the policy chose for the batch. Returns the rows that did ([n] bool), or None."""
        if copies is None:
            return None
        tokens, found = copies
        if not bool(found.any()):
            return None
        block.tokens[found] = tokens[found]
        budget = (max_new_tokens - live.produced - 1).clamp(min=0)
        width = self.draft.block_size if found.numel() == 1 else int(ell.max())
        ell[found] = budget[found].clamp(max=width)
        capped[found] = budget[found] < width
        return found

    @staticmethod
    def _the_drafts(ell: torch.Tensor, accepted: torch.Tensor,
                    looked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """What the skip gate learns from: the draft's own rows (a looked-up row verified no draft)."""
        if looked is None:
            return ell, accepted
        return torch.where(looked, 0, ell), torch.where(looked, 0, accepted)

    def mark(self, live: LiveRows) -> Callable[[], None]:
        """Where the rows stand now; calling the result rewinds target, draft and rows there, so a
        round can be run (and timed) again from the same state (engine/profile.py)."""
        target = self.target.mark()
        ctx_len, pending = live.context.ctx_len.clone(), list(live.context.pending)
        anchors, produced = live.anchors.clone(), live.produced.clone()
        history = None if live.history is None else live.history.length.clone()

        def rewind() -> None:
            self.target.rewind(target)
            live.context.ctx_len = ctx_len.clone()  # the draft's K/V past ctx_len is never read
            live.context.pending = list(pending)
            live.anchors, live.produced = anchors.clone(), produced.clone()
            if history is not None:
                live.history.length = history.clone()  # tokens past a row's length are never read
        return rewind

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 generator: torch.Generator | None = None,
                 on_round: Callable[[list[TraceRound]], None] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> RunReport:
        """Generate for all prompts in one batch. Returns outputs in prompt order. Trace rows are
        built only when `on_round` listens."""
        check_positive(max_new_tokens, "max_new_tokens")
        gamma = self.draft.block_size
        outputs = [RequestOutput(prompt_tokens=list(p), draft=AcceptanceStats(block_size=gamma)) for p in prompts]
        streams = Streams.empty(gamma)
        clock = Clock(self.target.device)
        clock.start()
        live = self.prefill(prompts, max_new_tokens, generator)
        clock.lap("prefill")
        self.policy.reset()
        self.sibling_rate = sib.SiblingRate()
        first = live.anchors.tolist()
        stop = set(self.stop_ids.tolist())
        for r, t in enumerate(first):
            outputs[r].tokens.append(t)
            if t in stop:
                outputs[r].finish_reason = "stop"
            if on_tokens:
                on_tokens(r, [t])
        finished = torch.tensor([t in stop or max_new_tokens <= 1 for t in first], device=live.anchors.device)
        round_no = [0] * len(prompts)
        steps = drafted_steps = 0
        while True:
            if bool(finished.any()):
                rows = (~finished).nonzero().flatten()
                if rows.numel() == 0:
                    break
                live.keep(rows, self.target)
            clock.lap("accept")
            rd = self.round(live, max_new_tokens, generator, clock)
            finished = rd.stopped | (live.produced >= max_new_tokens)
            requests = live.requests.tolist()
            streams.add(rd, [outputs[r].draft for r in requests])
            steps += 1
            drafted_steps += rd.drafted
            emitted, kept = rd.emitted.tolist(), rd.kept.tolist()
            for i, req in enumerate(requests):
                toks = emitted[i][: kept[i]]
                outputs[req].tokens.extend(toks)
                outputs[req].rounds += 1
                if on_tokens:
                    on_tokens(req, toks)
            for i in finished.nonzero().flatten().tolist():
                outputs[requests[i]].finish_reason = "stop" if bool(rd.stopped[i]) else "length"
            if on_round:
                on_round(trace_rows(rd, requests, round_no, gamma))
            for req in requests:
                round_no[req] += 1
        clock.lap("accept")
        times = dict(clock.totals)
        times["total"] = sum(clock.totals.values())
        return RunReport(outputs=outputs, streams=streams, times_ms=times, rounds=steps, drafted_steps=drafted_steps)


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
    logits = target.prefill(prompts).last_logits
    clock.lap("prefill")
    rows = torch.arange(R, device=dev)
    steps = 0
    while True:
        tok = draw(logits, sampling, generator)
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
    return RunReport(outputs=outputs, streams=Streams.empty(1), times_ms=times, rounds=steps)
