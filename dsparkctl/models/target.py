"""Target adapter: a transformers causal LM seen as "feed tokens, get logits + tapped features".

All KV-cache API details live here and nowhere else (transformers 5.x: `cache=` or, before it,
`past_key_values=` (`cache_kwarg`),
`DynamicCache(config=...)`, `DynamicLayer.keys/values`, `crop(-n)`).

Layout of the batched cache. Each request (row) owns the slots where its tokens were fed;
slots whose tokens were rejected, and right padding of ragged feeds, stay in the cache as
holes that the 2-D attention mask hides. Positions (RoPE) are passed explicitly per row, so a
hole never shifts a position. Holes at the tail that every row shares are cropped at once;
when holes exceed a quarter of the cache it is compacted (valid slots gathered to the left).
Batch 1 therefore never holds a hole: rollback is an exact `crop`.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dsparkctl.errors import ModelMismatchError
from dsparkctl.models.target_attention import fold_gqa, reads_bool_masks


def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A DynamicLayer that writes into a preallocated buffer (doubling when full) instead of
        concatenating: `keys`/`values` are views of the buffer's first n slots. A `cat` per layer
        per step copies the whole cache, which dominated decode time at batch 64 on CPU.
        Assigning new tensors to `keys`/`values` (row selection, compaction) is allowed: the
        next update re-buffers them."""

        _kbuf = _vbuf = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, T = self.keys.shape[-2] if self.keys.dim() == 4 else 0, key_states.shape[-2]
            buf = self._kbuf
            if (buf is None or n + T > buf.shape[-2] or buf.shape[:2] != key_states.shape[:2]
                    or (n and (self.keys.data_ptr() != buf.data_ptr() or self.keys.stride() != buf.stride()))):
                cap = max(256, 2 * (n + T))
                shape = (*key_states.shape[:2], cap, key_states.shape[-1])
                self._kbuf = key_states.new_empty(shape)
                self._vbuf = value_states.new_empty(shape[:3] + (value_states.shape[-1],))
                if n:
                    self._kbuf[:, :, :n] = self.keys
                    self._vbuf[:, :, :n] = self.values
            self._kbuf[:, :, n: n + T] = key_states
            self._vbuf[:, :, n: n + T] = value_states
            self.keys, self.values = self._kbuf[:, :, : n + T], self._vbuf[:, :, : n + T]
            return self.keys, self.values

    return GrowingLayer


def cache_kwarg(module: torch.nn.Module) -> str:
    """The keyword a transformers forward takes its KV cache by: `cache` (recent 5.x, the only
    spelling from 5.40) or `past_key_values` (earlier 5.x, e.g. the 5.17 of our GPU machines)."""
    return _cache_kwarg(type(module))


@functools.lru_cache(maxsize=None)
def _cache_kwarg(cls: type) -> str:
    import inspect

    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(module: torch.nn.Module, cache) -> dict:
    """`{<the module's cache keyword>: cache}`, to splat into its forward call."""
    return {cache_kwarg(module): cache}


def new_cache(config):
    """A transformers DynamicCache whose full-attention layers grow in place (see GrowingLayer)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    cls = _growing_layer_class()
    cache.layers = [cls() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def cached_forward(module: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache,
                   layer_ids: Sequence[int] = ()) -> tuple[Any, torch.Tensor | None]:
    """One forward of `module` (a causal LM, or its base model) over ids [R, T] at positions pos
    [R, T], appending their K/V to `cache`; mask [R, S+T] says which slots (cached, then these) hold
    a token, or is a prepared [R, 1, T, S+T] bool mask (a tree feed). Returns (the transformers
    output, the tapped layers' outputs [R, T, n_taps*H] on ids' device, or None without `layer_ids`)."""
    kw = dict(input_ids=ids, attention_mask=mask if mask.dim() == 4 else mask.to(torch.long), position_ids=pos,
              **with_cache(module, cache), use_cache=True)
    if not layer_ids:
        return module(**kw), None
    return forward_taps(module, layer_ids, ids.device, **kw)


def tapped(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """The tapped layers' outputs side by side on `device`: [..., n_taps*H] (hidden_states[i + 1]
    is layer i's output)."""
    return torch.cat([hidden_states[i + 1].to(device) for i in layer_ids], dim=-1)


_LAYERS: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()


def decoder_layers(module: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder-layer list of a causal LM or its base model: `get_decoder().layers` when it is
    as long as the config's num_hidden_layers (a multimodal model's vision tower may have another
    list named `layers` of that length), else None. Looked up by name each call, so layers replaced
    after loading are the ones found."""
    if module not in _LAYERS:
        cfg = getattr(module, "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        n = getattr(cfg, "num_hidden_layers", None)
        try:
            dec = module.get_decoder() if callable(getattr(module, "get_decoder", None)) else None
        except Exception:  # noqa: BLE001 - a model without a decoder accessor: no hooks
            dec = None
        found = None
        for name, m in module.named_modules():
            if dec is not None and m is dec:
                layers = getattr(dec, "layers", None)
                if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
                    found = f"{name}.layers" if name else "layers"
                break
        _LAYERS[module] = found
    name = _LAYERS[module]
    return None if name is None else module.get_submodule(name)


def forward_taps(module: torch.nn.Module, layer_ids: Sequence[int], device: torch.device,
                 **kwargs: Any) -> tuple[Any, torch.Tensor]:
    """`module(**kwargs)` and the tapped layers' outputs side by side on `device` [..., n_taps*H].

    Hooks on the tapped decoder layers catch their outputs, so only those stay alive:
    `output_hidden_states` keeps every layer's (32 prompts of 250 tokens through a 30-layer,
    576-wide target: 0.55 GB more, and a prefill 10-25% slower on one core). Where the layers
    cannot be found, or a tap is the embeddings (-1) or the last layer (whose hidden state in
    transformers is the final norm's output), it asks for every hidden state instead."""
    layers = decoder_layers(module)
    if layers is None or any(not 0 <= i < len(layers) - 1 for i in layer_ids):
        out = module(**kwargs, output_hidden_states=True)
        return out, tapped(out.hidden_states, layer_ids, device)
    caught: dict[int, list[torch.Tensor]] = {i: [] for i in set(layer_ids)}

    def catcher(i: int):
        def hook(_mod, _args, output):
            caught[i].append(output[0] if isinstance(output, tuple) else output)
        return hook
    handles = [layers[i].register_forward_hook(catcher(i)) for i in sorted(caught)]
    try:
        out = module(**kwargs, output_hidden_states=False)
    finally:
        for h in handles:
            h.remove()
    odd = {i: len(v) for i, v in caught.items() if len(v) != 1}
    if odd:  # a skipped or looped layer: its output is not one hidden state
        i, times = next(iter(odd.items()))
        raise ModelMismatchError(f"the target's decoder layer {i} ran {times} times in one forward: "
                                 "it cannot be tapped as one hidden state",
                                 "use a draft whose taps are layers every token passes once")
    return out, torch.cat([caught[i][0].to(device) for i in layer_ids], dim=-1)


def keep_cache_rows(layers, rows: torch.Tensor) -> None:
    """Keep only `rows` (indices into the batch) in each cache layer's keys and values."""
    for layer in layers:
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [R, T, V] float32, row r valid for t < lengths[r] (a chunked prefill: None)
    features: torch.Tensor | None  # [R, T, n_taps*H] concatenated tapped layer outputs (model dtype)
    last_logits: torch.Tensor | None = None  # prefill: [R, V] each row's last position


class TargetAdapter:
    """Owns one batched generation state (cache + validity mask) for a causal LM."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int] = ()):
        self.model = model.eval()
        fold_gqa(model)  # a verify forward attends without copying K/V (models/target_attention.py)
        self.config = model.config
        text_cfg = getattr(self.config, "text_config", None) or self.config
        self.text_config = text_cfg
        self.num_layers = int(text_cfg.num_hidden_layers)
        self.hidden_size = int(text_cfg.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.layer_ids = [int(i) for i in layer_ids]
        for i in self.layer_ids:
            if not (-1 <= i < self.num_layers - 1):
                raise ModelMismatchError(
                    f"tapped target layer {i} is out of range for a {self.num_layers}-layer target "
                    f"(valid: -1 .. {self.num_layers - 2}; the last layer's output is post-norm in HF)",
                    "use a draft trained for this target",
                )
        self.cache = None
        self.valid: torch.Tensor | None = None  # [R, S] bool, slot holds a committed token
        self.seq_len: torch.Tensor | None = None  # [R] committed tokens per row = next position
        self._pending: tuple[int, int] | None = None  # (first slot, T) of the last uncommitted feed
        self._compactions = 0  # slots were rearranged this many times (`mark`/`rewind` need none between)

    # --------------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        """Where inputs go and outputs come back: the input embedding's device (the first device of
        a model spread with a device map)."""
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def batch_size(self) -> int:
        return 0 if self.seq_len is None else int(self.seq_len.shape[0])

    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    # --------------------------------------------------------------------- core
    def _run(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> TargetOutput:
        # with a device map, layers (and their outputs) live on several devices: logits and taps come to ids'
        out, feats = cached_forward(self.model, ids, attn, pos, self.cache, self.layer_ids)
        return TargetOutput(logits=out.logits.float().to(ids.device), features=feats)

    PREFILL_BUDGET = 2 ** 27  # logits or attention-mask entries one prefill forward may hold

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> TargetOutput:
        """Start a new batch: feed each prompt (right-padded) and commit all of it. `last_logits`
        holds each row's last position; `logits` every position, unless the batch was fed in chunks
        (over PREFILL_BUDGET), where it is None."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill needs non-empty prompts")
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        T = int(lengths.max())
        ids = torch.zeros(len(prompts), T, dtype=torch.long, device=self.device)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        self.cache = new_cache(self.config)
        self.valid = torch.zeros(len(prompts), 0, dtype=torch.bool, device=self.device)
        self.seq_len = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
        R, rows = len(prompts), torch.arange(len(prompts), device=self.device)
        chunk = max(1, self.PREFILL_BUDGET // (R * max(self.vocab_size, T)))
        if chunk >= T:
            out = self.extend(ids, lengths)
            self.commit(lengths)
            out.last_logits = out.logits[rows, lengths - 1]
            return out
        # long or many prompts: in chunks, so that neither the logits nor the attention mask hold
        # R × T × V or R × T² entries at once; only each row's last logits are kept
        last = torch.zeros(R, self.vocab_size, dtype=torch.float32, device=self.device)
        feats = []
        for t0 in range(0, T, chunk):
            n = (lengths - t0).clamp(min=0, max=chunk)
            width = min(chunk, T - t0)
            out = self.extend(ids[:, t0: t0 + width], n)
            self.commit(n)
            ends = (lengths - 1 >= t0) & (lengths - 1 < t0 + width)
            if bool(ends.any()):
                last[ends] = out.logits[rows[ends], (lengths - 1 - t0)[ends]]
            if out.features is not None:
                feats.append(out.features)
        return TargetOutput(logits=None, features=torch.cat(feats, dim=1) if feats else None, last_logits=last)

    @torch.no_grad()
    def extend(self, ids: torch.Tensor, lengths: torch.Tensor, tree=None) -> TargetOutput:
        """Feed `ids[r, :lengths[r]]` after row r's committed tokens.  ids: [R, T], lengths: [R].
        `tree` (a tree feed, engine/siblings.py): (cached slots' validity [R, S], committed counts
        [R]) -> (mask [R, 1, T, S+T] bool, positions [R, T], the fed slots' validity [R, T]).
        The fed tokens are provisional until `commit`.
        """
        assert self._pending is None, "commit() the previous feed first"
        R, T = ids.shape
        S = self.valid.shape[1]
        ar = torch.arange(T, device=self.device)
        if tree is None:
            new_valid = ar[None, :] < lengths[:, None]  # [R, T]
            attn = torch.cat([self.valid, new_valid], dim=1)  # [R, S+T]
            pos = self.seq_len[:, None] + ar[None, :]  # [R, T]
            out = self._run(ids, attn, pos)
        else:
            mask, pos, new_valid = tree(self.valid, self.seq_len)
            out = self._run(ids, mask, pos)
            attn = torch.cat([self.valid, new_valid], dim=1)
        self.valid = attn
        self._pending = (S, T)
        return out

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the first keep[r] tokens of the last feed for row r; the rest become holes."""
        S, T = self._pending
        self._pending = None
        ar = torch.arange(T, device=self.device)
        self.valid[:, S:] &= ar[None, :] < keep[:, None]
        self.seq_len = self.seq_len + keep
        kept = int(keep.max()) if keep.numel() else 0
        self._trim(S + min(kept, T) if kept > 0 else None)  # the last used slot is known: no scan

    def relocate(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Before `commit`: copy the last feed's K/V at column src[i] to column dst[i] of row rows[i]
        (a tree feed's accepted sibling takes the place of the chain token it replaces, so what is
        kept stays a prefix of the feed and leaves no holes). Positions are in the K/V already."""
        S, _ = self._pending
        for layer in self._layers():
            r, s, d = rows.to(layer.keys.device), (S + src).to(layer.keys.device), (S + dst).to(layer.keys.device)
            layer.keys[r, :, d] = layer.keys[r, :, s]
            layer.values[r, :, d] = layer.values[r, :, s]

    @property
    def takes_trees(self) -> bool:
        """Whether `extend(tree=...)` works here: the target's attention reads its boolean mask."""
        return reads_bool_masks(self.model)

    def mark(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The committed state, for `rewind` after trial rounds (profiling)."""
        assert self._pending is None, "commit() the previous feed first"
        return self.valid.clone(), self.seq_len.clone(), int(self.valid.shape[1]), self._compactions

    def rewind(self, mark: tuple[torch.Tensor, torch.Tensor, int, int]) -> None:
        """Back to `mark`: every token fed or committed since is dropped (the slots before it
        are untouched, as long as no compaction rearranged them since)."""
        valid, seq_len, slots, compactions = mark
        if compactions != self._compactions:
            raise RuntimeError("the cache was compacted since mark(): it cannot be rewound")
        self._pending = None
        if self.valid.shape[1] > slots:
            self.cache.crop(slots - int(self.valid.shape[1]))  # negative: drop that many (the form every transformers accepts)
        self.valid, self.seq_len = valid.clone(), seq_len.clone()

    def _layers(self):
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
                raise ModelMismatchError(
                    "targets with sliding-window or non-standard KV caches are not supported yet",
                    "use a target with full attention (Llama, Qwen3, Mistral without sliding window)",
                )
            yield layer

    def _trim(self, last: int | None = None) -> None:
        """Crop the holes every row shares at the tail (`last`: the used width, when the caller knows
        it), then compact if holes exceed a quarter of the cache."""
        S = self.valid.shape[1]
        if last is None:
            used = self.valid.any(dim=0)
            last = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
        if last < S:
            self.cache.crop(-(S - last))
            self.valid = self.valid[:, :last]
        longest = int(self.seq_len.max())
        if self.valid.shape[1] > longest + max(16, longest // 4):
            self._compact()

    def _compact(self) -> None:
        """Gather each row's valid slots to the left; holes collect at the right end."""
        L = int(self.seq_len.max())
        self._compactions += 1
        # stable sort puts valid slots first, in their original order
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :L]  # [R, L]
        for layer in self._layers():
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = torch.gather(layer.keys, 2, idx)
            layer.values = torch.gather(layer.values, 2, idx)
        self.valid = torch.arange(L, device=self.device)[None, :] < self.seq_len[:, None]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished requests: keep only `rows` (indices into the current batch)."""
        keep_cache_rows(self._layers(), rows)
        self.valid = self.valid[rows]
        self.seq_len = self.seq_len[rows]
        self._trim()

    def cache_slots(self) -> int:
        return 0 if self.valid is None else int(self.valid.shape[1])
