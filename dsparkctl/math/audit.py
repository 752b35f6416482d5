"""Losslessness audit: does a scheduler keep the speculative output distributed exactly as the target?

Setting. Target and draft are order-1 Markov chains over V tokens; row V of each table is the
start state (the anchor `x0`). The draft's confidence logit for slot k depends on the previously
SAMPLED token `x_{k-1}` — so the survival of later slots depends on earlier drafts, which is what
lets a look-ahead scheduler peek at `x_k` (paper Appendix A).

One round for each of G·R requests (G batches of R, consecutive steps for stateful policies):
  1. the draft samples `x_1..x_γ` from q, recording confidence logits `C[x_{k-1}]`;
  2. the policy plans the step (draft or not, from earlier steps only) and picks ℓ from the
     survivals of the steps it drafts (`Policy.run_steps`); a step without a draft has ℓ = 0;
  3. Leviathan's rule: accept `x_k` w.p. `min(1, p/q)` for k ≤ ℓ; on the first rejection sample
     from `norm(max(0, p - q))`, else the bonus from `p` after the last accepted token. The
     policy observes each drafted step's acceptances before it plans the next (`Policy.observe`).
The first output token (and the first two, running a second round when a round emits only one)
is tested against the target with a chi-square test (p-value from the regularised upper
incomplete gamma, `torch.special.gammaincc`, so no scipy is needed at run time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from dsparkctl.errors import UsageError
from dsparkctl.math.admission import admission, survival_from_logits
from dsparkctl.math.policies import Policy
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sps import SPSTable, StepGrid
from dsparkctl.math.stats import wilson_interval


@dataclass(frozen=True)
class MarkovSetting:
    name: str
    p: torch.Tensor  # [V+1, V] target next-token probabilities given the previous token (row V = start)
    q: torch.Tensor  # [V+1, V] draft next-token probabilities
    conf_logit: torch.Tensor  # [V+1] confidence logit of a slot given the previous token (may be -inf)
    gamma: int  # block size γ
    R: int  # requests per batch
    sps: SPSTable  # steps/s at B batch tokens

    @property
    def V(self) -> int:
        return self.p.shape[1]

    def first_token_target(self) -> torch.Tensor:  # [V]
        return self.p[self.V]

    def two_token_target(self) -> torch.Tensor:  # [V, V]  P(y1, y2) = p(y1|S) p(y2|y1)
        return self.p[self.V].unsqueeze(1) * self.p[: self.V]


def appendix_a() -> MarkovSetting:
    """Paper Appendix A: p=(0.7,0.3), q=(0.5,0.5), a1=0.8, SPS 1.0/0.5/0.45 at B=1,2,3,
    c2=0.9 if x1=A else 0. Second-position chains chosen so the confidences are the true
    acceptance rates: after A p=(0.6,0.4), q=(0.5,0.5) (β=0.9); after B p=(1,0), q=(0,1) (β=0)."""
    p = torch.tensor([[0.6, 0.4], [1.0, 0.0], [0.7, 0.3]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    logit = lambda c: math.log(c / (1 - c)) if 0 < c < 1 else (-math.inf if c == 0 else math.inf)  # noqa: E731
    conf = torch.tensor([logit(0.9), logit(0.0), logit(0.8)], dtype=torch.float64)
    return MarkovSetting("appendix-a", p, q, conf, gamma=2, R=1, sps=SPSTable([1, 2, 3], [1.0, 0.5, 0.45]))


def random_setting(gen: torch.Generator, V: int | None = None, gamma: int | None = None,
                   R: int | None = None) -> MarkovSetting:
    """A random small setting: Dirichlet chains, token-dependent confidence logits, random
    decreasing staircase SPS table (so look-ahead and early stop can disagree)."""
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    V = V or ri(2, 5)
    gamma = gamma or ri(2, 4)
    R = R or ri(1, 4)
    conc = torch.full((V,), 0.7, dtype=torch.float64)
    dirichlet = lambda n: torch._standard_gamma(conc.expand(n, V).contiguous(), generator=gen)  # noqa: E731
    p = dirichlet(V + 1)
    p = p / p.sum(1, keepdim=True)
    q = 0.5 * p + 0.5 * dirichlet(V + 1)  # related but different
    q = q / q.sum(1, keepdim=True)
    conf = torch.randn(V + 1, generator=gen, dtype=torch.float64) * 2.5 + 1.0
    nmax = R * (gamma + 1)
    step_time = 1.0 + torch.cumsum(torch.rand(nmax, generator=gen, dtype=torch.float64) ** 4, 0) * 0.3
    sps = SPSTable(list(range(1, nmax + 1)), (1.0 / step_time).tolist())
    return MarkovSetting(f"random(V={V},γ={gamma},R={R})", p, q, conf, gamma, R, sps)


def with_plain_step(s: MarkovSetting, seed: int = 0, verify: str = "padded") -> MarkovSetting:
    """`s` with a step grid that knows a plain step's cost, priced at the edge of what the
    predicted survivals promise: the plain step's throughput is the median of the best drafted Θ
    over sampled blocks. The skip gate corrects those survivals by realized acceptance, so it
    closes (and probes) where drafts bring less than predicted and stays open where they bring more.
    `verify`: the grid's layout (padded: the policies admit whole levels; ragged: candidates)."""
    t = list(range(1, s.gamma + 2))
    ms = [1000.0 / float(s.sps.sps(torch.tensor(float(s.R * k)))) for k in t]
    ms = [max(ms[: i + 1]) for i in range(len(ms))]  # monotone
    gen = torch.Generator().manual_seed(seed)
    conf = torch.empty(512 * s.R, s.gamma, dtype=torch.float64)
    prev = torch.full((512 * s.R,), s.V, dtype=torch.long)
    for k in range(s.gamma):
        conf[:, k] = s.conf_logit[prev]
        prev = _categorical(s.q[prev], gen)
    drafted = SPSTable(s.sps.batch_tokens, s.sps.steps_per_sec, grid=StepGrid([s.R], t, [ms], verify=verify))
    best = admission(survival_from_logits(conf.view(512, s.R, s.gamma)), drafted)[0].max(dim=1).values  # [512]
    plain_ms = 1000.0 * s.R / float(best.median())
    grid = StepGrid([s.R], t, [ms], [min(plain_ms, ms[0])], verify=verify)
    sps = SPSTable(s.sps.batch_tokens, s.sps.steps_per_sec, grid=grid)
    return MarkovSetting(f"{s.name}+plain" + ("" if verify == "padded" else f"-{verify}"), s.p, s.q, s.conf_logit,
                         s.gamma, s.R, sps)


def over_confident(s: MarkovSetting, shift: float = 3.0) -> MarkovSetting:
    """`s` (priced by `with_plain_step`) with every confidence logit raised by `shift`: the drafts
    promise more than they bring, so the skip gate's realized correction decides (`Policy.observe`)."""
    return replace(s, name=f"{s.name}+overconfident", conf_logit=s.conf_logit + shift)


def _categorical(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One sample per row of `probs` `[M, V]` by inverse CDF → `[M]` long."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=probs.dtype) * cdf[:, -1:]
    return (u >= cdf).sum(-1).clamp(max=probs.shape[1] - 1)


def simulate_round(s: MarkovSetting, policy: Policy, anchors: torch.Tensor, gen: torch.Generator,
                   state=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One speculative round per request. anchors `[G, R]` (token ids, V = start state).

    Returns (tokens `[G·R, γ+1]` emitted in order, n_out `[G·R]` = accepted + 1, ℓ `[G·R]`,
    drafted `[G]` bool: the steps the policy ran a draft for).
    """
    G, R = anchors.shape
    M, gamma = G * R, s.gamma
    x0 = anchors.reshape(M)
    x = torch.empty(M, gamma, dtype=torch.long)
    conf = torch.empty(M, gamma, dtype=torch.float64)
    prev = x0
    for k in range(gamma):  # the draft's sequential head: slot k sees x_{k-1}
        conf[:, k] = s.conf_logit[prev]
        x[:, k] = _categorical(s.q[prev], gen)
        prev = x[:, k]
    prevs = torch.cat([x0.unsqueeze(1), x[:, :-1]], dim=1)  # [M, γ] token before each slot
    px, qx = s.p[prevs, x], s.q[prevs, x]
    u = torch.rand(M, gamma, generator=gen, dtype=torch.float64)
    acc_if_full = torch.cumprod((u * qx < px).to(torch.uint8), dim=1).sum(1)  # [M]: the coins do not depend on ℓ
    ell, drafted = policy.run_steps(survival_from_logits(conf.view(G, R, gamma), policy.temperatures), state,
                                    acc_if_full.view(G, R))  # the gate sees each step's outcome before the next
    ell = ell.reshape(M)
    acc = torch.minimum(acc_if_full, ell)  # [M]
    last = torch.cat([x0.unsqueeze(1), x], dim=1).gather(1, acc.unsqueeze(1)).squeeze(1)
    rejected = acc < ell
    resid = (s.p[last] - s.q[last]).clamp(min=0)
    resid_ok = resid.sum(1, keepdim=True) > 0
    dist = torch.where(rejected.unsqueeze(1) & resid_ok, resid, s.p[last])
    extra = _categorical(dist, gen)
    tokens = torch.cat([x, torch.zeros(M, 1, dtype=torch.long)], dim=1)
    tokens.scatter_(1, acc.unsqueeze(1), extra.unsqueeze(1))
    return tokens, acc + 1, ell, drafted


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """Pearson chi-square of observed `counts` against `probs` (same shape). → (stat, p-value, dof).
    Cells with zero expected probability must be empty, else the statistic is infinite."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    live = probs > 0
    if bool((counts[~live] > 0).any()):
        return math.inf, 0.0, int(live.sum()) - 1
    exp = n * probs[live]
    stat = float(((counts[live] - exp) ** 2 / exp).sum())
    dof = int(live.sum()) - 1
    if dof <= 0:
        return stat, 1.0, dof
    pval = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))
    return stat, pval, dof


@dataclass
class AuditResult:
    policy: str
    setting: str
    rounds: int  # request-rounds sampled (first round)
    first_stat: float
    first_p: float
    first_dof: int
    pair_stat: float
    pair_p: float
    pair_dof: int
    p_token0: float  # observed P(first token = token 0) ("A" in Appendix A)
    p_token0_ci: tuple[float, float]
    target_token0: float
    mean_verify: float
    claimed_lossless: bool
    alpha: float
    drafted_share: float = 1.0  # steps that ran a draft (below 1: the skip-the-draft path ran)

    @property
    def passed(self) -> bool:
        return self.first_p >= self.alpha and self.pair_p >= self.alpha

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["p_token0_ci"] = list(self.p_token0_ci)
        d["verdict"] = "pass" if self.passed else "FAIL"
        for k in ("first_stat", "pair_stat"):
            if math.isinf(d[k]):
                d[k] = None
        return d


def check_alpha(alpha: float, name: str = "the significance level alpha") -> None:
    """The significance level must be in (0, 1): at α = 0 every p-value "passes", biased or not.
    `name` is what the caller calls it in the message (`run_audit`: `option("alpha")`)."""
    if not 0.0 < alpha < 1.0:  # also refuses NaN
        raise UsageError(f"{name} {alpha} must be in (0, 1); at 0 even a biased policy passes",
                         "use a small positive level, e.g. 0.001")


def audit_policy(s: MarkovSetting, policy: Policy, rounds: int, gen: torch.Generator,
                 alpha: float = 1e-3, chunk: int = 100_000) -> AuditResult:
    """Run ≥ `rounds` request-rounds of `policy` on setting `s` and test the output distribution."""
    check_alpha(alpha)
    V = s.V
    groups = max(1, math.ceil(rounds / s.R))
    state = policy.new_state()
    first = torch.zeros(V, dtype=torch.long)
    pair = torch.zeros(V, V, dtype=torch.long)
    ell_sum = 0
    steps = drafted_steps = 0
    done = 0
    while done < groups:
        g = min(chunk, groups - done)
        anchors = torch.full((g, s.R), V, dtype=torch.long)
        tok, n_out, ell, d1 = simulate_round(s, policy, anchors, gen, state)
        y1 = tok[:, 0]
        tok2, _, _, d2 = simulate_round(s, policy, y1.view(g, s.R), gen, state)  # next round after y1
        steps += 2 * g
        drafted_steps += int(d1.sum()) + int(d2.sum())
        y2 = torch.where(n_out >= 2, tok[:, 1], tok2[:, 0])
        first += torch.bincount(y1, minlength=V)
        pair += torch.bincount(y1 * V + y2, minlength=V * V).view(V, V)
        ell_sum += int(ell.sum())
        done += g
    n = groups * s.R
    f_stat, f_p, f_dof = chi_square(first, s.first_token_target())
    p_stat, p_p, p_dof = chi_square(pair, s.two_token_target())
    k0 = int(first[0])
    return AuditResult(policy.spec, s.name, n, f_stat, f_p, f_dof, p_stat, p_p, p_dof, k0 / n, wilson_interval(k0, n),
                       float(s.first_token_target()[0]), ell_sum / n, policy.lossless, alpha, drafted_steps / steps)


def audit_policies(specs: Sequence[str], rounds: int, random_settings: int = 3, alpha: float = 1e-3,
                   seed: int = 0, plain_rounds: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> list[AuditResult]:
    """Every policy spec on Appendix A and on `random_settings` random settings, each also with a
    plain-step price (`with_plain_step`, `plain_rounds` request-rounds there; default `rounds`)
    in the padded layout, and the first random setting of ≥ 2 requests also in the ragged one
    (the layouts differ only there) and over-confident (`over_confident`); one result per pair,
    settings outer. Unknown specs fail before any simulation; every run is seeded from `seed`.
    `progress(done, total)` is told after each run."""
    check_alpha(alpha)
    settings = [appendix_a(), with_plain_step(appendix_a(), seed)]
    sgen = torch.Generator().manual_seed(10_000 + seed)
    ragged = False
    for _ in range(random_settings):
        r = random_setting(sgen)
        settings += [r, with_plain_step(r, seed)]
        if r.R >= 2 and not ragged:  # the layouts differ only with ≥ 2 requests
            settings += [with_plain_step(r, seed, "ragged"), over_confident(with_plain_step(r, seed))]
            ragged = True
    for spec in specs:
        parse_policy(spec, sps=settings[0].sps)
    results = []
    for si, s in enumerate(settings):
        for spec in specs:
            gen = torch.Generator().manual_seed(seed * 7919 + si)
            n = plain_rounds if plain_rounds is not None and s.sps.has_plain else rounds
            results.append(audit_policy(s, parse_policy(spec, sps=s.sps), n, gen, alpha))
            if progress is not None:
                progress(len(results), len(settings) * len(specs))
    return results
