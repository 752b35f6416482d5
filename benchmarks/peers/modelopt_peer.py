"""Peer harness: NVIDIA ModelOpt (nvidia-modelopt==0.47.0) DSpark draft export format.

Runs ONLY with the side virtualenv's python (never with /work/main/.venv).  The side venv
was built with exactly these commands (CPU only, PyPI):

    python3 -m venv /tmp/peervenv/modelopt
    /tmp/peervenv/modelopt/bin/pip install torch==2.13.0            # -> 2.13.0+cpu
    /tmp/peervenv/modelopt/bin/pip install nvidia-modelopt==0.47.0 --no-deps
    /tmp/peervenv/modelopt/bin/pip install numpy packaging tqdm "PyYAML>=6.0" \
        "omegaconf>=2.3.0" "pydantic>=2.0" regex rich safetensors nvidia-ml-py \
        "transformers<5.15,>=4.57"                                   # -> transformers 5.14.1
    /tmp/peervenv/modelopt/bin/pip install requests pulp scipy      # imported by modelopt.torch.utils/opt

Usage:
    /tmp/peervenv/modelopt/bin/python benchmarks/peers/modelopt_peer.py make OUT_DIR \
        [--quant none|fp8|nvfp4] [--seed 0] [--draft-layers 1] [--target-ids 0,1] [--markov-rank 8]
    /tmp/peervenv/modelopt/bin/python benchmarks/peers/modelopt_peer.py load DIR

make: builds a tiny Qwen3ForCausalLM base in memory, converts it with ModelOpt's own
    ``mtsp.convert(model, [("dflash", cfg)])`` with
    ``dflash_architecture_config.projector_type="dspark"`` (-> HFDSparkModel / DSparkModule),
    then writes it with ModelOpt's own exporter
    (``modelopt.torch.export.unified_export_hf.export_speculative_decoding`` ->
    ``model.get_exporter()`` == ``hf_spec_export.DSparkExporter``), dtype=bfloat16.
    Prints one JSON object describing what was written.

    DEVIATION (clearly labelled, only when len(target_layer_ids) != draft num_hidden_layers):
    ModelOpt's ``HFDFlashModel.modify`` rejects explicit target_layer_ids whose length differs
    from the draft's num_hidden_layers ("one target layer per draft layer is required").  The
    requested draft is 1 layer tapping 2 target layers, so the script converts WITHOUT explicit
    ids, then sets ``model.target_layer_ids`` / ``model.dflash_config.target_layer_ids`` and
    rebuilds ``model.dflash_module`` with ModelOpt's own ``_build_draft_module`` (DSparkModule
    itself accepts any number of ids: fc in_features = len(ids) * hidden).  Everything written
    to disk is still produced by DSparkExporter.  The JSON reports "validation_bypassed".

load: loads a folder with ModelOpt's own loading path for exported drafts, which is the
    warm-start loader ``HFDFlashModel._load_init_checkpoint`` (config field
    ``dflash_init_checkpoint``; the DSpark module's ``remap_dspark_nested_head_keys`` pre-hook
    from modeling_draft_checkpoint_compat runs inside it).  ModelOpt has NO config.json
    parser for drafts (its Nemotron warm-start recipe transcribes config.json by hand), so this
    script maps the exporter's config.json fields back onto DFlashConfig /
    dflash_architecture_config (the inverse of DSparkExporter._export_config), builds a tiny
    random Qwen3 base of matching vocab/hidden/num_target_layers, converts, then calls
    ``_load_init_checkpoint(DIR)``.  That loader is strict (raises on missing / unexpected /
    wrong-shaped tensors); it ignores only ``embed_tokens.weight``, ``lm_head.weight`` and
    ``rotary_emb`` buffers.  Prints one JSON line {"ok","error","missing","unexpected"};
    exit 0 only if the strict load succeeded.  Notes go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import torch

TINY_BASE = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
)


def _quiet_import():
    # modelopt prints banners / warnings on import; keep stdout for the JSON only.
    with contextlib.redirect_stdout(sys.stderr):
        import modelopt.torch.speculative as mtsp  # noqa: F401
        from modelopt.torch.speculative.plugins.hf_dspark import HFDSparkModel  # noqa: F401
    return mtsp


def _tiny_base(**over):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(TINY_BASE)
    kw.update(over)
    cfg = Qwen3Config(**kw, tie_word_embeddings=False, max_position_embeddings=128)
    # As if loaded with from_pretrained (the quantized export path iterates this list).
    cfg.architectures = ["Qwen3ForCausalLM"]
    return Qwen3ForCausalLM(cfg).eval()


def _convert(base, block_size, mask_token_id, arch, init_checkpoint=None, extra=None):
    """mtsp.convert with the DFlash mode; projector_type=dspark routes to HFDSparkModel."""
    mtsp = _quiet_import()
    cfg = {
        "dflash_block_size": block_size,
        "dflash_mask_token_id": mask_token_id,
        "dflash_architecture_config": dict(arch),
        "dflash_use_torch_compile": False,
    }
    if init_checkpoint is not None:
        cfg["dflash_init_checkpoint"] = str(init_checkpoint)
    cfg.update(extra or {})
    with contextlib.redirect_stdout(sys.stderr):
        return mtsp.convert(base, [("dflash", cfg)])


def _retarget(model, ids):
    """Set target_layer_ids after convert and rebuild the draft with ModelOpt's own factory."""
    model.target_layer_ids = list(ids)
    model.dflash_config.target_layer_ids = list(ids)
    model.dflash_module = model._build_draft_module(model.dflash_config)
    model.dflash_module.to(model._base_model.dtype)


def _describe_dir(out: Path) -> dict:
    from safetensors import safe_open

    facts = {"files": sorted(p.name for p in out.iterdir())}
    cfg = json.loads((out / "config.json").read_text())
    facts["config"] = cfg
    dc = cfg.get("dflash_config", {})
    facts["format"] = {
        "architectures": cfg.get("architectures"),
        "model_type": cfg.get("model_type"),
        "projector_type": dc.get("projector_type"),
    }
    facts["block_size"] = cfg.get("block_size")
    facts["mask_token_id"] = dc.get("mask_token_id")
    facts["markov_rank"] = dc.get("markov_rank")
    facts["markov_head_type"] = dc.get("markov_head_type")
    facts["target_layer_ids_as_written"] = dc.get("target_layer_ids")
    facts["target_layer_ids_meaning"] = (
        "zero-based base decoder-layer index i; ModelOpt taps HF hidden_states[i + 1] "
        "(hf_dflash.py / hf_dspark.py: offset = 1; hidden_states[lid + offset])"
    )
    facts["confidence"] = {
        "use_confidence_head": dc.get("use_confidence_head"),
        "confidence_head_input": "cat([h_k, markov_w1[x_{k-1}]]) -> Linear(hidden+rank, 1)",
    }
    facts["shift_label"] = dc.get("shift_label")
    tensors = {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
        for k in sorted(f.keys()):
            t = f.get_tensor(k)
            tensors[k] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
    facts["safetensors_metadata"] = meta
    facts["tensors"] = tensors
    qpath = out / "hf_quant_config.json"
    facts["hf_quant_config"] = json.loads(qpath.read_text()) if qpath.exists() else None
    facts["config_quantization_config"] = cfg.get("quantization_config")
    return facts


def cmd_make(
    out_dir: str, quant: str, seed: int, draft_layers: int = 1, target_ids=None, markov_rank=8
) -> int:
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "hf_quant_config.json"):
        (out / name).unlink(missing_ok=True)

    # DeepSpec ids [0, 1] == HF hidden_states[1], [2] == ModelOpt target_layer_ids [0, 1]
    # (ModelOpt indexes hidden_states[lid + 1]).
    target_ids = list(target_ids) if target_ids else [0, 1]
    arch = {
        "num_hidden_layers": draft_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "projector_type": "dspark",
        "markov_rank": markov_rank,
        "markov_head_type": "vanilla",
        "use_confidence_head": True,
    }
    bypass = len(target_ids) != draft_layers
    if not bypass:
        arch["target_layer_ids"] = target_ids

    # Real bases are loaded in bf16; the draft module follows the base dtype in modify().
    base = _tiny_base().to(torch.bfloat16)
    model = _convert(base, block_size=4, mask_token_id=63, arch=arch)
    if bypass:
        torch.manual_seed(seed + 1)
        _retarget(model, target_ids)
    model.eval()

    # Sanity: one forward of the draft (eval path of HFDFlashModel is backbone-only; run the
    # module directly so the Markov/confidence heads are exercised with the right shapes).
    with torch.no_grad():
        ids = torch.randint(0, 63, (1, 8))
        hs = model._base_model(input_ids=ids, output_hidden_states=True).hidden_states
        th = torch.cat([hs[i + 1] for i in model.target_layer_ids], dim=-1)
        blk = torch.full((1, 4), 63)
        blk[:, 0] = ids[:, -1]
        noise = model._base_model_embeddings(blk)
        pos = torch.arange(12).unsqueeze(0)
        h = model.dflash_module(noise, th, pos, None)
        prev = blk.view(1, 1, 4)
        model.dflash_module.compute_markov_bias(prev, h.view(1, 1, 4, -1))
        model.dflash_module.compute_confidence_logits(prev, h.view(1, 1, 4, -1))

    quant_cfg_name = None
    if quant != "none":
        import modelopt.torch.quantization as mtq

        qcfg = {"fp8": mtq.FP8_DEFAULT_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG}[quant]
        quant_cfg_name = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}[quant]
        import copy

        qcfg = copy.deepcopy(qcfg)

        def calib(m):
            # Whole draft incl. the Markov/confidence heads, so markov_w2 / confidence_proj
            # get an input amax (-> input_scale).  HFDSparkModel's eval forward is
            # backbone-only, so a calibration through it would leave the heads uncalibrated.
            with torch.no_grad():
                hh = m.dflash_module(noise, th, pos, None).view(1, 1, 4, -1)
                m.dflash_module.compute_markov_bias(prev, hh)
                m.dflash_module.compute_confidence_logits(prev, hh)

        with contextlib.redirect_stdout(sys.stderr):
            # Quantize only the draft (base stays unquantized: its weights are not exported).
            mtq.quantize(model.dflash_module, qcfg, forward_loop=lambda _m: calib(model))
            # _export_transformers_checkpoint is chosen by has_quant_opt(model), which looks at
            # the ROOT model's _modelopt_state; mark it the way mtq.quantize(model) would.
            model._modelopt_state = list(getattr(model, "_modelopt_state", [])) + [
                ("quantize", {})
            ]

    from modelopt.torch.export.unified_export_hf import export_speculative_decoding

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        export_speculative_decoding(model, dtype=torch.bfloat16, export_dir=str(out))
    facts = _describe_dir(out)
    facts.update(
        {
            "producer": "nvidia-modelopt==0.47.0 DSparkExporter (export_speculative_decoding)",
            "modelopt_wrapper_class": type(model).__name__,
            "draft_module_class": type(model.dflash_module).__name__,
            "exporter_class": type(model.get_exporter()).__name__,
            "exporter_stdout": log.getvalue().strip(),
            "seed": seed,
            "quant": quant_cfg_name,
            "validation_bypassed": bypass,
            "validation_bypassed_why": (
                "HFDFlashModel.modify requires len(target_layer_ids) == draft "
                "num_hidden_layers; ids set after convert and draft rebuilt via "
                "_build_draft_module" if bypass else None
            ),
        }
    )
    print(json.dumps(facts))
    return 0


def _arch_from_config(cfg: dict) -> tuple[dict, dict, dict]:
    """Inverse of DSparkExporter._export_config -> (dflash_architecture_config, DFlashConfig
    extras, base overrides)."""
    dc = cfg.get("dflash_config", {}) or {}
    arch = {}
    for k in (
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "hidden_act",
        "rms_norm_eps",
        "attention_bias",
        "attention_dropout",
        "layer_types",
    ):
        if k in cfg:
            arch[k] = cfg[k]
    for k in ("projector_type", "markov_rank", "markov_head_type", "use_confidence_head"):
        if k in dc:
            arch[k] = dc[k]
    if dc.get("projector_type") == "domino":
        for k in ("gru_hidden_dim", "emb_dim", "pure_draft_prefix_len", "shift_label"):
            if k in dc:
                arch[k] = dc[k]
    extra = {}
    if dc.get("use_swa"):
        extra["dflash_swa_window_size"] = dc.get("swa_window_size", cfg.get("sliding_window"))
    if "causal" in dc:
        extra["dflash_draft_attention"] = "causal" if dc["causal"] else "bidirectional"
    if dc.get("attention_sink_bias") or cfg.get("attention_sink_bias"):
        extra["dflash_attention_sink"] = True
    ids = list(dc.get("target_layer_ids") or [])
    n_target = cfg.get("num_target_layers") or (max(ids) + 1 if ids else 4)
    base_over = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=n_target,
        num_attention_heads=cfg.get("num_attention_heads", 4),
        num_key_value_heads=cfg.get("num_key_value_heads", 2),
        head_dim=cfg.get("head_dim", 8),
        intermediate_size=cfg.get("intermediate_size", 64),
    )
    if cfg.get("rope_theta") is not None:
        base_over["rope_theta"] = cfg["rope_theta"]
    return arch, extra, base_over


def cmd_load(d: str) -> int:
    res = {"ok": False, "error": None, "missing": [], "unexpected": []}
    try:
        from safetensors.torch import load_file

        path = Path(d)
        cfg = json.loads((path / "config.json").read_text())
        dc = cfg.get("dflash_config", {}) or {}
        arch, extra, base_over = _arch_from_config(cfg)
        ids = list(dc.get("target_layer_ids") or [])
        if cfg.get("quantization_config") or (path / "hf_quant_config.json").exists():
            print(
                "note: quantized export; ModelOpt's _load_init_checkpoint has no dequant path, "
                "scale tensors will surface as unexpected keys",
                file=sys.stderr,
            )
        # The same checks ModelOpt's modify() applies to explicit ids (minus the length rule,
        # which is bypassed below when it does not hold, see module docstring).
        bypass = bool(ids) and len(ids) != arch.get("num_hidden_layers")
        if ids and not bypass:
            arch["target_layer_ids"] = ids
        try:
            base_cls_over = {k: v for k, v in base_over.items() if k != "rope_theta"}
            base = _tiny_base(**base_cls_over)
        except Exception as e:  # pragma: no cover
            raise RuntimeError(f"cannot build base: {e}") from e
        init = None if bypass else path
        model = _convert(
            base,
            block_size=cfg["block_size"],
            mask_token_id=dc.get("mask_token_id"),
            arch=arch,
            init_checkpoint=init,
            extra=extra,
        )
        if bypass:
            print(
                f"note: len(target_layer_ids)={len(ids)} != num_hidden_layers="
                f"{arch.get('num_hidden_layers')}: ModelOpt's convert rejects this; ids set "
                "after convert, draft rebuilt with _build_draft_module, then ModelOpt's "
                "_load_init_checkpoint(DIR) called",
                file=sys.stderr,
            )
            _retarget(model, ids)
            with contextlib.redirect_stdout(sys.stderr):
                model._load_init_checkpoint(str(path))
        res["ok"] = True
    except Exception as e:  # report, then compute the key lists below
        res["error"] = f"{type(e).__name__}: {e}"
        model = locals().get("model")
    # Key lists, computed exactly as _load_init_checkpoint filters them.
    try:
        sd = load_file(str(Path(d) / "model.safetensors"))
        sd = {(k.split("dflash_module.", 1)[1] if "dflash_module." in k else k): v for k, v in sd.items()}
        ignored = ("embed_tokens.weight", "lm_head.weight")
        sd = {k: v for k, v in sd.items() if k not in ignored and "rotary_emb" not in k}
        if model is not None and hasattr(model, "dflash_module"):
            module_keys = set(model.dflash_module.state_dict().keys())
            resolved = dict(sd)
            for hook in model.dflash_module._load_state_dict_pre_hooks.values():
                hook(resolved, "", None, True, [], [], [])
            res["missing"] = sorted(
                k for k in module_keys - set(resolved) if "rotary_emb" not in k and k not in ignored
            )
            res["unexpected"] = sorted(set(resolved) - module_keys)
    except Exception as e:  # pragma: no cover
        if res["error"] is None:
            res["error"] = f"{type(e).__name__}: {e}"
    if res["ok"] and (res["missing"] or res["unexpected"]):
        res["ok"] = False
        res["error"] = res["error"] or "key mismatch"
    print(json.dumps(res))
    return 0 if res["ok"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out_dir")
    m.add_argument("--quant", choices=["none", "fp8", "nvfp4"], default="none")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--draft-layers", type=int, default=1)
    m.add_argument("--markov-rank", type=int, default=8, help="nvfp4 needs 16 (block 16)")
    m.add_argument("--target-ids", default="0,1", help="ModelOpt ids (HF hidden_states[i+1])")
    ld = sub.add_parser("load")
    ld.add_argument("dir")
    a = ap.parse_args(argv)
    if a.cmd == "make":
        ids = [int(x) for x in a.target_ids.split(",") if x.strip()]
        return cmd_make(a.out_dir, a.quant, a.seed, a.draft_layers, ids, a.markov_rank)
    return cmd_load(a.dir)


if __name__ == "__main__":
    sys.exit(main())
