"""Small helpers shared by the test tables."""

from __future__ import annotations

import os
from pathlib import Path


def snapshot(*roots: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `roots` with its mode, size and mtime (lstat: never follows a link or opens a FIFO),
    so a test can assert that a refused command left, created and changed nothing."""
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                out[p] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


# ------------------------------------------------------------------ a tiny training recipe
def write_tiny_prompts(path: Path, last: int = 40) -> Path:
    """A prompts file of three-word lines (w3 w4 w5, w6 w7 w8, ... below w`last`)."""
    path.write_text("\n".join(f"w{i} w{i + 1} w{i + 2}" for i in range(3, last, 3)) + "\n")
    return path


def tiny_recipe(target: Path, prompts: Path, name: str = "tiny", data: dict | None = None,
                optim: dict | None = None) -> str:
    """The TOML of a tiny training recipe for a tiny target (tiny_models.save_tiny_target): a
    one-layer draft tapping layers 0 and 2 (γ = 3, Markov rank 8), two held-out sequences; `data`
    and `optim` keys replace or add to the defaults below."""
    import json

    sections = {
        "target": {"model": str(target)},
        "draft": {"num_layers": 1, "layer_ids": [0, 2], "block_size": 3, "markov_rank": 8, "mask_token_id": 2},
        "data": {"dataset": str(prompts), "num_prompts": 8, "max_new_tokens": 8, "batch_size": 4, **(data or {})},
        "optim": {"steps": 2, "batch_sequences": 2, "anchors_per_sequence": 3, "threads": 1, **(optim or {})},
        "eval": {"holdout": 2},
    }
    lines = [f"name = {json.dumps(name)}"]
    for section, keys in sections.items():
        lines += [f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def regenerated_tiny(seed: int = 0):
    """(model, prompts, sequences): a tiny llama target (frozen) and four prompts it answered,
    sampled, up to 16 tokens each, with features and top-8 captured (train/data.regenerate_part)."""
    import torch

    from dsparkctl.train.parts import unpack
    from dsparkctl.train.target_passes import regenerate_part
    from tests.tiny_models import tiny_target

    model = tiny_target("llama", vocab=64, layers=4)
    for p in model.parameters():
        p.requires_grad_(False)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    part = regenerate_part(model, prompts, (0, 2), max_new_tokens=16, temperature=1.0, stop_ids=[1],
                           pad_id=2, topk=8, generator=torch.Generator().manual_seed(seed))
    return model, prompts, unpack(part, part)
