"""Hostile round 5, `served`: each case a tester found wrong, now refused or read right. Real
servers on loopback (raw sockets where a well-behaved HTTP library would not misbehave), real
scrapes written by prometheus_client, offline documents damaged one field at a time."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.strict_json import loads
from tests.test_served import VllmServer, offline_doc, rounds, vllm_responses

runner = CliRunner()


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


class RawServer:
    """Answers every connection with `reply` (bytes), then closes: whatever a test needs a server to say."""

    def __init__(self, reply: bytes):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.reply, self.requests = reply, []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.requests.append(conn.recv(65536))
                conn.sendall(self.reply)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way, so the port stops listening
        except OSError:
            pass
        self.sock.close()


def one_line_error(r, *expect: str) -> None:
    assert r.exit_code not in (0, 1) and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "(fix: " in lines[0], r.stderr
    for e in expect:
        assert e in lines[0], (e, lines[0])


def http_reply(body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % n + body


def test_a_body_cut_short_of_its_length_and_a_reply_that_is_not_http_are_named(tmp_path):
    body = VllmServer().feed(rounds(300)).scrape(tmp_path / "m.txt").read_bytes()
    short = RawServer(http_reply(body[:-2], length=len(body)))  # the last digits lost: 1200 read as 120
    noise = RawServer(b"SSH-2.0-OpenSSH_9.6\r\n")
    try:
        one_line_error(runner.invoke(app, ["served", short.url + "/metrics"]), "cut short")
        one_line_error(runner.invoke(app, ["served", noise.url + "/metrics"]), "did not answer")
    finally:
        short.close()
        noise.close()


def test_credentials_and_query_values_never_leave_the_process(tmp_path):
    body = VllmServer().feed(rounds(300)).scrape(tmp_path / "m.txt").read_bytes()
    srv = RawServer(http_reply(body))
    port = srv.sock.getsockname()[1]
    out = tmp_path / "doc.json"
    try:
        url = srv.url.replace("http://", "http://alice:hunter2@") + "/metrics?token=SECRETTOKEN&x=1"
        r = runner.invoke(app, ["served", url, "--out", str(out), "--json"])
        assert r.exit_code == 0, r.output
        req = srv.requests[0]  # the server got both, the credentials as basic authentication ...
        assert b"GET /metrics?token=SECRETTOKEN&x=1" in req and b"Authorization: Basic YWxpY2U6aHVudGVyMg==" in req
        for text in (r.output, out.read_text()):  # ... nothing else did
            assert "SECRETTOKEN" not in text and "hunter2" not in text and "alice" not in text
        assert loads(r.stdout)["source"]["paths"] == [srv.url.replace("http://", "http://***@")
                                                      + "/metrics?token=***&x=***"]
    finally:
        srv.close()
    closed = f"http://bob:pa55word@127.0.0.1:{port}/metrics"  # nothing listens there now
    r = runner.invoke(app, ["served", closed])
    one_line_error(r, "did not answer")
    assert "pa55word" not in r.output and "bob" not in r.output


@pytest.mark.parametrize("url", ["http://[::1/metrics", "http://[bold]x[/]:1/metrics", "http://127.0.0.1:99x/m",
                                 "http://127.0.0.1:0/metrics", "http://host name/metrics", "http:///metrics"])
def test_a_malformed_url_is_named_before_anything_is_fetched(url):
    one_line_error(runner.invoke(app, ["served", url]), "not a valid URL")


def test_a_byte_order_mark_and_federated_series(tmp_path):
    resp = vllm_responses(tmp_path / "r.jsonl", rounds(200, seed=3))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + resp.read_bytes())
    a, b = (loads(runner.invoke(app, ["served", str(p), "--json"]).stdout) for p in (resp, bom))
    assert a["drafts"] == b["drafts"] == 200 and a["per_position"] == b["per_position"]
    # two instances of one model in a federated scrape: both counted, not the last one read
    text = VllmServer().feed(rounds(100, seed=4)).scrape(tmp_path / "one.txt").read_text()
    fed = []
    for line in text.splitlines():
        if line.startswith("vllm:") and "{" in line:
            fed += [line.replace("{", '{instance="a",', 1), line.replace("{", '{instance="b",', 1)]
        else:
            fed.append(line)
    (tmp_path / "fed.txt").write_text("\n".join(fed) + "\n")
    assert loads(runner.invoke(app, ["served", str(tmp_path / "fed.txt"), "--json"]).stdout)["drafts"] == 200
    twice = text.replace('position="0"', 'position="00"', 1) + \
        next(ln for ln in text.splitlines() if 'position="0"' in ln and ln.startswith("vllm:")) + "\n"
    (tmp_path / "twice.txt").write_text(twice)
    one_line_error(runner.invoke(app, ["served", str(tmp_path / "twice.txt")]), "position 0 twice")


def test_parity_does_not_call_unchecked_or_empty_or_contradictory_evidence_agreement(tmp_path):
    scrape = VllmServer().feed(rounds(3000, seed=5)).scrape(tmp_path / "m.txt")
    doc = json.loads(offline_doc(tmp_path / "off.json", rounds(3000, seed=6)).read_text())
    entry = doc["datasets"]["mt-bench"]["drafts"]["shipped"]
    path = tmp_path / "d.json"

    def run(mutate, *extra):
        d = json.loads(json.dumps(doc))
        mutate(d["datasets"]["mt-bench"]["drafts"]["shipped"])
        path.write_text(json.dumps(d))
        return runner.invoke(app, ["served", str(scrape), "--offline", str(path), *extra])

    r = run(lambda e: None, "--fail-on-mismatch")
    assert r.exit_code == 0, r.output
    # offline never reached position 5: that position cannot be checked, so the verdict is partial
    live = entry["live"]
    cut = {**live, "histogram": live["histogram"][:4] + [live["histogram"][4] + live["histogram"][5], 0],
           "reached": live["reached"][:4] + [0], "accepted_at": live["accepted_at"][:4] + [0]}
    cut["tokens"] = sum((1 + j) * c for j, c in enumerate(cut["histogram"]))
    cut["verified"] = min(live["verified"], cut["verified"])
    r = run(lambda e: e.update(live=cut), "--fail-on-mismatch", "--json")
    assert r.exit_code == 1, r.output
    par = loads(r.stdout)["parity"]
    assert par["verdict"] == "partial" and par["unchecked_positions"] == [5]
    empty = {**live, "rounds": 0, "tokens": 0, "verified": 0, "histogram": [0] * 6, "reached": [0] * 5,
             "accepted_at": [0] * 5}
    one_line_error(run(lambda e: e.update(live=empty)), "measured nothing")
    one_line_error(run(lambda e: e["live"].update(reached=[live["rounds"]] * 5, accepted_at=[live["rounds"]] * 5)),
                   "contradict")
    one_line_error(run(lambda e: e.update(block_size=7)), "block size 7")


def test_counts_that_no_run_of_drafts_could_produce_are_refused(tmp_path):
    """An SGLang response whose proposal lengths say no step proposed a second draft, while two
    accepted two; a vLLM scrape whose 100 drafts proposed 100 tokens (one each) while 20 accepted a
    second: both were read, position 2 printed as measured."""
    sg = tmp_path / "sg.jsonl"
    sg.write_text(json.dumps({"text": "x", "meta_info": {
        "spec_verify_ct": 10, "spec_num_correct_drafts": 7, "spec_num_proposed_drafts": 50,
        "spec_correct_drafts_histogram": [5, 3, 2], "spec_cap_lens_histogram": [0, 0, 10]}}) + "\n")
    one_line_error(runner.invoke(app, ["served", str(sg)]), "accepted position 2 but only 0 proposed it")
    text = VllmServer().feed([(1, 0)] * 60 + [(1, 1)] * 40).scrape(tmp_path / "m.txt").read_text()
    lines = text.splitlines()
    for i, ln in enumerate(lines):  # 20 of them "accepted" a second position no draft proposed
        if ln.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total") and 'position="1"' in ln:
            lines[i] = ln.rsplit(" ", 1)[0] + " 20.0"
        elif ln.startswith("vllm:spec_decode_num_accepted_tokens_total"):
            lines[i] = ln.rsplit(" ", 1)[0] + " 60.0"
    (tmp_path / "bad.txt").write_text("\n".join(lines) + "\n")
    one_line_error(runner.invoke(app, ["served", str(tmp_path / "bad.txt")]), "tokens accepted past position 1")
