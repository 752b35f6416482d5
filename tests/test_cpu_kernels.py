"""Packed CPU kernels (models/packed_linear.py, engine/kernel_choice.py): same products, same greedy outputs, same law.

The packed path is what `generate`, `eval-acceptance` and `profile-sps` use on CPU by default,
so the losslessness tests run again here on a packed target + packed draft.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.engine.kernel_choice import (STOCK_IN_FILE, cache_path, cached_choice, choice_key, choose_kernels,
                                            route_from, rows_in_file)
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.errors import UsageError
from dsparkctl.files.atomic import current_umask
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.sps import SPSTable
from dsparkctl.models.draft_io import random_draft
from dsparkctl.models.packed_linear import (EVERY_CALL, STOCK, PackedLinear, pack_linears, packing_supported, route_of,
                                            unpack_linears, use_stock_up_to)
from dsparkctl.models.target import TargetAdapter
from tests.test_engine import PROMPTS, _exact_three_token_distribution, assert_three_tokens_distributed_as
from tests.tiny_models import bigram_oracle_draft, tiny_target

pytestmark = pytest.mark.skipif(not packing_supported(nn.Linear(2, 2)), reason="this torch has no oneDNN linear")
SPS = SPSTable([1, 2, 4, 8, 16, 32], [100.0, 99.0, 97.0, 90.0, 80.0, 60.0])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (7, 24), (2, 3, 24), (2, 9, 24)])
def test_packed_linear_computes_the_same_product(bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    packed = PackedLinear(lin, keep_weight=False)
    with torch.no_grad():
        y = packed(x)
        torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-5)
    assert y.shape == (*shape[:-1], 40)
    assert not hasattr(packed, "weight")  # only the packed copy lives
    assert PackedLinear(lin, keep_weight=True).weight is lin.weight


def test_pack_keeps_tied_head_shared_and_packs_each_linear_once():
    model = tiny_target("llama")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    shared = model.model.layers[0].mlp.up_proj
    model.model.layers[1].mlp.up_proj = shared  # one module reached twice
    n_linear = len({id(m) for m in model.modules() if type(m) is nn.Linear})
    head = model.get_output_embeddings()
    assert pack_linears(model, keep=(head,)) == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives, no copy
    assert model.model.layers[0].mlp.up_proj is model.model.layers[1].mlp.up_proj
    assert not hasattr(model.model.layers[0].self_attn.q_proj, "weight")
    assert pack_linears(model) == 0  # nothing left to pack


def test_pack_leaves_non_fp32_models_alone():
    model = tiny_target("llama").to(torch.bfloat16)
    assert not packing_supported(model) and pack_linears(model) == 0
    assert any(type(m) is nn.Linear for m in model.modules())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_logits_match_stock_logits(family):
    stock = tiny_target(family)
    packed = tiny_target(family)
    pack_linears(packed, keep=(packed.get_output_embeddings(),))
    ids = torch.tensor([PROMPTS[2], PROMPTS[0] + [1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", ["static:4", "static:2", "dspark"])
def test_greedy_identity_on_a_packed_pair(family, policy):
    stock = tiny_target(family)
    reference = plain_generate(TargetAdapter(stock), PROMPTS, 40, SamplingParams(0.0))  # stock kernels
    model = tiny_target(family)
    pack_linears(model, keep=(model.get_output_embeddings(),))
    tgt = TargetAdapter(model, [0, 1])
    draft = bigram_oracle_draft(tgt, PROMPTS, block_size=4, layer_ids=[0, 1])
    assert pack_linears(draft, keep_weight=True) > 0
    plain = plain_generate(TargetAdapter(model), PROMPTS, 40, SamplingParams(0.0))
    eng = SpeculativeEngine(tgt, draft, parse_policy(policy, sps=SPS), SamplingParams(0.0))
    rep = eng.generate(PROMPTS, 40)
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in plain.outputs]
    assert [o.tokens for o in plain.outputs] == [o.tokens for o in reference.outputs]
    assert eng.generate([PROMPTS[2]], 40).outputs[0].tokens == plain.outputs[2].tokens
    if policy == "static:4":
        assert rep.stats.histogram[4] > 0 and rep.stats.tau > 1.4  # real multi-token accepts happened


def assert_sampled_law_holds(params: SamplingParams, prepare_target, prepare_draft) -> None:
    """6,000 three-token samples of a tiny pair whose target (after its exact law is computed on
    stock kernels) and draft were prepared by the hooks follow the target's exact law (χ²)."""
    model = tiny_target("llama", vocab=8, hidden=32, seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    exact = _exact_three_token_distribution(model, [3, 5, 6], params)  # stock kernels
    prepare_target(model)
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, seed=5, block_size=3, markov_rank=4, layer_ids=[0, 1])
    prepare_draft(draft)
    eng = SpeculativeEngine(tgt, draft, parse_policy("static:3"), params)
    rep = eng.generate([[3, 5, 6]] * 6000, 3, generator=torch.Generator().manual_seed(11))
    assert rep.stats.histogram[0] > 300 and rep.stats.histogram[1] > 300, rep.stats.histogram
    assert_three_tokens_distributed_as(rep.outputs, exact, params)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)])
def test_sampled_output_on_a_packed_pair_matches_the_target_distribution(params):
    assert_sampled_law_holds(params, lambda model: pack_linears(model, keep=(model.get_output_embeddings(),)),
                             lambda draft: pack_linears(draft, keep_weight=True))


def test_sessions_pack_on_request_only(qwen3_pair):
    target, draft = qwen3_pair
    packed = open_session(str(target), str(draft), "cpu", "fp32", log=lambda m: None, cpu_kernels="packed")
    assert packed.cpu_kernels == "packed"
    assert any(isinstance(m, PackedLinear) for m in packed.target.model.modules())
    assert any(isinstance(m, PackedLinear) for m in packed.draft.modules())
    stock = open_session(str(target), str(draft), "cpu", "fp32", log=lambda m: None)  # training's default
    assert stock.cpu_kernels == "stock" and not any(isinstance(m, PackedLinear) for m in stock.target.model.modules())
    with pytest.raises(UsageError):
        open_session(str(target), str(draft), "cpu", "fp32", log=lambda m: None, cpu_kernels="fast")


def generate_each_way(pair, flag: str, values: tuple[str, ...], bad: str) -> None:
    """`generate --json --baseline` once per value of `flag`: each run reports the value it ran
    (JSON key = the flag's name), matches plain decoding, and all give the same greedy text; a
    `bad` value is refused with exit 2."""
    target, draft = pair
    runner = CliRunner()
    key = flag.removeprefix("--").replace("-", "_")
    texts = []
    for value in values:
        res = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--no-chat",
                                  "--max-new-tokens", "12", "--json", flag, value, "--baseline", "w1 w2 w3", "w4 w5"])
        assert res.exit_code == 0, res.output
        rep = json.loads(res.stdout)
        assert rep[key] == value and rep["baseline"]["identical_outputs"] == 2
        texts.append([r["text"] for r in rep["requests"]])
    assert all(t == texts[0] for t in texts)
    res = runner.invoke(app, ["generate", "--target", str(target), flag, bad, "w1"])
    assert res.exit_code == 2 and bad in res.output


def test_generate_reports_its_kernels_and_both_give_the_same_greedy_text(qwen3_pair):
    generate_each_way(qwen3_pair, "--cpu-kernels", ("packed", "stock"), "fast")


# --cpu-kernels auto: both copies kept, each call routed by its row count


def test_routed_linear_takes_the_stock_kernel_up_to_its_row_count_and_packed_above():
    torch.manual_seed(1)
    lin = nn.Linear(24, 40)
    packed_only = PackedLinear(lin, keep_weight=False)
    routed = PackedLinear(lin, keep_weight=True)
    use_stock_up_to(routed, 3)
    with torch.no_grad():
        for rows in (1, 3):  # stock: bit for bit what nn.Linear computes
            x = torch.randn(rows, 24)
            assert torch.equal(routed(x), lin(x))
        x = torch.randn(2, 2, 24)  # 4 rows: packed
        assert torch.equal(routed(x), packed_only(x))
    with pytest.raises(ValueError, match="keep_weight"):
        use_stock_up_to(packed_only, 2)


def test_routing_frees_the_copy_it_never_reads():
    model = tiny_target("llama")
    head = model.get_output_embeddings()
    pack_linears(model, keep=(head,), routing=True)
    q = model.model.layers[0].self_attn.q_proj
    assert hasattr(q, "weight") and q.packed.numel() > 0
    use_stock_up_to(model, 0, free=True)  # always packed: the stock copy goes (the tied/kept head stays)
    assert not hasattr(q, "weight") and hasattr(model.lm_head, "weight")
    model = tiny_target("llama")
    pack_linears(model, routing=True)
    use_stock_up_to(model, EVERY_CALL, free=True)  # always stock: the packed copy goes
    q = model.model.layers[0].self_attn.q_proj
    assert q.packed.numel() == 0 and route_of(model) == STOCK
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        torch.testing.assert_close(model(ids).logits, tiny_target("llama")(ids).logits, rtol=0, atol=0)


FLAT = {r: 11 for r in (1, 2, 3, 4, 6, 8)}


@pytest.mark.parametrize("ms, rows", [
    # the AMX Xeon: stock clearly faster up to 3 rows, packed clearly faster above -> both copies
    ({"stock": {1: 30, 2: 33, 3: 34, 4: 45, 6: 47, 8: 53}, "packed": {1: 38, 2: 38, 3: 39, 4: 39, 6: 42, 8: 46}}, 3),
    # the first VM: packed faster everywhere
    ({"stock": {1: 80, 2: 134, 3: 164, 4: 143, 6: 150, 8: 149}, "packed": {1: 77, 2: 82, 3: 90, 4: 102, 6: 103, 8: 109}}, 0),
    ({"stock": {r: 10 for r in FLAT}, "packed": FLAT}, STOCK_IN_FILE),
    ({"stock": {1: 10, 2: 12, 3: 10, 4: 10, 6: 10, 8: 10}, "packed": FLAT}, 1),
    # stock wins small, packed only ties above: one copy (stock), not two for nothing
    ({"stock": {1: 30, 2: 33, 3: 34, 4: 40, 6: 42, 8: 46}, "packed": {1: 38, 2: 38, 3: 39, 4: 40, 6: 42, 8: 46}},
     STOCK_IN_FILE),
    ({"stock": {r: 10.9 for r in FLAT}, "packed": FLAT}, 0),  # within the margin: a tie is not a win
])
def test_the_stock_route_ends_where_stock_first_loses(ms, rows):
    route = route_from(ms)
    assert rows_in_file(route) == rows
    assert route.label == {0: "packed", STOCK_IN_FILE: "stock"}.get(rows, f"stock<={rows},packed")


def _routed_llama():
    model = tiny_target("llama")
    pack_linears(model, routing=True)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    return model, lambda rows: model(input_ids=ids[:, :rows], use_cache=False)


def test_a_timed_choice_is_cached_for_this_machine_and_model(tmp_path, monkeypatch):
    cache = tmp_path / "k" / "cpu_kernels.json"
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(cache))
    model, forward = _routed_llama()
    assert cached_choice(model) is None
    route, ms = choose_kernels(model, forward, log=lambda m: None, repeats=2)
    assert route == route_from(ms) and cached_choice(model) == route
    doc = json.loads(cache.read_text())
    assert doc["format"] == "dsparkctl-cpu-kernels/1"  # the marker: only such a file is ever rewritten
    (entry,) = doc["choices"].values()
    assert entry["stock_rows"] == rows_in_file(route) and set(entry["forward_ms"]) == {"packed", "stock"}
    assert cache.stat().st_mode & 0o777 == 0o666 & ~current_umask()
    other = tiny_target("llama")
    other.config._name_or_path = "/somewhere/else"  # the same model read from elsewhere: the same choice
    assert cached_choice(other) == route
    torch.set_num_threads(max(1, torch.get_num_threads() - 1) if torch.get_num_threads() > 1 else 2)
    try:
        assert cached_choice(other) is None  # another thread count is another machine, as far as kernels go
    finally:
        torch.set_num_threads(threads_at_start)


threads_at_start = torch.get_num_threads()


MARKED = '{"format": "dsparkctl-cpu-kernels/1", "choices": CHOICES}'


@pytest.mark.parametrize("content,rewritten", [
    ("{not json", False), ("[" * 100000, False), ("[]", False), ('"x"', False), ("{KEY: 1}", False),
    ('{"my": "settings"}', False), ('{"format": "other/1", "choices": {}}', False), (b"\xff\xfe", False),
    ('{KEY: {"stock_rows": 1e400}}', False),
    ('{KEY: {"stock_rows": true}}', True), ('{KEY: {"stock_rows": 5}}', True),  # unmarked caches of older versions
    (MARKED.replace("CHOICES", '{KEY: {"stock_rows": -1}}'), True),
    (MARKED.replace("CHOICES", '{KEY: {"stock_rows": "3"}}'), True), (MARKED.replace("CHOICES", "[]"), False)])
def test_a_damaged_cache_is_never_an_error_and_never_a_wrong_route(tmp_path, monkeypatch, content, rewritten):
    """A cache of ours (marked, or an older unmarked one) with a bad entry is rewritten; anything
    else at the path is someone's: timed around, left as it is, said in a note."""
    cache = tmp_path / "cpu_kernels.json"
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(cache))
    model, forward = _routed_llama()
    if isinstance(content, bytes):
        cache.write_bytes(content)
    else:
        cache.write_text(content.replace("KEY", json.dumps(choice_key(model))))
    before = cache.read_bytes()
    assert cached_choice(model) is None
    logs = []
    route, _ = choose_kernels(model, forward, log=logs.append, repeats=1)  # timed again
    if rewritten:
        assert cached_choice(model) == route and not any("left as it is" in m for m in logs)
    else:
        assert cache.read_bytes() == before and any("left as it is" in m for m in logs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_kernels.json"]


def test_a_cache_path_that_is_no_file_is_timed_around_and_said(tmp_path, monkeypatch):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(fifo))
    model, forward = _routed_llama()
    assert cached_choice(model) is None  # a FIFO is not read (it would block)
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(tmp_path))  # a directory
    logs = []
    choose_kernels(model, forward, log=logs.append, repeats=1)
    assert any("is a folder" in m and "left as it is" in m and "--cpu-kernels" in m for m in logs)


def test_someone_elses_file_at_the_cache_path_is_left_alone(tmp_path, monkeypatch):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, not JSON\n")
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(notes))
    model, forward = _routed_llama()
    logs = []
    choose_kernels(model, forward, log=logs.append, repeats=1)
    assert notes.read_text() == "my notes, not JSON\n" and any("left as it is" in m for m in logs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no temporary left either


def test_unpacking_restores_plain_linears_with_the_same_logits():
    model = tiny_target("llama")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(ids).logits
    n = pack_linears(model, keep=(model.get_output_embeddings(),), routing=True)
    assert unpack_linears(model) == n
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("route", [2, EVERY_CALL])
def test_greedy_identity_on_a_routed_pair(route):
    model = tiny_target("qwen3")
    pack_linears(model, keep=(model.get_output_embeddings(),), routing=True)
    use_stock_up_to(model, route, free=True)
    tgt = TargetAdapter(model, [0, 1])
    draft = bigram_oracle_draft(tgt, PROMPTS, block_size=4, layer_ids=[0, 1])
    pack_linears(draft, keep_weight=True)
    use_stock_up_to(draft, route)
    plain = plain_generate(TargetAdapter(model), PROMPTS, 40, SamplingParams(0.0))
    for policy in ("static:4", "static:1", "dspark"):
        rep = SpeculativeEngine(tgt, draft, parse_policy(policy, sps=SPS), SamplingParams(0.0)).generate(PROMPTS, 40)
        assert [o.tokens for o in rep.outputs] == [o.tokens for o in plain.outputs], policy


def _seed_choice(model_dir, rows):
    """Write `rows` as this machine's cached choice for the model saved in `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    path = cache_path()
    doc = json.loads(path.read_text()) if path.is_file() else {"format": "dsparkctl-cpu-kernels/1", "choices": {}}
    doc["choices"][choice_key(model)] = {"stock_rows": rows}
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("rows", [0, 2, STOCK_IN_FILE])
def test_a_cached_choice_makes_only_the_copies_it_reads(qwen3_pair, tmp_path, monkeypatch, rows):
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(tmp_path / "cpu_kernels.json"))
    target, draft = qwen3_pair
    _seed_choice(target, rows)
    logs = []
    sess = open_session(str(target), str(draft), "cpu", "fp32", log=logs.append, cpu_kernels="auto")
    assert not any("timing" in m for m in logs)
    assert sess.cpu_kernels == {0: "packed", 2: "stock<=2,packed"}.get(rows, "stock")
    q = sess.target.model.model.layers[0].self_attn.q_proj
    if rows == STOCK_IN_FILE:  # nothing packed at all, target or draft
        assert type(q) is nn.Linear and not any(isinstance(m, PackedLinear) for m in sess.draft.modules())
    elif rows == 0:  # packed only: no stock copy kept
        assert isinstance(q, PackedLinear) and not hasattr(q, "weight") and q.stock_rows == 0
    else:
        assert isinstance(q, PackedLinear) and hasattr(q, "weight") and q.stock_rows == rows
        assert {m.stock_rows for m in sess.draft.modules() if isinstance(m, PackedLinear)} == {rows}


def test_auto_sessions_time_once_then_route_target_and_draft_alike(qwen3_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(tmp_path / "cpu_kernels.json"))
    target, draft = qwen3_pair
    logs = []
    sess = open_session(str(target), str(draft), "cpu", "fp32", log=logs.append, cpu_kernels="auto")
    assert any("timing" in m for m in logs)
    assert sess.cpu_kernels == sess.route.label and route_of(sess.target.model) == sess.route
    if sess.route.packed:
        assert {m.stock_rows for m in sess.draft.modules() if isinstance(m, PackedLinear)} == {sess.route.stock_rows}
    logs.clear()
    again = open_session(str(target), str(draft), "cpu", "fp32", log=logs.append, cpu_kernels="auto")
    assert again.cpu_kernels == sess.cpu_kernels and not any("timing" in m for m in logs)  # cached choice
    res = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--no-chat",
                                   "--max-new-tokens", "12", "--json", "--baseline", "w1 w2 w3"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["cpu_kernels"] == sess.cpu_kernels and rep["baseline"]["identical_outputs"] == 1


def test_a_target_whose_forward_cannot_be_timed_stays_on_stock_kernels(qwen3_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(tmp_path / "cpu_kernels.json"))
    import dsparkctl.engine.kernel_choice as kernel_choice

    def broken(model):
        def forward(rows):
            raise TypeError("forward() missing 1 required positional argument")
        return forward
    monkeypatch.setattr(kernel_choice, "row_forward", broken)
    target, draft = qwen3_pair
    logs = []
    sess = open_session(str(target), str(draft), "cpu", "fp32", log=logs.append, cpu_kernels="auto")
    assert sess.cpu_kernels == "stock" and any("could not time" in m for m in logs)
    assert not any(isinstance(m, PackedLinear) for m in sess.target.model.modules())
    assert cached_choice(sess.target.model) == STOCK  # remembered: the next run neither packs nor retries


@pytest.mark.parametrize("cached", [False, True])
def test_drafts_that_borrow_the_head_share_the_targets_packed_head(qwen3_pair, tmp_path, monkeypatch, cached):
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(tmp_path / "cpu_kernels.json"))
    target, _ = qwen3_pair
    if cached:
        _seed_choice(target, 2)
    sess = open_session(str(target), "random", "cpu", "fp32", log=lambda m: None, cpu_kernels="auto", settle=False)
    second, _, _ = sess.load_draft("random", None, 1)
    head = sess.target.model.get_output_embeddings()
    sess.settle_kernels(lambda m: None, (second,))
    head = sess.target.model.get_output_embeddings()
    assert sess.draft.lm_head is head and second.lm_head is head  # one head, packed once
    copies = [m for d in (sess.draft, second) for m in d.modules()
              if getattr(m, "weight", None) is head.weight and m is not head]
    assert not copies  # no second (packed) module on the head's weight


@pytest.mark.parametrize("argv", [
    ["eval-acceptance", "--limit", "1", "--max-new-tokens", "3", "--dataset", "mt-bench"],  # no full block of γ
    ["eval-acceptance", "--limit", "1", "--mode", "live", "--temperature", "-1", "--dataset", "mt-bench"],
    ["generate", "--max-new-tokens", "100000", "w1"],  # past the target's positions
    ["generate", "--policy", "static:99", "w1"],
    ["generate", "--policy", "bogus", "w1"],
    ["generate", "--calibration", "/nonexistent/calibration.json", "w1"],
])
def test_bad_input_fails_before_any_kernel_timing(qwen3_pair, tmp_path, monkeypatch, argv):
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(tmp_path / "cpu_kernels.json"))
    target, draft = qwen3_pair
    res = CliRunner().invoke(app, [*argv, "--target", str(target), "--draft", str(draft)])
    assert res.exit_code != 0 and "timing" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


def test_a_route_is_one_of_three_and_names_itself():
    from dsparkctl.models.packed_linear import PACKED, Route

    routes = (STOCK, PACKED, Route(packed=True, stock_rows=3))
    assert [r.label for r in routes] == ["stock", "packed", "stock<=3,packed"]
    for bad in ({"stock_rows": 2}, {"packed": True, "stock_rows": -1}):  # stock with a row count; negative rows
        with pytest.raises(ValueError):
            Route(**bad)
    with pytest.raises(AttributeError):
        PACKED.stock_rows = 2  # frozen


def test_packed_kernels_asked_for_where_they_cannot_run_are_refused_before_loading(qwen3_pair):
    """`--cpu-kernels packed` with bf16 used to run stock without a word."""
    target, draft = qwen3_pair
    res = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--cpu-kernels",
                                   "packed", "--dtype", "bf16", "--max-new-tokens", "4", "w1"])
    assert res.exit_code == 2 and "packed" in res.output and "fp32" in res.output and "Traceback" not in res.output
