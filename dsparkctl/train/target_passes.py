"""The target's passes that make a data part: regeneration and teacher forcing.

    regenerate_part       the target answers a batch of prompts (self-distillation, docs/background.md §7);
                          the tapped features and the target's top-k are captured while it
                          decodes (one forward per token, no second pass)
    teacher_forced_part   given sequences (the dataset's own answers, or cached tokens whose
                          features are re-extracted) run through the target once

Both return a part's tensors (`train/parts.py`); the cache that stores them is train/data.py.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dsparkctl.models.target import cached_forward, forward_taps, keep_cache_rows, new_cache
from dsparkctl.train.parts import pack


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
    base, head = model.model, model.get_output_embeddings()
    dev = next(model.parameters()).device  # the model's device; everything cached goes to the CPU
    R = len(prompts)
    plen = torch.tensor([len(p) for p in prompts])
    cache, taps, last, mask = _prefill(model, prompts, layer_ids, pad_id, plen, dev)
    stop = torch.tensor(sorted(set(int(t) for t in stop_ids)) or [-1], device=dev)
    rows = torch.arange(R, device=dev)  # batch index of each live row
    seq_len = plen.clone().to(dev)
    steps: list[list] = []  # per decode step: [rows, token, top-k ids, log-probs] (+ (rows, taps) once fed)
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
        out, taps_now = cached_forward(base, nxt[:, None], mask, seq_len[:, None], cache, layer_ids)
        # the taps of the token just fed (it belongs to the rows still live)
        step.append((rows.cpu(), taps_now[:, 0].to(torch.float16).cpu()))
        last = out.last_hidden_state[:, 0]
        seq_len = seq_len + 1
    return _by_row(steps, taps, prompts, plen)


def _prefill(model: Any, prompts: list[list[int]], layer_ids: tuple[int, ...], pad_id: int, plen: torch.Tensor,
             dev: torch.device) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts' right-padded prefill with explicit positions: (cache, the prompts' taps [R, L, F]
    fp16 on the CPU, each prompt's last hidden state [R, H], attention mask [R, L] bool)."""
    R = len(prompts)
    ids, mask = _right_pad(prompts, pad_id)
    ids, mask = ids.to(dev), mask.to(dev)
    pos = torch.arange(ids.shape[1], device=dev)[None].expand(R, -1)
    cache = new_cache(model.config)
    out, taps = cached_forward(model.model, ids, mask, pos, cache, layer_ids)
    taps = taps.to(torch.float16).cpu()  # [R, L, F]
    last = out.last_hidden_state[torch.arange(R, device=dev), (plen - 1).to(dev)]  # [R, H]
    return cache, taps, last, mask


def _by_row(steps: list[list], taps: torch.Tensor, prompts: list[list[int]],
            plen: torch.Tensor) -> dict[str, torch.Tensor]:
    """The part from the decode steps' tensors, regrouped by row (vectorised: no per-token Python work)."""
    R = len(prompts)
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
    return pack([list(p) + resp[r].tolist() for r, p in enumerate(prompts)], [len(p) for p in prompts],
                feats, list(tki.split(n_resp)), list(tkl.split(n_resp)))


@torch.no_grad()
def teacher_forced_part(model: Any, seqs: list[list[int]], prompt_lens: list[int], layer_ids: tuple[int, ...],
                        pad_id: int, topk: int, chunk: int = 8, precision: str = "fp32") -> dict[str, torch.Tensor]:
    """One forward per sequence (batched by length): tapped features and the target's top-k at
    response positions; `precision` bf16 runs the forwards under autocast (`data_precision`)."""
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
            out, taps = forward_taps(base, layer_ids, dev, input_ids=ids.to(dev), attention_mask=mask.long().to(dev))
            logits = [head(out.last_hidden_state[r, prompt_lens[j] - 1: len(seqs[j]) - 1]) for r, j in enumerate(rows)]
        taps = taps.to(torch.float16).cpu()
        for r, j in enumerate(rows):
            feats[j] = taps[r, : len(seqs[j]) - 1]
            i, v = _topk(logits[r].float(), topk)
            tki[j], tkl[j] = i.cpu(), v.cpu()
    return pack(seqs, prompt_lens, feats, tki, tkl)


def data_precision(precision: str, model: Any):
    """The target's teacher-forced forwards (recipe `data.precision`): as loaded, or under bf16
    autocast. Regeneration always runs as loaded: its answers are the target's own, exactly."""
    dev = next(model.parameters()).device
    return torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
