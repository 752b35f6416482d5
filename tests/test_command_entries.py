"""The library entries of generate, eval-acceptance and profile-sps (`run_generate`,
`run_eval_acceptance`, `run_profile_sps`): each refuses a bad spec before any model loads, in messages
that name the spec's fields (or, rendered with `names`, what the CLI calls them: its flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsparkctl.app.eval_acceptance import EvalSpec, run_eval_acceptance
from dsparkctl.app.generate import GenerateSpec, run_generate
from dsparkctl.app.profile_sps import ProfileSpec, run_profile_sps
from dsparkctl.errors import UsageError

NO_MODEL = "/nonexistent/no-such-model"  # loading it would be a different error: none is loaded

# (case, entry, spec, names, text of the message)
CASES = [
    ("generate: no tokens", run_generate, GenerateSpec(target=NO_MODEL, max_new_tokens=0), None,
     "max_new_tokens must be >= 1, got 0"),
    ("generate: no tokens, flag", run_generate, GenerateSpec(target=NO_MODEL, max_new_tokens=0),
     {"max_new_tokens": "--max-new-tokens"}, "--max-new-tokens must be >= 1, got 0"),
    ("generate: batch 0", run_generate, GenerateSpec(target=NO_MODEL, batch_size=0), None,
     "batch_size must be >= 1, got 0"),
    ("generate: trace is a folder", run_generate, GenerateSpec(target=NO_MODEL, trace=Path("{tmp}")), None,
     "trace {tmp} is a folder"),
    ("eval: labels", run_eval_acceptance, EvalSpec(target=NO_MODEL, labels=("a",)), None,
     "labels must be given once per drafts"),
    ("eval: no tokens", run_eval_acceptance, EvalSpec(target=NO_MODEL, max_new_tokens=0),
     {"max_new_tokens": "--max-new-tokens"}, "--max-new-tokens must be >= 1"),
    ("eval: batch 0", run_eval_acceptance, EvalSpec(target=NO_MODEL, batch_size=0), None, "batch_size must be >= 1, got 0"),
    ("eval: mode", run_eval_acceptance, EvalSpec(target=NO_MODEL, mode="fast"), None, "unknown mode 'fast'"),
    ("profile: one probe", run_profile_sps, ProfileSpec(target=NO_MODEL, out=Path("{tmp}/s.json"), requests=(1,),
                                                    tokens_per_request=(2,)), None,
     "the grid requests 1 × tokens_per_request 2 gives one batch-token count"),
    ("profile: repeats", run_profile_sps, ProfileSpec(target=NO_MODEL, out=Path("{tmp}/s.json"), repeats=0),
     {"context_len": "--context-len", "repeats": "--repeats", "warmup": "--warmup"},
     "--context-len and --repeats must be >= 1, --warmup >= 0"),
    ("profile: one device", run_profile_sps, ProfileSpec(target=NO_MODEL, out=Path("{tmp}/s.json"), target_parallel="tp"),
     None, "profile-sps times one process on one device; target_parallel 'tp'"),
    ("profile: out is a folder", run_profile_sps, ProfileSpec(target=NO_MODEL, out=Path("{tmp}")), None,
     "out {tmp} is a folder"),
]


@pytest.mark.parametrize("case,entry,spec,names,text", CASES, ids=[c[0] for c in CASES])
def test_refused_before_any_model_loads(case, entry, spec, names, text, tmp_path: Path):
    fields = {k: Path(str(v).format(tmp=tmp_path)) for k, v in vars(spec).items() if isinstance(v, Path)}
    spec = type(spec)(**{**vars(spec), **fields})
    with pytest.raises(UsageError) as e:
        entry(spec)
    assert text.format(tmp=tmp_path) in e.value.one_line(names), case
