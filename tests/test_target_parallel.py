"""--target-parallel: a big target spread by transformers' own means (device map, tensor parallel)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dsparkctl.cli.main import app
from tests.tiny_models import save_tiny_target, write_deepspec_draft


def test_device_map_gives_the_same_output(tmp_path):
    """On this CPU the device map places every layer on the CPU: the path runs and changes nothing
    (several GPUs were not available here)."""
    target = save_tiny_target(tmp_path / "t", "llama")
    draft = write_deepspec_draft(tmp_path / "d", block_size=3)
    args = ["generate", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "10", "--json",
            "--no-text", "w5 w6 w7", "w9 w10"]
    plain = CliRunner().invoke(app, args)
    mapped = CliRunner().invoke(app, args + ["--target-parallel", "device-map"])
    assert plain.exit_code == 0 and mapped.exit_code == 0, mapped.output
    assert [r["text"] for r in json.loads(plain.stdout)["requests"]] == \
        [r["text"] for r in json.loads(mapped.stdout)["requests"]]


def test_tensor_parallel_needs_torchrun(tmp_path):
    target = save_tiny_target(tmp_path / "t", "llama")
    res = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", "random", "--target-parallel", "tp",
                                   "hello"])
    assert res.exit_code != 0 and "torchrun" in res.output and len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(app, ["generate", "--target", str(target), "--target-parallel", "pipeline", "hello"])
    assert res.exit_code != 0 and "unknown --target-parallel" in res.output
