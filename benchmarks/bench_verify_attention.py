"""A verify forward with transformers' SDPA (K/V repeated to every query head) and with dsparkctl's
folded attention (models/target_attention.py), alternated in one process on the embedded target
(256 cached tokens, one request): ms per forward at 1, 3 and 6 new tokens (medians), and the
largest difference of the logits.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/bench_verify_attention.py [--repeats 25]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.session import open_session
from dsparkctl.models.target_attention import NAME, fold_gqa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    sess = open_session(None, None, "cpu", "fp32", log=lambda m: None, cpu_kernels="auto")
    p = encode_prompts(sess.target.tokenizer, load_prompts("mt-bench", limit=4))[3]
    p = (p * (256 // len(p) + 1))[:256]
    ad, model = sess.adapter, sess.target.model
    assert fold_gqa(model), "the embedded target should take the folded attention"

    def forward(T: int, impl: str) -> tuple[float, torch.Tensor]:
        model.config._attn_implementation_internal = impl
        ids = torch.tensor([p[:T]])
        mark = ad.mark()
        t0 = time.perf_counter()
        out = ad.extend(ids, torch.tensor([T]))
        ad.commit(torch.tensor([T]))
        dt = time.perf_counter() - t0
        ad.rewind(mark)
        return dt, out.logits

    with torch.no_grad():
        ad.prefill([p])
        for T in (3, 6):
            diff = (forward(T, "sdpa")[1] - forward(T, NAME)[1]).abs().max()
            print(f"{T} tokens: largest logit difference {float(diff):.2e}")
        ms: dict[tuple[int, str], list[float]] = {}
        for _ in range(args.repeats):
            for T in (1, 3, 6):
                for impl in ("sdpa", NAME):
                    ms.setdefault((T, impl), []).append(1000 * forward(T, impl)[0])
    for (T, impl), v in ms.items():
        print(f"{T} token(s) {impl:15s} {statistics.median(v[3:]):6.2f} ms")


if __name__ == "__main__":
    main()
