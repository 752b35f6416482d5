"""Small judges for benchmarks/interop_check.sh's "draft formats" section (run with the project's .venv python;
it reads JSON and safetensors files only, no dsparkctl code). Each subcommand prints exactly one line
("ok   ..." or "FAIL ...") and exits 1 on FAIL.

  facts FMT INSPECT_JSON FACTS_JSON
      `dsparkctl inspect DIR --json` of a draft a peer trainer made against the facts its `make` printed: the
      format key, block_size, mask_token_id, markov rank, and the target layers in DeepSpec's canonical ids
      (converted from the peer's own convention, which its facts state).
  load FMT LABEL LOAD_JSON RC
      a peer's own `load` verdict (its JSON line and exit status), in one line.
  roundtrip A B ORIG_DIR BACK_DIR ORIG_INSPECT BACK_INSPECT
      A -> B -> A: model.safetensors bit-identical (names, dtypes, shapes, bytes), and inspect's description of
      the draft (format, block size, mask, Markov head, confidence head, slot convention, layers, vocabulary)
      unchanged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PEER_LAYER_IDS = {  # the facts key holding the peer's layer ids, and its offset to DeepSpec's canonical ids
    "speculators": ("aux_hidden_state_layer_ids", -1),  # HF hidden_states index: canonical = id - 1
    "specforge": ("target_layer_ids", 0),  # zero-based layer outputs (hidden_states[id + 1]) = canonical
    "modelopt": ("target_layer_ids_as_written", 0),  # decoder layer i, taps hidden_states[i + 1] = canonical
}


def _own(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def _report(inspect_path: str) -> dict:
    return json.loads(Path(inspect_path).read_text())["draft_format"]


def facts(fmt: str, inspect_path: str, facts_path: str) -> tuple[bool, str]:
    d = _report(inspect_path)
    f = json.loads(Path(facts_path).read_text())
    key, offset = PEER_LAYER_IDS[fmt]
    written = f[key]
    canonical = [i + offset for i in written]
    got = {"format": d["format"]["key"], "block_size": d["block_size"], "mask_token_id": d["mask_token_id"],
           "markov_rank": d["markov"]["rank"], "canonical": d["target_layers"]["canonical"]}
    want = {"format": fmt, "block_size": f["block_size"], "mask_token_id": f["mask_token_id"],
            "markov_rank": f["markov_rank"], "canonical": canonical}
    bad = [f"{k}: inspect says {got[k]!r}, the peer wrote {want[k]!r}" for k in want if got[k] != want[k]]
    if bad:
        return False, f"inspect of {_own(fmt)} own draft: " + "; ".join(bad)
    return True, (f"inspect of {_own(fmt)} own draft: format {got['format']}, block_size {got['block_size']}, mask "
                  f"{got['mask_token_id']}, markov rank {got['markov_rank']}, {key} {written} -> canonical "
                  f"{got['canonical']} (hidden_states {[i + 1 for i in got['canonical']]})")


def load(fmt: str, label: str, load_path: str, rc: str) -> tuple[bool, str]:
    try:
        r = json.loads(Path(load_path).read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError) as exc:
        return False, f"{label}: no verdict from the peer (exit {rc}; {type(exc).__name__}: {exc})"
    if r.get("ok") and rc == "0":
        extra = ""
        if fmt == "specforge" and isinstance(r.get("warm_start"), dict):
            ws = r["warm_start"]
            said = f" ({ws.get('loaded_keys')} keys)" if ws.get("ok") else f": {str(ws.get('error'))[:200]}"
            extra = f", warm start {'ok' if ws.get('ok') else 'refused'}{said}"
        if fmt == "speculators":
            mc = r.get("model_config", {})
            extra = (f", exact save layout {r.get('exact_save_layout')}, block {mc.get('block_size')}, mask "
                     f"{mc.get('mask_token_id')}, aux layers {mc.get('aux_hidden_state_layer_ids')}, draft vocab "
                     f"{mc.get('draft_vocab_size')}")
        return True, f"{label}: strict load, no missing/unexpected tensors{extra}"
    if fmt == "speculators" and _speculators_unloaded_head_only(r):
        mc = r.get("model_config", {})
        return True, (f"{label}: strict load, no missing/unexpected/mismatched tensors, exact save layout, block "
                      f"{mc.get('block_size')}, mask {mc.get('mask_token_id')}, aux layers "
                      f"{mc.get('aux_hidden_state_layer_ids')} (the peer flags NaN in lm_head.weight: a full-vocabulary "
                      "speculators draft does not store it -- speculators' _keys_to_ignore_on_save drops it when "
                      "use_draft_vocab is false and load_verifier_weights fills it from the verifier, which the peer "
                      "skips without --verifier-weights -- so that NaN is uninitialised memory, not a file value)")
    err = r.get("error") or f"exit {rc}"
    keys = {k: r.get(k) for k in ("missing", "unexpected", "mismatched", "nan_after_load") if r.get(k)}
    return False, f"{label}: {' '.join(str(err).split())[:300]}{' ' + json.dumps(keys)[:400] if keys else ''}"


def _speculators_unloaded_head_only(r: dict) -> bool:
    info = r.get("hf_loading_info") or {}
    mc = r.get("model_config") or {}
    return (not r.get("missing") and not r.get("unexpected") and not r.get("mismatched")
            and not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
            and r.get("exact_save_layout") is True and r.get("nan_after_load") == ["lm_head.weight"]
            and mc.get("use_draft_vocab") is False)


DESCRIBED = ("block_size", "drafts_per_round", "draft_layers", "markov", "confidence_head", "mask_token_id",
             "hidden_size")


def roundtrip(a: str, b: str, orig: str, back: str, orig_inspect: str, back_inspect: str) -> tuple[bool, str]:
    import torch
    from safetensors.torch import load_file

    x = load_file(str(Path(orig) / "model.safetensors"))
    y = load_file(str(Path(back) / "model.safetensors"))
    label = f"round trip {a} -> {b} -> {a}"
    problems = []
    if x.keys() != y.keys():
        problems.append(f"tensor names differ: only in the original {sorted(x.keys() - y.keys())}, only after the "
                        f"round trip {sorted(y.keys() - x.keys())}")
    differ = sorted(k for k in x.keys() & y.keys() if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape
                    or not torch.equal(x[k], y[k]))
    if differ:
        shown = ", ".join(f"{k} {x[k].dtype}{list(x[k].shape)} vs {y[k].dtype}{list(y[k].shape)}" for k in differ[:6])
        problems.append(f"tensors differ: {shown}")
    p, q = _report(orig_inspect), _report(back_inspect)
    for k in DESCRIBED:
        if p.get(k) != q.get(k):
            problems.append(f"inspect {k}: {p.get(k)!r} -> {q.get(k)!r}")
    if p["format"]["key"] != q["format"]["key"]:
        problems.append(f"format {p['format']['key']} -> {q['format']['key']}")
    for k in ("as_written", "canonical", "num_target_layers"):
        if p["target_layers"].get(k) != q["target_layers"].get(k):
            problems.append(f"target_layers.{k}: {p['target_layers'].get(k)} -> {q['target_layers'].get(k)}")
    if p["slot_convention"]["sample_from_anchor"] != q["slot_convention"]["sample_from_anchor"]:
        problems.append("sample_from_anchor changed")
    if p["vocabulary"] != q["vocabulary"]:
        problems.append(f"vocabulary {p['vocabulary']} -> {q['vocabulary']}")
    if problems:
        return False, f"{label}: " + "; ".join(problems)
    return True, (f"{label}: {len(x)} tensors bit-identical (names, dtypes, shapes, bytes); inspect describes the "
                  "same draft (format, block, mask, Markov/confidence heads, slots, layers, vocabulary)")


def main(argv: list[str]) -> int:
    cmds = {"facts": (facts, 3), "load": (load, 4), "roundtrip": (roundtrip, 6)}
    if not argv or argv[0] not in cmds or len(argv) - 1 != cmds[argv[0]][1]:
        print(__doc__, file=sys.stderr)
        return 2
    fn, _ = cmds[argv[0]]
    try:
        ok, line = fn(*argv[1:])
    except Exception as exc:  # a judge that cannot judge is a failed check
        ok, line = False, f"{argv[0]} {' '.join(argv[1:3])}: {type(exc).__name__}: {exc}"
    print(f"{'ok  ' if ok else 'FAIL'} {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
