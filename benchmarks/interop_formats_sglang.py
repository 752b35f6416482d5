"""SGLang's own readers on the shipped draft converted to the other draft formats (benchmarks/interop_check.sh,
section "draft formats").

Runs inside the SGLang 0.5.23 side virtualenv (NOT the project's .venv; it imports no dsparkctl code). The
expected facts come from the shipped draft's own config.json (DeepSpec ids: id i = decoder layer i's output =
transformers hidden_states[i + 1], which is also DFlash/DSpark's `target_layer_ids` convention in SGLang).

For each export named:
  - the config through SGLang's own get_config (what read_draft_checkpoint_config calls), then
    `dspark_config.parse_dspark_draft_config` and `dflash_utils.parse_dflash_draft_config` (SGLang reads the
    nested dflash_config first): block size / gamma, mask token id, target layer ids, markov rank and type,
    draft and target layer counts;
  - the model class SGLang's registry resolves from the config's architectures (`ModelRegistry`): one of its
    DSpark classes (models/dspark.py) or not;
  - the model built from the config with SGLang's class and `load_weights` run on the file's tensors, every
    tensor SGLang keeps compared with the file (q/k/v and gate/up are fused by SGLang: compared fused).
Where SGLang's code cannot read a format, a 'note:' line says so with the reason from its source.

Building layers on a CPU needs two things this script sets, and only these (both SGLang's own means):
  - the runtime context published with `sglang.test.parallel_groups.publish` (SGLang's fixture for building
    layers without distributed groups), one rank;
  - `rotary_embedding.base._is_cpu = True`: SGLang's RotaryEmbedding otherwise imports vllm._custom_ops on a
    machine that is neither CUDA nor its CPU engine (SGLANG_USE_CPU_ENGINE=1, which needs sgl_kernel's CPU
    build for the KV cache); with it RoPE takes SGLang's own torch path. RoPE has no weights.
SGLANG_RAGGED_VERIFY_MODE=compact, as serve-config prints it: in SGLang's STATIC mode the DSpark model has
no confidence head to load (build_confidence_head).

Usage: python interop_formats_sglang.py OUR_DRAFT_DIR TARGET_DIR FORMAT=DIR [FORMAT=DIR ...]
One line per check ("ok" / "FAIL" / "note:"); exit status 1 if any check failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "compact"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from interop_common import Checks, Note  # noqa: E402

check = Checks("sglang")

import interop_sglang  # noqa: E402,F401  (the inert torchvision stand-in, where torchvision is absent)

def expected(ours: Path) -> dict:
    c = json.loads((ours / "config.json").read_text())
    return {"block_size": c["block_size"], "mask_token_id": c["mask_token_id"], "markov_rank": c["markov_rank"],
            "markov_head_type": c["markov_head_type"], "canonical": list(c["target_layer_ids"]),
            "layers": c["num_hidden_layers"], "target_layers": c["num_target_layers"]}


def sglang_config(folder: Path):
    from sglang.srt.utils.hf_transformers_utils import get_config

    return get_config(str(folder), trust_remote_code=False)


def parsers(fmt: str, folder: Path, want: dict) -> str:
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config

    try:
        hf = sglang_config(folder)
    except Exception as exc:
        if fmt == "speculators":
            raise Note("SGLang 0.5.23 has no reader for speculators' format (no `speculators_model_type`, "
                       "`speculators_config` or `transformer_layer_config` anywhere in sglang/srt; the draft layers' "
                       "config is nested where SGLang's get_config does not look, and config.json has no model_type): "
                       f"get_config stops with {type(exc).__name__}: {' '.join(str(exc).split())[:160]}") from None
        raise
    ds = parse_dspark_draft_config(draft_hf_config=hf)
    df = parse_dflash_draft_config(draft_hf_config=hf)
    got = {"block_size": df.block_size, "gamma": ds.gamma, "mask_token_id": ds.mask_token_id,
           "target_layer_ids": ds.target_layer_ids, "dflash_target_layer_ids": df.target_layer_ids,
           "markov_rank": ds.markov_rank, "markov_head_type": ds.markov_head_type,
           "layers": ds.num_hidden_layers, "target_layers": ds.num_target_layers}
    bad = [f"{k} {got[k]!r} != {v!r}" for k, v in (
        ("block_size", want["block_size"]), ("gamma", want["block_size"]), ("mask_token_id", want["mask_token_id"]),
        ("target_layer_ids", want["canonical"]), ("dflash_target_layer_ids", want["canonical"]),
        ("markov_rank", want["markov_rank"]), ("markov_head_type", want["markov_head_type"]),
        ("layers", want["layers"]), ("target_layers", want["target_layers"])) if got[k] != v]
    assert not bad, "; ".join(bad)
    return (f"model_type {hf.model_type}, DFlash block size {df.block_size}, DSpark gamma {ds.gamma}, mask id "
            f"{ds.mask_token_id}, taps {ds.target_layer_ids} (hidden_states {[i + 1 for i in ds.target_layer_ids]}), "
            f"markov {ds.markov_head_type} rank {ds.markov_rank}, {ds.num_hidden_layers} draft / "
            f"{ds.num_target_layers} target layers")


_READY: list = []


def ready(target: Path) -> None:
    """One rank's runtime context and SGLang's torch RoPE (see the module doc), once."""
    if _READY:
        return
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    rope_base._is_cpu = True
    publish(ServerArgs(model_path=str(target), device="cpu"), role="scheduler")
    _READY.append(True)


def resolve(folder: Path):
    from sglang.srt.models.dspark import DSparkDraftMixin
    from sglang.srt.models.registry import ModelRegistry

    hf = sglang_config(folder)
    cls, arch = ModelRegistry.resolve_model_cls(hf.architectures)
    return hf, cls, arch, issubclass(cls, DSparkDraftMixin)


def registry(fmt: str, folder: Path) -> str:
    hf, cls, arch, is_dspark = resolve(folder)
    if not is_dspark:
        raise Note(f"ModelRegistry resolves architectures {hf.architectures} to {cls.__module__}.{cls.__name__}, "
                   "a DFlash model without the Markov and confidence heads; SGLang's DSpark classes (models/dspark.py: "
                   "Qwen3DSparkModel, LingDSparkModel, DSparkDraftModel) are chosen by architectures only, and "
                   "dflash_config.projector_type 'dspark' is not read by its model selection (dflash_utils reads "
                   "projector_type only to tell 'domino' apart)")
    return f"architectures {hf.architectures} -> {cls.__module__}.{cls.__name__} (a DSpark class)"


FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def compare(model, tensors: dict) -> tuple[list[str], list[str]]:
    """(file tensors SGLang's model holds equal, file tensors it holds nowhere or differently)."""
    import torch

    params = dict(model.named_parameters())
    fused: dict[str, list] = {}
    equal, other = [], []
    for name, t in tensors.items():
        for part, (f, i) in FUSED.items():
            if f".{part}." in name:
                fused.setdefault(name.replace(part, f), [None] * 3)[i] = (name, t)
                break
        else:
            p = params.get(name)
            ok = p is not None and tuple(p.shape) == tuple(t.shape) and torch.equal(p.data, t.to(p.dtype))
            (equal if ok else other).append(name)
    for pname, parts in fused.items():
        parts = [x for x in parts if x is not None]
        whole = torch.cat([t for _, t in parts], 0)
        p = params.get(pname)
        ok = p is not None and tuple(p.shape) == tuple(whole.shape) and torch.equal(p.data, whole.to(p.dtype))
        (equal if ok else other).extend(n for n, _ in parts)
    return equal, other


def file_tensors(folder: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def build_and_load(hf, cls, folder: Path) -> tuple[object, list[str], list[str]]:
    import torch

    with torch.device("cpu"):
        model = cls(hf)
    model = model.to(torch.float32)
    tensors = file_tensors(folder)
    model.load_weights(iter(tensors.items()))
    equal, other = compare(model, tensors)
    return model, equal, other


def promoted(hf):
    """The config with the DSpark head fields SGLang's parse_dspark_draft_config reads from dflash_config also set
    at the top level, where SGLang's model constructors (build_markov_head, build_confidence_head) read them."""
    import copy

    c = copy.deepcopy(hf)
    nested = getattr(c, "dflash_config", None) or {}
    for k in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        if k in nested and getattr(c, k, None) is None:
            setattr(c, k, nested[k])
    return c


def load(fmt: str, folder: Path, target: Path) -> str:
    ready(target)
    hf, cls, arch, is_dspark = resolve(folder)
    if not is_dspark:  # what SGLang would do with the file: its DFlash model, and which tensors it would keep
        _, equal, other = build_and_load(hf, cls, folder)
        raise Note(f"{cls.__name__} (SGLang's class for {hf.architectures}) loads {len(equal)} of the file's "
                   f"{len(equal) + len(other)} tensors and skips {sorted(other)} without an error "
                   "(models/dflash.py load_weights: 'Ignore unexpected weights'): the draft would run without its "
                   "Markov and confidence heads; SGLang's DSpark classes read them as markov_head.*/confidence_head.*")
    try:
        build_and_load(hf, cls, folder)
    except ValueError as exc:
        if "markov_rank" not in str(exc):
            raise
        reason = (f"{cls.__name__}(config) stops with ValueError: {str(exc).splitlines()[0]} -- models/dspark.py "
                  "build_markov_head/build_confidence_head read config.markov_rank (and markov_head_type, "
                  "confidence_head_with_markov) at the top level only, while parse_dspark_draft_config (and SpecForge's "
                  "own format) keep them in dflash_config")
        model, equal, other = build_and_load(promoted(hf), cls, folder)
        assert not other, f"with the fields lifted, SGLang still does not hold {sorted(other)} as in the file"
        assert model.confidence_head is not None, "no confidence head"
        raise Note(f"{reason}. With those fields lifted to the top level (nothing else changed), "
                   f"{cls.__name__}.load_weights holds all {len(equal)} of the file's tensors equal to the file, "
                   "markov and confidence heads included") from None
    model, equal, other = build_and_load(hf, cls, folder)
    assert not other, f"SGLang does not hold {sorted(other)} as in the file"
    return f"{cls.__name__}.load_weights holds all {len(equal)} of the file's tensors equal to the file"


def main() -> int:
    ours, target, *pairs = sys.argv[1:]
    want = expected(Path(ours))
    for pair in pairs:
        fmt, folder = pair.split("=", 1)
        d = Path(folder)
        check(f"{fmt} export {d.name}: get_config + parse_dspark_draft_config / parse_dflash_draft_config",
              lambda: parsers(fmt, d, want))
        if fmt == "speculators":
            continue  # nothing further reads it (the note above)
        check(f"{fmt} export {d.name}: ModelRegistry picks a DSpark model class", lambda: registry(fmt, d))
        check(f"{fmt} export {d.name}: model built from the config + load_weights", lambda: load(fmt, d, Path(target)))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
