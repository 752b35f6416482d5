"""Markov heads: DeepSpec parameter names/shapes, step shapes, formulas, rnn state."""

from __future__ import annotations

import pytest
import torch

from dsparkctl.errors import UsageError
from dsparkctl.models.markov_head import MarkovHead

V, RANK, H, R = 13, 4, 6, 3

# DeepSpec state_dict keys (under the draft's `markov_head.` prefix) and shapes.
EXPECTED_KEYS = {
    "vanilla": {"markov_w1.weight": (V, RANK), "markov_w2.weight": (V, RANK)},
    "gated": {"markov_w1.weight": (V, RANK), "markov_w2.weight": (V, RANK),
              "gate_proj.weight": (RANK, H + RANK), "gate_proj.bias": (RANK,)},
    "rnn": {"markov_w1.weight": (V, RANK), "markov_w2.weight": (V, RANK),
            "joint_proj.weight": (3 * RANK, 2 * RANK + H), "joint_proj.bias": (3 * RANK,)},
}


@pytest.mark.parametrize("kind", list(EXPECTED_KEYS))
def test_state_dict_names_and_shapes(kind):
    head = MarkovHead(V, RANK, H, kind)
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == EXPECTED_KEYS[kind]
    # a DeepSpec-named state dict loads strictly
    head.load_state_dict({k: torch.randn(s) for k, s in EXPECTED_KEYS[kind].items()}, strict=True)


def test_bad_kind_and_rank():
    with pytest.raises(UsageError):
        MarkovHead(V, RANK, H, "lstm")
    with pytest.raises(UsageError):
        MarkovHead(V, 0, H)


@pytest.mark.parametrize("kind", list(EXPECTED_KEYS))
def test_step_shapes_and_markov_embed(kind):
    torch.manual_seed(0)
    head = MarkovHead(V, RANK, H, kind)
    prev = torch.tensor([0, 5, 12])
    hidden = torch.randn(R, H)
    state = head.init_state(R, "cpu", torch.float32)
    assert (state is None) == (kind != "rnn")
    bias, embed, new_state = head.step(prev, hidden, state)
    assert bias.shape == (R, V) and embed.shape == (R, RANK)
    torch.testing.assert_close(embed, head.markov_w1.weight[prev])  # confidence-head input, all kinds
    if kind == "rnn":
        assert new_state.shape == (R, RANK) and not torch.equal(new_state, state)
    else:
        assert new_state is None


def test_formulas():
    torch.manual_seed(1)
    prev, hidden = torch.tensor([1, 2, 3]), torch.randn(R, H)
    w1 = lambda h: h.markov_w1.weight[prev]  # noqa: E731

    van = MarkovHead(V, RANK, H, "vanilla")
    torch.testing.assert_close(van.step(prev, None, None)[0], w1(van) @ van.markov_w2.weight.T)

    gated = MarkovHead(V, RANK, H, "gated")
    gate = torch.sigmoid(torch.cat([hidden, w1(gated)], -1) @ gated.gate_proj.weight.T + gated.gate_proj.bias)
    torch.testing.assert_close(gated.step(prev, hidden, None)[0], (gate * w1(gated)) @ gated.markov_w2.weight.T)

    rnn = MarkovHead(V, RANK, H, "rnn")
    s = torch.randn(R, RANK)
    z = torch.cat([s, w1(rnn), hidden], -1) @ rnn.joint_proj.weight.T + rnn.joint_proj.bias
    g, c, o = z[:, :RANK], z[:, RANK:2 * RANK], z[:, 2 * RANK:]
    bias, _, s_new = rnn.step(prev, hidden, s)
    torch.testing.assert_close(s_new, torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c))
    torch.testing.assert_close(bias, torch.tanh(o) @ rnn.markov_w2.weight.T)
    # state None means zeros
    torch.testing.assert_close(rnn.step(prev, hidden, None)[0], rnn.step(prev, hidden, torch.zeros(R, RANK))[0])


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_hidden_required(kind):
    with pytest.raises(ValueError):
        MarkovHead(V, RANK, H, kind).step(torch.tensor([1]), None, None)


@pytest.mark.parametrize("kind", list(EXPECTED_KEYS))
def test_teacher_forced_matches_steps(kind):
    torch.manual_seed(2)
    head = MarkovHead(V, RANK, H, kind)
    prev, hidden = torch.randint(0, V, (R, 4)), torch.randn(R, 4, H)
    bias, embeds = head.teacher_forced_bias(prev, hidden)
    state = head.init_state(R, "cpu", torch.float32)
    for k in range(4):
        b, e, state = head.step(prev[:, k], hidden[:, k], state)
        torch.testing.assert_close(bias[:, k], b)
        torch.testing.assert_close(embeds[:, k], e)


@pytest.mark.parametrize("kind", list(EXPECTED_KEYS))
def test_step_logits_is_base_plus_the_step_bias(kind):
    torch.manual_seed(0)
    head = MarkovHead(V, RANK, H, kind)
    base, prev, hidden = torch.randn(R, V), torch.randint(0, V, (R,)), torch.randn(R, H)
    state = head.init_state(R, "cpu", torch.float32)
    with torch.no_grad():
        bias, embed, new = head.step(prev, hidden, state)
        logits, embed2, new2 = head.step_logits(base, prev, hidden, state)
        torch.testing.assert_close(logits, base + bias)
        assert torch.equal(embed2, embed) and (new is None) == (new2 is None)
        # the vanilla head's cached W2ᵀ follows an in-place change of W2
        head.markov_w2.weight.mul_(2.0)
        bias, _, _ = head.step(prev, hidden, state)
        torch.testing.assert_close(head.step_logits(base, prev, hidden, state)[0], base + bias)
