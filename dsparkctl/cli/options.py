"""The options commands share, typed: device, dtype, kernels, target, draft, revision, sampling,
and the parsers of list-valued options.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any, Sequence

import typer

from dsparkctl.checks import ascii_int
from dsparkctl.engine.session import CPU_KERNELS
from dsparkctl.models.quant_linear import DRAFT_WEIGHTS
from dsparkctl.errors import UsageError
from dsparkctl.models.loading import DTYPES


def choices(name: str, values: Sequence[str]) -> Any:
    """An option's choice type built from the library's tuple of names (so the two cannot drift);
    a member is named as its value with "-" as "_" (`Mode.teacher_forced` is "teacher-forced")."""
    return Enum(name, {v.replace("-", "_"): v for v in values}, type=str)


Device = choices("Device", ("auto", "cpu", "cuda"))


DType = choices("DType", DTYPES)


CpuKernels = choices("CpuKernels", CPU_KERNELS)


DraftWeights = choices("DraftWeights", DRAFT_WEIGHTS)


JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed (all randomness is seeded).")]


DeviceOpt = Annotated[Device, typer.Option("--device", help="Where to run the models.")]


DTypeOpt = Annotated[DType, typer.Option("--dtype", help="Model dtype (auto = bf16 on CUDA, fp32 on CPU).")]


_REVISION = re.compile(r"^(?!.*\.\.)(?!.*//)(?!.*/\.)[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,254}$")


def _check_revision(value: str | None) -> str | None:
    """A git ref or commit the hub could hold: refused here, not after retries against the hub."""
    if value is not None and (not _REVISION.match(value) or value.endswith(("/", ".", ".lock"))):
        raise typer.BadParameter(f"{value!r} is not a branch, tag or commit (e.g. main, v1.0, refs/pr/1, or a "
                                 "40-hex commit)")
    return value


RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Hub revision (branch, tag or commit).",
                                                 callback=_check_revision)]


TrustRemoteCodeOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model repos to run their own "
                                                  "Python code (off unless given).")]


TargetOpt = Annotated[str | None, typer.Option("--target", help="Target model: folder or hub id (default: the "
                                               "embedded SmolLM2-135M-Instruct).")]


DraftOpt = Annotated[str | None, typer.Option("--draft", help="Draft model: folder (DeepSpec, speculators, SpecForge "
                                              "or ModelOpt format), hub id, or 'random' for an untrained one "
                                              "(default: the shipped draft for the embedded target).")]


TargetParallelOpt = Annotated[str, typer.Option("--target-parallel", help="For a target too big for one GPU: none, "
                                                "device-map (one process spreads its layers over the visible GPUs) "
                                                "or tp (tensor parallel: run under torchrun, one shard per process).")]


CpuKernelsOpt = Annotated[CpuKernels, typer.Option("--cpu-kernels", help="CPU fp32 only: packed = weights packed "
                                                  "once for oneDNN (often faster); stock = torch's default kernels; "
                                                  "auto = whichever this CPU runs faster (timed once, cached).")]


DraftWeightsOpt = Annotated[DraftWeights, typer.Option("--draft-weights", help="The draft's linear weights: int8 = "
                                                      "quantized (CPU, fp32 drafts; faster, and the output is still "
                                                      "exactly the target's); fp32 = as stored; auto = int8 wherever "
                                                      "it can run.")]


TemperatureOpt = Annotated[float | None, typer.Option("--temperature", help="Sampling temperature; 0 = greedy "
                                                     "(default: 0, or the --preset's).")]


MaxNewTokensOpt = Annotated[int | None, typer.Option("--max-new-tokens", help="Tokens to generate per prompt "
                                                     "(default: 128, or the --preset's).")]


PresetOpt = Annotated[str | None, typer.Option("--preset", help="Another tool's evaluation settings, so numbers "
                                               "compare with its tables: deepspec (temperature 1.0, 2048 tokens, chat "
                                               "template, its HumanEval instruction). Options given explicitly win.")]


INT_LIST_MAX = 1 << 16  # no load level, request count or token count we profile or sweep is larger


def int_list(text: str, option: str, maximum: int = INT_LIST_MAX) -> list[int]:
    """A comma-separated list of positive integers up to `maximum` given to `option` (e.g.
    "--requests 1,2,4"): a typo such as 99999999999 is refused here, not by an allocation of
    terabytes later."""
    vals = [ascii_int(x.strip(" ")) for x in text.split(",") if x.strip(" ")]  # not "５", "1_0" or a newline
    if any(v is None for v in vals):
        raise UsageError(f"{option} must be comma-separated integers, got {text!r}", f"e.g. {option} 1,2,4")
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{option} must be positive integers, got {text!r}", f"e.g. {option} 1,2,4")
    big = [v for v in vals if v > maximum]
    if big:
        raise UsageError(f"{option} {big[0]} is larger than {maximum}", f"use values in 1..{maximum}, e.g. {option} 1,2,4")
    return vals
