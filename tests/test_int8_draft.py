"""A draft's linears in int8 (models/quant_linear.py): close products, the target's own output, the
target's law, and sessions that run it only where it can run."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import dsparkctl.models.quant_linear as ql
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.errors import UsageError
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.sps import SPSTable
from dsparkctl.models.draft_io import random_draft
from dsparkctl.models.packed_linear import PackedLinear, pack_linears
from dsparkctl.models.quant_linear import Int8Linear, int8_supported, quantize_draft
from dsparkctl.models.target import TargetAdapter
from tests.test_cpu_kernels import assert_sampled_law_holds, generate_each_way
from tests.test_engine import PROMPTS
from tests.tiny_models import bigram_oracle_draft, tiny_target

pytestmark = pytest.mark.skipif(not int8_supported(), reason="this torch has no working int8 linear ops")
SPS = SPSTable([1, 2, 4, 8, 16, 32], [100.0, 99.0, 97.0, 90.0, 80.0, 60.0])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (6, 64), (2, 5, 64)])
def test_int8_linear_is_close_to_the_fp32_product(bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    x = torch.randn(*shape)
    q = Int8Linear(lin.weight, lin.bias)
    with torch.no_grad():
        y, ref = q(x), lin(x)
    assert y.shape == ref.shape
    rel = (y - ref).norm() / ref.norm()
    assert 0 < rel < 0.02, rel  # int8: not the same arithmetic, but within a percent or two
    assert q.weight is lin.weight  # the fp32 weight stays reachable (dtype reads, fused copies)


def test_quantize_draft_keeps_the_feature_projection_in_fp32_and_fuses_in_int8():
    tgt = TargetAdapter(tiny_target("llama"), [0, 1])
    draft = random_draft(tgt, seed=3, block_size=4, markov_rank=8, layer_ids=[0, 1])
    pack_linears(draft, keep_weight=True)
    n = quantize_draft(draft)
    assert n > 0
    assert isinstance(draft.fc, PackedLinear)  # the taps' projection: quantizing it cost τ on the shipped draft
    assert isinstance(draft.layers[0].mlp.down_proj, Int8Linear)
    assert isinstance(draft.lm_head, Int8Linear)
    assert all(m.out_features >= 2 for m in draft.modules() if isinstance(m, Int8Linear))  # not the confidence head
    fused = draft.layers[0].fused()
    assert fused is not None and isinstance(fused[0], Int8Linear) and isinstance(fused[1], Int8Linear)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("policy,siblings", [("static:4", 0), ("dspark", "auto"), ("static:2", 2)])
def test_greedy_identity_with_an_int8_draft(family, policy, siblings):
    model = tiny_target(family)
    pack_linears(model, keep=(model.get_output_embeddings(),))
    tgt = TargetAdapter(model, [0, 1])
    draft = bigram_oracle_draft(tgt, PROMPTS, block_size=4, layer_ids=[0, 1])
    assert quantize_draft(draft) > 0
    # the reference is plain decoding by a target loaded apart, stock kernels: nothing shared with the run
    plain = plain_generate(TargetAdapter(tiny_target(family)), PROMPTS, 40, SamplingParams(0.0))
    eng = SpeculativeEngine(tgt, draft, parse_policy(policy, sps=SPS), SamplingParams(0.0), siblings=siblings)
    rep = eng.generate(PROMPTS, 40)
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in plain.outputs]
    assert eng.generate([PROMPTS[2]], 40).outputs[0].tokens == plain.outputs[2].tokens
    assert any(isinstance(m, Int8Linear) for m in eng.draft.modules())  # the run drafted in int8
    if policy == "static:4":
        assert rep.stats.tau > 1.4  # the oracle still drafts well in int8: real multi-token accepts


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)])
def test_sampled_output_with_an_int8_draft_matches_the_target_distribution(params):
    assert_sampled_law_holds(params, lambda model: None, quantize_draft)


def test_sessions_run_int8_where_asked_or_where_auto_can(qwen3_pair, monkeypatch):
    target, draft = qwen3_pair
    quiet = dict(log=lambda m: None, cpu_kernels="packed")
    auto = open_session(str(target), str(draft), "cpu", "fp32", draft_weights="auto", **quiet)
    assert auto.draft_precision == "int8" and auto.conditions()["draft_weights"] == "int8"
    assert any(isinstance(m, Int8Linear) for m in auto.draft.modules())
    assert not any(isinstance(m, Int8Linear) for m in auto.target.model.modules())  # the target is never touched
    fp32 = open_session(str(target), str(draft), "cpu", "fp32", draft_weights="fp32", **quiet)
    assert fp32.draft_precision == "fp32" and not any(isinstance(m, Int8Linear) for m in fp32.draft.modules())
    bf16 = open_session(str(target), str(draft), "cpu", "bf16", draft_weights="auto",
                        **{**quiet, "cpu_kernels": "auto"})  # packed needs fp32: asked for with bf16, refused
    assert bf16.draft_precision == "bfloat16"  # auto leaves what it cannot quantize as it is
    with pytest.raises(UsageError, match="int8 needs the CPU, fp32"):
        open_session(str(target), str(draft), "cpu", "bf16", draft_weights="int8", **quiet)
    with pytest.raises(UsageError, match="unknown"):
        open_session(str(target), str(draft), "cpu", "fp32", draft_weights="int4", **quiet)
    monkeypatch.setattr(ql, "_CHECKED", False)  # a torch whose int8 ops fail their self-check
    assert open_session(str(target), str(draft), "cpu", "fp32", draft_weights="auto", **quiet).draft_precision == "fp32"
    with pytest.raises(UsageError, match="no working int8 ops"):
        open_session(str(target), str(draft), "cpu", "fp32", draft_weights="int8", **quiet)


def test_generate_reports_its_draft_weights_and_both_give_the_same_greedy_text(qwen3_pair):
    generate_each_way(qwen3_pair, "--draft-weights", ("int8", "fp32"), "int4")
