"""Drafts side by side on training recipes' held-out splits (teacher-forced, exact greedy τ).

Each recipe's held-out split is the first `eval.holdout` sequences of its regenerated data
(the target's own greedy answers to prompts the recipe never trains on), read from the data
cache its training built. Comparing drafts on every family's split at once is how a stage is
judged against the shipped draft: stage 8's ShareGPT split, stage 9's code split, stage 11's
prose split (docs/train.md).

    .venv/bin/python benchmarks/heldout_splits.py --recipe recipes/smollm2-135m-dspark-stage9.toml \\
        --recipe recipes/smollm2-135m-dspark-stage11.toml --draft default --draft drafts/stage11 \\
        --out benchmarks/results/heldout_stage11.json

`default` is the shipped draft. A recipe whose data is not cached yet is refused (building
it is `dsparkctl train`'s job, and can take an hour).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.errors import DsparkError
from dsparkctl.files.atomic import cannot_write_file, write_json
from dsparkctl.models.draft_io import load_draft, read_draft_config
from dsparkctl.models.loading import default_draft_dir, load_target, stop_token_ids
from dsparkctl.models.target import TargetAdapter
from dsparkctl.train.data import build_dataset, data_dir
from dsparkctl.train.job import default_cache_dir, heldout_stats
from dsparkctl.train.recipe import load_recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", action="append", required=True, type=Path, help="a recipe whose held-out split to use")
    ap.add_argument("--draft", action="append", required=True, help="a draft folder, or `default` (the shipped one)")
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if why := cannot_write_file(args.out):
        sys.exit(f"--out {args.out}: {why}")
    missing = [d for d in args.draft if d != "default" and not (Path(d) / "config.json").is_file()]
    if missing:
        sys.exit(f"--draft {missing[0]}: not a draft folder (no config.json there)")
    if len(set(args.draft)) < len(args.draft) or len({p.stem for p in args.recipe}) < len(args.recipe):
        sys.exit("a --draft or a recipe name is given twice: each is one column or row of the result")
    recipes = {}
    for path in args.recipe:  # every recipe is read and checked before the target loads
        rec = load_recipe(path, ["optim.init_from=\"\""])  # the split needs no starting draft
        if rec.target.model != "embedded":
            sys.exit(f"{path}: its target is {rec.target.model!r}; this script reads the embedded target's splits")
        recipes[path] = rec
    folders = {spec: default_draft_dir() if spec == "default" else Path(spec) for spec in args.draft}
    for spec, folder in folders.items():  # the cached features are the recipes' taps: a draft must read the same layers
        cfg = read_draft_config(folder)
        for path, rec in recipes.items():
            if tuple(cfg.target_layer_ids) != tuple(rec.draft.layer_ids):
                sys.exit(f"--draft {spec} taps layers {list(cfg.target_layer_ids)}, {path} cached "
                         f"{list(rec.draft.layer_ids)}: its τ there would be meaningless")
    torch.set_num_threads(1)
    lt = load_target(None, torch.device("cpu"), torch.float32, log=lambda s: None)
    stops = stop_token_ids(lt.tokenizer, lt.model)
    splits = {}
    for path, rec in recipes.items():
        held_only = dataclasses.replace(rec, data=dataclasses.replace(rec.data, num_prompts=rec.eval.holdout,
                                                                      extra_responses=0, extra_dataset=None))
        if not data_dir(held_only, args.cache_dir).is_dir():
            sys.exit(f"{path}: its data is not in {args.cache_dir} (train the recipe first)")
        splits[path.stem] = build_dataset(held_only, lt.model, lt.tokenizer, stops, args.cache_dir,
                                          log=lambda s: None)[: rec.eval.holdout]
    adapter = TargetAdapter(lt.model)
    rows = {}
    for spec, folder in folders.items():
        draft = load_draft(folder, adapter, dtype=torch.float32, device="cpu")
        rows[spec] = {}
        for name, held in splits.items():
            st = heldout_stats(draft, held, 0.0)
            ci = st.tau_interval()  # None (and τ None) when the split holds no full block
            rows[spec][name] = {"tau": st.tau, "tau_interval": list(ci) if ci else None, "sequences": len(held),
                                "anchors": st.anchors}
            shown = f"τ {st.tau:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and st.tau is not None else "τ - (no full blocks)"
            print(f"{spec:32s} {name:36s} {shown}", flush=True)
    write_json(args.out, {"format": "dsparkctl-heldout-splits/1", "greedy": True, "results": rows,
                          **provenance_of("heldout_splits.py")})


if __name__ == "__main__":
    try:
        main()
    except DsparkError as e:  # a bad recipe or draft: one line, not a traceback
        sys.exit(f"error: {e.one_line()}")
