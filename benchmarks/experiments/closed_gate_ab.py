"""Plain decoding against dspark with its gate closed, prefill and decode apart (issue 29).

Under load dspark's gate closes and every step is a plain step, but it runs in the speculative
engine: the target's forward taps the layers the draft reads and the draft's context update is
deferred. This alternates the two loops (the order flips every repeat) on the first B MT-Bench
prompts, greedy, and prints each loop's prefill and decode time (decode = total - prefill):

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/experiments/closed_gate_ab.py 32 6 48

Measured on a 2-core VM (the other core busy training, so both loops slowed alike), 32 requests,
48 tokens, 6 repeats: with output_hidden_states prefill 15.7 s plain against 19.6 s dspark, decode
7.6 s against 8.3 s; with hooks on the tapped layers 16.4 s against 17.5 s and 6.5 s both.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.formats.calibration import load_survival_prior, load_temperatures
from dsparkctl.formats.sps import load_sps_table
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams


def main() -> None:
    usage = "usage: closed_gate_ab.py REQUESTS REPEATS NEW_TOKENS (three positive integers)"
    if len(sys.argv) != 4 or not all(a.isdigit() and int(a) > 0 for a in sys.argv[1:]):
        sys.exit(usage)
    B, reps, N = (int(a) for a in sys.argv[1:])
    torch.set_num_threads(1)
    sess = open_session(None, None, "cpu", "fp32", log=lambda m: None, cpu_kernels="auto")
    cal, gamma = sess.default_calibration(), sess.draft.block_size
    sps = load_sps_table(Path(__file__).resolve().parents[1] / "results" / "sps_issue29.json")
    greedy = SamplingParams(0.0)
    policy = parse_policy("dspark", sps=sps, temperatures=load_temperatures(cal, gamma),
                          prior=load_survival_prior(cal, gamma))
    engine = SpeculativeEngine(sess.adapter, sess.draft, policy, greedy, stop_token_ids=[])
    plain = sess.plain_adapter()
    prompts = encode_prompts(sess.target.tokenizer, load_prompts("mt-bench"))[:B]
    res: dict[str, list[tuple[float, float]]] = {"plain": [], "gate": []}
    drafted = 0
    for i in range(reps):
        for name in (("plain", "gate") if i % 2 == 0 else ("gate", "plain")):
            r = plain_generate(plain, prompts, N, greedy) if name == "plain" else engine.generate(prompts, N)
            res[name].append((r.times_ms["total"] - r.times_ms["prefill"], r.times_ms["prefill"]))
            if name == "gate":
                drafted = r.drafted_steps
        print(i, {k: (round(v[-1][1]), round(v[-1][0])) for k, v in res.items()}, "(prefill, decode ms); gate drafted",
              drafted, flush=True)
    med = {k: (statistics.median(x[1] for x in v), statistics.median(x[0] for x in v)) for k, v in res.items()}
    if drafted:
        print(f"note: the gate opened ({drafted} drafted steps in the last run): at {B} requests this is "
              "not the closed-gate path alone")
    print(f"B={B}: prefill ms plain {med['plain'][0]:.0f} gate {med['gate'][0]:.0f}; decode ms plain "
          f"{med['plain'][1]:.0f} gate {med['gate'][1]:.0f} (medians of {reps})")


if __name__ == "__main__":
    main()
