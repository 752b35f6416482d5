"""What profile-sps's whole-step timing changed by: until issue 21 it timed its own copy of the
round's stages (draft, schedule, verify, the draft's context update; the target rolled back by
commit 0); now it times the engine's own round (also the commit and stop bookkeeping) and rewinds
it (`SpeculativeEngine.mark`). Both, alternated repeat by repeat in one process on the embedded
pair (fp32, stock kernels, context 128), 10 timed repeats after 4 warm-up: medians and new/old.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/experiments/profile_round_ab.py
"""

import json
import statistics as st
import sys
import time
from pathlib import Path

import torch

from dsparkctl.engine.clock import Clock
from dsparkctl.engine.profile import DraftEvery
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import provenance_of  # noqa: E402

torch.set_num_threads(1)
print(json.dumps(provenance_of(__file__)), flush=True)  # the printed result says where it came from
sess = open_session(None, None, "cpu", "fp32", None, log=lambda m: None)
gamma = sess.draft.block_size
eng = SpeculativeEngine(sess.adapter, sess.draft, parse_policy(f"static:{gamma}"), SamplingParams(0.0), stop_token_ids=sess.stop_ids)
tgt, drf = eng.target, eng.draft
for R in (1, 4):
    prompts = torch.randint(0, tgt.vocab_size, (R, 128), generator=torch.Generator().manual_seed(0)).tolist()
    live = eng.prefill(prompts, gamma + 2, None)
    rewind = eng.mark(live)
    ctx_len = live.context.ctx_len.clone()
    zero = torch.zeros(R, dtype=torch.long)
    for t in (1, 2, 3):
        old, new = [], []
        for i in range(14):
            # old
            t0 = time.perf_counter()
            prop = drf.propose(live.context, live.anchors, eng.draft_sampling, None)
            eng.policy.choose(prop.confidence_logits, block_size=gamma, num_requests=R)
            ell = torch.full((R,), t - 1, dtype=torch.long)
            r, out, _ = eng.verify(live, prop.block, ell, None)
            drf.append_context(live.context, out.features, r.accepted + 1)
            dt_old = (time.perf_counter() - t0) * 1000
            tgt.commit(zero); live.context.ctx_len = ctx_len.clone()
            # new
            pol = eng.policy; eng.policy = DraftEvery(t - 1)
            c = Clock(None); c.start()
            eng.round(live, gamma + 2, None, c); c.lap("commit")
            dt_new = sum(c.totals.values())
            rewind(); eng.policy = pol
            if i >= 4:
                old.append(dt_old); new.append(dt_new)
        print(R, t, f"old {st.median(old):.2f} ms  new {st.median(new):.2f} ms  new/old {st.median(new)/st.median(old):.3f}", flush=True)
