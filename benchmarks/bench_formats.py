"""The shipped draft in every draft format: written, read back, round-tripped, and run on the embedded
target — the same greedy tokens and the same teacher-forced acceptance, or (where the format forces a
change the user dropped by name) the acceptance the change costs, measured.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_formats.py --prompts 8 --max-new-tokens 64 \
        [--peer-venvs /tmp/interop] --out benchmarks/results/formats_shipped.json

Each format's row: read (the folder is recognised and read), write (convert wrote it), round trip (A → B → A
gives bit-identical tensors and the same draft config), greedy tokens identical to the original draft's on
every prompt (and to plain decoding), teacher-forced τ and per-position conditional acceptance (greedy,
γ = 5, the draft alone, no lookup) against the original's, and, with --peer-venvs, whether the trainer's own
classes load the file (benchmarks/peers/<format>_peer.py load, in the side venvs interop_check.sh builds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dsparkctl.app.convert import ConvertSpec, run_convert  # noqa: E402
from dsparkctl.data.prompts import encode_prompts, load_prompts  # noqa: E402
from dsparkctl.engine.session import open_target  # noqa: E402
from dsparkctl.engine.speculative import SpeculativeEngine  # noqa: E402
from dsparkctl.evaluation.continuations import cached_continuations  # noqa: E402
from dsparkctl.evaluation.teacher_forced import evaluate_sequences  # noqa: E402
from dsparkctl.files.atomic import write_json  # noqa: E402
from dsparkctl.math.policy_spec import parse_policy  # noqa: E402
from dsparkctl.math.sampling import SamplingParams  # noqa: E402
from dsparkctl.models import draft_formats as formats  # noqa: E402
from dsparkctl.models.loading import default_draft_dir  # noqa: E402
from dsparkctl.models.target import TargetAdapter  # noqa: E402
from provenance import provenance_of  # noqa: E402  (benchmarks/provenance.py)

DROPS = {"specforge": ("vocab-map",), "modelopt": ("vocab-map",)}  # what the shipped draft cannot keep there
PEER_VENV = {"speculators": "speculators-venv", "specforge": "specforge-venv", "modelopt": "modelopt-venv"}


def same_tensors(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def peer_load(fmt: str, folder: Path, venvs: Path | None) -> str:
    if fmt not in PEER_VENV:
        return "n/a (dsparkctl's own format)"
    if venvs is None:
        return "not run (--peer-venvs)"
    py = venvs / PEER_VENV[fmt] / "bin" / "python"
    if not py.exists():
        return f"not run ({py} missing: bash benchmarks/interop_check.sh --build-only)"
    r = subprocess.run([str(py), str(ROOT / "benchmarks" / "peers" / f"{fmt}_peer.py"), "load", str(folder)],
                       capture_output=True, text=True, timeout=600)
    line = (r.stdout.strip().splitlines() or ["{}"])[-1]
    try:
        doc = json.loads(line)
    except ValueError:
        doc = {}
    return "loaded (strict)" if r.returncode == 0 and doc.get("ok") else f"refused: {doc.get('error') or r.stderr[-200:]}"


def measure(sess, folder: str, seqs, prompt_lens, prompts, max_new: int) -> dict:
    draft, _, _ = sess.load_draft(folder)
    tf = evaluate_sequences(draft, sess.target.model, seqs, prompt_lens, SamplingParams(0.0))
    adapter = TargetAdapter(sess.target.model, draft.cfg.target_layer_ids)
    eng = SpeculativeEngine(adapter, draft, parse_policy(f"static:{draft.block_size}"), SamplingParams(0.0),
                            stop_token_ids=sess.stop_ids)
    rep = eng.generate(prompts, max_new)
    return {"tau_tf": tf.tau, "conditional_tf": tf.conditional(), "anchors": tf.anchors,
            "tokens": [o.tokens for o in rep.outputs], "live_tau": rep.stats.tau}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--peer-venvs", type=Path, default=None, help="interop_check.sh's INTEROP_DIR")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    sess = open_target(None, cpu_kernels="stock", draft_weights="fp32", log=lambda m: print(m, file=sys.stderr))
    lt = sess.target
    prompts = encode_prompts(lt.tokenizer, load_prompts(a.dataset, None, a.prompts))
    conts, _ = cached_continuations(lt.model, prompts, SamplingParams(0.0), a.max_new_tokens, sess.stop_ids)
    seqs = [p + c for p, c in zip(prompts, conts)]
    lens = [len(p) for p in prompts]
    src = default_draft_dir()
    original = measure(sess, str(src), seqs, lens, prompts, a.max_new_tokens)
    plain_same = all(t == c[: len(t)] for t, c in zip(original["tokens"], conts))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-formats-") as tmp:
        for fmt in formats.FORMATS:
            out, back = Path(tmp) / fmt.key, Path(tmp) / f"{fmt.key}-back"
            doc = run_convert(ConvertSpec("default", out, fmt.key, DROPS.get(fmt.key, ()), "embedded"),
                              log=lambda m: None)
            read = formats.read(out)
            run_convert(ConvertSpec(str(out), back, "deepspec"), log=lambda m: None)
            trip = same_tensors(src, back) and formats.read(back).config == formats.read(src).config
            m = measure(sess, str(out), seqs, lens, prompts, a.max_new_tokens)
            rows.append({
                "format": fmt.key, "read": read.format == fmt.key, "write": True, "changes": doc["changes"],
                "added_from_target": doc["added_from_target"], "warnings": doc["warnings"],
                "round_trip_identical": trip if not doc["changes"] else None,
                "round_trip_note": None if not doc["changes"] else "not reversible by design: the conversion dropped "
                                                                   + ", ".join(DROPS[fmt.key]),
                "greedy_tokens_identical": m["tokens"] == original["tokens"],
                "tau_tf": m["tau_tf"], "tau_tf_identical": m["tau_tf"] == original["tau_tf"],
                "conditional_tf": m["conditional_tf"],
                "conditional_identical": m["conditional_tf"] == original["conditional_tf"],
                "live_tau": m["live_tau"], "live_tau_identical": m["live_tau"] == original["live_tau"],
                "loaded_by_own_code": peer_load(fmt.key, out, a.peer_venvs)})
    doc = {"bench": "formats", "dataset": a.dataset, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
           "original": {"tau_tf": original["tau_tf"], "conditional_tf": original["conditional_tf"],
                        "anchors": original["anchors"], "live_tau": original["live_tau"],
                        "greedy_equals_plain": plain_same},
           "formats": rows, **provenance_of(__file__)}
    write_json(a.out, doc)
    print(f"original: teacher-forced tau {original['tau_tf']:.4f}, live tau {original['live_tau']:.3f}, "
          f"greedy = plain decoding: {plain_same}")
    print("| format | read | write | round trip identical | greedy tokens identical | TF tau | TF tau and c_j identical "
          "| live tau (static:5) | loaded by its own code |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        trip = "yes" if r["round_trip_identical"] else r["round_trip_note"] if r["round_trip_identical"] is None else "NO"
        print(f"| {r['format']} | {'yes' if r['read'] else 'NO'} | yes | {trip} | "
              f"{'yes' if r['greedy_tokens_identical'] else 'no'} | {r['tau_tf']:.4f} | "
              f"{'yes' if r['tau_tf_identical'] and r['conditional_identical'] else 'no'} | {r['live_tau']:.3f}"
              f"{' (identical)' if r['live_tau_identical'] else ''} | {r['loaded_by_own_code']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
