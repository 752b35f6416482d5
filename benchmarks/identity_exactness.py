"""Could greedy speculative output be bit-identical to plain decoding, and at what cost? A probe of
the target's row-count invariance on this CPU, with a prototype of the change that would make it so
(monkeypatched here, nothing in dsparkctl changed).

Greedy identity is exact only if the logits row that decides a token has the same bits whichever
forward computed it: a 1-row plain step, row j of a (γ+1)-row verify, or a sibling's column of a
tree verify, and only if every K/V that row attends to has the same bits too. Three checks:

  1. linears: for each of the target's linear shapes and each kernel (torch's stock F.linear, the
     packed oneDNN linear of models/packed_linear.py), the classes of row counts M whose row 0
     comes out bit-identical (one class = the kernel is row-count invariant there);
  2. decisions: the logits of 40 greedy positions after a prompt, fed one token per forward (plain
     decoding) and in chunks of T = 2, 4, 6, 8 (verify forwards; their K/V then feed the next
     chunk, as a round's accepted tokens do), under each kernel route and attention:
       today   the session's attention (`dsparkctl-sdpa`: one SDPA call over all T queries, keys up
               to the feed's end, masked), routes stock / stock<=3,packed / packed
       exact   packed linears with a 1-row call run as 2 rows (the M ≥ 2 class), and attention
               row by row: each query through the same one-query SDPA call over exactly the keys
               it attends (a view of the cache prefix; the attended slots gathered for a sibling),
               the call a plain step makes
     counted as positions whose logits are bit-identical to plain's (also packed+pad1 with today's
     attention, and today's route with row-exact attention: each half of the change alone);
  3. siblings: a tree verify (chain of 5 + 2 siblings of x1): are the siblings' columns
     bit-identical to plain decoding of [x0, sibling]?
  4. cost: median ms of a 1-row step and of T-row verify forwards (T = 2..8) at a 256-token context:
     today's route (`--route`, default stock<=3,packed, this machine's auto choice at one thread),
     packed, packed+pad1, today's route with row-exact attention, and exact, interleaved.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/identity_exactness.py --out benchmarks/results/identity_exactness.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine import siblings as sib
from dsparkctl.files.atomic import write_json
from dsparkctl.models.loading import load_target
from dsparkctl.models.packed_linear import PackedLinear, Route, pack_linears, unpack_linears, use_stock_up_to
from dsparkctl.models.target import TargetAdapter

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 32, 64)
EXACT_ATTN = "dsparkctl-rowexact"
MAX_ROWS = 16  # wider feeds (a prefill) keep the one-call attention: both decoders run the same prefill


# ------------------------------------------------------------------------------ the prototype
def _pad_one_row(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """PackedLinear.forward with a 1-row call computed as 2 rows (row 0 kept): oneDNN's M = 1 path
    reduces K = 1536 (down_proj) in another order than its M ≥ 2 path."""
    if self.stock_rows or x.numel() // self.in_features != 1:
        return _PACKED_FORWARD(self, x)
    x2 = x.reshape(1, self.in_features).expand(2, -1).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")[:1]
    return y.reshape(*x.shape[:-1], self.out_features)


_PACKED_FORWARD = PackedLinear.forward


def row_exact_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Attention one query at a time, each through the one-query call a plain step makes: q [1, kvh,
    rep, d] (the GQA fold) over exactly the keys it attends, no mask. query [B, h, T, d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, h, T, d = query.shape
    if T > MAX_ROWS or module.training or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kvh, S = key.shape[1], key.shape[2]
    out = query.new_empty(B, T, h, d)
    for b in range(B):
        for t in range(T):
            if attention_mask is None:
                keep: slice | torch.Tensor = slice(0, S - T + t + 1)  # causal
            else:
                m = attention_mask[b, 0, t, :S]
                idx = (m if m.dtype == torch.bool else m == 0).nonzero().flatten()
                keep = slice(0, idx.numel()) if int(idx[-1]) + 1 == idx.numel() else idx
            k, v = key[b:b + 1, :, keep], value[b:b + 1, :, keep]
            q = query[b:b + 1, :, t].reshape(1, kvh, h // kvh, d)
            out[b, t] = F.scaled_dot_product_attention(q, k, v, scale=scaling).reshape(h, d)
    return out, None


def register_exact() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(EXACT_ATTN, row_exact_sdpa)
    AttentionMaskInterface.register(EXACT_ATTN, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"])


def install_exact() -> None:
    """The prototype in place for a whole session: every PackedLinear pads a 1-row call to 2 rows,
    and the session's attention (`dsparkctl-sdpa`, whose name `takes_trees` reads) runs row by row."""
    from transformers import AttentionInterface

    from dsparkctl.models.target_attention import NAME, _register

    _register()
    PackedLinear.forward = _pad_one_row
    AttentionInterface.register(NAME, row_exact_sdpa)


def set_config(model, route: Route, exact: bool, attention: str, pad: bool | None = None) -> None:
    """Bring the model to a kernel route (both weight copies kept), 1-row padding (default: with
    `exact`) and an attention (row-exact with `exact`, else `attention`)."""
    unpack_linears(model)
    if route.packed:
        pack_linears(model, keep=(model.get_output_embeddings(),), routing=True)
        use_stock_up_to(model, route.stock_rows)
    PackedLinear.forward = _pad_one_row if (exact if pad is None else pad) else _PACKED_FORWARD
    model.set_attn_implementation(EXACT_ATTN if exact else attention)


# ------------------------------------------------------------------------------ the checks
def linear_classes(model) -> dict:
    """Per linear shape and kernel: the row counts grouped by bit-identical row 0."""
    layer = model.model.layers[0]
    lins = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj, "o_proj": layer.self_attn.o_proj,
            "gate_proj": layer.mlp.gate_proj, "down_proj": layer.mlp.down_proj, "lm_head": model.lm_head}
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.no_grad():
        for name, lin in lins.items():
            x = torch.randn(max(ROW_COUNTS), lin.in_features, generator=g)
            packed = PackedLinear(lin, True)
            for kind, f in (("stock", lambda z: F.linear(z, lin.weight, lin.bias)), ("packed", packed),
                            ("packed+pad1", lambda z: _pad_one_row(packed, z))):
                rows = {M: f(x[:M])[0] for M in ROW_COUNTS}
                classes: list[list[int]] = []
                for M in ROW_COUNTS:
                    hit = next((c for c in classes if torch.equal(rows[c[0]], rows[M])), None)
                    hit.append(M) if hit is not None else classes.append([M])
                out[f"{name} {lin.in_features}->{lin.out_features}"] = out.get(
                    f"{name} {lin.in_features}->{lin.out_features}", {}) | {kind: classes}
    return out


def feed(ad: TargetAdapter, prefix: list[int], tokens: list[int], T: int) -> torch.Tensor:
    """Logits [len(tokens), V] of `tokens` fed after `prefix` in chunks of T (each committed)."""
    rows = []
    with torch.no_grad():
        ad.prefill([prefix])
        for i in range(0, len(tokens), T):
            chunk = tokens[i:i + T]
            out = ad.extend(torch.tensor([chunk]), torch.tensor([len(chunk)]))
            ad.commit(torch.tensor([len(chunk)]))
            rows.append(out.logits[0, :len(chunk)])
    return torch.cat(rows)


def tree_check(ad: TargetAdapter, prefix: list[int], tokens: list[int], plain_rows: torch.Tensor) -> dict:
    """Chain [x0..x4] and the two runners-up of x1 as siblings: chain rows vs plain, sibling
    columns vs plain decoding of [x0, sibling]."""
    x = tokens[:5]
    sibs = torch.topk(plain_rows[0], 3).indices[1:].tolist()  # runners-up for the position after x0
    fd = sib.SiblingFeed(tokens=torch.tensor([sibs]), valid=torch.ones(1, 2, dtype=torch.bool), chain=5)
    chain = torch.ones(1, 5, dtype=torch.bool)
    with torch.no_grad():
        ad.prefill([prefix])
        out = ad.extend(torch.tensor([x + sibs]), torch.tensor([5]),
                        tree=lambda cached, seq_len: sib.tree_layout(fd, chain, cached, seq_len))
        ad.commit(torch.tensor([1]))
        chain_equal = [bool(torch.equal(out.logits[0, j], plain_rows[j])) for j in range(5)]
        sib_equal, sib_diff = [], []
        for j, s in enumerate(sibs):
            ref = feed(ad, prefix, [x[0], s], 1)[1]
            sib_equal.append(bool(torch.equal(out.logits[0, 5 + j], ref)))
            sib_diff.append(float((out.logits[0, 5 + j] - ref).abs().max()))
    return {"chain_rows_equal_plain": chain_equal, "sibling_columns_equal_plain": sib_equal,
            "sibling_max_abs_diff": sib_diff}


def timing(model, ad: TargetAdapter, context: list[int], configs: dict, attention: str, repeats: int) -> dict:
    """Median ms of one forward of T new tokens after `context` (rolled back after each), per config
    (stock_rows, pad a 1-row call, row-exact attention), configs and T interleaved in every repeat so
    a drift of the shared machine hits all alike. The model is packed with both copies kept."""
    unpack_linears(model)
    pack_linears(model, keep=(model.get_output_embeddings(),), routing=True)
    rows = (1, 2, 3, 4, 6, 8)
    ms: dict[str, dict[int, list[float]]] = {c: {T: [] for T in rows} for c in configs}
    with torch.no_grad():
        ad.prefill([context])
        for rep in range(repeats + 2):
            names = list(configs)
            names = names[rep % len(names):] + names[:rep % len(names)]
            for name in names:
                stock_rows, pad, exact = configs[name]
                use_stock_up_to(model, stock_rows)
                PackedLinear.forward = _pad_one_row if pad else _PACKED_FORWARD
                model.set_attn_implementation(EXACT_ATTN if exact else attention)
                for T in rows:
                    t0 = time.perf_counter()
                    ad.extend(torch.tensor([context[:T]]), torch.tensor([T]))
                    dt = (time.perf_counter() - t0) * 1e3
                    ad.commit(torch.tensor([0]))
                    if rep >= 2:
                        ms[name][T].append(dt)
    return {c: {T: statistics.median(v) for T, v in d.items()} for c, d in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--route", type=int, default=3,
                    help="today's route for the timing: N of stock<=N,packed (0: packed)")
    ap.add_argument("--linears-only", action="store_true", help="check 1 alone (e.g. under another thread count)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "identity_exactness.json")
    args = ap.parse_args()
    register_exact()
    lt = load_target(None, torch.device("cpu"), torch.float32, log=lambda m: None)
    model, tok = lt.model, lt.tokenizer
    ad = TargetAdapter(model, ())  # folds GQA: the session's attention, dsparkctl-sdpa
    today_attn = model.config._attn_implementation
    doc: dict = {"attention_today": today_attn, "linears": linear_classes(model)}
    if args.linears_only:
        write_json(args.out, {**doc, **provenance_of(__file__)})
        print(f"wrote {args.out}")
        return
    prompt = encode_prompts(tok, load_prompts("mt-bench", limit=1))[0]
    with torch.no_grad():  # the greedy continuation the decisions are checked on
        tokens = [int(ad.prefill([prompt]).logits[0, -1].argmax())]
        for _ in range(args.positions - 1):
            out = ad.extend(torch.tensor([tokens[-1:]]), torch.tensor([1]))
            ad.commit(torch.tensor([1]))
            tokens.append(int(out.logits[0, 0].argmax()))
    checked = {"stock": (Route(), False, False), "stock<=3,packed": (Route(True, 3), False, False),
               "packed": (Route(True, 0), False, False), "packed+pad1": (Route(True, 0), False, True),
               "stock<=3,packed, row-exact attention": (Route(True, 3), True, False),
               "exact (packed+pad1, row-exact attention)": (Route(True, 0), True, True)}
    doc["decisions"], doc["siblings"] = {}, {}
    for label, (route, exact, pad) in checked.items():
        set_config(model, route, exact, today_attn, pad)
        plain = feed(ad, prompt, tokens, 1)
        row = {}
        for T in (2, 4, 6, 8):
            chunked = feed(ad, prompt, tokens, T)
            row[f"T={T}"] = {"equal": int((chunked == plain).all(dim=1).sum()), "of": len(tokens),
                             "max_abs_diff": float((chunked - plain).abs().max())}
        doc["decisions"][label] = row
        doc["siblings"][label] = tree_check(ad, prompt, tokens, plain)
        print(label, row, doc["siblings"][label], flush=True)
    context = (prompt * 8)[:256]
    n = args.route
    today = f"stock<={n},packed" if n else "packed"
    configs = {today: (n, False, False), "packed": (0, False, False), "packed+pad1": (0, True, False),
               f"{today}, row-exact attention": (n, False, True),
               "exact (packed+pad1, row-exact attention)": (0, True, True)}
    doc["timing_ms"] = timing(model, ad, context, configs, today_attn, args.repeats)
    for label, row in doc["timing_ms"].items():
        print(label, {k: round(v, 1) for k, v in row.items()}, flush=True)
    write_json(args.out, {**doc, "positions": args.positions, "context_for_timing": len(context),
                          **provenance_of(__file__)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
