#!/usr/bin/env python3
"""Peer harness: SGLang SpecForge (PyPI ``specforge==0.2.0``) DSpark draft format.

Run with the SIDE virtualenv's python, never with /work/main/.venv:

    /tmp/peervenv/specforge/bin/python benchmarks/peers/specforge_peer.py make OUT_DIR
    /tmp/peervenv/specforge/bin/python benchmarks/peers/specforge_peer.py load DIR

Side venv, built with exactly these commands (CPU only, no sglang / GPU kernels):

    python3 -m venv /tmp/peervenv/specforge
    /tmp/peervenv/specforge/bin/pip install torch==2.13.0          # -> torch 2.13.0+cpu
    /tmp/peervenv/specforge/bin/pip install specforge==0.2.0 --no-deps
    /tmp/peervenv/specforge/bin/pip install transformers==5.8.1    # specforge pins it;
        # pulls huggingface-hub, safetensors, tokenizers, numpy, pyyaml, tqdm, ...

(specforge pins torch==2.11.0 and sglang==0.5.14; neither is needed for the
draft modeling/config/export modules used here.  torch 2.13.0+cpu works.)

``make`` builds a tiny DSpark draft with SpecForge's own classes
(``Qwen3Config`` via ``AutoDraftModelConfig.from_file`` ->
``AutoDraftModel.from_config`` -> ``DSparkDraftModel``), writes a SpecForge
training checkpoint (``training_state.pt`` with ``draft_state_dict``, exactly
what ``DSparkTrainStrategy.checkpoint_state_filter`` persists) and exports it
with SpecForge's own exporter ``specforge.export.to_hf.export_to_hf`` (the
documented route for DFlash-family drafts: ``--to hf``; the ``to_sglang``
exporter refuses non-EAGLE3 checkpoints).  That calls
``materialize_draft`` (bf16), ``model.save_pretrained`` and
``apply_legacy_rope_scaling``.

``load`` loads a folder with SpecForge's loading path: config through
``specforge.training.model_loading.load_draft_config_source`` (registry ->
``Qwen3Config.from_dict``), model through ``AutoDraftModel.from_config``, then
``load_state_dict(strict=True)`` of the folder's safetensors (the model's
load-state-dict pre-hook maps legacy ``logit_head.`` keys).  As a secondary
check it also runs SpecForge's warm-start loader
(``warm_start_draft_model``, which goes through ``from_pretrained``) and
reports its verdict under ``"warm_start"``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SEED = 1234

# Tiny DSpark draft.  target_layer_ids uses SpecForge's convention: zero-based
# target *layer output* ids; extract_context_feature reads
# hidden_states[layer_id + 1] of an HF output_hidden_states tuple, so [0, 1]
# means HF hidden_states[1] and hidden_states[2].
DRAFT_CONFIG = {
    "architectures": ["DSparkDraftModel"],
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "layer_types": ["full_attention"],
    "tie_word_embeddings": False,
    "num_target_layers": 4,
    "block_size": 4,
    "dflash_config": {
        "target_layer_ids": [0, 1],
        "mask_token_id": 63,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        # SpecForge default is False; the code supports True (input = hidden+rank).
        "confidence_head_with_markov": True,
    },
}


def _tensor_table(folder: str) -> dict:
    from safetensors import safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as fh:
            for key in fh.keys():
                t = fh.get_slice(key)
                out[key] = {
                    "shape": list(t.get_shape()),
                    "dtype": t.get_dtype(),
                    "file": os.path.basename(path),
                }
    return dict(sorted(out.items()))


def cmd_make(out_dir: str) -> int:
    import torch

    import specforge.modeling.draft  # noqa: F401  (registers architectures)
    from specforge.export.to_hf import export_to_hf
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.training.strategies.base import DSparkTrainStrategy

    os.makedirs(out_dir, exist_ok=True)
    # SpecForge prints progress to stdout; keep stdout for our one JSON object.
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory() as tmp:
        cfg_path = os.path.join(tmp, "draft_config.json")
        with open(cfg_path, "w") as fh:
            json.dump(DRAFT_CONFIG, fh, indent=2)

        torch.manual_seed(SEED)
        config = AutoDraftModelConfig.from_file(cfg_path)
        # Trainer: build_registered_draft -> from_config(torch_dtype=model.torch_dtype),
        # whose schema default is bfloat16; so real checkpoints hold bf16 tensors.
        model = AutoDraftModel.from_config(config, torch_dtype=torch.bfloat16)

        # Trainer-side checkpoint: the DSpark strategy keeps draft_model.* keys
        # with the prefix stripped.  Emulate the wrapped module's names.
        wrapped = {f"draft_model.{k}": v for k, v in model.state_dict().items()}
        draft_sd = DSparkTrainStrategy.checkpoint_state_filter(None, wrapped)
        ckpt_dir = os.path.join(tmp, "run-step1")
        os.makedirs(ckpt_dir)
        torch.save(
            {"draft_state_dict": draft_sd, "strategy": "dspark", "global_step": 1},
            os.path.join(ckpt_dir, "training_state.pt"),
        )
        # The exporter's config comes from the same draft config json; the
        # trainer writes resolved mask_token_id/target_layer_ids back into
        # dflash_config (already explicit here).
        export_to_hf(ckpt_dir, cfg_path, out_dir)
    for name in os.listdir(out_dir):  # save_pretrained leaves 0600 files
        os.chmod(os.path.join(out_dir, name), 0o644)

    with open(os.path.join(out_dir, "config.json")) as fh:
        saved_cfg = json.load(fh)
    dc = saved_cfg.get("dflash_config", {})
    facts = {
        "producer": "specforge==0.2.0 export_to_hf (save_pretrained)",
        "format": "specforge-dspark-hf",
        "architectures": saved_cfg.get("architectures"),
        "model_type": saved_cfg.get("model_type"),
        "block_size": saved_cfg.get("block_size"),
        "mask_token_id": dc.get("mask_token_id"),
        "markov_rank": dc.get("markov_rank"),
        "markov_head_type": dc.get("markov_head_type"),
        "target_layer_ids": dc.get("target_layer_ids"),
        "target_layer_ids_convention": "zero-based target layer outputs; HF hidden_states[id+1]",
        "hf_hidden_states_indices": [i + 1 for i in dc.get("target_layer_ids", [])],
        "num_target_layers": saved_cfg.get("num_target_layers"),
        "enable_confidence_head": dc.get("enable_confidence_head"),
        "confidence_head_with_markov": dc.get("confidence_head_with_markov"),
        "confidence_head_with_markov_default": False,
        "projector_type": dc.get("projector_type"),
        "attention_mode": dc.get("attention_mode"),
        "files": sorted(os.listdir(out_dir)),
        "tensors": _tensor_table(out_dir),
    }
    print(json.dumps(facts))
    return 0


def _read_state_dict(folder: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        sd = {}
        for path in files:
            sd.update(load_file(path))
        return sd
    import torch

    bins = sorted(glob.glob(os.path.join(folder, "*.bin")))
    if bins:
        sd = {}
        for path in bins:
            sd.update(torch.load(path, map_location="cpu", weights_only=True))
        return sd
    raise FileNotFoundError(f"no *.safetensors or *.bin in {folder}")


def cmd_load(folder: str) -> int:
    result = {"ok": False, "error": None, "missing": [], "unexpected": []}
    with contextlib.redirect_stdout(sys.stderr):
        _load_into(folder, result)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def _load_into(folder: str, result: dict) -> None:
    try:
        import specforge.modeling.draft  # noqa: F401
        from specforge.modeling.auto import AutoDraftModel
        from specforge.training.model_loading import load_draft_config_source

        config = load_draft_config_source(folder)
        model = AutoDraftModel.from_config(config)
        result["model_class"] = type(model).__name__
        sd = _read_state_dict(folder)
        try:
            info = model.load_state_dict(sd, strict=True)
            result["missing"] = sorted(info.missing_keys)
            result["unexpected"] = sorted(info.unexpected_keys)
            result["ok"] = not info.missing_keys and not info.unexpected_keys
        except RuntimeError as exc:
            # Recover the key lists for the report, then keep the strict error.
            info = model.load_state_dict(sd, strict=False) if "size mismatch" not in str(exc) else None
            if info is not None:
                result["missing"] = sorted(info.missing_keys)
                result["unexpected"] = sorted(info.unexpected_keys)
            result["error"] = " ".join(str(exc).split())[:2000]
        # Secondary: SpecForge's warm-start path (from_pretrained based).
        try:
            from specforge.training.model_loading import warm_start_draft_model

            fresh = AutoDraftModel.from_config(load_draft_config_source(folder))
            rep = warm_start_draft_model(
                fresh, folder, draft_config=load_draft_config_source(folder), strategy="dspark"
            )
            result["warm_start"] = {"ok": True, "loaded_keys": rep.loaded_keys,
                                    "missing": list(rep.missing_keys)}
        except Exception as exc:  # noqa: BLE001
            result["warm_start"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in {"make", "load"}:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        print("usage: specforge_peer.py {make OUT_DIR | load DIR}", file=sys.stderr)
        return 2
    return cmd_make(argv[1]) if argv[0] == "make" else cmd_load(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
