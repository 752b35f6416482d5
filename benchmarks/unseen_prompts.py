"""ShareGPT prompts that no stage of the shipped draft trained on, as a prompts file (issue 29).

The shipped draft's stages took their prompts from the front of the seeded candidate orders
(`train/data.py candidate_items`): regenerated answers from the first `--regenerated` prompts of the
regenerate order, teacher-forced answers from the first `--responses` of the responses order. This
writes prompts outside both prefixes (in the responses order, from its tail, up to --limit) to a
JSONL file with a `prompt` field, for calibration traces and speed checks on prompts the draft has
not seen. ShareGPT ships no license, so the file stays outside the repository.

    .venv/bin/python benchmarks/unseen_prompts.py --out /tmp/unseen.jsonl [--limit 200] [--also RECIPE ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsparkctl.models.loading import load_target
from dsparkctl.train.data import candidate_items, extra_recipe
from dsparkctl.train.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "smollm2-135m-dspark-stage5.toml")
    ap.add_argument("--regenerated", type=int, default=896, help="regenerate-order prompts any stage used")
    ap.add_argument("--responses", type=int, default=9600, help="responses-order prompts any stage used")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--also", type=Path, action="append", default=[],
                    help="another recipe whose prompts are excluded too: the first data.num_prompts of its "
                         "regenerate order and the first data.extra_responses of its responses order (its own "
                         "data.seed; e.g. stage 8's reordered prompts)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch

    tok = load_target(None, torch.device("cpu"), torch.float32, log=lambda m: None).tokenizer
    rec = load_recipe(args.recipe)
    regen = candidate_items(rec, tok)
    import dataclasses
    resp = candidate_items(dataclasses.replace(rec, data=dataclasses.replace(rec.data, source="responses")), tok)
    used = {tuple(it["prompt"]) for it in regen[: args.regenerated]} | {tuple(it["prompt"]) for it in resp[: args.responses]}
    for extra in args.also:
        other = load_recipe(extra)
        used |= {tuple(it["prompt"]) for it in candidate_items(other, tok)[: other.data.num_prompts]}
        if other.data.extra_responses:
            used |= {tuple(it["prompt"]) for it in candidate_items(extra_recipe(other), tok)[: other.data.extra_responses]}
    from dsparkctl.data.prompts import encode_prompts, load_conversations

    texts_by_ids = {}
    pairs = load_conversations(rec.data.dataset, rec.data.field, rec.data.response_field)
    for text, ids in zip((p for p, _ in pairs), encode_prompts(tok, [p for p, _ in pairs])):
        texts_by_ids.setdefault(tuple(ids), text)
    unseen = [it["prompt"] for it in reversed(resp[args.responses:]) if tuple(it["prompt"]) not in used][: args.limit]
    texts = [texts_by_ids[tuple(ids)] for ids in unseen]
    args.out.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    print(f"wrote {len(texts)} unseen prompts to {args.out} ({len(resp)} candidates, {len(used)} used by training)")


if __name__ == "__main__":
    main()
