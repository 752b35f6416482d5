"""Training data: the cache of prompt + response token ids, with the target's features and top-k.

Two sources of responses (recipe `data.source`), both made by train/target_passes.py:
    regenerate   the target answers each prompt (self-distillation, docs/background.md §7); the tapped
                 features and the target's top-k are captured while it decodes (one forward
                 per token, no second pass)
    responses    the dataset's own responses (e.g. ShareGPT's first assistant turn), run through
                 the target once, teacher-forced: several times cheaper per token, but the
                 text is not what the target itself would write

Cache layout (outside the repo, `cache_dir/data-<digest>/`, digest of [target] and [data]
without `num_prompts`, so a larger `num_prompts` extends a cache instead of replacing it):
    prompts.json                                  candidate prompts in their (seeded) order
    tokens_00000.safetensors                      one part of `batch_size` sequences: token ids,
                                                  prompt lengths, offsets
    feats_00000.taps<ids>.k<topk>.safetensors     the same part's tapped features [ΣS-1, F] fp16
                                                  and the target's top-k at response positions
Every file is written atomically; an interrupted build resumes at the first missing file.
Changing the tapped layers re-extracts features from the cached tokens (teacher-forced) and
never regenerates. What a part holds per sequence, and the check a cached one must pass, is
train/parts.py.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from dsparkctl.data.filters import PROMPT_FILTERS
from dsparkctl.data.prompts import encode_prompts, load_conversations, load_prompts
from dsparkctl.distributed import DATA_PARALLEL, barrier
from dsparkctl.errors import InputError
from dsparkctl.files.atomic import atomic_open, write_json
from dsparkctl.files.ownership import regular_file
from dsparkctl.locks import claim, release, wait_for
from dsparkctl.strict_json import loads
from dsparkctl.train.parts import Sequence, check_part, unpack
from dsparkctl.train.recipe import Recipe
from dsparkctl.train.target_passes import regenerate_part, teacher_forced_part

FORMAT = "dsparkctl-train-data/2"


def candidate_items(recipe: Recipe, tokenizer: Any) -> list[dict[str, list[int]]]:
    """Every usable item, chat-encoded, deduplicated, in a seeded order (prefix-stable in num_prompts)."""
    d = recipe.data
    keep = PROMPT_FILTERS[d.prompt_filter] if d.prompt_filter else (lambda text: True)
    if d.source == "responses":
        pairs = [(p, r) for p, r in load_conversations(d.dataset, d.field, d.response_field) if keep(p)]
        prompts = encode_prompts(tokenizer, [p for p, _ in pairs])
        responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for _, r in pairs]
        items = [{"prompt": p, "response": list(r[: d.max_new_tokens])} for p, r in zip(prompts, responses) if r]
    else:
        texts = [t for t in load_prompts(d.dataset, d.field) if keep(t)]
        items = [{"prompt": p} for p in encode_prompts(tokenizer, texts)]
    seen: set[tuple[int, ...]] = set()
    uniq = []
    for it in items:
        key = tuple(it["prompt"])
        if len(key) <= d.max_prompt_tokens and key not in seen:
            seen.add(key)
            uniq.append(it)
    random.Random(d.seed).shuffle(uniq)
    if len(uniq) < d.num_prompts:
        kept = f"pass data.prompt_filter = {d.prompt_filter!r} and " if d.prompt_filter else ""
        raise InputError(f"{d.dataset}: only {len(uniq)} distinct prompts {kept}fit max_prompt_tokens="
                         f"{d.max_prompt_tokens}, recipe asks for {d.num_prompts}",
                         "lower data.num_prompts or raise data.max_prompt_tokens"
                         + (", or drop the filter" if d.prompt_filter else ""))
    return uniq


def data_dir(recipe: Recipe, cache_dir: Path) -> Path:
    return cache_dir / f"data-{recipe.data_digest()}"


def feature_name(part: int, layer_ids: tuple[int, ...], topk: int) -> str:
    return f"feats_{part:05d}.taps{'-'.join(str(i) for i in layer_ids)}.k{topk}.safetensors"


def build_dataset(recipe: Recipe, model: Any, tokenizer: Any, stop_ids: list[int], cache_dir: Path,
                  log: Callable[[str], None] = print,
                  on_batch: Callable[[int, int], None] | None = None, holdout: int = 0) -> list[Sequence]:
    """Build (or reuse) every part covering the first `num_prompts` items; return their sequences.

    With `data.extra_responses` the dataset's own answers to that many more prompts follow
    (teacher-forced, their own cache), minus any prompt among the first `holdout` sequences."""
    items = _source_items(recipe, model, tokenizer, cache_dir, log)
    extra = extra_recipe(recipe) if recipe.data.extra_responses else None
    # the extras' dataset is read now: a bad one fails before any answer is regenerated
    extra_items = _source_items(extra, model, tokenizer, cache_dir, log) if extra is not None else None
    seqs = _build_source(recipe, items, model, tokenizer, stop_ids, cache_dir, on_batch, log)
    if extra is not None:
        held = {tuple(s.tokens[: s.prompt_len].tolist()) for s in seqs[:holdout]}
        more = _build_source(extra, extra_items, model, tokenizer, stop_ids, cache_dir, on_batch, log)
        seqs += [s for s in more if tuple(s.tokens[: s.prompt_len].tolist()) not in held]
    return seqs


def extra_recipe(recipe: Recipe) -> Recipe:
    """The recipe that builds `data.extra_responses`: the answers of `data.extra_dataset` (or of
    data.dataset), teacher-forced. With another dataset its prompt field is found by name; the
    cache is keyed as if that dataset had been data.dataset, so recipes share it."""
    d = recipe.data
    other = d.extra_dataset is not None and d.extra_dataset != d.dataset
    return dataclasses.replace(recipe, data=dataclasses.replace(
        d, source="responses", num_prompts=d.extra_responses, extra_responses=0, extra_dataset=None,
        dataset=d.extra_dataset if other else d.dataset, field=None if other else d.field,
        prompt_filter=""))  # the replay is every answer: the filter picks what is regenerated


def _vocab(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def read_items(pfile: Path, vocab: int, responses: bool) -> tuple[list[dict] | None, str]:
    """(items, "") from a valid prompts.json; (None, why) for a damaged one ("" when absent).
    Valid: a regular file, strict JSON, a list of {"prompt": [ids]} (and "response" for the
    responses source), every id inside the vocabulary."""
    if not os.path.lexists(pfile):
        return None, ""
    if not regular_file(pfile):
        return None, "is not a regular file"
    try:
        items = loads(pfile.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"is not valid JSON ({type(exc).__name__})"
    keys = {"prompt", "response"} if responses else {"prompt"}

    def ids(v: Any, empty_ok: bool) -> bool:
        return isinstance(v, list) and (empty_ok or len(v) > 0) and all(type(t) is int and 0 <= t < vocab for t in v)
    if not isinstance(items, list) or not all(isinstance(it, dict) and set(it) == keys and ids(it["prompt"], False)
                                              and (not responses or ids(it["response"], False)) for it in items):
        return None, "does not hold lists of token ids of this target"
    return items, ""


def _source_items(recipe: Recipe, model: Any, tokenizer: Any, cache_dir: Path,
                  log: Callable[[str], None] = print) -> list[dict]:
    """A source's candidate items: its cached prompts.json (validated), else read from its dataset,
    chat-encoded and cached."""
    d = recipe.data
    folder = data_dir(recipe, cache_dir)
    pfile = folder / "prompts.json"
    items, why = read_items(pfile, _vocab(model), d.source == "responses")
    if items is not None and len(items) < d.num_prompts:
        raise InputError(f"{pfile}: holds {len(items)} prompts, recipe asks for {d.num_prompts}",
                         "lower data.num_prompts")
    if items is None:
        if why:
            log(f"note: the data cache's {pfile} {why}; rebuilding it (and the parts that depend on it)")
            _discard(pfile, folder)
        items = candidate_items(recipe, tokenizer)  # a bad dataset fails here, before any folder is made
        folder.mkdir(parents=True, exist_ok=True)
        write_json(pfile, items, each_rank=True)  # every rank reads its own data cache
    return items


def _build_source(recipe: Recipe, items: list[dict], model: Any, tokenizer: Any, stop_ids: list[int],
                  cache_dir: Path, on_batch: Callable[[int, int], None] | None,
                  log: Callable[[str], None] = print) -> list[Sequence]:
    d = recipe.data
    folder = data_dir(recipe, cache_dir)
    layer_ids = tuple(recipe.draft.layer_ids)
    bs = d.batch_size
    nb = (d.num_prompts + bs - 1) // bs
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    seqs: list[Sequence] = []
    if DATA_PARALLEL.active:  # under torchrun each rank first builds its own share of the missing parts
        for b in DATA_PARALLEL.mine(range(nb)):
            _build_part(recipe, model, tokenizer, stop_ids, folder, items, b, layer_ids, pad, log)
        barrier()
    for b in range(nb):
        toks, feats = _build_part(recipe, model, tokenizer, stop_ids, folder, items, b, layer_ids, pad, log)
        seqs.extend(unpack(toks, feats))
        if on_batch:
            on_batch(b + 1, nb)
    return seqs


def _discard(path: Path, folder: Path) -> None:
    """Remove a damaged cache file of ours so it is rebuilt; something that is not a regular file
    (a folder, a FIFO, a link) is not ours to remove: refused in one line naming it."""
    if os.path.lexists(path) and not regular_file(path):
        raise InputError(f"{path} is not a regular file; the data cache {folder} is damaged",
                         f"delete {folder} to rebuild the data")
    path.unlink(missing_ok=True)


def _load_part(path: Path) -> tuple[dict[str, torch.Tensor] | None, str]:

    if not regular_file(path):
        return None, "is not a regular file"
    try:
        return load_file(str(path)), ""
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        return None, f"cannot be read ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__})"


def _build_part(recipe: Recipe, model: Any, tokenizer: Any, stop_ids: list[int], folder: Path, items: list[dict],
                b: int, layer_ids: tuple[int, ...], pad: int,
                log: Callable[[str], None] = print) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Part b's token and feature tensors: read from the cache (validated: a damaged file is
    discarded with a note and rebuilt), or built and cached (atomically)."""
    d = recipe.data
    bs = d.batch_size
    part = items[b * bs: min((b + 1) * bs, d.num_prompts)]
    tfile = folder / f"tokens_{b:05d}.safetensors"
    ffile = folder / feature_name(b, layer_ids, d.topk)
    cfg = getattr(model.config, "text_config", None) or model.config
    n_features, vocab = len(layer_ids) * int(cfg.hidden_size), _vocab(model)
    if not (tfile.is_file() and ffile.is_file()):
        _wait_for_other_builder(folder / f"part_{b:05d}.lock", lambda: tfile.is_file() and ffile.is_file(), log=log)
    toks = feats = None
    if os.path.lexists(tfile):
        toks, why = _load_part(tfile)
        why = why or check_part(toks, None, part, n_features, d.topk, vocab)
        if why:
            log(f"note: the data cache's {tfile} {why}; discarded, rebuilding part {b}")
            _discard(tfile, folder)
            _discard(ffile, folder)
            toks = None
    if toks is not None and os.path.lexists(ffile):
        feats, why = _load_part(ffile)
        why = why or check_part(toks, feats, part, n_features, d.topk, vocab)
        if why:
            log(f"note: the data cache's {ffile} {why}; discarded, recomputing its features")
            _discard(ffile, folder)
            feats = None
    if toks is not None and feats is not None:
        return toks, feats
    if toks is not None:
        offs = toks["offsets"].tolist()
        s = [toks["tokens"][offs[i]: offs[i + 1]].tolist() for i in range(len(offs) - 1)]
        packed = teacher_forced_part(model, s, toks["prompt_len"].tolist(), layer_ids, pad, d.topk,
                                     precision=d.precision)
        feats = {k: packed[k] for k in ("features", "topk_ids", "topk_logp")}
        _save(ffile, feats)
        return toks, feats
    lock = _claim(folder / f"part_{b:05d}.lock")
    packed = _compute_part(d, model, part, b, layer_ids, stop_ids, pad)
    toks = {k: packed[k] for k in ("tokens", "prompt_len", "offsets")}
    feats = {k: packed[k] for k in ("features", "topk_ids", "topk_logp")}
    _save(ffile, feats)
    _save(tfile, toks)
    release(lock)
    return toks, feats


def _compute_part(d: Any, model: Any, part: list[dict], b: int, layer_ids: tuple[int, ...], stop_ids: list[int],
                  pad: int) -> dict[str, torch.Tensor]:
    if d.source == "responses":
        packed = teacher_forced_part(model, [it["prompt"] + it["response"] for it in part],
                                     [len(it["prompt"]) for it in part], layer_ids, pad, d.topk, precision=d.precision)
    else:
        gen = torch.Generator().manual_seed(d.seed * 100_003 + b)
        packed = regenerate_part(model, [it["prompt"] for it in part], layer_ids, d.max_new_tokens,
                                 d.temperature, stop_ids, pad, d.topk, gen)
    return packed


def _wait_for_other_builder(lock: Path, done: Callable[[], bool], log: Callable[[str], None] = print) -> None:
    """If another live process is building this part, wait for it (bounded, with a message)
    instead of computing the same part twice; a lock whose owner is gone is stale (locks.py)."""
    wait_for(lock, done, f"data part {lock.name.split('_')[1].split('.')[0]} of {lock.parent}", log=log)


def _claim(lock: Path) -> Path:
    """Mark a part as being built by this process (removed when its files are written)."""
    if not claim(lock):  # another process claimed it between our check and now: build it anyway, ours wins
        lock.unlink(missing_ok=True)
        claim(lock)
    return lock


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with atomic_open(path, "wb", each_rank=True) as fh:  # under torchrun each rank writes its share of the parts
        fh.write(save(tensors, metadata={"format": FORMAT}))
