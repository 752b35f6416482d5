"""How fast is one training step, against what this machine's GEMMs allow? (issue 29)

A training step of the shipped draft's shape (batch_sequences × anchors_per_sequence blocks over
contexts of --context positions, random features and targets: the step's arithmetic does not
depend on the values) is timed forward + backward + AdamW, in fp32 and under bf16 autocast.
Its matrix FLOPs are counted by torch's FlopCounterMode (forward and backward); the GEMM rate is
measured on the step's own matmul shapes (each shape timed alone, weighted by its FLOPs), so
"achieved / GEMM rate" says how much of the step is arithmetic at the speed this CPU does it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_train_step.py [--threads 1] [--repeats 10]
        [--batch-sequences 4] [--anchors 16] [--context 300] [--out benchmarks/results/train_step.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py
from torch.utils.flop_counter import FlopCounterMode

from dsparkctl.files.atomic import write_json
from dsparkctl.models.draft_io import load_draft
from dsparkctl.models.loading import load_target
from dsparkctl.models.target import TargetAdapter
from dsparkctl.train.batches import Batch
from dsparkctl.train.trainer import batch_loss, trainable


def random_batch(draft, B: int, N: int, S: int, k: int, gen: torch.Generator) -> Batch:
    g, F_ = draft.block_size, draft.fc.weight.shape[1]
    K = draft.cfg.output_vocab_size
    a_pos = torch.sort(torch.randperm(S - g - 1, generator=gen)[:N] + 1).values.expand(B, N).contiguous()
    toks = torch.randint(0, draft.cfg.vocab_size, (B, N, g + 1), generator=gen)
    p = torch.softmax(torch.randn(B, N, g, k, generator=gen), -1)
    return Batch(features=torch.randn(B, S, F_, generator=gen), anchor_ids=toks[:, :, 0], anchor_pos=a_pos,
                 prev_tokens=toks[:, :, :g], target_idx=torch.randint(0, K, (B, N, g), generator=gen),
                 topk_idx=torch.randint(0, K, (B, N, g, k), generator=gen), topk_p=p,
                 valid=torch.ones(B, N, g, dtype=torch.bool))


def mm_shapes(fn) -> tuple[int, Counter]:
    """FLOPs of fn() and the (M, K, N) shapes of its matrix products (forward and backward)."""
    shapes: Counter = Counter()
    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                a, b = (args[1], args[2]) if func is torch.ops.aten.addmm.default else (args[0], args[1])
                shapes[(a.shape[0], a.shape[1], b.shape[1])] += 1
            elif func is torch.ops.aten.bmm.default:
                a, b = args[0], args[1]
                shapes[(a.shape[0] * a.shape[1], a.shape[2], b.shape[2])] += 1
            return func(*args, **(kwargs or {}))
    with FlopCounterMode(display=False) as fc, Spy():
        fn()
    return fc.get_total_flops(), shapes


def gemm_rate(shapes: Counter, dtype: torch.dtype, reps: int = 5) -> float:
    """FLOP-weighted GFLOP/s of plain matmuls of these shapes in `dtype` (each timed alone)."""
    flops = secs = 0.0
    for (M, K, N), count in shapes.items():
        a, b = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
        a @ b
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        dt = (time.perf_counter() - t) / reps
        flops += 2 * M * K * N * count
        secs += dt * count
    return flops / secs / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="dsparkctl/assets/drafts/smollm2-135m-dspark")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batch-sequences", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--context", type=int, default=300, help="positions of context per sequence")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lt = load_target(None, torch.device("cpu"), torch.float32, log=lambda m: None)
    for p in lt.model.parameters():
        p.requires_grad_(False)
    draft = load_draft(args.draft, TargetAdapter(lt.model), dtype=torch.float32, device="cpu")
    params = list(trainable(draft).values())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(draft, args.batch_sequences, args.anchors, args.context, 32, gen)
    rows = []
    for precision in ("fp32", "bf16"):
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext

        def step():
            with ctx():
                loss = batch_loss(draft, batch, (0.1, 0.9, 1.0)).total
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        flops, shapes = mm_shapes(step)
        for _ in range(2):
            step()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        rate = gemm_rate(shapes, dtype)
        blocks = args.batch_sequences * args.anchors
        rows.append({"precision": precision, "step_s": round(med, 4), "blocks_per_s": round(blocks / med, 1),
                     "matmul_gflop": round(flops / 1e9, 2), "achieved_gflops": round(flops / med / 1e9, 1),
                     "gemm_rate_gflops": round(rate, 1), "share_of_gemm_rate": round(flops / med / 1e9 / rate, 3)})
        print(rows[-1], flush=True)
    doc = {"benchmark": "bench_train_step", "args": {k: str(v) for k, v in vars(args).items()},
           "rows": rows, **provenance_of(__file__)}
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
