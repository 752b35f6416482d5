"""calibrate reads SGLang's own STS collection: .pt shards of logits and prefix_mask, tensors only."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.errors import InputError
from dsparkctl.formats.calibration import read_sglang_shard
from dsparkctl.tuning.calibration import calibrate_traces


def shard(path, n=400, gamma=4, seed=0, temperature=2.0, observed=False):
    """Like sglang's StsDataRecorder: survival label k = first k+1 drafts matched."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, gamma, generator=g) * 2
    p = torch.sigmoid(logits / temperature)  # an over-confident head: truth is softer
    ok = torch.rand(n, gamma, generator=g) < p
    accepted = ok.to(torch.long).cumprod(1).sum(1)
    mask = (torch.arange(gamma)[None, :] < accepted[:, None]).float()
    obj = {"logits": logits.float(), "prefix_mask": mask}
    if observed:
        obs = torch.ones(n, gamma)
        obs[: n // 4, -1] = 0  # a quarter of the rows did not verify the last draft
        obj["observed_mask"] = obs
    torch.save(obj, path)
    return path, accepted


def test_shards_calibrate_like_traces(tmp_path):
    a, acc_a = shard(tmp_path / "raw.0.pt", seed=1)
    b, _ = shard(tmp_path / "raw.1.pt", seed=2, observed=True)
    lg, acc = read_sglang_shard(a)
    assert lg.shape == (400, 4) and torch.equal(acc, acc_a)
    assert read_sglang_shard(b)[0].shape[0] == 300  # partly observed rows are left out
    res = calibrate_traces([a, b], holdout=0.25, bins=10)
    assert res["block_size"] == 4 and res["rounds"]["train"] + res["rounds"]["heldout"] == 700
    assert all(t > 1.2 for t in res["temperatures"])  # it finds the head over-confident


class _Unpickled(Exception):
    pass


class Evil:
    """A pickle that would run code if it were ever unpickled: torch.load(weights_only=True) must refuse it."""

    def __reduce__(self):
        return (_Unpickled, ("this object was unpickled",))


def _pickled(path):
    torch.save({"logits": Evil(), "prefix_mask": torch.zeros(2, 2)}, path)


def _raw_pickle(path):
    with open(path, "wb") as fh:
        pickle.dump({"logits": Evil(), "prefix_mask": torch.zeros(2, 2)}, fh)


BAD = [
    ("a pickled object", _pickled, "refused without unpickling"),
    ("a raw pickle", _raw_pickle, "refused without unpickling"),
    ("not a dict", lambda p: torch.save([torch.zeros(3, 2)], p), "expected a dict"),
    ("no prefix_mask", lambda p: torch.save({"logits": torch.zeros(3, 2)}, p), "prefix_mask"),
    ("shapes differ", lambda p: torch.save({"logits": torch.zeros(3, 2), "prefix_mask": torch.zeros(3, 3)}, p),
     "differ"),
    ("not a prefix", lambda p: torch.save({"logits": torch.zeros(2, 2), "prefix_mask": torch.tensor([[0., 1.], [1., 0.]])},
                                          p), "non-increasing"),
    ("NaN logits", lambda p: torch.save({"logits": torch.full((2, 2), float("nan")), "prefix_mask": torch.zeros(2, 2)},
                                        p), "NaN"),
    ("text file", lambda p: p.write_text("hello"), "refused without unpickling"),
]


@pytest.mark.parametrize("name,make,message", BAD, ids=[b[0] for b in BAD])
def test_bad_shards_are_one_line_and_write_nothing(tmp_path, name, make, message):
    bad = tmp_path / "bad.pt"
    make(bad)
    with pytest.raises(InputError, match=message):
        read_sglang_shard(bad)
    out = tmp_path / "calib.json"
    good, _ = shard(tmp_path / "ok.pt")
    res = CliRunner().invoke(app, ["calibrate", str(good), str(bad), "--out", str(out)])
    assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("calib*"))


def test_cli_writes_sglang_sts_from_shards(tmp_path):
    a, _ = shard(tmp_path / "raw.0.pt", n=600)
    out = tmp_path / "calib.json"
    res = CliRunner().invoke(app, ["calibrate", str(a), "--out", str(out), "--bins", "10"])
    assert res.exit_code == 0, res.output
    sts = json.loads((tmp_path / "calib.sglang-sts.json").read_text())
    assert len(sts["temperatures"]) == 4 and all(t > 0 for t in sts["temperatures"])


def test_shard_given_twice_is_refused(tmp_path):
    a, _ = shard(tmp_path / "raw.0.pt")
    link = tmp_path / "same.pt"
    link.hardlink_to(a)
    for paths in ([a, a], [a, link]):
        with pytest.raises(InputError, match="given twice"):
            calibrate_traces(paths, holdout=0.25, bins=10)


def test_upper_case_suffix_is_a_shard(tmp_path):
    a, _ = shard(tmp_path / "RAW.0.PT")
    res = calibrate_traces([a], holdout=0.25, bins=10)
    assert len(res["temperatures"]) == 4


@pytest.mark.parametrize("obj,needle", [
    ({"logits": torch.zeros(3, 300), "prefix_mask": torch.zeros(3, 300)}, "at most 256"),
    ({"logits": torch.zeros(3, 4), "prefix_mask": torch.zeros(3, 4), "observed_mask": torch.ones(2, 4)},
     "observed_mask must be a tensor shaped like logits"),
])
def test_bad_shards(obj, needle, tmp_path):
    torch.save(obj, tmp_path / "bad.0.pt")
    with pytest.raises(InputError, match=needle):
        read_sglang_shard(tmp_path / "bad.0.pt")
