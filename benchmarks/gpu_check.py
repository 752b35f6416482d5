"""The device check: correctness of the CUDA path, and speed on models of real shapes.

Run by benchmarks/gpu_check.sh on the lent GPU machine (its own python3, torch and transformers;
nothing fetched). Writes under $OUT: summary.txt (everything below, one line each), results.json,
sps_<model>.json and sps_<model>.png (whole-step vs target-forward curves).

1. correctness (tiny random Llama and Qwen3 targets, fp32 and bf16): greedy speculative output
   equals plain greedy output at batch 1 and in a ragged batch of 8; the verification rule's
   output law passes a chi-square test on the device; `generate` runs end to end (CLI).
2. speed on random-initialised models of real shapes (benchmarks/configs): SmolLM2-135M,
   Qwen3-0.6B, Qwen3-8B, bf16: the SPS table measured both ways (whole step and target forward)
   and the engine's per-round overhead (time outside the two models' forwards) at batch 1, 8, 64,
   with device synchronisation before every clock read.

DSPARKCTL_GPU_DRYRUN=1 runs the same steps on the CPU with shrunken shapes (the registry-free
dry run here). Every step is timed; a failing step is recorded and the rest still run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import provenance_of  # noqa: E402 - benchmarks/provenance.py (this script's folder)

from dsparkctl.engine.profile import profile_sps, profile_whole_step, table_from_points  # noqa: E402
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate  # noqa: E402
from dsparkctl.math.policy_spec import parse_policy  # noqa: E402
from dsparkctl.math.sampling import SamplingParams  # noqa: E402
from dsparkctl.models.draft_io import random_draft  # noqa: E402
from dsparkctl.models.target import TargetAdapter  # noqa: E402

DRY = os.environ.get("DSPARKCTL_GPU_DRYRUN") == "1"
DEV = torch.device("cpu" if DRY else "cuda")
OUT = Path(os.environ.get("OUT", ROOT / "gpu-out"))
OUT.mkdir(parents=True, exist_ok=True)
LINES: list[str] = []
RESULTS: dict = {"device": str(DEV), "dry_run": DRY, "steps": {}, **provenance_of(__file__)}


def say(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)
    (OUT / "summary.txt").write_text("\n".join(LINES) + "\n")


def step(name: str):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            res = fn()
            RESULTS["steps"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1), "result": res}
            say(f"[ok {time.perf_counter() - t0:.0f}s] {name}")
        except Exception as exc:  # noqa: BLE001 - record and go on: one device call must report everything
            RESULTS["steps"][name] = {"ok": False, "seconds": round(time.perf_counter() - t0, 1),
                                      "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            say(f"[FAILED {time.perf_counter() - t0:.0f}s] {name}: {type(exc).__name__}: {exc}")
        (OUT / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")
        return fn
    return wrap


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


say(f"device {DEV} ({torch.cuda.get_device_name(0) if DEV.type == 'cuda' else 'cpu dry run'}), torch "
    f"{torch.__version__}, python {sys.version.split()[0]}")
import transformers  # noqa: E402

say(f"transformers {transformers.__version__}")


# ------------------------------------------------------------------------------------------------ 1
@step("greedy identity, tiny Llama/Qwen3, fp32+bf16, batch 1 and ragged 8")
def _identity():
    from tests.tiny_models import bigram_oracle_draft, tiny_target

    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17], [20], [21, 22, 23], [30, 31],
               [40, 41, 42, 43, 44, 45], [50]]
    out = {}
    for family in ("llama", "qwen3"):
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny_target(family).to(DEV, dtype)
            tgt = TargetAdapter(model, [0, 1])
            draft = bigram_oracle_draft(tgt, prompts, layer_ids=[0, 1])
            eng = SpeculativeEngine(tgt, draft, parse_policy("static:4"), SamplingParams(0.0))
            ref = plain_generate(TargetAdapter(model), prompts, 40, SamplingParams(0.0))
            batch = eng.generate(prompts, 40)
            single = [eng.generate([p], 40).outputs[0].tokens for p in prompts]
            ok8 = sum(a.tokens == b.tokens for a, b in zip(batch.outputs, ref.outputs))
            ok1 = sum(a == b.tokens for a, b in zip(single, ref.outputs))
            key = f"{family}-{str(dtype).replace('torch.', '')}"
            out[key] = {"batch8_identical": ok8, "batch1_identical": ok1, "of": len(prompts), "tau": batch.stats.tau}
            say(f"  {key}: identical at batch 8 {ok8}/8, at batch 1 {ok1}/8, τ {batch.stats.tau:.2f}")
            if dtype == torch.float32:
                assert ok8 == ok1 == len(prompts), key
    return out


@step("verification rule chi-square on the device")
def _chi2():
    from scipy.stats import chisquare

    from dsparkctl.math.verify import verify

    g = torch.Generator(device=DEV).manual_seed(0)
    V, n = 6, 200_000
    p = torch.softmax(torch.randn(1, 2, V, generator=g, device=DEV), -1).expand(n, 2, V).contiguous()
    q = torch.softmax(torch.randn(1, 1, V, generator=g, device=DEV) * 2, -1).expand(n, 1, V).contiguous()
    x = torch.multinomial(q[:, 0], 1, generator=g)  # drafts drawn from q
    res = verify(p, q, x, torch.ones(n, dtype=torch.long, device=DEV), g, False)
    first = res.emitted[:, 0].cpu()
    obs = torch.bincount(first, minlength=V).double()
    stat, pval = chisquare(obs.numpy(), (p[0, 0].double().cpu() * n).numpy())
    say(f"  first-token law vs target: chi2 {stat:.1f}, p = {pval:.3f}")
    assert pval > 1e-3
    return {"chi2": stat, "p": pval}


@step("generate end to end (CLI, tiny target)")
def _generate_cli():
    import subprocess

    from tests.tiny_models import save_tiny_target

    d = Path(tempfile.mkdtemp())
    save_tiny_target(d / "t", "qwen3")
    dev = "cpu" if DRY else "cuda"
    r = subprocess.run([sys.executable, "-m", "dsparkctl", "generate", "--target", str(d / "t"), "--draft", "random",
                        "--device", dev, "--dtype", "bf16", "--max-new-tokens", "16", "--baseline", "--json",
                        "--no-text", "w5 w6 w7", "w8 w9"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-500:]
    rep = json.loads(r.stdout)
    say(f"  generate on {rep['device']}: {rep['generated_tokens']} tokens, speedup field {rep['speedup']:.2f}")
    return {"device": rep["device"], "tokens": rep["generated_tokens"]}


# ------------------------------------------------------------------------------------------------ 2
def real_shape(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((ROOT / "benchmarks" / "configs" / f"{name}.json").read_text())
    if DRY:  # same family, a few layers, small width: the code path, not the speed
        cfg.update(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=min(cfg["vocab_size"], 4096))
        cfg.update({k: min(v, cfg["vocab_size"] - 1) for k, v in cfg.items() if k.endswith("token_id") and v})
    config = AutoConfig.for_model(**cfg)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if DRY else torch.bfloat16)
    return model.eval()


def speed(name: str, gamma: int, layers: int):
    model = real_shape(name)
    L = model.config.num_hidden_layers
    taps = sorted({1, L // 2, L - 3})
    probe = TargetAdapter(model, ())
    draft = random_draft(probe, num_layers=layers, block_size=gamma, markov_rank=64, layer_ids=taps)
    adapter = TargetAdapter(model, taps)
    engine = SpeculativeEngine(adapter, draft, parse_policy(f"static:{gamma}"), SamplingParams(0.0))
    reqs = [1, 8, 64] if not DRY else [1, 2]
    toks = list(range(1, gamma + 2))
    ctx = 512 if not DRY else 32
    reps = 5 if not DRY else 2
    t = time.perf_counter()
    whole = table_from_points(profile_whole_step(engine, reqs, toks, ctx, repeats=reps, warmup=2))
    tf = table_from_points(profile_sps(TargetAdapter(model, ()), reqs, toks, ctx, repeats=reps, warmup=2))
    prof_s = time.perf_counter() - t
    overhead = {}
    for R in reqs:
        prompts = torch.randint(0, model.config.vocab_size, (R, ctx)).tolist()
        engine.generate(prompts, 4)  # warm-up
        rep = engine.generate(prompts, 32 if not DRY else 8)
        tm = rep.times_ms
        loop = tm["total"] - tm.get("prefill", 0.0)
        outside = tm.get("schedule", 0.0) + tm.get("accept", 0.0)
        overhead[R] = {"rounds": rep.rounds, "round_ms": loop / max(rep.rounds, 1), "outside_share": outside / loop,
                       "draft_share": tm.get("draft", 0.0) / loop}
        say(f"  {name} batch {R}: round {loop / max(rep.rounds, 1):.1f} ms, outside the forwards "
            f"{100 * outside / loop:.1f}%, draft {100 * tm.get('draft', 0.0) / loop:.1f}%")
    for label, (bt, sps) in (("whole-step", whole), ("target-forward", tf)):
        say(f"  {name} SPS {label}: " + ", ".join(f"B={b}:{s:.0f}" for b, s in zip(bt, sps)))
    (OUT / f"sps_{name}.json").write_text(json.dumps({"whole_step": {"batch_tokens": whole[0], "steps_per_sec": whole[1]},
                                                      "target_forward": {"batch_tokens": tf[0], "steps_per_sec": tf[1]},
                                                      "context_len": ctx, "gamma": gamma, **provenance_of(__file__)},
                                                     indent=1) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(whole[0], whole[1], "o-", label="whole step (draft + verify)")
        ax.plot(tf[0], tf[1], "s--", label="target forward only")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch tokens")
        ax.set_ylabel("steps/s")
        ax.set_title(f"{name} ({DEV}, bf16, context {ctx})")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(OUT / f"sps_{name}.png", dpi=100)
        plt.close(fig)
    except Exception as exc:  # noqa: BLE001 - a plot is not worth failing the step
        say(f"  (no plot: {exc})")
    del model, engine, adapter
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return {"sps_whole_step": whole, "sps_target_forward": tf, "overhead": overhead, "profile_seconds": prof_s}


for _name, _gamma, _layers in (("smollm2-135m", 5, 2), ("qwen3-0.6b", 7, 2), ("qwen3-8b", 7, 5)):
    step(f"speed {_name} (γ={_gamma}, {_layers} draft layers)")(lambda n=_name, g=_gamma, k=_layers: speed(n, g, k))

ok = all(s["ok"] for s in RESULTS["steps"].values())
say("ALL OK" if ok else "SOME STEPS FAILED (see results.json)")
sys.exit(0 if ok else 1)
