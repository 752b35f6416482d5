"""Training data: prompt + response token ids, with the target's features and top-k distribution.

Two sources of responses (recipe `data.source`):
    regenerate   the target answers each prompt (self-distillation, DSPARK.md); the tapped
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
never regenerates.

Per sequence of S tokens with prompt length P: `features[t]` is the tapped output at position
t (t = 0..S-2), and top-k row j is the target's distribution at position P-1+j, i.e. for the
token at P+j (j = 0..S-P-1), stored as ids (int32) and log-probabilities (fp16, T = 1).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dsparkctl.data.prompts import encode_prompts, load_conversations, load_prompts
from dsparkctl.distributed import DATA_PARALLEL, barrier
from dsparkctl.errors import InputError
from dsparkctl.fsutil import atomic_open, write_json
from dsparkctl.train.recipe import Recipe

FORMAT = "dsparkctl-train-data/2"


@dataclass
class Sequence:
    tokens: torch.Tensor  # [S] long: prompt + response
    prompt_len: int  # P
    features: torch.Tensor  # [S-1, n_taps*H] fp16 tapped target layers at positions 0..S-2
    topk_ids: torch.Tensor  # [S-P, k] int32: target top-k for the token at P+j
    topk_logp: torch.Tensor  # [S-P, k] fp16 log-probabilities (T = 1) of those ids

    @property
    def response_len(self) -> int:
        return int(self.tokens.shape[0]) - self.prompt_len


# ---------------------------------------------------------------------------------------- prompts
def candidate_items(recipe: Recipe, tokenizer: Any) -> list[dict[str, list[int]]]:
    """Every usable item, chat-encoded, deduplicated, in a seeded order (prefix-stable in num_prompts)."""
    d = recipe.data
    if d.source == "responses":
        pairs = load_conversations(d.dataset, d.field, d.response_field)
        prompts = encode_prompts(tokenizer, [p for p, _ in pairs])
        responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for _, r in pairs]
        items = [{"prompt": p, "response": list(r[: d.max_new_tokens])} for p, r in zip(prompts, responses) if r]
    else:
        items = [{"prompt": p} for p in encode_prompts(tokenizer, load_prompts(d.dataset, d.field))]
    seen: set[tuple[int, ...]] = set()
    uniq = []
    for it in items:
        key = tuple(it["prompt"])
        if len(key) <= d.max_prompt_tokens and key not in seen:
            seen.add(key)
            uniq.append(it)
    random.Random(d.seed).shuffle(uniq)
    if len(uniq) < d.num_prompts:
        raise InputError(f"{d.dataset}: only {len(uniq)} distinct prompts fit max_prompt_tokens="
                         f"{d.max_prompt_tokens}, recipe asks for {d.num_prompts}",
                         "lower data.num_prompts or raise data.max_prompt_tokens")
    return uniq


# ---------------------------------------------------------------------------------------- target passes
def _right_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[r, : len(s)] = True
    return ids, mask


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] float32 -> top-k ids [N, k] int32 and log-probs [N, k] fp16 (T = 1)."""
    v, i = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return i.to(torch.int32), v.to(torch.float16)


def _draw(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """The next token per row [n] from logits [n, V]: the argmax when greedy, else a multinomial draw
    on the CPU (where the generator lives). Not math.sampling.draw: its exponential race draws the
    same law from another random stream, and a data cache built for a seed must not change."""
    if temperature > 0:
        probs = torch.softmax(logits / temperature, dim=-1).cpu()
        return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)
    return logits.argmax(-1)


@torch.no_grad()
def regenerate_part(model: Any, prompts: list[list[int]], layer_ids: tuple[int, ...], max_new_tokens: int,
                    temperature: float, stop_ids: list[int], pad_id: int, topk: int,
                    generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Decode responses for one batch of prompts, capturing tapped features and top-k as we go.

    Right-padded prefill with explicit positions; each decode step feeds one token per live row
    (padding slots stay as masked holes); finished rows leave the batch at once. The base model
    runs and the head is applied at the last position only: the target adapter's prefill would
    compute logits at every position ([R, L, V], gigabytes at a recipe's batch). The cache is
    handled through models/target.py.
    """
    from dsparkctl.models.target import cached_forward, keep_cache_rows, new_cache, tapped

    base, head = model.model, model.get_output_embeddings()
    dev = next(model.parameters()).device  # the model's device; everything cached goes to the CPU
    R = len(prompts)
    ids, mask = _right_pad(prompts, pad_id)
    ids, mask = ids.to(dev), mask.to(dev)
    plen = torch.tensor([len(p) for p in prompts])
    pos = torch.arange(ids.shape[1], device=dev)[None].expand(R, -1)
    cache = new_cache(model.config)
    out = cached_forward(base, ids, mask, pos, cache)
    taps = tapped(out.hidden_states, layer_ids, dev).to(torch.float16).cpu()  # [R, L, F]
    last = out.last_hidden_state[torch.arange(R, device=dev), (plen - 1).to(dev)]  # [R, H]
    stop = torch.tensor(sorted(set(int(t) for t in stop_ids)) or [-1], device=dev)
    rows = torch.arange(R, device=dev)  # batch index of each live row
    seq_len = plen.clone().to(dev)
    steps: list[tuple[torch.Tensor, ...]] = []  # per decode step: (rows, token, top-k ids, log-probs, taps)
    count = torch.zeros(R, dtype=torch.long, device=dev)  # response tokens so far per row
    for _step in range(max_new_tokens):
        logits = head(last).float()  # [n, V]
        i, v = _topk(logits, topk)
        nxt = _draw(logits, temperature, generator)
        count[rows] += 1
        done = torch.isin(nxt, stop) | (count[rows] >= max_new_tokens)
        step = [rows.cpu(), nxt.cpu(), i.cpu(), v.cpu()]
        steps.append(step)
        if bool(done.all()):
            break
        if bool(done.any()):
            kd = (~done).nonzero().flatten()
            rows, nxt, seq_len, mask = rows[kd], nxt[kd], seq_len[kd], mask[kd]
            keep_cache_rows(cache.layers, kd)
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool, device=dev)], dim=1)
        out = cached_forward(base, nxt[:, None], mask, seq_len[:, None], cache)
        # the taps of the token just fed (it belongs to the rows still live)
        step.append((rows.cpu(), tapped(out.hidden_states, layer_ids, dev)[:, 0].to(torch.float16).cpu()))
        last = out.last_hidden_state[:, 0]
        seq_len = seq_len + 1
    # regroup the per-step tensors by row (vectorised: no per-token Python work)
    tok_rows = torch.cat([st[0] for st in steps])
    order = torch.sort(tok_rows, stable=True).indices  # by row, then step
    toks = torch.cat([st[1] for st in steps])[order]
    tki = torch.cat([st[2] for st in steps])[order]
    tkl = torch.cat([st[3] for st in steps])[order]
    n_resp = torch.bincount(tok_rows, minlength=R).tolist()
    fed = [st[4] for st in steps if len(st) > 4]
    if fed:
        f_rows = torch.cat([r for r, _ in fed])
        f_order = torch.sort(f_rows, stable=True).indices
        f_taps = torch.cat([t for _, t in fed])[f_order]
        n_fed = torch.bincount(f_rows, minlength=R).tolist()
    else:
        f_taps, n_fed = taps.new_zeros(0, taps.shape[-1]), [0] * R
    resp = toks.split(n_resp)
    feats = [torch.cat([taps[r, : plen[r]], t]) for r, t in enumerate(f_taps.split(n_fed))]
    return _pack([list(p) + resp[r].tolist() for r, p in enumerate(prompts)], [len(p) for p in prompts],
                 feats, list(tki.split(n_resp)), list(tkl.split(n_resp)))


@torch.no_grad()
def teacher_forced_part(model: Any, seqs: list[list[int]], prompt_lens: list[int], layer_ids: tuple[int, ...],
                        pad_id: int, topk: int, chunk: int = 8, precision: str = "fp32") -> dict[str, torch.Tensor]:
    """One forward per sequence (batched by length): tapped features and the target's top-k at
    response positions; `precision` bf16 runs the forwards under autocast (`data_precision`)."""
    from dsparkctl.models.target import tapped

    base, head = model.model, model.get_output_embeddings()
    dev = next(model.parameters()).device
    n = len(seqs)
    feats: list = [None] * n
    tki: list = [None] * n
    tkl: list = [None] * n
    by_length = sorted(range(n), key=lambda j: len(seqs[j]))  # chunks of similar lengths: little padding
    for c in range(0, n, chunk):
        rows = by_length[c: c + chunk]
        ids, mask = _right_pad([seqs[j] for j in rows], pad_id)
        with data_precision(precision, model):
            out = base(input_ids=ids.to(dev), attention_mask=mask.long().to(dev), output_hidden_states=True)
            logits = [head(out.last_hidden_state[r, prompt_lens[j] - 1: len(seqs[j]) - 1]) for r, j in enumerate(rows)]
        taps = tapped(out.hidden_states, layer_ids, dev).to(torch.float16).cpu()
        for r, j in enumerate(rows):
            feats[j] = taps[r, : len(seqs[j]) - 1]
            i, v = _topk(logits[r].float(), topk)
            tki[j], tkl[j] = i.cpu(), v.cpu()
    return _pack(seqs, prompt_lens, feats, tki, tkl)


def _pack(seqs: list[list[int]], prompt_lens: list[int], feats: list[torch.Tensor], tki: list[torch.Tensor],
          tkl: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    offs = [0]
    for s in seqs:
        offs.append(offs[-1] + len(s))
    return {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.long),
            "prompt_len": torch.tensor(prompt_lens, dtype=torch.long), "offsets": torch.tensor(offs),
            "features": torch.cat([f[: len(s) - 1] for f, s in zip(feats, seqs)]).contiguous(),
            "topk_ids": torch.cat([t[: len(s) - p] for t, s, p in zip(tki, seqs, prompt_lens)]).contiguous(),
            "topk_logp": torch.cat([t[: len(s) - p] for t, s, p in zip(tkl, seqs, prompt_lens)]).contiguous()}


def unpack(tokens: dict[str, torch.Tensor], feats: dict[str, torch.Tensor]) -> list[Sequence]:
    out = []
    offs = tokens["offsets"].tolist()
    plens = tokens["prompt_len"].tolist()
    foff = koff = 0
    for i in range(len(offs) - 1):
        S, P = offs[i + 1] - offs[i], plens[i]
        out.append(Sequence(tokens=tokens["tokens"][offs[i]: offs[i + 1]], prompt_len=P,
                            features=feats["features"][foff: foff + S - 1],
                            topk_ids=feats["topk_ids"][koff: koff + S - P],
                            topk_logp=feats["topk_logp"][koff: koff + S - P]))
        foff += S - 1
        koff += S - P
    return out


# ---------------------------------------------------------------------------------------- the cache
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
    seqs = _build_source(recipe, model, tokenizer, stop_ids, cache_dir, on_batch, log)
    d = recipe.data
    if d.extra_responses:
        import dataclasses
        extra = dataclasses.replace(recipe, data=dataclasses.replace(d, source="responses", num_prompts=d.extra_responses,
                                                                     extra_responses=0))
        held = {tuple(s.tokens[: s.prompt_len].tolist()) for s in seqs[:holdout]}
        more = _build_source(extra, model, tokenizer, stop_ids, cache_dir, on_batch, log)
        seqs += [s for s in more if tuple(s.tokens[: s.prompt_len].tolist()) not in held]
    return seqs


def _vocab(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def read_items(pfile: Path, vocab: int, responses: bool) -> tuple[list[dict] | None, str]:
    """(items, "") from a valid prompts.json; (None, why) for a damaged one ("" when absent).
    Valid: a regular file, strict JSON, a list of {"prompt": [ids]} (and "response" for the
    responses source), every id inside the vocabulary."""
    from dsparkctl.fsutil import regular_file
    from dsparkctl.strict_json import loads

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


def _build_source(recipe: Recipe, model: Any, tokenizer: Any, stop_ids: list[int], cache_dir: Path,
                  on_batch: Callable[[int, int], None] | None,
                  log: Callable[[str], None] = print) -> list[Sequence]:
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
    from dsparkctl.fsutil import regular_file

    if os.path.lexists(path) and not regular_file(path):
        raise InputError(f"{path} is not a regular file; the data cache {folder} is damaged",
                         f"delete {folder} to rebuild the data")
    path.unlink(missing_ok=True)


def check_part(toks: dict[str, torch.Tensor], feats: dict[str, torch.Tensor] | None, part: list[dict],
               n_features: int, topk: int, vocab: int) -> str:
    """"" when a cached part fits the items it was built from and the recipe; else why not. The
    token file: the part's prompts, in order, each followed by ids inside the vocabulary; the
    feature file: one feature row per position but the last, one top-k row per response token."""
    if set(toks) != {"tokens", "prompt_len", "offsets"} or any(t.dtype != torch.long or t.dim() != 1
                                                               for t in toks.values()):
        return "holds other tensors than a token part"
    offs, plen, ids = toks["offsets"].tolist(), toks["prompt_len"].tolist(), toks["tokens"]
    if len(offs) != len(part) + 1 or len(plen) != len(part) or offs[0] != 0 or offs[-1] != ids.numel():
        return "does not hold this part's sequences"
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return "holds token ids outside the target's vocabulary"
    for i, it in enumerate(part):
        S = offs[i + 1] - offs[i]
        if plen[i] != len(it["prompt"]) or S <= plen[i] or ids[offs[i]: offs[i] + plen[i]].tolist() != it["prompt"]:
            return f"sequence {i} is not the prompt it was built from"
    if feats is None:
        return ""
    n_feat = sum(offs[i + 1] - offs[i] - 1 for i in range(len(part)))
    n_resp = sum(offs[i + 1] - offs[i] - plen[i] for i in range(len(part)))
    if not {"features", "topk_ids", "topk_logp"} <= set(feats) <= {"features", "topk_ids", "topk_logp", *toks}:
        return "holds other tensors than a feature part"  # (older versions also kept the token tensors here)
    f, ki, kl = feats["features"], feats["topk_ids"], feats["topk_logp"]
    if f.dtype != torch.float16 or tuple(f.shape) != (n_feat, n_features) or not bool(torch.isfinite(f).all()):
        return f"features are {tuple(f.shape)} {f.dtype}, expected ({n_feat}, {n_features}) finite float16"
    if ki.dtype != torch.int32 or tuple(ki.shape) != (n_resp, topk) or (ki.numel() and (
            int(ki.min()) < 0 or int(ki.max()) >= vocab)):
        return "top-k ids do not fit the part"
    if kl.dtype != torch.float16 or tuple(kl.shape) != (n_resp, topk) or bool(kl.isnan().any()) or bool((kl > 0).any()):
        return "top-k log-probabilities do not fit the part"
    return ""


def _load_part(path: Path) -> tuple[dict[str, torch.Tensor] | None, str]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dsparkctl.fsutil import regular_file

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
    from dsparkctl.locks import release

    release(lock)
    return toks, feats


def data_precision(precision: str, model: Any):
    """The target's teacher-forced forwards (recipe `data.precision`): as loaded, or under bf16
    autocast. Regeneration always runs as loaded: its answers are the target's own, exactly."""
    import contextlib

    dev = next(model.parameters()).device
    return torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


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
    from dsparkctl.locks import wait_for

    wait_for(lock, done, f"data part {lock.name.split('_')[1].split('.')[0]} of {lock.parent}", log=log)


def _claim(lock: Path) -> Path:
    """Mark a part as being built by this process (removed when its files are written)."""
    from dsparkctl.locks import claim

    if not claim(lock):  # another process claimed it between our check and now: build it anyway, ours wins
        lock.unlink(missing_ok=True)
        claim(lock)
    return lock


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    with atomic_open(path, "wb", each_rank=True) as fh:  # under torchrun each rank writes its share of the parts
        fh.write(save(tensors, metadata={"format": FORMAT}))
