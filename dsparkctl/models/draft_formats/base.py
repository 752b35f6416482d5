"""What a draft format is, and the one in-memory draft every format reads into and writes from.

A format (`DraftFormat`) is a small declarative description: how its `config.json` and its tensor
names say "this is me", how its tensor names map to ours, how it counts target layers, how it maps
the draft's vocabulary, what it can hold, and two small functions that read and write its config.
Every reader produces a `CanonicalDraft`; every writer consumes one; converting A -> B is read A,
write B (registry.py). Nothing outside this package branches on a format.

The canonical draft is DeepSpec's layout as dsparkctl loads it (`DSparkDraft`'s state-dict names):
  - target layer ids count DeepSpec's way: id i is the OUTPUT of decoder layer i (transformers'
    `hidden_states[i + 1]`), -1 the embeddings;
  - a reduced vocabulary is `draft_vocab_ids` [K] int64, strictly increasing target ids, with
    `markov_head.markov_w2.weight` [K, r] and (when carried) `lm_head.weight` [K, H];
  - the slot convention is `DraftConfig.sample_from_anchor` (True: slot k predicts token p+k+1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor

from dsparkctl.models.draft_config import DraftConfig

BORROWED = ("embed_tokens.weight", "lm_head.weight")  # copies of the target's, frozen, in every format
TOOL_KEY = "dsparkctl"  # our block in a written config.json (every format's config validation allows it)


@dataclass(frozen=True)
class FileFacts:
    """What the files say, as they say it (inspect shows these beside the canonical values)."""
    layer_ids_key: str  # the config field holding the target layer ids, e.g. "aux_hidden_state_layer_ids"
    layer_ids: tuple[int, ...]  # as written
    layer_rule: str  # how that format counts them, in words
    slot_rule: str  # where the slot convention comes from: "config: sample_from_anchor" or "implied by ..."
    slot_stated: bool  # the file states it (else the format implies it)
    version: str | None = None  # the format's own version field, where it has one
    target: dict[str, Any] | None = None  # what target the file names
    quantization: dict[str, Any] | None = None  # hf_quant_config.json or quantization_config, as found
    warnings: tuple[str, ...] = ()  # what the file holds that dsparkctl runs differently, in words


@dataclass
class CanonicalDraft:
    """A draft in memory, whatever file it came from (see the module doc for the conventions)."""
    config: DraftConfig
    tensors: dict[str, Tensor]  # canonical names -> tensors exactly as stored (dtype kept)
    format: str  # the format it was read from (or "memory")
    facts: FileFacts | None = None
    added: tuple[str, ...] = ()  # tensors an earlier conversion copied in from the target
    changes: tuple[str, ...] = ()  # what an earlier conversion dropped or changed, in words

    @property
    def reduced(self) -> bool:
        return "draft_vocab_ids" in self.tensors

    @property
    def own_tensors(self) -> dict[str, Tensor]:
        """The draft's own weights: everything but the copies of the target's embedding and head."""
        return {k: v for k, v in self.tensors.items() if k not in BORROWED}


@dataclass(frozen=True)
class DraftFormat:
    key: str  # short id: --to value, JSON "format"
    title: str
    trainer: str  # who writes it, for the reader
    claims_config: Callable[[dict[str, Any]], bool]  # config.json says "this format"
    claims_tensors: Callable[[set[str]], bool]  # the tensor names are this format's
    renames: tuple[tuple[str, str], ...] = ()  # (canonical, file) name pairs; a pair ending in "." is a prefix
    legacy_renames: tuple[tuple[str, str], ...] = ()  # older files' names, read only
    layer_offset: int = 0  # id as written = canonical id + layer_offset
    layer_rule: str = "id i = output of decoder layer i (hidden_states[i + 1]); -1 = embeddings"
    vocab: str = "index"  # "index" (draft_vocab_ids) | "d2t" (d2t offsets + t2d mask) | "full" (no reduction)
    holds_anchor_free_slots: bool = True  # can say sample_from_anchor false
    holds_head_types: tuple[str, ...] = ("vanilla", "gated", "rnn")
    holds_hidden_only_confidence: bool = True  # a confidence head that reads the hidden state alone
    needs_markov: bool = False  # only DSpark drafts (markov_rank > 0)
    names_target: bool = False  # the format has a field naming the target (else dsparkctl keeps it in its block)
    # borrowed tensors the format must carry for this config (copied from --target when the draft lacks them)
    needs: Callable[[DraftConfig], tuple[str, ...]] = lambda cfg: ()
    own_files: tuple[str, ...] = ()  # files only this format writes (two formats' files in one folder is refused)
    read_config: Callable[[dict[str, Any], str], tuple[dict[str, Any], FileFacts]] | None = None
    write_config: Callable[[CanonicalDraft], dict[str, Any]] | None = None
    # tensor steps beyond renames and the vocabulary map (dequantizing, merging): canonical names in and out
    read_tensors: Callable[[dict[str, Tensor], DraftConfig, FileFacts, str], dict[str, Tensor]] | None = None
    write_tensors: Callable[[dict[str, Tensor], DraftConfig], dict[str, Tensor]] | None = None
    warnings: Callable[[DraftConfig], list[str]] = lambda cfg: []  # what the trainer's own loader will say of it
    notes: tuple[str, ...] = field(default=())  # rules stated in docs/formats.md, shown by inspect

    def to_file_name(self, name: str) -> str:
        return _rename(name, self.renames, forward=True)

    def to_canonical_name(self, name: str) -> str:
        for pairs in (self.renames, self.legacy_renames):
            new = _rename(name, pairs, forward=False)
            if new != name:
                return new
        return name


def _rename(name: str, pairs: tuple[tuple[str, str], ...], forward: bool) -> str:
    for canon, file in pairs:
        a, b = (canon, file) if forward else (file, canon)
        if a.endswith(".") and name.startswith(a):
            return b + name[len(a):]
        if name == a:
            return b
    return name


def has_any(names: set[str], *patterns: str) -> bool:
    """Some name matches one of the regexes (anchored at the start)."""
    return any(re.match(p, n) for p in patterns for n in names)
