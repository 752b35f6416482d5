"""Verify-length schedulers: from survivals to how many drafts each request verifies.

A policy turns a step's survivals `[R, γ]` (math/admission.py: terms, candidate order, the Θ
curve, and why a rule is lossless) into verify lengths `[R]`; `Policy.choose` is the
engine-facing call for one step, `choose_batched` runs G steps `[G, R, γ]` at once (the audit
and the sweep). Each policy's `why` says why it is lossless, or why not. The spec grammar
(`static:K`, `dspark`, ...) that builds them is math/policy_spec.py.

Skipping the draft. Verifying nothing still pays for the draft; a step without one is a plain decoding step.
Before each step the engine asks `Policy.plan(R)` whether to draft at all. The answer may use only what
happened before this step (it is made before the current drafts exist), so any rule is lossless; a skipped
step emits one target token per request, exactly as plain decoding does. `static:0` never drafts. `dspark` and
`dspark-async` skip when their SPS table knows the plain step's cost (`SPSTable.has_plain`) and their estimate
of what a draft brings says that no number of verified drafts beats a plain step at this load by the margin M
(`gate_margin`): `max_{m≥1} τ*(m)/t_draft(R, R+m) ≤ (1 + M)·R/t_plain(R)` (a draft that verifies nothing never
pays), every request taken at the estimated survival profile. The estimate is a moving average of the mean
survival profile of drafted steps at least `lag` steps old (1 for dspark, 2 for dspark-async), started at each
batch from the calibration's held-out survival rates when there is one (`prior`). While skipping they draft
again after 8, 16, 32, ... (FIRST_PROBE_GAP doubling, at most `MAX_PROBE_GAP`; from the prior: PRIOR_GAP,
2·PRIOR_GAP, ...) skipped steps: a probe that refreshes the estimate and verifies what Algorithm 1 admits on
its current survivals. The gate reads that profile corrected by the acceptance verification realized on
drafted steps at least `lag` old (`Policy.observe`; math/realized.py), since predicted survivals over-promise
on task families the calibration did not see (docs/design/scheduling.md). `Policy.run_steps`
replays G consecutive steps (the sweep and the audit), one step at a time for such policies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dsparkctl.errors import UsageError
from dsparkctl.math.admission import (admission, argmax_count, early_stop_count, lengths_from_count, plain_theta,
                                      sorted_candidates, survival_from_logits)
from dsparkctl.math.realized import Realized
from dsparkctl.math.sps import SPSTable, check_table_for

MAX_PROBE_GAP = 256  # skipped steps between two probes, at most (the gap doubles from FIRST_PROBE_GAP)
FIRST_PROBE_GAP = 8  # skipped steps before the first probe once the gate closes
PRIOR_GAP = 64  # skipped steps before the first probe when the skip decision comes from the prior
EMA_WEIGHT = 0.2  # weight of the newest drafted step in the gate's moving average survival profile
GATE_MARGIN = 0.10  # drafting must beat a plain step by this share on paper (see `_Gated.drafting_pays`)
SOLO_MARGIN = 0.0  # the same for one request: no ragged rows, cache holes or compaction to pay for


def gate_margin(num_requests: int) -> float:  # what drafting must win by on paper at this load
    return SOLO_MARGIN if num_requests == 1 else GATE_MARGIN


@dataclass
class PolicyState:
    """Cross-step memory of a stateful policy (dspark, dspark-async).

    pending: dspark-async without a plain-step cost: capacities computed at the last steps,
    oldest first; the capacity used at step t is the one computed at step t-2. Before two steps
    exist the policy uses `initial_per_request` drafts per request (K = R·initial), fixed in
    advance, hence still lossless.
    step: engine steps planned so far. drafted: (step, survivals `[R, γ]`) of the last two drafted
    steps, newest last. skipped: consecutive steps planned without a draft; gap: skipped steps
    before the next probe. probe: this step drafts only to refresh the estimate.
    """

    pending: list[int] = field(default_factory=list)
    step: int = 0
    drafted: list[tuple[int, dict]] = field(default_factory=list)
    skipped: int = 0
    gap: int = FIRST_PROBE_GAP
    probe: bool = False
    profile: torch.Tensor | None = None  # moving average of the mean survival profile `[γ]` (the gate's estimate)
    unfolded: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # drafted steps not yet `lag` old
    verdicts: dict[int, bool] = field(default_factory=dict)  # drafting_pays per R for the current profile
    realized: Realized | None = None  # realized against predicted acceptance of drafted steps (the correction)
    unobserved: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class Policy:
    """A verify-length scheduler. `choose` is the engine hook; `choose_batched` runs many steps."""

    name = "policy"
    arg: str | None = None  # the spec's argument, e.g. "K" in static:K; None when it takes none
    requires_confidence = True
    needs_sps = False
    lossless = True
    never_drafts = False  # whether `plan` always answers "no draft" (static:0: plain decoding through the engine)
    why = ""

    def __init__(self, spec: str, sps: SPSTable | None = None,
                 temperatures: torch.Tensor | Sequence[float] | None = None,
                 prior: torch.Tensor | Sequence[float] | None = None):
        self.spec = spec
        self.sps = sps
        self.temperatures = None if temperatures is None else torch.as_tensor(temperatures, dtype=torch.float64)
        self.prior = None if prior is None else torch.as_tensor(prior, dtype=torch.float64).flatten()
        self.state = self.new_state()
        if self.needs_sps and sps is None:
            raise UsageError(f"policy {spec!r} needs an SPS table", "give it the engine's steps-per-second table")
        if self.needs_sps:
            check_table_for(spec, sps)

    def new_state(self) -> PolicyState | None:
        return None

    def reset(self) -> None:
        self.state = self.new_state()

    @property
    def can_skip(self) -> bool:
        """Whether `plan` may ever answer "no draft"."""
        return False

    def plan(self, num_requests: int, state: PolicyState | None = None) -> bool:
        """Before an engine step of `num_requests` requests: draft this step (True) or run a plain
        step (False)? Called exactly once per step, before `choose`; decided from earlier steps only."""
        return True

    def run_steps(self, survival: torch.Tensor, state: PolicyState | None = None,
                  accepted_if_full: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """G consecutive steps: survivals `[G, R, γ]` (used only where a step drafts) → (lengths
        `[G, R]` long, drafted `[G]` bool). A skipped step verifies nothing and drafts nothing.
        `accepted_if_full` `[G, R]`: drafts each row would accept if all γ were verified; a
        drafted step is then `observe`d with min(that, ℓ) before the next step is planned."""
        G = survival.shape[0]
        if not self.can_skip:
            return self.choose_batched(survival, state), torch.ones(G, dtype=torch.bool)
        state = state if state is not None else self.state
        out = torch.zeros(survival.shape[:2], dtype=torch.long)
        drafted = torch.zeros(G, dtype=torch.bool)
        for g in range(G):
            if self.plan(survival.shape[1], state):
                drafted[g] = True
                out[g] = self.choose_batched(survival[g: g + 1], state)[0]
                if accepted_if_full is not None:
                    self.observe(out[g], torch.minimum(accepted_if_full[g], out[g]), state)
        return out, drafted

    def observe(self, lengths: torch.Tensor, accepted: torch.Tensor, state: PolicyState | None = None) -> None:
        """After a drafted step was verified: its verify lengths `[R]` and accepted drafts `[R]`, in
        the rows' order of that step's `choose`. Only the skip gate reads them."""

    def survival(self, conf_logits: torch.Tensor) -> torch.Tensor:
        return survival_from_logits(conf_logits, self.temperatures)

    def choose(self, conf_logits: torch.Tensor | None, block_size: int | None = None,
               state: PolicyState | None = None, num_requests: int | None = None) -> torch.Tensor:
        """Verify lengths for one engine step.

        conf_logits `[R, γ]` raw (pre-sigmoid) logits, or None for a draft without a confidence
        head (then pass `block_size` and `num_requests`; only static:K accepts that).
        state: a stateful policy's memory; None uses the policy's own (`reset()` clears it).
        Returns `[R]` long verify lengths in 0..γ.
        """
        if conf_logits is None:
            if self.requires_confidence:
                raise UsageError(f"policy {self.spec!r} needs confidence logits but the draft has no "
                                 "confidence head", "use static:K (e.g. static:1 = MTP-1)")
            if block_size is None or num_requests is None:
                raise UsageError("without confidence logits pass block_size and num_requests",
                                 "pass block_size and num_requests, or the confidence logits")
            a = torch.zeros(1, num_requests, block_size, dtype=torch.float64)
        else:
            conf_logits = conf_logits.detach().cpu()  # the schedulers' arithmetic is on the host (their state too)
            if conf_logits.dim() != 2:
                raise UsageError(f"confidence logits must be [R, γ], got shape {tuple(conf_logits.shape)}",
                                 "pass one row of γ logits per request")
            if block_size is not None and conf_logits.shape[1] != block_size:
                raise UsageError(f"confidence logits have {conf_logits.shape[1]} positions, "
                                 f"block size is {block_size}", "pass logits from a draft of this block size")
            a = (self.survival(conf_logits) if self.requires_confidence
                 else torch.zeros(conf_logits.shape, dtype=torch.float64)).unsqueeze(0)
        return self.choose_batched(a, state if state is not None else self.state)[0]

    def choose_batched(self, survival: torch.Tensor, state: PolicyState | None = None) -> torch.Tensor:
        """survival `[G, R, γ]` (G consecutive steps) → lengths `[G, R]` long."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"Policy({self.spec})"


class Static(Policy):
    name, arg, requires_confidence = "static", "K", False
    why = "lossless: ℓ = K is fixed before any draft exists (static:0 is plain decoding: no draft at all)"

    def __init__(self, spec, k: int, **kw):
        super().__init__(spec, **kw)
        self.k, self.never_drafts = k, k == 0

    can_skip = property(lambda self: self.k == 0)

    def plan(self, num_requests, state=None):
        return self.k != 0

    def choose_batched(self, survival, state=None):
        G, R, gamma = survival.shape
        return torch.full((G, R), min(self.k, gamma), dtype=torch.long)


class Threshold(Policy):
    name, arg = "threshold", "t"
    why = "lossless: verifying x_k depends on c_1..c_k, which see x_0..x_{k-1} only"

    def __init__(self, spec, t: float, **kw):
        super().__init__(spec, **kw)
        self.t = t

    def choose_batched(self, survival, state=None):
        # conditional c_k = a_k / a_{k-1}
        prev = torch.cat([torch.ones_like(survival[..., :1]), survival[..., :-1]], dim=-1)
        c = torch.where(prev > 0, survival / prev.clamp(min=1e-300), torch.zeros_like(survival))
        return torch.cumprod((c >= self.t).to(torch.uint8), dim=-1).sum(-1).long()


class Survival(Policy):
    name, arg = "survival", "t"
    why = "lossless: verifying x_k depends on a_k = Π_{i≤k} c_i, which does not see x_k"

    def __init__(self, spec, t: float, **kw):
        super().__init__(spec, **kw)
        self.t = t

    def choose_batched(self, survival, state=None):
        return torch.cumprod((survival >= self.t).to(torch.uint8), dim=-1).sum(-1).long()


class _ThetaSearch(Policy):
    """Admit the top candidates by survival; how many is `count` of the Θ curve `[G, n+1]` → `[G]`."""

    needs_sps = True
    count: Callable[[torch.Tensor], torch.Tensor]  # early_stop_count or argmax_count

    def choose_batched(self, survival, state=None):
        theta, lengths = admission(survival, self.sps)
        return lengths(self.count(theta))


class _Gated(Policy):
    """What dspark and dspark-async share: the decision to draft at all (see the module doc)."""

    needs_sps = True
    lag = 1  # the estimate comes from a drafted step at least this many steps old

    def new_state(self) -> PolicyState:
        """A batch starts from the prior (the calibration's survival profile) when there is one,
        with the first probe PRIOR_GAP skipped steps away (the prior is a measured profile, not a
        guess); every batch starts alike, so a run split across processes decides as one process."""
        state = PolicyState()
        if self.prior is not None:
            state.profile, state.gap = self.prior.clone(), PRIOR_GAP
        return state

    @property
    def can_skip(self) -> bool:
        return self.sps is not None and self.sps.has_plain

    def _estimate(self, state: PolicyState) -> dict | None:
        """The newest drafted step at least `lag` steps before this one: {"survival" `[R', γ]`, ...}."""
        for step, est in reversed(state.drafted):
            if state.step - step >= self.lag:
                return est
        return None

    def _fold(self, state: PolicyState) -> None:
        """Fold the mean survival profile of every drafted step at least `lag` steps old into the
        moving average the gate reads (weight EMA_WEIGHT for the newest), and what verification of
        those steps realized into its correction."""
        while state.unfolded and state.step - state.unfolded[0][0] >= self.lag:
            _, prof = state.unfolded.pop(0)
            state.profile = prof if state.profile is None else (1 - EMA_WEIGHT) * state.profile + EMA_WEIGHT * prof
            state.verdicts = {}
        while state.unobserved and state.step - state.unobserved[0][0] >= self.lag:
            _, surv, lengths, accepted = state.unobserved.pop(0)
            state.realized = state.realized or Realized.empty(surv.shape[1])
            state.realized.add(surv, lengths, accepted)
            state.verdicts = {}

    def observe(self, lengths, accepted, state=None):
        state = state if state is not None else self.state
        if self.can_skip and state.drafted and state.drafted[-1][0] == state.step:
            surv = state.drafted[-1][1]["survival"]
            state.unobserved.append((state.step, surv, lengths.cpu().clone(), accepted.cpu().clone()))

    def drafting_pays(self, state: PolicyState, R: int) -> bool:
        """Does some number of verified drafts beat a plain step at R requests by `gate_margin(R)`,
        with the corrected moving average profile (R requests alike) as the estimate of what a draft
        brings? The margin pays for what the estimate leaves out: cache holes, ragged rows and
        compaction, none of which one request has (benchmarks/experiments/gate_solo.py). Cached per R."""
        got = state.verdicts.get(R)
        if got is None:
            profile = state.profile if state.realized is None else state.realized.correct(state.profile)
            theta, _ = admission(profile.expand(1, R, -1), self.sps)  # [1, n+1]; n = 0 verifies nothing
            got = state.verdicts[R] = float(theta[:, 1:].max()) > (1 + gate_margin(R)) * plain_theta(R, self.sps)
        return got

    def capacity(self, est: dict, R: int) -> int:
        """The Θ-maximising capacity (a count along `admission`'s order: candidates, or levels for
        a padded table) with the estimate's survivals `[R', γ]` standing for the current ones
        (R' ≠ R: their mean profile, R times). Cached per R."""
        got = est.get(R)
        if got is None:
            surv = est["survival"]
            if surv.shape[0] != R:
                surv = surv.mean(0, keepdim=True).expand(R, -1)
            got = est[R] = int(argmax_count(admission(surv.unsqueeze(0), self.sps)[0])[0])
        return got

    def plan(self, num_requests, state=None):
        state = state if state is not None else self.state
        state.step += 1
        state.probe = False
        if not self.can_skip:
            return True
        self._fold(state)
        if state.profile is None or self.drafting_pays(state, num_requests):
            state.skipped, state.gap = 0, FIRST_PROBE_GAP
            return True
        if state.skipped >= state.gap:  # a probe refreshes the estimate
            state.skipped, state.gap, state.probe = 0, min(2 * state.gap, MAX_PROBE_GAP), True
            return True
        state.skipped += 1
        return False

    def _record(self, survival: torch.Tensor, state: PolicyState | None) -> None:
        if state is not None:
            last = survival[-1]
            state.drafted = (state.drafted + [(state.step, {"survival": last.clone()})])[-2:]
            if self.can_skip:
                state.unfolded.append((state.step, last.mean(0).clone()))


class DSpark(_Gated, _ThetaSearch):
    name, count = "dspark", staticmethod(early_stop_count)
    why = ("lossless: Algorithm 1 breaks at the first candidate that does not raise Θ, so admitting "
           "(r,k) depends only on candidates ranked before it, never on x_k; whether to draft at all is "
           "decided from earlier steps")

    def choose_batched(self, survival, state=None):
        state = state if state is not None else self.state
        self._record(survival, state)
        return super().choose_batched(survival, state)


class Retrospective(_ThetaSearch):
    name, count, lossless = "retrospective", staticmethod(argmax_count), False
    why = ("BIASED: the argmax over all lengths looks at Θ after admitting (r,k+1), whose survival "
           "depends on x_k, so whether x_k is verified depends on x_k (paper Appendix A)")


class Budget(Policy):
    name, arg = "budget", "B"
    why = "lossless: a fixed count B of top candidates; the rank of (r,k) never depends on x_k"

    def __init__(self, spec, b: int, **kw):
        super().__init__(spec, **kw)
        self.b = b

    def choose_batched(self, survival, state=None):
        G, R, gamma = survival.shape
        vals, req = sorted_candidates(survival)
        return lengths_from_count(req, torch.full((G,), min(self.b, R * gamma), dtype=torch.long), R)


class DSparkAsync(_Gated):
    name, lag = "dspark-async", 2
    why = ("lossless: capacity K comes from an unrestricted search over survivals two steps old "
           "(fixed before the current drafts exist), then top-K by current survival is a per-request "
           "prefix whose membership for (r,k) does not depend on x_k (paper §5.2); whether to draft "
           "at all is decided from the same old survivals")

    def __init__(self, spec, initial_per_request: int = 1, **kw):
        self.initial = initial_per_request
        super().__init__(spec, **kw)

    def choose_batched(self, survival, state=None):
        G, R, gamma = survival.shape
        state = state if state is not None else self.state
        theta, lengths = admission(survival, self.sps)
        initial = self.initial if self.sps.padded else R * self.initial  # in admission's units
        if self.can_skip:  # one step at a time (run_steps): capacity from the newest drafted step ≥ 2 old
            caps = []
            for g in range(G):
                est = self._estimate(state) if state is not None else None
                stop = int(early_stop_count(theta[g: g + 1])[0])
                if state is not None and state.probe:  # a probe verifies what Algorithm 1 admits now
                    cap = stop
                else:  # capacity fixed in advance, then Algorithm 1's break within it
                    cap = min(initial if est is None else self.capacity(est, R), stop)
                caps.append(cap)
                self._record(survival[g: g + 1], state)
            return lengths(torch.tensor(caps, dtype=torch.long))
        own = argmax_count(theta)  # [G] capacity each step would pick
        prior = list(state.pending[-2:]) if state is not None else []
        prior = [initial] * (2 - len(prior)) + prior  # first two steps: fixed default
        cap = torch.cat([torch.tensor(prior, dtype=torch.long), own])[:G]  # step g uses own[g-2]
        if state is not None:
            state.pending = (prior + own.tolist())[-2:]
        return lengths(cap)

