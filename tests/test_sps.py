"""SPS tables: validation, lookup modes, extrapolation, our format and SGLang's."""

import json

import pytest
import torch

from dsparkctl.errors import InputError
from dsparkctl.formats.sps import load_sps_table, save_sps_table
from dsparkctl.math.sps import SPSTable

BT, SPS = [1, 4, 16, 64], [100.0, 80.0, 40.0, 12.0]


@pytest.mark.parametrize("bt,sps,msg", [
    ([], [], "no probes"),
    ([1, 2], [1.0], "2 batch_tokens but 1"),
    ([1, 4, 4], [3.0, 2.0, 1.0], "not strictly increasing"),
    ([4, 1], [3.0, 2.0], "not strictly increasing"),
    ([0, 1], [3.0, 2.0], "not a positive integer"),
    ([1, 2.5], [3.0, 2.0], "not a positive integer"),
    ([1, 2], [3.0, 0.0], "not a positive finite"),
    ([1, 2], [3.0, float("nan")], "not a positive finite"),
])
def test_validation(bt, sps, msg):
    with pytest.raises(InputError, match=msg):
        SPSTable(bt, sps)


@pytest.mark.parametrize("mode,b,expect", [
    ("floor", [0, 1, 3, 4, 15, 16, 64, 1000], [100, 100, 100, 80, 80, 40, 12, 12]),
    ("linear", [0, 1, 2.5, 4, 10, 64, 1000], [100, 100, 90, 80, 60, 12, 12]),
])
def test_lookup_modes(mode, b, expect):
    t = SPSTable(BT, SPS, mode=mode)
    assert torch.allclose(t.sps(torch.tensor(b)), torch.tensor(expect, dtype=torch.float64))


def test_extrapolation_policies():
    lin = SPSTable(BT, SPS, extrapolate="linear")
    # step time 1/40 at 16, 1/12 at 64: slope per token; at 112 step time = 1/12 + 48*slope
    slope = (1 / 12 - 1 / 40) / 48
    assert lin.sps(torch.tensor([112.0])).item() == pytest.approx(1 / (1 / 12 + 48 * slope))
    assert lin.sps(torch.tensor([64.0])).item() == pytest.approx(12.0)
    with pytest.raises(InputError, match="beyond"):
        SPSTable(BT, SPS, extrapolate="error").sps(torch.tensor([65]))


def test_dense_matches_lookup():
    t = SPSTable(BT, SPS)
    d = t.dense(200)
    assert d.shape == (201,)
    assert torch.equal(d, t.sps(torch.arange(201)))


@pytest.mark.parametrize("fmt", ["dsparkctl", "sglang"])
def test_roundtrip(tmp_path, fmt):
    t = SPSTable(BT, SPS, meta={"device": "cpu"}, max_batch_tokens=128)
    p = tmp_path / f"{fmt}.json"
    save_sps_table(t, p, fmt=fmt)
    obj = json.loads(p.read_text())
    if fmt == "sglang":
        assert set(obj) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    else:
        assert obj["format"] == "dsparkctl-sps/1" and "provenance" in obj and obj["device"] == "cpu"
    u = load_sps_table(p)
    assert u.batch_tokens == BT and u.steps_per_sec == SPS and u.max_batch_tokens == 128


@pytest.mark.parametrize("content,msg", [
    ("{not json", "not valid JSON"),
    ('{"foo": 1}', "not an SPS table"),
    ('{"sample_batch_tokens": [2, 1], "sample_steps_per_sec": [1, 2], "max_batch_tokens": 4}',
     "not strictly increasing"),
    ('{"bias_seconds": 0.1}', "additive"),
    ('{"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [2, 1], "max_batch_tokens": 4}',
     "below the last probe"),
])
def test_bad_files(tmp_path, content, msg):
    p = tmp_path / "t.json"
    p.write_text(content)
    with pytest.raises(InputError, match=msg):
        load_sps_table(p)


def test_a_saved_table_prices_steps_exactly_as_the_one_written(tmp_path):
    """A cached machine table is read back by later runs (and by the other torchrun ranks' run):
    costs must survive the file unrounded, or a near tie decides differently (skip or draft)."""
    import torch

    from dsparkctl.formats.sps import load_sps_table, save_sps_table
    from dsparkctl.math.sps import SPSTable, StepGrid

    grid = StepGrid([1, 2, 4], [1, 2, 3], [[10.123456789, 11.98765, 13.5], [12.3333333, 14.1, 15.77777],
                                           [20.1, 23.3, 27.123456]], [9.87654321, 11.1111111, 18.2222222])
    table = SPSTable([1, 2, 3, 4], [98.7654321, 90.1, 80.33, 70.77], meta={"measures": "whole-step"}, grid=grid)
    save_sps_table(table, tmp_path / "s.json")
    back = load_sps_table(tmp_path / "s.json")
    ell = torch.tensor([[0, 1, 2], [2, 2, 0]])
    assert torch.equal(table.lengths_seconds(ell), back.lengths_seconds(ell))
    assert [table.plain_seconds(r) for r in (1, 3, 4)] == [back.plain_seconds(r) for r in (1, 3, 4)]
