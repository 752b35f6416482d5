"""Draft formats (models/draft_formats): the trainers' own miniature drafts are read with the right
conventions, every conversion is exact and reversible, a draft runs the same in every format, and
bad folders are refused in one line with nothing written.

The fixtures under tests/fixtures/peers/ were saved BY speculators 0.9.0, SpecForge 0.2.0 and
ModelOpt 0.47.0's own classes (benchmarks/peers/*_peer.py make, in side venvs; interop_check.sh
runs them again and loads our writes with the same classes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.evaluation.conventions import readings
from dsparkctl.evaluation.teacher_forced import evaluate_sequences
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models import draft_formats as formats
from dsparkctl.models.draft_io import load_draft, random_draft, save_draft
from dsparkctl.models.target import TargetAdapter
from tests.helpers import snapshot
from tests.tiny_models import bigram_oracle_draft, save_tiny_target, tiny_target

PEERS = Path(__file__).parent / "fixtures" / "peers"
FORMATS = [f.key for f in formats.FORMATS]
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17], [20]]

# what each trainer's `make` wrote (benchmarks/peers/*_peer.py): tiny Qwen3 target, vocab 64, hidden 32,
# block 4, mask 63, Markov rank 8, taps = transformers hidden_states[1] and [2] (= canonical ids 0 and 1)
PEER_FACTS = {
    "speculators": dict(as_written=(1, 2), field="aux_hidden_state_layer_ids", vocab=32, layers=1, stated=True,
                        version="0.9.0", target="peer-fixture/tiny-qwen3-verifier"),
    "specforge": dict(as_written=(0, 1), field="dflash_config.target_layer_ids", vocab=0, layers=1, stated=False,
                      version=None, target=None),
    "modelopt": dict(as_written=(0, 1), field="dflash_config.target_layer_ids", vocab=0, layers=2, stated=True,
                     version=None, target=None),
}


@pytest.fixture(autouse=True)
def _one_line_errors(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


def run(*args: str):
    r = CliRunner().invoke(app, [str(a) for a in args])
    r.text = " ".join(r.output.split())  # one line however the console wrapped it
    return r


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ reading
@pytest.mark.parametrize("peer", sorted(PEER_FACTS))
def test_each_trainers_own_draft_is_read_with_its_conventions(peer):
    want = PEER_FACTS[peer]
    d = formats.read(PEERS / peer)
    assert d.format == peer and d.config.kind == "dspark"
    c = d.config
    assert (c.block_size, c.mask_token_id, c.markov_rank, c.vocab_size, c.hidden_size) == (4, 63, 8, 64, 32)
    assert c.target_layer_ids == (0, 1) and d.facts.layer_ids == want["as_written"]
    assert d.facts.layer_ids_key == want["field"] and d.facts.slot_stated == want["stated"]
    assert c.sample_from_anchor and c.drafts_per_block == 4
    assert c.enable_confidence_head and c.confidence_head_with_markov
    assert c.draft_vocab_size == want["vocab"] and c.num_hidden_layers == want["layers"]
    assert d.facts.version == want["version"]
    assert (d.facts.target or {}).get("name_or_path") == want["target"]
    assert d.reduced == bool(want["vocab"])
    if d.reduced:  # speculators' d2t/t2d became the index map
        ids = d.tensors["draft_vocab_ids"]
        raw = tensors(PEERS / peer)
        assert torch.equal(ids, torch.arange(32) + raw["d2t"]) and torch.equal(torch.nonzero(raw["t2d"]).flatten(), ids)


@pytest.mark.parametrize("peer", sorted(PEER_FACTS))
def test_inspect_json_names_format_and_both_layer_conventions(peer):
    r = run("inspect", PEERS / peer, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)["draft_format"]
    assert d["format"]["key"] == peer
    assert d["target_layers"]["as_written"] == list(PEER_FACTS[peer]["as_written"])
    assert d["target_layers"]["canonical"] == [0, 1]
    assert d["slot_convention"]["sample_from_anchor"] is True
    human = run("inspect", PEERS / peer)
    assert human.exit_code == 0 and "slot convention" in human.stdout and "canonical" in human.stdout


# --------------------------------------------------------------------------------------- converting
@pytest.mark.parametrize("peer", sorted(PEER_FACTS))
@pytest.mark.parametrize("via", FORMATS)
def test_round_trips_give_the_same_tensors_and_config(peer, via, tmp_path):
    source = formats.read(PEERS / peer)
    mid, back = tmp_path / "mid", tmp_path / "back"
    r = run("convert", PEERS / peer, mid, "--to", via, "--json")
    if source.reduced and via in ("specforge", "modelopt"):  # full-vocabulary formats: refused, nothing written
        assert r.exit_code == 2 and "--drop vocab-map" in r.text and not mid.exists()
        return
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["read_back_identical"] is True
    assert run("convert", mid, back, "--to", peer).exit_code == 0
    assert same_tensors(tensors(PEERS / peer), tensors(back))
    assert formats.read(back).config == source.config


def test_the_shipped_draft_converts_exactly_or_says_what_it_would_lose(tmp_path):
    r = run("convert", "default", tmp_path / "s", "--to", "specforge")
    assert r.exit_code == 2 and "8192 of 49152" in r.text and "--drop vocab-map" in r.text
    assert not (tmp_path / "s").exists()
    r = run("convert", "default", tmp_path / "v", "--to", "speculators")
    assert r.exit_code == 2 and "--target" in r.text and not (tmp_path / "v").exists()
    r = run("convert", "default", tmp_path / "s", "--to", "specforge", "--drop", "vocab-map", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["changes"] and "vocabulary map dropped" in doc["changes"][0]
    got = formats.read(tmp_path / "s")
    assert not got.reduced and got.tensors["markov_head.markov_w2.weight"].shape == (49152, 64)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["dsparkctl"]["conversion"]["changes"] == doc["changes"]


def _tiny_pair(tmp_path, reduced: bool):
    model = tiny_target("qwen3")
    tgt = TargetAdapter(model, [0, 1])
    draft = bigram_oracle_draft(tgt, PROMPTS, block_size=4, layer_ids=[0, 1])
    if reduced:  # the same oracle on the 48 even-or-low ids: speculators carries the map, d2t/t2d
        ids = torch.cat([torch.arange(0, 32), torch.arange(32, 64, 2)])
        small = random_draft(tgt, seed=3, block_size=4, markov_rank=draft.cfg.markov_rank, layer_ids=[0, 1],
                             draft_vocab_size=ids.numel())
        sd = {k: v for k, v in draft.state_dict().items() if k not in ("lm_head.weight", "embed_tokens.weight")}
        sd["markov_head.markov_w2.weight"] = sd["markov_head.markov_w2.weight"][ids]
        small.load_state_dict(sd, strict=False)
        small.set_draft_vocab(ids)
        small.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
        draft = small
    folder = save_draft(draft, tmp_path / "draft", dtype=torch.float32)
    return model, folder, save_tiny_target(tmp_path / "target", "qwen3")  # the same seeded model, as a folder


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_a_draft_drafts_the_same_in_every_format(reduced, tmp_path):
    """Greedy tokens, rounds and teacher-forced acceptance identical whatever file the draft came from."""
    model, folder, target = _tiny_pair(tmp_path, reduced)
    tgt = TargetAdapter(model, [0, 1])
    base = plain_generate(TargetAdapter(model), PROMPTS, 24, SamplingParams(0.0))
    seqs = [p + o.tokens for p, o in zip(PROMPTS, base.outputs)]
    results = {}
    for fmt in FORMATS:
        out = tmp_path / fmt
        r = run("convert", folder, out, "--to", fmt, "--target", target)
        if reduced and fmt in ("specforge", "modelopt"):
            assert r.exit_code == 2
            continue
        assert r.exit_code == 0, r.output
        d = load_draft(out, tgt)
        rep = SpeculativeEngine(tgt, d, parse_policy("static:4"), SamplingParams(0.0)).generate(PROMPTS, 24)
        tf = evaluate_sequences(d, model, seqs, [len(p) for p in PROMPTS], SamplingParams(0.0))
        results[fmt] = ([o.tokens for o in rep.outputs], rep.stats.histogram, tf.conditional())
    assert all(toks == [o.tokens for o in base.outputs] for toks, _, _ in results.values())
    first = next(iter(results.values()))
    assert all(v == first for v in results.values()), {k: v[1:] for k, v in results.items()}
    hist = first[1]  # the oracle drafts well: the comparison is not between two failures
    assert first[2][0] > 0.25 and max(k for k, n in enumerate(hist) if n) >= 2, first[1:]
    assert len(results) == (2 if reduced else 4)


# ------------------------------------------------------------------------------- the slot convention
def test_a_draft_that_does_not_sample_from_its_anchor_drafts_from_slot_one_and_stays_lossless():
    model = tiny_target("qwen3")
    tgt = TargetAdapter(model, [0, 1])
    oracle = bigram_oracle_draft(tgt, PROMPTS, block_size=5, layer_ids=[0, 1])
    free = type(oracle)(oracle.cfg.replace(sample_from_anchor=False))
    free.load_state_dict(oracle.state_dict(), strict=False)
    free.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    free.eval()
    assert (free.block_size, oracle.block_size) == (4, 5)
    feats = torch.randn(1, 12, 64)
    anchors, pos = torch.tensor([[7, 9]]), torch.tensor([[4, 8]])
    with torch.no_grad():
        full = oracle.forward_blocks(feats, anchors, pos)  # [1, 2, 5, H]
        tail = free.forward_blocks(feats, anchors, pos)  # [1, 2, 4, H]: slots 1..4 of the same block
    assert torch.equal(tail, full[:, :, 1:])
    base = plain_generate(TargetAdapter(model), PROMPTS, 30, SamplingParams(0.0))
    rep = SpeculativeEngine(tgt, free, parse_policy("static:4"), SamplingParams(0.0)).generate(PROMPTS, 30)
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in base.outputs]
    assert max(k for k, n in enumerate(rep.stats.histogram) if n) >= 2  # multi-token rounds happened


def test_the_probe_tries_every_reading_the_target_can_hold():
    cfg = formats.read(PEERS / "specforge").config  # taps (0, 1) of a 4-layer target: +1 fits, -1 too (embeddings)
    got = [(r.sample_from_anchor, r.layer_shift) for r in readings(cfg, 4)]
    assert got[0] == (True, 0) and set(got) == {(a, s) for a in (True, False) for s in (0, -1, 1)}
    assert all(r.layer_shift != 1 for r in readings(cfg.replace(target_layer_ids=(1, 2)), 4))  # layer 3 is the last


@pytest.mark.slow
def test_the_probe_names_a_wrong_slot_convention_on_the_shipped_draft(tmp_path):
    assert run("convert", "default", tmp_path / "v", "--to", "speculators", "--target", "embedded").exit_code == 0
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    cfg["sample_from_anchor"] = False
    (tmp_path / "v" / "config.json").write_text(json.dumps(cfg))
    r = run("inspect", tmp_path / "v", "--target", "embedded", "--probe", "8", "--json")
    assert r.exit_code == 3, r.output
    found = [f for f in json.loads(r.stdout)["findings"] if f["check"] == "conventions"][0]
    assert found["level"] == "error" and "sample_from_anchor true" in found["message"]
    rows = found["probe"]["readings"]
    assert rows[0]["c1"] < max(x["c1"] for x in rows) - 0.05


# -------------------------------------------------------------------------------------- bad input
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **kw) -> None:
    c = json.loads((folder / "config.json").read_text())
    for k, v in kw.items():
        if "." in k:
            outer, inner = k.split(".")
            c[outer][inner] = v
        else:
            c[k] = v
    (folder / "config.json").write_text(json.dumps(c))


def _edit_tensors(folder: Path, drop=(), **kw) -> None:
    t = tensors(folder)
    for k in drop:
        t.pop(k)
    t.update(kw)
    save_file(t, str(folder / "model.safetensors"))


def _fp8_modelopt(folder: Path) -> None:
    t = tensors(folder)
    w = t["fc.weight"].float()
    scale = w.abs().max() / 448.0
    t["fc.weight"] = (w / scale).to(torch.float8_e4m3fn)
    t["fc.weight_scale"] = scale.reshape(())
    t["fc.input_scale"] = torch.tensor(1.0)
    save_file(t, str(folder / "model.safetensors"))


def _bad_cases():
    """(id, how to spoil a copy of a fixture, which fixture, the message)"""
    return [
        ("config of one format over another's tensors", "modelopt",
         lambda f: shutil.copy(PEERS / "speculators" / "config.json", f / "config.json"),
         "says vLLM speculators DSpark draft (speculators) but the safetensors hold"),
        ("d2t disagrees with t2d", "speculators",
         lambda f: _edit_tensors(f, t2d=torch.roll(tensors(f)["t2d"], 1)), "d2t and t2d disagree"),
        ("offsets out of the target vocabulary", "speculators",
         lambda f: _edit_tensors(f, d2t=tensors(f)["d2t"] + 40), "outside the vocabulary [0, 64)"),
        ("quantised weights without their scales", "modelopt",
         lambda f: (_fp8_modelopt(f), _edit_tensors(f, drop=("fc.weight_scale",))), "fc.weight_scale is missing"),
        ("two formats' files in one folder", "speculators",
         lambda f: (f / "hf_quant_config.json").write_text("{}"), "mixes two formats' files"),
        ("reduced vocabulary without its map", "speculators",
         lambda f: _edit_tensors(f, drop=("d2t", "t2d")), "draft_vocab_size 32 but no vocabulary map"),
        ("a scale with no weight", "modelopt",
         lambda f: _edit_tensors(f, **{"norm.weight_scale": torch.tensor(1.0)}), "belongs to no quantized weight"),
        ("fc narrower than its taps", "speculators",
         lambda f: _edit_tensors(f, **{"fc.weight": torch.zeros(32, 40, dtype=torch.bfloat16)}),
         "fc.weight has shape [32, 40], expected [32, 64]"),
        ("a head with rows missing", "modelopt",
         lambda f: _edit_tensors(f, **{"markov_w2.weight": torch.zeros(60, 8, dtype=torch.bfloat16)}),
         "tensor markov_w2.weight has shape (60, 8), expected (64, 8)"),
        ("a tensor missing", "specforge", lambda f: _edit_tensors(f, drop=("norm.weight",)), "missing tensor norm.weight"),
        ("NaN weights", "specforge",
         lambda f: _edit_tensors(f, **{"norm.weight": torch.full((32,), float("nan"), dtype=torch.bfloat16)}),
         "norm.weight holds NaN or infinite values"),
        ("a string where a number goes", "speculators", lambda f: _edit_config(f, markov_rank="8"),
         'markov_rank must be an integer, got "8"'),
        ("layer ids below the embeddings", "specforge", lambda f: _edit_config(f, **{"dflash_config.target_layer_ids": [-3, 1]}),
         "count decoder layers from 0"),
        ("draft_vocab_size against d2t", "speculators", lambda f: _edit_config(f, draft_vocab_size=16),
         "draft_vocab_size 16 but d2t maps 32 draft ids"),
        ("a projector that is not DSpark's", "modelopt", lambda f: _edit_config(f, **{"dflash_config.projector_type": "eagle"}),
         "projector_type 'eagle' is not a DSpark draft"),
        ("weights linked from outside the folder", "specforge",
         lambda f: (shutil.move(f / "model.safetensors", f.parent / "elsewhere.safetensors"),
                    (f / "model.safetensors").symlink_to(f.parent / "elsewhere.safetensors")), "leads outside the draft folder"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=[c[0] for c in _bad_cases()])
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_bad_folders_are_refused_in_one_line_with_nothing_written(case, command, tmp_path):
    _, peer, spoil, message = case
    folder = _copy(PEERS / peer, tmp_path / "in")
    spoil(folder)
    before = snapshot(tmp_path)
    args = ["inspect", folder] if command == "inspect" else ["convert", folder, tmp_path / "out", "--to", "deepspec"]
    r = run(*args)
    assert r.exit_code != 0 and message in r.text, r.output
    assert r.output.count("error:") == 1 and "Traceback" not in r.output, r.output
    assert snapshot(tmp_path) == before


def test_a_quantized_modelopt_draft_is_read_dequantized_and_converted_only_by_name(tmp_path):
    folder = _copy(PEERS / "modelopt", tmp_path / "in")
    _fp8_modelopt(folder)
    raw = tensors(folder)
    d = formats.read(folder)
    want = (raw["fc.weight"].float() * raw["fc.weight_scale"]).to(torch.bfloat16)
    assert torch.equal(d.tensors["fc.weight"], want) and "fc.weight_scale" not in d.tensors
    r = run("convert", folder, tmp_path / "o", "--to", "deepspec")
    assert r.exit_code == 2 and "--drop quantization" in r.text and not (tmp_path / "o").exists()
    assert run("convert", folder, tmp_path / "o", "--to", "deepspec", "--drop", "quantization").exit_code == 0


def test_nvfp4_weights_unpack_low_nibble_first_and_scale_per_sixteen(tmp_path):
    from dsparkctl.models.draft_formats.modelopt import E2M1, _read_tensors

    codes = torch.randint(0, 16, (4, 32))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # even index in the low nibble
    scale = torch.tensor([[0.5, 2.0]] * 4).to(torch.float8_e4m3fn)
    d = formats.read(PEERS / "modelopt")
    out = _read_tensors({"x.weight": packed, "x.weight_scale": scale, "x.weight_scale_2": torch.tensor(3.0)},
                        d.config, d.facts, "t")
    want = E2M1[codes] * torch.tensor([0.5] * 16 + [2.0] * 16) * 3.0
    assert torch.equal(out["x.weight"], want.to(torch.bfloat16)) and set(out) == {"x.weight"}


@pytest.mark.parametrize("args, message", [
    (["--to", "gguf"], "unknown draft format 'gguf'"),
    (["--to", "specforge", "--drop", "everything"], "is not something a conversion can drop"),
    (["--to", "deepspec", "--drop", "vocab-map"], "nothing to drop"),
])
def test_nonsense_options_are_refused_before_anything_is_read(args, message, tmp_path):
    r = run("convert", PEERS / "speculators", tmp_path / "o", *args)
    assert r.exit_code == 2 and message in r.text and not (tmp_path / "o").exists()


def test_a_conversion_never_writes_onto_or_into_its_input(tmp_path):
    folder = _copy(PEERS / "specforge", tmp_path / "in")
    before = snapshot(tmp_path)
    for out in (folder, folder / "sub"):
        r = run("convert", folder, out, "--to", "deepspec")
        assert r.exit_code == 2 and ("one of the inputs" in r.text or "inside the input" in r.text), r.output
    assert snapshot(tmp_path) == before


def test_convert_checks_a_named_target_and_its_output_path_before_any_work(tmp_path):
    other = save_tiny_target(tmp_path / "t", "qwen3", vocab=60, layers=4)
    r = run("convert", PEERS / "specforge", tmp_path / "o", "--to", "deepspec", "--target", other)
    assert r.exit_code != 0 and "vocab_size 64 but target" in r.text and not (tmp_path / "o").exists()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    r = run("convert", PEERS / "specforge", tmp_path / "dangling", "--to", "deepspec")
    assert r.exit_code == 2 and "is a symbolic link" in r.text and not (tmp_path / "nowhere").exists()
    inner = _copy(PEERS / "modelopt", tmp_path / "m") / "sub"
    r = run("convert", PEERS / "specforge", inner, "--to", "deepspec")
    assert r.exit_code == 2 and "inside the model folder" in r.text and not inner.exists()


def test_layer_ids_past_the_targets_depth_and_a_foreign_vocabulary_are_named_by_file_and_field(tmp_path):
    target = save_tiny_target(tmp_path / "t", "qwen3", vocab=64, layers=4)
    assert run("inspect", PEERS / "speculators", "--target", target).exit_code == 0
    folder = _copy(PEERS / "speculators", tmp_path / "d")
    _edit_config(folder, aux_hidden_state_layer_ids=[1, 4])
    r = run("inspect", folder, "--target", target, "--json")
    assert r.exit_code == 3
    bad = [f for f in json.loads(r.stdout)["findings"] if f["level"] == "error"]
    assert len(bad) == 1 and "aux_hidden_state_layer_ids [1, 4]" in bad[0]["message"]
    assert str(folder / "config.json") in bad[0]["message"]
    other = save_tiny_target(tmp_path / "t2", "qwen3", vocab=60, layers=4)
    r = run("inspect", PEERS / "specforge", "--target", other, "--json")
    msgs = [f["message"] for f in json.loads(r.stdout)["findings"] if f["level"] == "error"]
    assert r.exit_code == 3 and any("vocab_size 64 but target" in m and "vocab_size 60" in m for m in msgs)
