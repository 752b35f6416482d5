"""`profile-sps --server`: a batching OpenAI-compatible server on loopback (tests/openai_stub.py),
profiled through the CLI; the table it writes read back by the planners; each way a server fails
gives one line and writes nothing."""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from dsparkctl.app.profile_server import ServerProfileSpec, run_profile_server
from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.errors import InputError
from dsparkctl.formats.sps import load_sps_table
from tests.openai_stub import StubEngine

runner = CliRunner()
FAST = ["--requests", "1,2,4", "--repeats", "2", "--warmup", "1", "--output-tokens", "16", "--context-len", "8"]


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


@pytest.fixture
def stub(request):
    engines = []

    def make(**kw) -> StubEngine:
        engines.append(StubEngine(**kw))
        return engines[-1]
    yield make
    for e in engines:
        e.close()


def one_line_error(r, *expect: str) -> None:
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error:") and "(fix: " in lines[-1], r.stderr
    for e in expect:
        assert e in lines[-1], (e, lines[-1])


def test_a_plain_server_gives_one_token_per_request_and_step_times_that_grow_with_the_batch(stub, tmp_path):
    eng = stub(base_ms=6.0, per_token_ms=1.5)
    out = tmp_path / "srv.json"
    r = runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(out), "--json", *FAST])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [p["requests"] for p in doc["points"]] == [1, 2, 4]
    assert all(p["kind"] == "plain" and p["batch_tokens"] == p["requests"] and p["tokens_per_step"] == 1.0
               and p["drafted_share"] == 0.0 for p in doc["points"])
    assert doc["batch_tokens"] == [1, 2, 4]
    for p in doc["points"]:  # the stub's step is 6 + 1.5·B ms; a loaded machine only adds time
        assert 6.0 + 1.5 * p["requests"] <= p["step_ms"] < 1000, p
    table = load_sps_table(out)
    assert table.meta["measures"] == "served-step" and table.meta["servers"][0]["version"] == "stub-1"
    assert table.meta["servers"][0]["speculative"] is None
    assert load_sps_table(tmp_path / "srv.sglang.json").steps_per_sec == table.steps_per_sec
    assert (tmp_path / "srv.png").stat().st_size > 0


def test_a_speculating_server_is_priced_by_the_tokens_it_verified_and_pools_with_a_plain_one(stub, tmp_path):
    spec, plain = stub(k=5, accept=1), stub()  # five drafts per step: the shipped draft's block size
    out = tmp_path / "pooled.json"
    r = runner.invoke(app, ["profile-sps", "--server", spec.url, "--server", plain.url, "--out", str(out), "--json",
                            *FAST])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    drafted = [p for p in doc["points"] if p["kind"] == "drafted"]
    assert [p["requests"] for p in drafted] == [1, 2, 4]
    for p in drafted:  # every step verifies 1 + 5 tokens per request and emits 2 of them
        assert p["batch_tokens"] == pytest.approx(6 * p["requests"], rel=0.02)
        assert p["tokens_per_step"] == pytest.approx(2.0, rel=0.02) and p["drafted_share"] == pytest.approx(1.0, rel=0.02)
    assert doc["batch_tokens"] == [1, 2, 4, 6, 12, 24]  # plain B = R, drafted B = 6R: one table
    assert doc["servers"][0]["speculative"] == {"positions": 5}
    # the planners read it like any other table
    served = tmp_path / "served.json"
    spec_metrics = spec.url + "/metrics"
    assert runner.invoke(app, ["served", spec_metrics, "--out", str(served)]).exit_code == 0
    s = runner.invoke(app, ["sweep-scheduler", "--served", str(served), "--sps-table", str(out), "--json"])
    assert s.exit_code == 0, s.output
    sweep = json.loads(s.stdout)
    assert sweep["cost_source"]["kind"] == "server" and sweep["cost_source"]["server"] == spec.url
    assert sweep["vllm_length_table"][0][0] == 1 and all(0 <= k <= 5 for _, _, k in sweep["vllm_length_table"])
    assert any("step costs measured on the running server" in n for n in sweep["notes"])
    c = runner.invoke(app, ["serve-config", "--served", str(served), "--sps-table", str(out), "--json",
                            "--export-full-vocab", str(tmp_path / "full")])
    assert c.exit_code == 0, c.output
    notes = json.loads(c.stdout)["notes"]
    assert any("planned from served acceptance" in n for n in notes), notes
    assert any("step costs measured on the running server " + spec.url in n for n in notes), notes


def test_context_lengths_each_get_a_table(stub, tmp_path):
    eng = stub()
    r = runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(tmp_path / "c.json"), "--json",
                            "--requests", "1,2", "--repeats", "1", "--warmup", "0", "--output-tokens", "12",
                            "--context-len", "8,32"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [b["context_len"] for b in doc["by_context"]] == [8, 32]
    assert load_sps_table(tmp_path / "c.json").meta["by_context"][1]["batch_tokens"] == [1, 2]


def _closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("mode, expect", [
    ("html", "/v1/models did not answer JSON"),
    ("drop", "dropped the connection mid-stream"),
    ("no-usage", "streamed without usage"),
    ("error", "reported an error mid-stream: engine died"),
])
def test_a_server_that_misbehaves_gives_one_line_and_no_table(stub, tmp_path, mode, expect):
    eng = stub(mode=mode)
    r = runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(tmp_path / "t.json"), *FAST])
    one_line_error(r, expect)
    assert list(tmp_path.iterdir()) == []


def test_a_url_that_does_not_answer_and_bad_options_fail_before_any_load(stub, tmp_path):
    one_line_error(runner.invoke(app, ["profile-sps", "--server", _closed_port(), "--out", str(tmp_path / "t.json")]),
                   "did not answer")
    eng = stub()
    cases = [(["--server", "ftp://x"], "not an http(s) URL"), (["--server", eng.url, "--draft", "x"], "--draft"),
             (["--server", eng.url, "--requests", "4000"], "concurrent"),
             (["--server", eng.url, "--time-limit", "nan"], "--time-limit"),
             (["--server", eng.url, "--output-tokens", "2"], "--output-tokens"),
             (["--server", eng.url, "--model", "other"], "does not serve model 'other'"),
             (["--model", "m"], "--model is for --server")]
    for args, expect in cases:
        one_line_error(runner.invoke(app, ["profile-sps", "--out", str(tmp_path / "t.json"), *args]), expect)
    assert eng.served == 0 and list(tmp_path.iterdir()) == []


def test_a_grid_too_large_for_the_time_limit_is_stopped_with_nothing_written(stub, tmp_path):
    eng = stub(base_ms=20.0)
    r = runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(tmp_path / "t.json"), "--time-limit", "1",
                            "--requests", "1,2,4,8,16", "--repeats", "5", "--output-tokens", "32", "--context-len", "8"])
    one_line_error(r, "over --time-limit 1 s")
    assert eng.served < 5 + 1 and list(tmp_path.iterdir()) == []


def test_a_server_that_stalls_is_given_up_on(stub, tmp_path):
    eng = stub(mode="stall")
    spec = ServerProfileSpec(servers=(eng.url,), out=tmp_path / "t.json", requests=(1,), context_lens=(8,),
                             output_tokens=16, repeats=1, warmup=0, stall_s=0.5)
    with pytest.raises(InputError, match="stalled"):
        run_profile_server(spec)
    assert list(tmp_path.iterdir()) == []


def test_context_buckets_split_the_served_acceptance_and_the_plan(stub, tmp_path):
    """Short prompts accept far more than long ones here; each context's length table is planned
    from its own costs and its own bucket's acceptance, and the notes say no engine reads it yet."""
    from tests.test_served import rounds, vllm_responses

    short = vllm_responses(tmp_path / "s.jsonl", rounds(400, conds=[0.9] * 5, seed=1), per_request=50)
    long = vllm_responses(tmp_path / "l.jsonl", rounds(400, conds=[0.2] * 5, seed=2), per_request=50)
    both = tmp_path / "responses.jsonl"
    with open(both, "w") as fh:
        for path, n in ((short, 20), (long, 900)):
            for line in path.read_text().splitlines():
                fh.write(json.dumps({**json.loads(line), "usage": {"prompt_tokens": n, "completion_tokens": 50}}) + "\n")
    served = tmp_path / "served.json"
    r = runner.invoke(app, ["served", str(both), "--context-buckets", "100", "--out", str(served), "--json"])
    assert r.exit_code == 0, r.output
    buckets = json.loads(r.stdout)["by_context"]
    assert [b["prompt_tokens"] for b in buckets] == [[1, 100], [101, None]] and [b["responses"] for b in buckets] == [8, 8]
    assert buckets[0]["per_position"][0]["conditional"] > 0.8 > 0.3 > buckets[1]["per_position"][0]["conditional"]
    eng = stub()
    table = tmp_path / "t.json"
    assert runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(table), "--requests", "1,2",
                               "--repeats", "1", "--warmup", "0", "--output-tokens", "12",
                               "--context-len", "8,500"]).exit_code == 0
    s = runner.invoke(app, ["sweep-scheduler", "--served", str(served), "--sps-table", str(table), "--json",
                            "--concurrency", "1,2"])
    assert s.exit_code == 0, s.output
    plans = json.loads(s.stdout)["by_context"]
    assert [(p["context_len"], p["acceptance_prompt_tokens"]) for p in plans] == [(8, [1, 100]), (500, [101, None])]
    assert plans[0]["vllm_length_table"][0][2] >= plans[1]["vllm_length_table"][0][2]  # more accepted: verify more
    assert any("no engine reads a per-context table" in n for n in json.loads(s.stdout)["notes"])
    one_line_error(runner.invoke(app, ["served", eng.url + "/metrics", "--context-buckets", "100"]),
                   "context buckets need response files")


def test_a_server_someone_else_is_using_is_refused(stub, tmp_path):
    eng = stub(k=3, accept=1, other_traffic=7)
    r = runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(tmp_path / "t.json"), *FAST])
    one_line_error(r, "another client used it")
    assert list(tmp_path.iterdir()) == []


def test_chunks_that_group_several_steps_are_counted_by_their_tokens(stub, tmp_path):
    """A busy frontend may send two steps' tokens in one chunk: the step time comes from the tokens
    the chunks hold (vLLM's token_ids), not from the gaps between chunks, which would read double."""
    eng = stub(base_ms=20.0, per_token_ms=0.0, mode="coalesce")
    r = runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(tmp_path / "t.json"), "--json",
                            "--requests", "1,2", "--repeats", "1", "--warmup", "0", "--output-tokens", "24",
                            "--context-len", "8"])
    assert r.exit_code == 0, r.output
    for p in json.loads(r.stdout)["points"]:
        assert p["kind"] == "plain" and 20.0 <= p["step_ms"] < 32.0, p  # 40 ms if each chunk were a step


def test_servers_that_cannot_be_pooled_or_take_the_request_are_refused_before_any_round(stub, tmp_path):
    a, b = stub(), stub(model="other")
    short = stub(max_model_len=64)
    port = a.url.rsplit(":", 1)[1]
    cases = [([a.url, b.url], "serve different models"),
             ([a.url, a.url + "/"], "names one server twice"),
             ([a.url, f"http://localhost:{port}/v1"], "names one server twice"),
             ([short.url], "takes at most 64 tokens per request")]
    for urls, expect in cases:
        args = [x for u in urls for x in ("--server", u)]
        one_line_error(runner.invoke(app, ["profile-sps", *args, "--out", str(tmp_path / "t.json"), "--requests", "1",
                                           "--context-len", "60", "--output-tokens", "16"]), expect)
    assert a.served == b.served == short.served == 0 and list(tmp_path.iterdir()) == []


def test_text_a_server_sends_is_shown_without_its_control_characters(stub, tmp_path):
    eng = stub(version="1.0\x1b[31m[bold]red")
    r = runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(tmp_path / "t.json"), *FAST])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "1.0\\x1b[31m[bold]red" in r.stdout


def test_the_time_limit_cuts_a_round_short(stub, tmp_path):
    """A round of a slow server is not waited for: the limit stops it mid-round, nothing written."""
    import time
    eng = stub(base_ms=300.0)  # 40 tokens: a 12-second round
    start = time.monotonic()
    r = runner.invoke(app, ["profile-sps", "--server", eng.url, "--out", str(tmp_path / "t.json"), "--time-limit", "2",
                            "--requests", "1", "--repeats", "1", "--warmup", "0", "--output-tokens", "40",
                            "--context-len", "8"])
    one_line_error(r, "ran past its --time-limit")
    assert time.monotonic() - start < 8 and list(tmp_path.iterdir()) == []


def test_ctrl_c_mid_round_stops_at_once_and_writes_nothing(stub, tmp_path):
    import signal
    import subprocess
    import sys
    import time
    eng = stub(base_ms=300.0)
    proc = subprocess.Popen([sys.executable, "-m", "dsparkctl", "profile-sps", "--server", eng.url, "--out",
                             str(tmp_path / "t.json"), "--requests", "1", "--repeats", "1", "--warmup", "0",
                             "--output-tokens", "60", "--context-len", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while eng.served == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - sent < 5, (proc.returncode, err)
    assert list(tmp_path.iterdir()) == []


def test_a_counter_that_is_not_a_number_is_named():
    from dsparkctl.formats.served_scrape import engine_totals
    text = '# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{model_name="m"} NaN\n'
    with pytest.raises(InputError, match="not a finite count"):
        engine_totals(text, "scrape", "m")
