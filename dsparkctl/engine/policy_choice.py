"""Which verify-length policy a session runs: the default for its draft, built from its SPS table
and calibration files, and what the user must be told about it (a calibration for another draft,
a table profiled elsewhere, a scheduler that chose to draft rarely).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsparkctl.engine.session import Session
from dsparkctl.formats.calibration import calibration_draft_notes, load_survival_prior, load_temperatures
from dsparkctl.formats.sps import check_block_size, condition_notes, load_sps_table
from dsparkctl.formats.trace import RoundCounts, describe_rounds, recording_fix, recording_hint
from dsparkctl.math.policies import Policy
from dsparkctl.math.policy_spec import check_spec_fits, parse_policy, parse_spec
from dsparkctl.math.sps import SPSTable, check_table_for

DEFAULT_POLICY = "dspark"  # what won at batch 1 in benchmarks/bench_policies.py (docs/scheduling.md)


def default_policy(sess: Session) -> str:
    """The policy `generate` runs without --policy: DEFAULT_POLICY for a draft with a confidence
    head (with this machine's cached SPS table and the draft's calibration), else static:γ."""
    return DEFAULT_POLICY if sess.draft.confidence_head is not None else f"static:{sess.draft.block_size}"


def recording_policy(sess: Session) -> tuple[str, str | None]:
    """The policy `generate --trace` runs without --policy, and what the user is told: static:γ,
    every position verified, since a trace is read by `calibrate` (per-position acceptance, unbiased
    only when no policy chose which positions to verify) and `sweep-scheduler` (which replays full
    verification). The default policy would record plain steps wherever it skips the draft."""
    full = f"static:{sess.draft.block_size}"
    default = default_policy(sess)
    if default == full:
        return full, None
    return full, (f"--trace without --policy records with {full} (every position verified, as calibrate and "
                  f"sweep-scheduler need) instead of the default {default}; pass --policy {default} to record "
                  f"what {default} runs")


def trace_note(counts: RoundCounts, header: dict, path: Path) -> str | None:
    """What the user must be told about a trace just written that `calibrate` or `sweep-scheduler`
    cannot (fully) use; None when every round is a drafted round with every position verified."""
    if counts.rounds and counts.full and counts.drafted == counts.rounds and not counts.short:
        return None
    what = describe_rounds(counts, header, path)
    if not counts.verified:
        return f"{what}; calibrate and sweep-scheduler cannot use it: {recording_fix(counts, header, path)}"
    if not counts.short:
        return (f"{what}; calibrate and sweep-scheduler use only its {counts.drafted} drafted rounds, those the "
                f"policy chose to draft in: {recording_hint(header, path)}")
    return (f"{what}; sweep-scheduler needs every position verified, and calibrate would fit only on the "
            f"positions the policy chose: {recording_hint(header, path)}")


@dataclass(frozen=True)
class PolicyPlan:
    """A policy's spec and every file it reads, checked (`plan_policy`); built once with `build`."""
    spec: str
    block_size: int
    temperatures: list[float] | None = None  # the calibration's STS temperatures
    prior: list[float] | None = None  # the calibration's held-out survival profile
    sps: SPSTable | None = None  # the table given by file; None: none given

    @property
    def needs_machine_table(self) -> bool:
        """The policy plans with step costs and no table was given: this machine's is needed."""
        return self.sps is None and parse_spec(self.spec)[0].needs_sps

    def build(self, sps: SPSTable | None = None) -> Policy:
        table = self.sps if sps is None else sps
        if table is not None:
            check_block_size(table, self.block_size)
        return parse_policy(self.spec, sps=table, temperatures=self.temperatures, prior=self.prior)


def plan_policy(spec: str | None, block_size: int, sps_table: Path | None, calibration: Path | None) -> PolicyPlan:
    """Check a policy spec (name, argument, fit to the block) and read the files it may need (the
    SPS table and the calibration), building nothing: every input fails here, before slow work."""
    spec = spec or f"static:{block_size}"
    check_spec_fits(spec, block_size)
    temps = prior = None
    if calibration is not None:
        temps = load_temperatures(calibration, gamma=block_size)
        prior = load_survival_prior(calibration, block_size)
    sps = load_sps_table(sps_table) if sps_table is not None else None
    if sps is not None:
        check_block_size(sps, block_size)
        if parse_spec(spec)[0].needs_sps:
            check_table_for(spec, sps)
    return PolicyPlan(spec, block_size, temps, prior, sps)


def load_policy(spec: str | None, block_size: int, sps_table: Path | None, calibration: Path | None,
                sps: SPSTable | None = None) -> Policy:
    """A verify-length policy from its spec, with the SPS table (a file, or `sps` itself) and the STS
    temperatures it may need: `plan_policy` and `PolicyPlan.build` in one call."""
    return plan_policy(spec, block_size, sps_table, calibration).build(sps)


def calibration_notes(calibration: Path | None, sess: Session) -> list[str]:
    """Refuse a calibration fitted for another draft (one line); note one that does not say."""
    if calibration is None:
        return []

    return calibration_draft_notes(calibration, sess.draft.fingerprint())


def policy_notes(policy: Policy, sess: Session) -> list[str]:
    """What the user must be told about a policy's SPS table in this session: other conditions
    (machine, threads, kernels, target) than it was profiled under, or no plain-step price (so
    the policy can never skip the draft)."""

    if policy.sps is None:
        return []
    notes = condition_notes(policy.sps, sess.conditions(), target=sess.target.name)
    if hasattr(policy, "lag") and not policy.sps.has_plain:
        notes.append(f"{policy.sps.source} has no plain-step entry, so {policy.spec} can never skip the draft; "
                     "profile again with `dsparkctl profile-sps` (it times a plain step too)")
    return notes


RARELY = 0.25  # a policy that drafted in fewer of the steps than this is said to have drafted rarely


def scheduler_note(pol: Policy, drafted: int, steps: int, requests: int, gamma: int) -> str | None:
    """Why a policy that may skip the draft drafted in few of the steps, from the step costs it
    planned with; None when it drafted in most steps (or cannot skip)."""
    sps = pol.sps
    if not steps or drafted >= RARELY * steps or sps is None or not sps.has_plain:
        return None
    import torch

    plain = sps.plain_seconds(requests) * 1000
    one = float(sps.step_seconds(requests, torch.tensor([2.0 * requests]))[0]) * 1000
    full = float(sps.step_seconds(requests, torch.tensor([(gamma + 1.0) * requests]))[0]) * 1000
    how = "never drafted" if drafted == 0 else f"drafted in {drafted} of {steps} steps"
    return (f"the scheduler {how}: at {requests} request(s) a plain step costs {plain:.1f} ms, a round verifying "
            f"1 draft {one:.1f} ms ({one / plain:.2f}x) and {gamma} drafts {full:.1f} ms ({full / plain:.2f}x), so "
            f"a round pays only where the draft's calibrated confidences promise more than that many tokens, and "
            f"they seldom did; the speedup below is the scheduler's choice against plain decoding, not what "
            f"drafting every step would give (policy static:2 drafts every step)")
