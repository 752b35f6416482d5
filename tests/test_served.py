"""`dsparkctl served` (issue 27): served acceptance read from Prometheus scrapes (written here with
prometheus_client under vLLM's metric names and labels), vLLM's per-request metrics and SGLang's
meta_info, each fed rounds whose true counts we know; the parity verdict; planning from served
acceptance; and bad input (one line, exit != 0, nothing written). The same files made by the
engines' own classes are checked in benchmarks/interop_check.sh."""

from __future__ import annotations

import http.server
import json
import random
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.formats.sps import save_sps_table
from dsparkctl.math.sps import SPSTable
from dsparkctl.math.stats import AcceptanceStats
from dsparkctl.strict_json import loads
from tests.helpers import snapshot

runner = CliRunner()
K = 5
TRUE = [0.6, 0.5, 0.45, 0.4, 0.35]


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


def rounds(n: int, conds=TRUE, lengths=(K,), seed: int = 0) -> list[tuple[int, int]]:
    """(drafted, accepted) per step: position k accepted with probability conds[k-1] given 1..k-1."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ell = lengths[i % len(lengths)]
        a = 0
        while a < ell and rng.random() < conds[a]:
            a += 1
        out.append((ell, a))
    return out


def truth(steps) -> AcceptanceStats:
    s = AcceptanceStats(block_size=K)
    s.add_rounds([e for e, _ in steps], [a for _, a in steps])
    return s


class VllmServer:
    """vLLM's counters (names, labels, 0-based positions) in a registry of their own."""

    def __init__(self, model: str = "m", engines: int = 1):
        self.reg = CollectorRegistry()
        lab = ["model_name", "engine"]
        mk = lambda name: Counter(name, "", lab, registry=self.reg)  # noqa: E731
        self.drafts, self.tokens, self.acc = (mk("vllm:spec_decode_num_drafts"), mk("vllm:spec_decode_num_draft_tokens"),
                                              mk("vllm:spec_decode_num_accepted_tokens"))
        self.pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "", lab + ["position"], registry=self.reg)
        self.model, self.engines = model, engines
        for e in range(engines):  # vLLM creates every series up front
            for c in (self.drafts, self.tokens, self.acc):
                c.labels(model, str(e))
            for p in range(K):
                self.pos.labels(model, str(e), str(p))

    def feed(self, steps) -> "VllmServer":
        for i, (ell, a) in enumerate(steps):
            e = str(i % self.engines)
            self.drafts.labels(self.model, e).inc()
            self.tokens.labels(self.model, e).inc(ell)
            self.acc.labels(self.model, e).inc(a)
            for p in range(a):
                self.pos.labels(self.model, e, str(p)).inc()
        return self

    def scrape(self, path: Path) -> Path:
        path.write_bytes(generate_latest(self.reg))
        return path


def vllm_responses(path: Path, steps, per_request: int = 50, detailed: bool = True, model: str = "m") -> Path:
    with open(path, "w") as fh:
        for i in range(0, len(steps), per_request):
            part = steps[i:i + per_request]
            hist = [0] * (K + 1)
            for _, a in part:
                hist[a] += 1
            sd = {"mean_acceptance_length": 1 + sum(a for _, a in part) / len(part), "draft_acceptance_rate": 0.5,
                  "acceptance_histogram": hist, "num_spec_steps": len(part),
                  "num_accepted_draft_tokens": sum(a for _, a in part), "num_draft_tokens": sum(e for e, _ in part),
                  "num_spec_tokens": K}
            if detailed:
                sd |= {"per_step_accepted": [a for _, a in part], "per_step_drafted": [e for e, _ in part]}
            fh.write(json.dumps({"id": f"c{i}", "object": "chat.completion", "model": model, "choices": [],
                                 "metrics": {"speculative_decoding": sd}}) + "\n")
    return path


def sglang_responses(path: Path, steps, per_request: int = 50, ragged: bool = True) -> Path:
    with open(path, "w") as fh:
        for i in range(0, len(steps), per_request):
            part = steps[i:i + per_request]
            hist, caps = [0] * (K + 1), [0] * (K + 2)
            for e, a in part:
                hist[a] += 1
                caps[e + 1] += 1
            while hist[-1] == 0:  # SGLang's lists grow only as far as a count was seen
                hist.pop()
            meta = {"spec_verify_ct": len(part), "spec_num_correct_drafts": sum(a for _, a in part),
                    "spec_num_proposed_drafts": len(part) * K, "spec_accept_length": 1.5, "spec_accept_rate": 0.3,
                    "spec_correct_drafts_histogram": hist, "completion_tokens": 1 + sum(1 + a for _, a in part)}
            if ragged:
                meta["spec_cap_lens_histogram"] = caps
            fh.write(json.dumps({"text": "x", "meta_info": meta}) + "\n")
    return path


def served(*args: str) -> dict:
    r = runner.invoke(app, ["served", *args, "--json"])
    assert r.exit_code == 0, r.output
    return loads(r.stdout)


def assert_exact(doc: dict, t: AcceptanceStats) -> None:
    assert [p["accepted"] for p in doc["per_position"]] == t.accepted_at
    for p, c in zip(doc["per_position"], t.conditional()):
        assert p["identified"] and p["conditional"] == pytest.approx(c, abs=1e-12)
    assert doc["tau"] == pytest.approx(t.tau)


# ---- sources ---------------------------------------------------------------------------------

def test_scrape_full_length_gives_exact_conditionals(tmp_path):
    steps = rounds(4000)
    doc = served(str(VllmServer(engines=2).feed(steps).scrape(tmp_path / "m.txt")))
    t = truth(steps)
    assert doc["engine"] == "vllm" and doc["lengths"] == "fixed" and doc["drafts"] == 4000
    assert_exact(doc, t)
    # under full-length drafts vLLM's documented rate IS the survival
    for p, s in zip(doc["per_position"], t.survival()):
        assert p["accepted_share"] == pytest.approx(s) and p["survival"] == pytest.approx(s)
    lo, hi = doc["tau_interval"]
    assert lo < t.tau < hi


def test_scrape_of_mixed_lengths_bounds_what_it_cannot_identify(tmp_path):
    steps = rounds(6000, lengths=(5, 2, 3, 1))
    doc = served(str(VllmServer().feed(steps).scrape(tmp_path / "m.txt")))
    t = truth(steps)
    assert doc["lengths"] == "mixed"
    first, *later = doc["per_position"]
    assert first["identified"] and first["conditional"] == pytest.approx(t.conditional()[0])
    for p, c in zip(later, t.conditional()[1:]):
        assert not p["identified"] and p["conditional"] is None  # never called conditional
        lo, hi = p["conditional_bounds"]
        assert lo <= c <= hi
        # vLLM's documented per-position rate is far from the conditional here
        assert p["accepted_share"] < 0.8 * c
    assert any("mixed" in n for n in doc["notes"])


def test_vllm_detailed_responses_are_exact_under_mixed_lengths(tmp_path):
    steps = rounds(3000, lengths=(5, 2, 3, 1), seed=4)
    doc = served(str(vllm_responses(tmp_path / "r.jsonl", steps)))
    assert doc["lengths"] == "per-step" and doc["requests"] == 60
    assert_exact(doc, truth(steps))
    summary = served(str(vllm_responses(tmp_path / "s.jsonl", steps, detailed=False)))
    assert summary["lengths"] == "mixed" and not summary["per_position"][1]["identified"]


def test_sglang_meta_info(tmp_path):
    steps = rounds(3000, seed=5)
    static = served(str(sglang_responses(tmp_path / "static.jsonl", steps, ragged=False)))
    assert static["engine"] == "sglang" and static["lengths"] == "fixed"
    assert_exact(static, truth(steps))
    mixed_steps = rounds(3000, lengths=(5, 2, 0, 3), seed=6)  # SGLang counts verify steps with no draft too
    doc = served(str(sglang_responses(tmp_path / "ragged.jsonl", mixed_steps)))
    t = truth([s for s in mixed_steps if s[0] > 0] + [s for s in mixed_steps if s[0] == 0])
    assert doc["draft_tokens"] == sum(e for e, _ in mixed_steps)
    assert doc["per_position"][0]["identified"]  # tested = steps that drafted ≥ 1, known from the windows
    assert doc["per_position"][0]["conditional"] == pytest.approx(t.conditional()[0])
    for p, c in zip(doc["per_position"][1:], t.conditional()[1:]):
        assert p["conditional_bounds"][0] <= c <= p["conditional_bounds"][1]


def test_two_scrapes_give_the_window_between_them(tmp_path):
    early, late = rounds(1000, seed=1), rounds(2000, seed=2)
    srv = VllmServer().feed(early)
    a = srv.scrape(tmp_path / "a.txt")
    b = srv.feed(late).scrape(tmp_path / "b.txt")
    doc = served(str(a), str(b))
    assert doc["source"]["kind"] == "prometheus-window" and doc["drafts"] == 2000
    assert_exact(doc, truth(late))
    # a window may start before the first request (counters at zero), but not end there
    fresh = VllmServer()
    zero = fresh.scrape(tmp_path / "zero.txt")
    assert served(str(zero), str(fresh.feed(early).scrape(tmp_path / "c.txt")))["drafts"] == 1000
    r = runner.invoke(app, ["served", str(zero)])
    assert r.exit_code != 0 and "no drafted steps" in r.stderr


def test_metrics_url_on_loopback(tmp_path):
    body = generate_latest(VllmServer().feed(rounds(500)).reg)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            if self.path == "/metrics":
                self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        doc = served(url + "/metrics")
        assert doc["drafts"] == 500 and doc["source"]["paths"] == [url + "/metrics"]
        r = runner.invoke(app, ["served", url + "/nope"])
        assert r.exit_code != 0 and "HTTP 404" in r.stderr
    finally:
        server.shutdown()


def test_a_server_that_trickles_or_stalls_is_given_up_on_within_the_deadline(monkeypatch):
    """The per-read socket timeout never fires for a server that sends a byte now and then: the
    whole fetch has one deadline, and the message says so."""
    import time

    from dsparkctl.serving import served as srv

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _ in range(60):  # a byte every 0.1 s: each read is quick, the whole is not
                self.wfile.write(b"#")
                self.wfile.flush()
                time.sleep(0.1)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(srv, "URL_TIMEOUT_S", 1.0)
    try:
        t = time.monotonic()
        r = runner.invoke(app, ["served", f"http://127.0.0.1:{server.server_address[1]}/metrics"])
        assert time.monotonic() - t < 4
        assert r.exit_code != 0 and "did not finish answering within 1 s" in r.stderr and not r.stdout
    finally:
        server.shutdown()


def test_evidence_given_twice_is_refused_and_a_window_without_creation_times_says_so(tmp_path):
    srv = VllmServer().feed(rounds(300, seed=40))
    a = srv.scrape(tmp_path / "a.txt")
    copy = tmp_path / "copy.txt"
    copy.write_bytes(a.read_bytes())
    for args, expect in (([a, a], "given twice"), ([a, tmp_path / "." / "a.txt"], "given twice"),
                         ([a, copy], "the same evidence twice")):
        r = runner.invoke(app, ["served", *map(str, args)])
        assert r.exit_code != 0 and expect in r.stderr and "Traceback" not in r.output, (args, r.output)
    resp = vllm_responses(tmp_path / "r.jsonl", rounds(100, seed=41))
    r = runner.invoke(app, ["served", str(resp), str(resp)])
    assert r.exit_code != 0 and "given twice" in r.stderr
    b = srv.feed(rounds(300, seed=42)).scrape(tmp_path / "b.txt")
    strip = lambda p: "".join(ln for ln in p.read_text().splitlines(True) if "_created" not in ln)  # noqa: E731
    (tmp_path / "a0.txt").write_text(strip(a))
    (tmp_path / "b0.txt").write_text(strip(b))
    doc = served(str(tmp_path / "a0.txt"), str(tmp_path / "b0.txt"))
    assert doc["drafts"] == 300 and any("no creation times" in n for n in doc["notes"])
    assert not any("no creation times" in n for n in served(str(a), str(b))["notes"])
    # a restart the process start time shows, where no `_created` series does
    (tmp_path / "a1.txt").write_text(strip(a) + "process_start_time_seconds 100.0\n")
    (tmp_path / "b1.txt").write_text(strip(b) + "process_start_time_seconds 200.0\n")
    r = runner.invoke(app, ["served", str(tmp_path / "a1.txt"), str(tmp_path / "b1.txt")])
    assert r.exit_code != 0 and "restarted" in r.stderr, r.output


# ---- the parity verdict ----------------------------------------------------------------------

def offline_doc(path: Path, steps, temperature: float = 0.0) -> Path:
    doc = {"format": "dsparkctl-eval-acceptance/1", "mode": "live", "temperature": temperature,
           "datasets": {"mt-bench": {"prompts": 80, "drafts": {"shipped": {
               "source": "x", "kind": "dspark", "block_size": K, "live": truth(steps).to_json()}}}}}
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("case,conds,first_cause", [
    ("agree", TRUE, None),
    ("position 1", [0.35, 0.5, 0.45, 0.4, 0.35], "template"),
    ("later positions", [0.6, 0.2, 0.15, 0.1, 0.1], "markov"),
    ("later fall much further than position 1", [0.45, 0.1, 0.1, 0.1, 0.1], "markov"),
    ("one factor", [c * 0.55 for c in TRUE], "sampling"),
    ("not running", [0.01, 0.0, 0.0, 0.0, 0.0], "not-running"),
])
def test_verdict(tmp_path, case, conds, first_cause):
    off = offline_doc(tmp_path / "off.json", rounds(4000, seed=10))
    scrape = VllmServer().feed(rounds(4000, conds, seed=11)).scrape(tmp_path / "m.txt")
    par = served(str(scrape), "--offline", str(off))["parity"]
    if first_cause is None:
        assert par["verdict"] == "agree" and not par["causes"]
        assert all(r["agree"] for r in par["positions"])
    else:
        assert par["verdict"] != "agree" and par["causes"][0]["cause"] == first_cause
    r = runner.invoke(app, ["served", str(scrape), "--offline", str(off), "--fail-on-mismatch"])
    assert (r.exit_code == 0) == (first_cause is None)


def test_verdict_from_a_trace_and_a_mixed_scrape(tmp_path):
    from dsparkctl.formats.trace import TraceRound, TraceWriter

    with TraceWriter(tmp_path / "t.jsonl", {"block_size": K, "temperature": 0.0, "draft": "d"}) as w:
        w.write(TraceRound(request=i // 10, round=i % 10, block_size=K, confidence_logits=None, verify_length=e,
                           accepted=a, batch_tokens=6, draft_ms=1.0, verify_ms=2.0)
                for i, (e, a) in enumerate(rounds(3000, seed=20)))
    scrape = VllmServer().feed(rounds(4000, lengths=(5, 3), seed=21)).scrape(tmp_path / "m.txt")
    par = served(str(scrape), "--offline", str(tmp_path / "t.jsonl"))["parity"]
    assert par["offline"]["measure"] == "live (trace)"
    assert par["verdict"] == "agree"  # bounded positions agree where the truth lies within them
    assert not par["positions"][1]["served_identified"]


def test_parity_compares_the_draft_alone_and_refuses_what_cannot_be_compared(tmp_path):
    """The engine's counters are the draft's alone: an offline document whose live figures pool the
    draft with context lookup (written before they were kept apart) is refused; one that keeps the
    copies apart is compared by the draft's own figures. A damaged document is named, not compared;
    an engine drafting more positions than offline measured is not an agreement."""
    scrape = VllmServer().feed(rounds(4000, seed=31)).scrape(tmp_path / "m.txt")
    doc = json.loads(offline_doc(tmp_path / "off.json", rounds(4000, seed=30)).read_text())
    entry = doc["datasets"]["mt-bench"]["drafts"]["shipped"]

    def run_with(d, *extra):
        (tmp_path / "d.json").write_text(json.dumps(d))
        return runner.invoke(app, ["served", str(scrape), "--offline", str(tmp_path / "d.json"), "--json", *extra])

    pooled = {**doc, "lookup": True}
    r = run_with(pooled)
    assert r.exit_code != 0 and "pools the draft's rounds with context lookup" in r.stderr and not r.stdout
    apart = {**pooled, "datasets": {"mt-bench": {"prompts": 80, "drafts": {"shipped": {
        **entry, "live": {**entry["live"], "lookup": {"rounds_looked_up": 9, "copies": None, "engine_tau": 3.0}}}}}}}
    r = run_with(apart)
    assert r.exit_code == 0, r.output
    assert loads(r.stdout)["parity"]["verdict"] == "agree"
    tf = {"block_size": K, "anchors": 10, "tau": 2.0, "tau_interval": [1.8, 2.2],
          "conditional": [0.6, 0.5, 0.45, 0.4, 0.35], "conditional_interval": [[0.5, 0.7]] * K}
    for bad in ({"conditional": [1.5, 0.5, 0.45, 0.4, 0.35]}, {"conditional": [0.6] * 3},
                {"conditional_interval": [[0.7, 0.5]] * K}, {"tau": float("nan")}, {"block_size": "5"}):
        d = {**doc, "mode": "teacher-forced", "datasets": {"mt-bench": {"drafts": {"shipped": {
            "block_size": K, "teacher_forced": {**tf, **bad}}}}}}
        (tmp_path / "d.json").write_text(json.dumps(d, allow_nan=True))
        r = runner.invoke(app, ["served", str(scrape), "--offline", str(tmp_path / "d.json")])
        assert r.exit_code != 0 and "Traceback" not in r.output, (bad, r.output)
        assert ("damaged" in r.stderr or "NaN" in r.stderr or "strict" in r.stderr.lower()), (bad, r.stderr)
    broken = json.loads(json.dumps(doc))
    broken["datasets"]["mt-bench"]["drafts"]["shipped"]["live"]["accepted_at"][0] += 10 ** 6  # c1 > 1
    r = run_with(broken)
    assert r.exit_code != 0 and "contradict" in r.stderr, r.output
    s3 = AcceptanceStats(block_size=3)
    short = rounds(4000, seed=30, lengths=(3,))
    s3.add_rounds([e for e, _ in short], [a for _, a in short])
    fewer = json.loads(json.dumps(doc))
    fewer["datasets"]["mt-bench"]["drafts"]["shipped"].update(block_size=3, live=s3.to_json())
    par = loads(run_with(fewer).stdout)["parity"]
    assert par["verdict"] == "disagree" and par["causes"][0]["cause"] == "block-size"


# ---- planning from served acceptance ---------------------------------------------------------

def test_sweep_and_serve_config_from_served(tmp_path):
    sps = tmp_path / "sps.json"
    save_sps_table(SPSTable([1, 4, 16, 64, 256, 1024], [50.0, 45.0, 35.0, 20.0, 8.0, 2.5]), sps)
    steps = rounds(3000)
    doc_path = tmp_path / "served.json"
    served(str(VllmServer().feed(steps).scrape(tmp_path / "m.txt")), "--out", str(doc_path))
    r = runner.invoke(app, ["sweep-scheduler", "--served", str(doc_path), "--sps-table", str(sps),
                            "--concurrency", "1,64", "--json"])
    assert r.exit_code == 0, r.output
    sweep = loads(r.stdout)
    assert sweep["acceptance_source"]["kind"] == "served"
    assert sweep["policies"] == [f"static:{k}" for k in range(K + 1)]
    tau5 = next(x["tokens_per_step"] for x in sweep["rows"] if x["policy"] == "static:5" and x["concurrency"] == 1)
    assert tau5 == pytest.approx(truth(steps).tau, abs=0.03)
    # counts that only bound a conditional are refused for planning
    mixed = tmp_path / "mixed.json"
    served(str(VllmServer().feed(rounds(3000, lengths=(5, 2))).scrape(tmp_path / "x.txt")), "--out", str(mixed))
    r = runner.invoke(app, ["sweep-scheduler", "--served", str(mixed), "--sps-table", str(sps)])
    assert r.exit_code != 0 and "only bounded" in r.stderr
    r = runner.invoke(app, ["serve-config", "--served", str(doc_path)])
    assert r.exit_code != 0 and "--sps-table" in r.stderr


# ---- bad input -------------------------------------------------------------------------------

def _bad_cases(d: Path) -> dict[str, tuple[list[str], str]]:
    steps = rounds(800)
    srv = VllmServer().feed(steps)
    good = srv.scrape(d / "good.txt")
    text = good.read_text()
    restarted = VllmServer().feed(rounds(100)).scrape(d / "restarted.txt")
    (d / "nospec.txt").write_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 0\n")
    (d / "gap.txt").write_text("\n".join(l for l in text.splitlines() if 'position="2"' not in l) + "\n")
    (d / "nan.txt").write_text(text.replace('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 800.0',
                                            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} NaN'))
    (d / "neg.txt").write_text(text.replace('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 800.0',
                                            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} -3.0'))
    (d / "garbage.txt").write_text("this is { not prometheus\n")
    (d / "nopos.txt").write_text("\n".join(l for l in text.splitlines() if "per_pos" not in l) + "\n")
    vllm_responses(d / "v.jsonl", steps)
    sglang_responses(d / "s.jsonl", steps)
    (d / "both.jsonl").write_text((d / "v.jsonl").read_text() + (d / "s.jsonl").read_text())
    other = vllm_responses(d / "other.jsonl", steps[:100], model="other")
    (d / "models.jsonl").write_text((d / "v.jsonl").read_text() + other.read_text())
    (d / "plain.jsonl").write_text(json.dumps({"id": "x", "choices": [], "model": "m"}) + "\n")
    (d / "sps.json").write_text(json.dumps({"format": "dsparkctl-sps/1", "batch_tokens": [1, 2],
                                            "steps_per_sec": [1.0, 1.0]}))
    (d / "edited.jsonl").write_text((d / "v.jsonl").read_text().replace('"num_spec_steps": 50', '"num_spec_steps": 51', 1))
    offline_doc(d / "off.json", steps)
    return {
        "counters backwards (restart)": ([str(good), str(restarted)], "went backwards"),
        "scrapes in the wrong order": ([str(restarted), str(good)], "went backwards"),
        "no speculative metrics": ([str(d / "nospec.txt")], "no speculative-decoding metrics"),
        "per-position gap": ([str(d / "gap.txt")], "gaps"),
        "per-position series missing": ([str(d / "nopos.txt")], "is missing"),
        "NaN counter": ([str(d / "nan.txt")], "whole numbers"),
        "negative counter": ([str(d / "neg.txt")], "whole numbers"),
        "not prometheus": ([str(d / "garbage.txt")], "not Prometheus"),
        "two engines' responses": ([str(d / "both.jsonl")], "cannot be pooled"),
        "another model's responses": ([str(d / "models.jsonl")], "from model 'other'"),
        "responses without metrics": ([str(d / "plain.jsonl")], "no response carries"),
        "edited response": ([str(d / "edited.jsonl")], "disagrees"),
        "scrape and responses": ([str(good), str(d / "v.jsonl")], "cannot be pooled"),
        "missing file": ([str(d / "nope.txt")], "does not exist"),
        "url not answering": (["http://127.0.0.1:9/metrics"], "did not answer"),
        "offline not ours": ([str(good), "--offline", str(good)], "not valid JSON"),
        "offline of another kind": ([str(good), "--offline", str(d / "v.jsonl")], "not valid JSON"),
        "offline not an evaluation": ([str(good), "--offline", str(d / "sps.json")], "neither an eval-acceptance"),
        "offline options without offline": ([str(good), "--offline-dataset", "mt-bench"], "--offline"),
        "offline dataset not there": ([str(good), "--offline", str(d / "off.json"), "--offline-dataset", "nope"],
                                      "no dataset 'nope'"),
        "offline measure unknown": ([str(good), "--offline", str(d / "off.json"), "--offline-measure", "x"],
                                    "live or teacher-forced"),
        "out is an input": ([str(good), "--out", str(good)], "one of the inputs"),
        "three scrapes": ([str(good), str(good), str(good)], "3 scrapes"),
    }


def test_bad_input_one_line_nonzero_nothing_written(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    cases = _bad_cases(d)
    out = tmp_path / "out" / "served.json"
    out.parent.mkdir()
    before = snapshot(d, out.parent)
    for name, (args, expect) in cases.items():
        r = runner.invoke(app, ["served", *args] + ([] if "--out" in args else ["--out", str(out)]))
        assert r.exit_code != 0, name
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], (name, r.stderr)
        assert "Traceback" not in r.output
        assert snapshot(d, out.parent) == before, name


def test_reached_bounds_always_hold_the_truth():
    """Property: for any mix of draft lengths, the bounds from totals contain the true tested counts,
    and collapse to them when every draft has full length or per-length counts are known exactly."""
    from dsparkctl.math.stats import reached_bounds

    rng = random.Random(3)
    for _ in range(300):
        lengths = [rng.randint(1, K) for _ in range(rng.randint(1, 4))]
        steps = rounds(rng.randint(1, 300), [rng.random() for _ in range(K)], lengths, seed=rng.randint(0, 10 ** 6))
        t = truth(steps)
        D, T = len(steps), sum(e for e, _ in steps)
        L = [sum(1 for e, _ in steps if e >= k) for k in range(1, K + 1)]
        for known in (None, [D] + [None] * (K - 1), L):
            for (lo, hi), n in zip(reached_bounds(t.accepted_at, D, known, T), t.reached):
                assert lo <= n <= hi
        if T == K * D:
            assert [lo for lo, _ in reached_bounds(t.accepted_at, D, None, T)] == t.reached
