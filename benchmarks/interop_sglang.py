"""Run SGLang's own readers on what `dsparkctl serve-config` wrote (benchmarks/interop_check.sh).

Runs inside a side virtualenv with `sglang==0.5.23` installed with --no-deps plus the pure-Python
packages these readers import (NOT the project's .venv; it imports no dsparkctl code):
  - every environment variable of the printed line is a field of `sglang.srt.environ.Envs`, and
    `ragged_verify.read_ragged_verify_mode` reads the printed SGLANG_RAGGED_VERIFY_MODE;
  - every flag of the printed launch line parses with `ServerArgs.add_cli_args` (argparse refuses
    unknown flags) to the values we meant;
  - `dspark_sps.load_sps_table_from_path` / `is_uninitialized_sps_table` on the SPS table,
    `dspark_sts.load_sts_calibration_from_path` on the STS file;
  - `dspark_config.parse_dspark_draft_config` and `dflash_utils.parse_dflash_draft_config` on the
    config of every draft folder named (read with transformers' AutoConfig, as SGLang does).
Where torchvision is not installed, an inert placeholder stands in for it (`_InertTorchvision`).

Usage: python interop_sglang.py SERVE_JSON DRAFT_DIR [DRAFT_DIR ...]
One line per check ("ok" / "FAIL"); exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback
import types
from pathlib import Path

FAILED: list[str] = []


class _Inert(types.ModuleType):
    """An attribute-less stand-in module: every attribute is another stand-in."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self.__name__}.{name}")


class _InertTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """SGLang's draft-config parsers live in modules whose imports reach its multimodal
    processors (`srt/configs/__init__.py` -> `multimodal/internvl_utils.py`), which import
    torchvision at module level. PyPI's torchvision is a CUDA build that cannot load beside a CPU
    torch ("operator torchvision::nms does not exist"), and no reader checked here calls it, so
    when torchvision is absent this stands an inert module in for it. Nothing else is replaced."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Inert(spec.name)

    def exec_module(self, module):
        module.__path__ = []


if importlib.util.find_spec("torchvision") is None:
    # transformers decides once, at import, whether torchvision exists: let it see the truth first
    import transformers.models.auto.image_processing_auto  # noqa: F401
    import transformers.models.auto.processing_auto  # noqa: F401

    sys.meta_path.append(_InertTorchvision())


def check(name: str, fn) -> None:
    try:
        detail = fn()
    except Exception as exc:  # one line per check; the traceback goes to stderr
        FAILED.append(name)
        print(f"FAIL sglang: {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        traceback.print_exc(file=sys.stderr)
        return
    print(f"ok   sglang: {name}{': ' + str(detail) if detail not in (None, '') else ''}", flush=True)


def env_fields(env: dict[str, str]) -> str:
    from sglang.srt.environ import EnvField, Envs

    unknown = [k for k in env if not isinstance(Envs.__dict__.get(k), EnvField)]
    assert not unknown, f"not SGLang environment variables: {unknown}"
    return ", ".join(f"{k}={v}" for k, v in env.items())


def ragged_mode(env: dict[str, str]) -> str:
    os.environ.update(env)
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode, read_ragged_verify_mode

    mode = read_ragged_verify_mode()
    assert mode == RaggedVerifyMode.COMPACT, mode
    return f"{mode!r}"


def server_args(argv: list[str], block_size: int) -> str:
    from sglang.srt.server_args import ServerArgs

    assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv[:3]
    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    ns, unknown = parser.parse_known_args(argv[3:])
    assert not unknown, f"flags ServerArgs does not know: {unknown}"
    want = {"speculative_algorithm": "DSPARK", "speculative_dspark_block_size": block_size}
    got = {k: getattr(ns, k) for k in want}
    assert got == want, got
    flags = [a for a in argv[3:] if a.startswith("--")]
    return f"{len(flags)} flags known ({', '.join(f.removeprefix('--') for f in flags)})"


def sps(path: str) -> str:
    from sglang.srt.speculative.dspark_components.dspark_sps import is_uninitialized_sps_table, load_sps_table_from_path

    t = load_sps_table_from_path(path)
    assert not is_uninitialized_sps_table(t), "SGLang counts the table uninitialised (it would verify every draft)"
    return f"{type(t).__name__}, {len(t.sample_batch_tokens)} probes, initialised"


def sts(path: str, block_size: int) -> str:
    from sglang.srt.speculative.dspark_components.dspark_sts import load_sts_calibration_from_path

    c = load_sts_calibration_from_path(path)
    assert len(c.temperatures) == block_size, (len(c.temperatures), block_size)
    return f"{len(c.temperatures)} temperatures, dataset {c.dataset!r}, num_samples {c.num_samples}"


def draft_config(folder: str) -> str:
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder)
    ds = parse_dspark_draft_config(draft_hf_config=hf)
    df = parse_dflash_draft_config(draft_hf_config=hf)
    assert ds.require_markov() and ds.gamma == 5 and ds.mask_token_id is not None, ds
    return (f"model_type {hf.model_type}, DSpark gamma {ds.gamma}, layers {ds.num_hidden_layers}, taps "
            f"{ds.target_layer_ids}, mask id {ds.mask_token_id}, markov rank {ds.markov_rank}; DFlash block size "
            f"{df.block_size}, layer_types {getattr(hf, 'layer_types', None)}")


def main() -> int:
    serve, *drafts = sys.argv[1:]
    r = json.loads(Path(serve).read_text())
    s, gamma = r["sglang"], r["block_size"]
    check("environment variables exist in sglang.srt.environ.Envs", lambda: env_fields(s["env"]))
    check("ragged_verify.read_ragged_verify_mode on the printed environment", lambda: ragged_mode(s["env"]))
    check("ServerArgs.add_cli_args parses the printed launch line", lambda: server_args(s["argv"], gamma))
    check("dspark_sps.load_sps_table_from_path", lambda: sps(s["files"]["sps_table"]))
    check("dspark_sts.load_sts_calibration_from_path", lambda: sts(s["files"]["sts"], gamma))
    for folder in drafts:
        check(f"parse_dspark_draft_config / parse_dflash_draft_config on {Path(folder).name}",
              lambda: draft_config(folder))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
