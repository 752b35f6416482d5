"""A draft's config.json is typed (models/draft_config.py): every field is checked where it is read, in
one line naming it; non-finite JSON numbers are refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsparkctl.errors import CheckpointError
from dsparkctl.models.draft_io import load_draft
from tests.tiny_models import write_deepspec_draft


def _config(tmp_path: Path, **changes) -> Path:
    folder = write_deepspec_draft(tmp_path / "d", block_size=4, with_embeddings=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


CONFIGS = [
    ("block_size a string", {"block_size": "4"}, "block_size must be an integer"),
    ("block_size a float", {"block_size": 4.0}, "block_size must be an integer"),
    ("block_size true", {"block_size": True}, "block_size must be an integer"),
    ("hidden_size 0", {"hidden_size": 0}, "hidden_size must be >= 1"),
    ("rms_norm_eps a string", {"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a finite number"),
    ("rms_norm_eps negative", {"rms_norm_eps": -1e-6}, "must be > 0"),
    ("confidence flag a string", {"enable_confidence_head": "yes"}, "enable_confidence_head must be true or false"),
    ("layer ids strings", {"target_layer_ids": ["0", "1"]}, "target_layer_ids must be a list of integers"),
    ("unknown markov head", {"markov_head_type": "fancy"}, "markov_head_type 'fancy'"),
    ("mask_token_id null", {"mask_token_id": None}, "missing mask_token_id"),
    ("text_config a string", {"hidden_size": None, "text_config": "x"}, "text_config must be an object"),
    ("architectures an object", {"architectures": {"a": 1}}, "architectures must be a list"),
    ("block_size 10**9", {"block_size": 10 ** 9}, "block_size must be in"),
    ("rope_theta 1e-300", {"rope_theta": 1e-300}, "rope_theta >= 1"),
    # checked against the file's shapes before anything is allocated (a 10**12-wide MLP would not fit)
    ("intermediate_size 10**12", {"intermediate_size": 10 ** 12}, "expected (1000000000000, 32) from config"),
]


@pytest.mark.parametrize("case,changes,needle", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_draft_config_is_typed(case, changes, needle, tmp_path):
    folder = _config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        load_draft(folder)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_draft_config_rejects_non_finite_json(constant, tmp_path):
    folder = write_deepspec_draft(tmp_path / "d", block_size=4)
    text = (folder / "config.json").read_text().replace('"rms_norm_eps": 1e-06', f'"rms_norm_eps": {constant}')
    assert constant in text
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_draft(folder)
