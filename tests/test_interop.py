"""What SGLang, vLLM, DeepSpec and transformers read from the files we write (docs/serving.md)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.errors import CheckpointError
from dsparkctl.models.draft_config import DraftConfig
from dsparkctl.models.draft_io import load_draft, random_draft, save_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import save_tiny_target, tiny_target, write_deepspec_draft


# ------------------------------------------------------------------ configs transformers accepts
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_written_draft_config_loads_with_the_targets_transformers_config_class(tmp_path, family):
    """DeepSpec's build_draft_config: layer_types = full attention × DRAFT layers, untied
    embeddings, architectures = the draft class. Copying the target's 8 layer types made
    transformers' Qwen3Config refuse a 2-layer draft."""
    from transformers import LlamaConfig, Qwen3Config

    model = tiny_target(family, layers=8)
    draft = random_draft(TargetAdapter(model), num_layers=2, layer_ids=[1, 3])
    cfg = json.loads((save_draft(draft, tmp_path / "d") / "config.json").read_text())
    loaded = {"qwen3": Qwen3Config, "llama": LlamaConfig}[family].from_dict(cfg)
    assert loaded.num_hidden_layers == 2
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["tie_word_embeddings"] is False
    if family == "qwen3":
        assert cfg["layer_types"] == ["full_attention"] * 2 and loaded.layer_types == ["full_attention"] * 2
    else:  # as vLLM 0.32.0 and SGLang 0.5.23 read it (benchmarks/interop_check.sh): non-causal full attention
        assert cfg["model_type"] == "llama" and "layer_types" not in cfg


def test_shipped_draft_config_is_llama_without_layer_types():
    """docs/serving.md says what we ship: the SmolLM2 target's llama config plus the draft fields."""
    from dsparkctl.models.loading import default_draft_dir

    folder = default_draft_dir()
    if folder is None:
        pytest.skip("no shipped draft in this install")
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"], cfg["tie_word_embeddings"]) == ("llama", ["Qwen3DSparkModel"], False)
    assert "layer_types" not in cfg and cfg["draft_vocab_size"] == 8192 and cfg["vocab_size"] == 49152


@pytest.mark.parametrize("d2t, message", [(torch.zeros(2, 16, dtype=torch.long), "1-D integer"),
                                          (torch.zeros(16), "1-D integer"),
                                          (torch.full((16,), 60, dtype=torch.long), "outside the vocabulary")])
def test_vllm_form_with_a_bad_d2t_is_refused(tmp_path, d2t, message):
    from safetensors.torch import load_file, save_file

    tgt = TargetAdapter(tiny_target("qwen3"), [0, 1])
    draft = random_draft(tgt, num_layers=1, layer_ids=[0, 1], markov_rank=8, draft_vocab_size=16)
    folder = save_draft(draft, tmp_path / "d")
    t = load_file(str(folder / "model.safetensors"))
    del t["draft_vocab_ids"]
    t["d2t"] = d2t
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_draft(folder, tgt)


# ------------------------------------------------------------------ nested dflash_config / dspark_config
BASE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}


def test_fields_are_read_from_nested_configs_first():
    nested = {**BASE, "block_size": 3, "mask_token_id": 2, "target_layer_ids": [0, 1],
              "dflash_config": {"block_size": 4, "mask_token_id": 5, "target_layer_ids": [1, 2]},
              "dspark_config": {"markov_rank": 8, "markov_head_type": "gated"}}
    cfg = DraftConfig.from_dict(nested)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (4, 5, (1, 2))
    assert (cfg.markov_rank, cfg.markov_head_type) == (8, "gated")
    # SGLang: a prefixed top-level key beats dspark_config, which beats dflash_config
    cfg = DraftConfig.from_dict({**nested, "dspark_block_size": 6, "dspark_config": {"block_size": 7}})
    assert cfg.block_size == 6
    cfg = DraftConfig.from_dict({**nested, "dspark_config": {"block_size": 7}})
    assert cfg.block_size == 7


def test_a_draft_with_only_nested_fields_loads_and_runs(tmp_path):
    folder = write_deepspec_draft(tmp_path / "d")
    cfg = json.loads((folder / "config.json").read_text())
    moved = {k: cfg.pop(k) for k in ("block_size", "mask_token_id", "target_layer_ids")}
    cfg["dflash_config"] = moved
    (folder / "config.json").write_text(json.dumps(cfg))
    tgt = TargetAdapter(tiny_target("llama"), [0, 1])
    draft = load_draft(folder, tgt)
    assert draft.block_size == moved["block_size"] and draft.cfg.target_layer_ids == tuple(moved["target_layer_ids"])


# ------------------------------------------------------------------ architectures we do not know
@pytest.mark.parametrize("arch, message", [(["Gemma4DSparkModel"], "Gemma-4"), (["MysteryDraft"], "unknown draft"),
                                           ("Qwen3Eagle3Model", "unknown draft")])
def test_unknown_architectures_are_refused(tmp_path, arch, message):
    folder = write_deepspec_draft(tmp_path / "d", overrides={"architectures": arch})
    with pytest.raises(CheckpointError, match=message):
        load_draft(folder, TargetAdapter(tiny_target("llama"), [0, 1]))


def test_cli_refuses_a_gemma4_draft_in_one_line(tmp_path):
    target = save_tiny_target(tmp_path / "target", "llama")
    folder = write_deepspec_draft(tmp_path / "d", overrides={"architectures": ["Gemma4DSparkModel"]})
    trace = tmp_path / "t.jsonl"
    res = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", str(folder), "--max-new-tokens",
                                   "4", "--trace", str(trace), "w5 w6"])
    assert res.exit_code != 0 and "Gemma-4" in res.output and "architectures" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not trace.exists()


def test_full_vocabulary_draft_keeps_deepspec_tensor_names(tmp_path):
    from safetensors.torch import load_file

    draft = random_draft(TargetAdapter(tiny_target("qwen3")), num_layers=1, layer_ids=[0, 1])
    names = set(load_file(str(save_draft(draft, tmp_path / "d") / "model.safetensors")))
    assert "draft_vocab_ids" not in names and {"fc.weight", "hidden_norm.weight",
                                                "markov_head.markov_w1.weight"} <= names
    assert all(not n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert torch.is_tensor(draft.fc.weight)


# ------------------------------------------------------------------ drafts for loaders that do not borrow
def test_draft_with_embeddings_loads_with_from_pretrained_and_matches_ours(tmp_path):
    """DeepSpec's eval.py builds the draft with from_pretrained and reads embed_tokens/lm_head
    from the file; `--with-embeddings` writes them. transformers reads the same tensors."""
    from transformers import Qwen3ForCausalLM

    model = tiny_target("qwen3")
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, num_layers=1, layer_ids=[0, 1], markov_rank=8, seed=4)
    folder = save_draft(draft, tmp_path / "d", dtype=torch.float32, include_embeddings=True)
    hf = Qwen3ForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(hf.lm_head.weight, model.lm_head.weight)
    torch.testing.assert_close(hf.model.embed_tokens.weight, model.model.embed_tokens.weight)
    torch.testing.assert_close(hf.model.layers[0].self_attn.q_proj.weight, draft.layers[0].self_attn.q_proj.weight)
    alone = load_draft(folder)  # no target: its own embedding and head
    feats = torch.randn(1, 6, 2 * model.config.hidden_size)
    anchors, pos = torch.tensor([[5, 7]]), torch.tensor([[2, 4]])
    h_ours = draft.forward_blocks(feats, anchors, pos)
    h_alone = alone.forward_blocks(feats, anchors, pos)
    prev = torch.randint(0, 64, (1, 2, draft.block_size))
    torch.testing.assert_close(alone.block_logits(h_alone, prev)[0], draft.block_logits(h_ours, prev)[0])
    torch.testing.assert_close(hf.lm_head(h_alone), draft.lm_head(h_ours))


def test_reduced_vocabulary_drafts_cannot_be_exported_with_embeddings():
    from dsparkctl.errors import InputError
    from dsparkctl.train.draft_init import check_embeddings_export

    with pytest.raises(InputError, match="reduced-vocabulary"):
        check_embeddings_export(8192, True)
    check_embeddings_export(0, True)
    check_embeddings_export(8192, False)
