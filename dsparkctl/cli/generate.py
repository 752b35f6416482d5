"""`dsparkctl generate`: lossless speculative generation with a DSpark/DFlash draft."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import typer
from rich.table import Table

from dsparkctl.cli.common import (DeviceOpt, DType, DTypeOpt, Device, JsonOpt, SeedOpt, err, guarded, out,
                                  print_json, show_progress, styled)
from dsparkctl.errors import InputError, UsageError


def register(app: typer.Typer) -> None:
    app.command("generate", help="Speculative generation: draft → schedule → verify, batched; "
                "prints text, τ and per-position acceptance.")(generate)


def acceptance_table(stats: Any, title: str) -> Table:
    """Per-position conditional acceptance and survival with 95% Wilson intervals."""
    t = Table(title=title, title_justify="left")
    for col in ("position", "reached", "accepted", "conditional c_j [95% CI]", "survival a_j [95% CI]"):
        t.add_column(col, justify="right")
    cond, surv = stats.conditional(), stats.survival()
    ci_c, ci_s = stats.conditional_interval(), stats.survival_interval()
    for j in range(stats.block_size):
        def fmt(v, ci):
            return "-" if v is None else f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        t.add_row(str(j + 1), str(stats.reached[j]), str(stats.accepted_at[j]), fmt(cond[j], ci_c[j]),
                  fmt(surv[j], ci_s[j]))
    return t


def load_policy(spec: str | None, block_size: int, sps_table: Path | None, calibration: Path | None):
    from dsparkctl.math.policies import parse_policy
    from dsparkctl.math.sps import SPSTable

    temps = None
    if calibration is not None:
        from dsparkctl.calibrate import load_temperatures
        temps = load_temperatures(calibration, gamma=block_size)
    sps = SPSTable.load(sps_table) if sps_table is not None else None
    return parse_policy(spec or f"static:{block_size}", sps=sps, temperatures=temps)


@guarded
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompt texts (or use --prompts-file/--dataset).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts-file", help="Prompts: .txt (one per line), .json, .jsonl, .parquet.")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="Built-in prompt set (mt-bench, humaneval, sharegpt) or a hub dataset id.")] = None,
    field: Annotated[Optional[str], typer.Option("--field", help="Prompt field in a JSON/JSONL/parquet/hub dataset.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Use only the first N prompts.")] = None,
    target: Annotated[Optional[str], typer.Option("--target", help="Target model: folder or hub id (default: embedded SmolLM2-135M-Instruct).")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", help="DeepSpec draft folder or hub id; 'random' for an untrained one (default: the shipped draft for the embedded target).")] = None,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Hub revision for --target/--draft.")] = None,
    policy: Annotated[Optional[str], typer.Option("--policy", help="Verify-length policy: static:K (default K = block size), threshold:t, survival:t, dspark, dspark-async, budget:B.")] = None,
    sps_table: Annotated[Optional[Path], typer.Option("--sps-table", help="SPS table for dspark/dspark-async/budget (from profile-sps).")] = None,
    calibration: Annotated[Optional[Path], typer.Option("--calibration", help="Per-position temperatures from `dsparkctl calibrate`.")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature; 0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Top-k sampling (0 = off).")] = 0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate per prompt.")] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Requests decoded together.")] = 8,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    seed: SeedOpt = 0,
    stream: Annotated[bool, typer.Option("--stream", help="Print text as it is generated (one request at a time).")] = False,
    json_out: JsonOpt = False,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write a per-round trace (JSON lines) for calibrate/sweep-scheduler.")] = None,
    baseline: Annotated[bool, typer.Option("--baseline", help="Also run plain target decoding on the same prompts; report tokens/s of both and the ratio.")] = False,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Wrap prompts in the target's chat template.")] = True,
    show_text: Annotated[bool, typer.Option("--text/--no-text", help="Print the generated text.")] = True,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow model repos to run their own code (off by default).")] = False,
) -> None:
    from dsparkctl.data.prompts import encode_prompts, load_prompts
    from dsparkctl.engine.session import open_session
    from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
    from dsparkctl.math.sampling import SamplingParams
    from dsparkctl.math.stats import AcceptanceStats
    from dsparkctl.provenance import provenance
    from dsparkctl.trace import TraceWriter

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    sources = sum(x is not None and x != [] for x in (prompts, prompts_file, dataset))
    if sources > 1:
        raise UsageError("give prompts as arguments, --prompts-file or --dataset, not several")
    if prompts:
        texts = list(prompts)
        if any(not p.strip() for p in texts):
            raise InputError("an empty prompt was given", "remove the empty argument")
    elif prompts_file is not None:
        if not prompts_file.is_file():
            raise InputError(f"prompt file {prompts_file} does not exist")
        texts = load_prompts(str(prompts_file), field=field, limit=limit)
    elif dataset is not None:
        texts = load_prompts(dataset, field=field, limit=limit)
    else:
        texts = ["Write a short poem about speculative decoding."]
    if limit:
        texts = texts[:limit]

    log = (lambda m: err.print(styled((m, "dim")))) if not json_out or show_progress() else (lambda m: None)
    sess = open_session(target, draft, device.value, dtype.value, revision, trust_remote_code, seed, log=log)
    for n in sess.notes:
        err.print(styled(("note:", "yellow"), f" {n}"))
    gamma = sess.draft.block_size
    pol = load_policy(policy, gamma, sps_table, calibration)
    engine = SpeculativeEngine(sess.adapter, sess.draft, pol, sampling, stop_token_ids=sess.stop_ids)
    ids = encode_prompts(sess.target.tokenizer, texts, chat=chat)
    tok = sess.target.tokenizer
    bs = 1 if stream else batch_size
    chunks = [list(range(i, min(i + bs, len(ids)))) for i in range(0, len(ids), bs)]

    writer = None
    if trace is not None:
        writer = TraceWriter(trace, provenance(target=sess.target.name, draft=sess.draft_name,
                                                dataset=dataset or (str(prompts_file) if prompts_file else "args"),
                                                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                                block_size=gamma, policy=pol.spec, device=str(sess.device),
                                                dtype=str(sess.dtype).replace("torch.", "")))
    # warm-up: one tiny forward so neither run pays one-time costs
    sess.plain_adapter().prefill([ids[0][:8]])

    gen = torch.Generator(device=sess.device).manual_seed(seed)
    stats = AcceptanceStats(block_size=gamma)
    times: dict[str, float] = {}
    results: list[Any] = [None] * len(ids)
    rounds = 0
    progress = None
    try:
        if show_progress() and not stream:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            progress = Progress(TextColumn("generate"), BarColumn(), TextColumn("{task.completed}/{task.total} prompts"),
                                TimeElapsedColumn(), console=err, transient=True)
            progress.start()
            task = progress.add_task("gen", total=len(ids))
        t0 = time.perf_counter()
        for chunk in chunks:
            offset = chunk[0]
            on_tokens = None
            if stream:
                out.print(styled((f"── prompt {offset + 1}", "bold")))
                state = {"ids": [], "text": ""}
                def on_tokens(_r: int, toks: list[int], state=state) -> None:
                    state["ids"].extend(toks)
                    text = tok.decode(state["ids"], skip_special_tokens=True)
                    out.print(text[len(state["text"]):], end="", markup=False, highlight=False)
                    state["text"] = text
            def on_round(rows, offset=offset):
                if writer is not None:
                    from dataclasses import replace
                    writer.write(replace(r, request=r.request + offset) for r in rows)
            rep = engine.generate([ids[i] for i in chunk], max_new_tokens, generator=gen,
                                  on_round=on_round, on_tokens=on_tokens)
            if stream:
                out.print()
            for i, o in zip(chunk, rep.outputs):
                results[i] = o
            stats = stats.merge(rep.stats)
            rounds += rep.rounds
            for k, v in rep.times_ms.items():
                times[k] = times.get(k, 0.0) + v
            if progress:
                progress.advance(task, len(chunk))
        spec_wall = time.perf_counter() - t0
        if writer is not None:
            writer.close()
            writer = None
    except BaseException as exc:
        if writer is not None:
            writer.abort(exc)
        raise
    finally:
        if progress:
            progress.stop()

    generated = sum(len(o.tokens) for o in results)
    report: dict[str, Any] = {
        "target": sess.target.name, "draft": sess.draft_name, "draft_kind": sess.draft.cfg.kind,
        "block_size": gamma, "policy": pol.spec, "device": str(sess.device),
        "dtype": str(sess.dtype).replace("torch.", ""),
        "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed},
        "prompts": len(ids), "batch_size": bs, "max_new_tokens": max_new_tokens,
        "generated_tokens": generated, "wall_s": spec_wall, "tokens_per_s": generated / spec_wall,
        "acceptance": stats.to_json(),
        "conditional_interval": stats.conditional_interval(), "survival_interval": stats.survival_interval(),
        "timing_ms": times, "engine_steps": rounds, "notes": sess.notes,
    }
    if rounds:
        per = {k: v / rounds for k, v in times.items() if k in ("draft", "verify", "schedule", "accept")}
        per["overhead"] = per.get("schedule", 0.0) + per.get("accept", 0.0)
        report["per_step_ms"] = per

    if baseline:
        plain = sess.plain_adapter()
        gen_b = torch.Generator(device=sess.device).manual_seed(seed)
        t0 = time.perf_counter()
        base_out: list[Any] = [None] * len(ids)
        for chunk in chunks:
            rep = plain_generate(plain, [ids[i] for i in chunk], max_new_tokens, sampling, sess.stop_ids, gen_b)
            for i, o in zip(chunk, rep.outputs):
                base_out[i] = o
        base_wall = time.perf_counter() - t0
        base_tokens = sum(len(o.tokens) for o in base_out)
        report["baseline"] = {"generated_tokens": base_tokens, "wall_s": base_wall,
                              "tokens_per_s": base_tokens / base_wall}
        report["speedup"] = report["tokens_per_s"] / report["baseline"]["tokens_per_s"]
        if sampling.greedy:
            report["baseline"]["identical_outputs"] = sum(a.tokens == b.tokens for a, b in zip(results, base_out))

    texts_out = [tok.decode(o.tokens, skip_special_tokens=True) for o in results]
    if json_out:
        report["requests"] = [{"index": i, "text": t, "generated_tokens": len(o.tokens),
                               "finish_reason": o.finish_reason, "rounds": o.rounds}
                              for i, (t, o) in enumerate(zip(texts_out, results))]
        print_json(report)
        return
    if show_text and not stream:
        for i, t in enumerate(texts_out):
            out.print(styled((f"── prompt {i + 1}", "bold"), " ", (f"({len(results[i].tokens)} tokens, "
                                                                   f"{results[i].finish_reason})", "dim")))
            out.print(t, markup=False, highlight=False)
    summary = Table(title=f"{sess.draft_name} ({sess.draft.cfg.kind}, γ={gamma}) on {sess.target.name} · "
                    f"policy {pol.spec} · T={temperature}", title_justify="left")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    tau = stats.tau
    summary.add_row("τ (tokens per round, bonus included)", f"{tau:.3f}" if tau else "-")
    summary.add_row("rounds / engine steps", f"{stats.rounds} / {rounds}")
    summary.add_row("generated tokens", str(generated))
    summary.add_row("speculative tokens/s", f"{report['tokens_per_s']:.1f}")
    if "per_step_ms" in report:
        p = report["per_step_ms"]
        summary.add_row("per step: draft / verify / overhead ms",
                        f"{p.get('draft', 0):.1f} / {p.get('verify', 0):.1f} / {p['overhead']:.1f}")
    if baseline:
        b = report["baseline"]
        summary.add_row("plain target tokens/s", f"{b['tokens_per_s']:.1f}")
        summary.add_row("speedup (speculative / plain)", f"{report['speedup']:.2f}×")
        if "identical_outputs" in b:
            summary.add_row("greedy outputs identical to plain", f"{b['identical_outputs']}/{len(ids)}")
    out.print(summary)
    out.print(acceptance_table(stats, "per-position acceptance (conditional = accepted/reached; "
                                      "survival = P(first j accepted))"))
