"""Running many prompts in batches: the one loop behind `generate`, its baseline and `eval-acceptance`.

Prompts are cut into consecutive batches of `batch_size` (batch i = prompts[i·bs : (i+1)·bs]).
Each batch draws from its own random generator, seeded from (seed, batch index), so what a
batch produces does not depend on which process runs it or in what order: a run split across
ranks (`dsparkctl.distributed`) merges into exactly the single-process result. Trace rows and
streamed tokens are renumbered from batch rows to prompt indices.

A *decoder* is anything with the engine's `generate` signature, bound to its settings:
`speculative_decoder(engine, n)` or `plain_decoder(adapter, n, sampling, stop_ids)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Protocol, Sequence

import torch

from dsparkctl.distributed import DATA_PARALLEL, Split
from dsparkctl.engine.rounds import RequestOutput, RunReport, Streams
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.errors import UsageError, option
from dsparkctl.formats.trace import TraceRound
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.stats import AcceptanceStats
from dsparkctl.models.target import TargetAdapter

OnRound = Callable[[list[TraceRound]], None]
OnTokens = Callable[[int, list[int]], None]


class Decoder(Protocol):
    def __call__(self, prompts: list[list[int]], generator: torch.Generator, on_round: OnRound | None,
                 on_tokens: OnTokens | None) -> RunReport: ...


def speculative_decoder(engine: SpeculativeEngine, max_new_tokens: int) -> Decoder:
    def decode(prompts, generator, on_round, on_tokens):
        return engine.generate(prompts, max_new_tokens, generator=generator, on_round=on_round, on_tokens=on_tokens)
    return decode


def plain_decoder(adapter: TargetAdapter, max_new_tokens: int, sampling: SamplingParams,
                  stop_token_ids: Sequence[int]) -> Decoder:
    def decode(prompts, generator, on_round, on_tokens):
        return plain_generate(adapter, prompts, max_new_tokens, sampling, stop_token_ids, generator)
    return decode


def batch_ranges(n: int, batch_size: int) -> list[range]:
    """Consecutive prompt index ranges of at most batch_size (the unit of work and of seeding)."""
    return [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def batch_generator(device: torch.device | str, seed: int, index: int) -> torch.Generator:
    """The generator of batch `index`: a function of (seed, index) only."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)


@dataclass
class PromptsResult:
    outputs: list[RequestOutput | None]  # prompt order; None for prompts this process did not run
    streams: Streams | None  # each proposer's outcomes, merged over batches (None for plain decoding)
    times_ms: dict[str, float] = field(default_factory=dict)  # summed engine phase times
    rounds: int = 0  # engine steps
    drafted_steps: int = 0  # engine steps that speculated, drafted or copied (the policy planned the rest as plain steps)
    wall_s: float = 0.0
    trace_rows: list[TraceRound] = field(default_factory=list)  # merged runs only (distributed)

    @property
    def stats(self) -> AcceptanceStats | None:
        """The draft's own acceptance (None for plain decoding)."""
        return None if self.streams is None else self.streams.draft

    @property
    def generated(self) -> int:
        return sum(len(o.tokens) for o in self.outputs if o is not None)

    def add(self, outputs: Iterable[tuple[int, RequestOutput]], streams: Streams | None, rounds: int,
            times_ms: dict[str, float], drafted_steps: int = 0) -> None:
        """Fold in one batch's or one rank's part: outputs by prompt index, summed statistics and times."""
        for i, o in outputs:
            self.outputs[i] = o
        if self.streams is not None:
            self.streams = self.streams.merge(streams)
        self.rounds += rounds
        self.drafted_steps += drafted_steps
        for k, v in times_ms.items():
            self.times_ms[k] = self.times_ms.get(k, 0.0) + v


def run_prompts(decode: Decoder, prompts: Sequence[Sequence[int]], batch_size: int, seed: int,
                device: torch.device | str, *, block_size: int | None = None, batches: Sequence[int] | None = None,
                on_round: OnRound | None = None, on_tokens: OnTokens | None = None,
                on_batch: Callable[[int, int], None] | None = None, split: Split = DATA_PARALLEL) -> PromptsResult:
    """Decode `prompts` batch by batch (only the batch indices in `batches`, when given).

    block_size: the draft's γ when `decode` is speculative (acceptance statistics are merged),
    None for plain decoding. `split`: how the batches are shared among torchrun ranks (the
    session's `split`); a divided run hands `on_round` the merged rows once, at the end."""
    ranges = batch_ranges(len(prompts), batch_size)
    todo = list(range(len(ranges))) if batches is None else list(batches)
    shard = split.active and batches is None
    if shard:  # under torchrun: this rank's batches; rows are buffered and merged on every rank below
        if on_tokens:
            raise UsageError("streaming tokens is for one process", f"drop {option('stream')} under torchrun")
        todo = split.mine(todo)
        rows: list[TraceRound] = []
        final_on_round, on_round = on_round, rows.extend  # every rank keeps its rows (writers are rank-aware)
    res = PromptsResult(outputs=[None] * len(prompts), streams=Streams.empty(block_size) if block_size else None)
    t0 = time.perf_counter()
    for done, b in enumerate(todo, 1):
        idx = ranges[b]
        base = idx.start
        shifted_round = (lambda rows, base=base: on_round([replace(r, request=r.request + base) for r in rows])
                         ) if on_round else None
        shifted_tokens = (lambda r, toks, base=base: on_tokens(r + base, toks)) if on_tokens else None
        rep = decode([list(prompts[i]) for i in idx], batch_generator(device, seed, b), shifted_round, shifted_tokens)
        res.add(zip(idx, rep.outputs), rep.streams, rep.rounds, rep.times_ms, rep.drafted_steps)
        if on_batch:
            on_batch(done, len(todo))
    res.wall_s = time.perf_counter() - t0
    if shard:
        res = _merge(split.merged((res, rows)), len(prompts), block_size)
        if final_on_round:
            final_on_round(res.trace_rows)
    return res


def _merge(pieces: list[tuple[PromptsResult, list[TraceRound]]], n: int, block_size: int | None) -> PromptsResult:
    """Every rank's part of a run -> the one-process result (outputs in prompt order, summed
    statistics and times, the slowest rank's wall time, trace rows ordered by request and round)."""
    out = PromptsResult(outputs=[None] * n, streams=Streams.empty(block_size) if block_size else None)
    for part, _ in pieces:
        out.add(((i, o) for i, o in enumerate(part.outputs) if o is not None), part.streams, part.rounds,
                part.times_ms, part.drafted_steps)
        out.wall_s = max(out.wall_s, part.wall_s)
    out.trace_rows = sorted((r for _, rows in pieces for r in rows), key=lambda r: (r.request, r.round))
    return out
