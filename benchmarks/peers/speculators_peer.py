"""Peer oracle for the vLLM ``speculators`` DSpark draft format (speculators==0.9.0).

Run ONLY with the side venv's python (never with /work/main/.venv):

    /tmp/peervenv/speculators/bin/python benchmarks/peers/speculators_peer.py make OUT_DIR
    /tmp/peervenv/speculators/bin/python benchmarks/peers/speculators_peer.py load DIR [--verifier-weights]

Side venv setup (the exact commands that worked, Python 3.11, CPU only):

    python3 -m venv /tmp/peervenv/speculators
    /tmp/peervenv/speculators/bin/pip install torch==2.13.0          # CPU build from local wheels
    echo 'torch==2.13.0' > /tmp/peervenv/constraints.txt
    /tmp/peervenv/speculators/bin/pip install speculators==0.9.0 -c /tmp/peervenv/constraints.txt
    # torchvision/torchaudio come from PyPI built against CUDA torch; with the CPU
    # torch they break `import transformers` ("operator torchvision::nms does not
    # exist"). speculators never imports them, so remove them:
    /tmp/peervenv/speculators/bin/pip uninstall -y torchvision torchaudio

(Without the constraint, `pip install speculators==0.9.0` replaces the CPU torch
with torch 2.14.1 + ~4.5 GB of nvidia-* CUDA wheels; that also works, just big.)

``make`` builds the draft exactly the way ``speculators train`` does
(``create_transformer_layer_config`` + ``DSparkDraftModel.from_training_args``)
against a tiny random Qwen3 verifier written to a temp dir, then saves it with
``save_pretrained``. Because the temp verifier path would leak into config.json,
``speculators_config.verifier.name_or_path`` is replaced by the placeholder
``VERIFIER_PLACEHOLDER`` before saving (the only post-hoc edit).

``load`` loads a folder with speculators' own path: ``SpeculatorModelConfig``
pydantic validation + ``DSparkDraftModel.from_pretrained`` (transformers'
loader, loading info collected) + an explicit strict state-dict comparison
against the set of keys speculators itself writes. Verifier weights
(embed_tokens / verifier_lm_head / verifier_norm, pulled from the verifier at
load time) are NOT fetched unless ``--verifier-weights`` is given, since the
verifier named in config.json is normally not available offline.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VERIFIER_PLACEHOLDER = "peer-fixture/tiny-qwen3-verifier"

# tiny verifier (the "target" model)
V_VOCAB, V_HIDDEN, V_LAYERS, V_HEADS, V_KV, V_HEAD_DIM, V_INTER = 64, 32, 4, 4, 2, 8, 64
# draft
BLOCK_SIZE, MASK_TOKEN_ID, MARKOV_RANK, DRAFT_VOCAB = 4, 63, 8, 32
# HF hidden_states indices [1, 2] == DeepSpec ids [0, 1]; speculators'
# aux_hidden_state_layer_ids use the HF hidden_states index (== vLLM capture id).
AUX_LAYER_IDS = [1, 2]


def _tensor_list(path: Path) -> list[dict]:
    from safetensors import safe_open

    out = []
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for k in sorted(f.keys()):
            t = f.get_tensor(k)
            out.append({"name": k, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")})
    return out


def cmd_make(out_dir: str) -> int:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from speculators.models.dspark import DSparkDraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as vdir:
        vcfg = Qwen3Config(
            vocab_size=V_VOCAB,
            hidden_size=V_HIDDEN,
            num_hidden_layers=V_LAYERS,
            num_attention_heads=V_HEADS,
            num_key_value_heads=V_KV,
            head_dim=V_HEAD_DIM,
            intermediate_size=V_INTER,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        Qwen3ForCausalLM(vcfg).save_pretrained(vdir)

        # Same call speculators' training CLI makes (draft.num_layers=1, qwen3 arch,
        # silu; full attention on the single draft layer).
        tl_config = create_transformer_layer_config(
            verifier_name_or_path=vdir,
            num_layers=1,
            draft_arch="qwen3",
            hidden_act="silu",
            sliding_window=2048,
            full_attention_indices=[0],
        )

        # Draft vocab: every even target id (32 of 64). d2t[i] = target_id - i.
        target_ids = torch.arange(0, V_VOCAB, 2, dtype=torch.long)
        d2t = target_ids - torch.arange(DRAFT_VOCAB, dtype=torch.long)
        t2d = torch.zeros(V_VOCAB, dtype=torch.bool)
        t2d[target_ids] = True

        model = DSparkDraftModel.from_training_args(
            verifier_config=tl_config,
            t2d=t2d,
            d2t=d2t,
            verifier_name_or_path=vdir,
            target_layer_ids=list(AUX_LAYER_IDS),
            draft_vocab_size=DRAFT_VOCAB,
            block_size=BLOCK_SIZE,
            mask_token_id=MASK_TOKEN_ID,
            markov_rank=MARKOV_RANK,
            markov_head_type="vanilla",
            enable_confidence_head=True,
            confidence_head_with_markov=True,
        )

    # only post-hoc edit: don't leak the temp verifier path
    model.config.speculators_config.verifier.name_or_path = VERIFIER_PLACEHOLDER
    # bf16 like `speculators train --dry-run` (draft_model.to(hidden_states_dtype));
    # Module.to(dtype) leaves the int64 d2t / bool t2d buffers untouched.
    model.to(torch.bfloat16)
    model.save_pretrained(str(out))

    cfg = json.loads((out / "config.json").read_text())
    facts = {
        "format": cfg.get("speculators_model_type"),
        "architectures": cfg.get("architectures"),
        "speculators_version": cfg.get("speculators_version"),
        "block_size": cfg.get("block_size"),
        "mask_token_id": cfg.get("mask_token_id"),
        "markov_rank": cfg.get("markov_rank"),
        "markov_head_type": cfg.get("markov_head_type"),
        "aux_hidden_state_layer_ids": cfg.get("aux_hidden_state_layer_ids"),
        "aux_hidden_state_layer_ids_convention": "HF hidden_states index (= vLLM capture id); DeepSpec id = value - 1",
        "sample_from_anchor": cfg.get("sample_from_anchor"),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "verifier_vocab_size": cfg["transformer_layer_config"].get("vocab_size"),
        "verifier": cfg.get("speculators_config", {}).get("verifier"),
        "files": sorted(p.name for p in out.iterdir()),
        "tensors": _tensor_list(out / "model.safetensors"),
    }
    print(json.dumps(facts))
    return 0


def _expected_saved_keys(model) -> set[str]:
    ignore = set(model._keys_to_ignore_on_save or [])  # noqa: SLF001 (instance copy)
    return {k for k in model.state_dict() if k not in ignore}


def cmd_load(path: str, verifier_weights: bool) -> int:
    result: dict = {"ok": False, "error": None, "missing": [], "unexpected": [], "mismatched": []}
    try:
        import torch
        from safetensors.torch import load_file

        from speculators import SpeculatorModelConfig
        from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

        d = Path(path)
        # 1) speculators' own config validation (pydantic; subclass by speculators_model_type)
        config = SpeculatorModelConfig.from_pretrained(str(d))
        if not isinstance(config, DSparkSpeculatorConfig):
            raise TypeError(f"config resolved to {type(config).__name__}, not DSparkSpeculatorConfig")

        if not verifier_weights:
            DSparkDraftModel.load_verifier_weights = lambda self: None  # type: ignore[method-assign]

        # 2) speculators' own from_pretrained (transformers loader underneath)
        loaded = DSparkDraftModel.from_pretrained(str(d), output_loading_info=True)
        model, info = loaded if isinstance(loaded, tuple) else (loaded, {})
        result["hf_loading_info"] = {k: sorted(map(str, v)) for k, v in (info or {}).items()}

        # 3) strict check: saved tensors must be exactly what speculators itself writes
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError("no *.safetensors in folder")
        saved: dict = {}
        for f in files:
            saved.update(load_file(str(f)))
        ref = DSparkDraftModel(config=SpeculatorModelConfig.from_pretrained(str(d)))
        sd = ref.state_dict()
        expected = _expected_saved_keys(ref)
        result["missing"] = sorted(expected - saved.keys())
        result["unexpected"] = sorted(saved.keys() - sd.keys())
        result["mismatched"] = sorted(
            f"{k}: saved {list(saved[k].shape)} expected {list(sd[k].shape)}"
            for k in saved.keys() & sd.keys()
            if tuple(saved[k].shape) != tuple(sd[k].shape)
        )
        # loaded-but-not-expected (e.g. embed_tokens written by a non-speculators tool)
        result["extra_saved_but_ignored_on_save"] = sorted((saved.keys() & sd.keys()) - expected)
        # True only if the folder holds exactly the tensor set speculators' save writes
        result["exact_save_layout"] = saved.keys() == expected
        missing_keys, unexpected_keys = ref.load_state_dict(saved, strict=False)
        # a full-vocabulary draft never stores lm_head (load_verifier_weights fills it from the verifier, which
        # this check skips without --verifier-weights): only a stored head can be NaN for a reason in the file
        nan = [k for k in ("lm_head.weight",) if k in sd and k in saved and torch.isnan(model.state_dict()[k]).any()]
        result["nan_after_load"] = nan
        result["model_config"] = {
            "block_size": model.config.block_size,
            "mask_token_id": model.config.mask_token_id,
            "markov_rank": model.config.markov_rank,
            "aux_hidden_state_layer_ids": model.config.aux_hidden_state_layer_ids,
            "sample_from_anchor": model.config.sample_from_anchor,
            "draft_vocab_size": model.config.draft_vocab_size,
            "use_draft_vocab": bool(model.use_draft_vocab),
        }
        result["ok"] = not (
            result["missing"] or result["unexpected"] or result["mismatched"] or nan
            or result["hf_loading_info"].get("missing_keys")
            or result["hf_loading_info"].get("unexpected_keys")
            or result["hf_loading_info"].get("mismatched_keys")
            or result["hf_loading_info"].get("error_msgs")
        )
        if not result["ok"] and result["error"] is None:
            result["error"] = "state dict does not match speculators DSparkDraftModel strictly"
    except Exception as exc:  # noqa: BLE001
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=6)
    print(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "make":
        return cmd_make(argv[1])
    if len(argv) >= 2 and argv[0] == "load":
        return cmd_load(argv[1], "--verifier-weights" in argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
