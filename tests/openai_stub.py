"""A small OpenAI-compatible server on loopback that batches like an engine: one engine thread steps
every in-flight request together (a step of B verified tokens takes `base_ms + per_token_ms · B`),
each step streams one chunk per request, and /metrics exports vLLM's counters (written by
prometheus_client). `mode` makes it misbehave the ways real servers do."""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, generate_latest


class StubEngine:
    def __init__(self, k: int = 0, accept: int = 0, base_ms: float = 4.0, per_token_ms: float = 0.5,
                 mode: str = "ok", model: str = "stub", metrics: bool = True, other_traffic: int = 0,
                 version: str = "stub-1", max_model_len: int | None = None):
        self.k, self.accept, self.base_ms, self.per_token_ms = k, accept, base_ms, per_token_ms
        self.mode, self.model, self.metrics = mode, model, metrics
        self.other_traffic = other_traffic  # tokens another client generates between two scrapes
        self.version, self.max_model_len = version, max_model_len
        self.lock = threading.Lock()
        self.active: list[dict] = []
        self.served = 0
        self.reg = CollectorRegistry()
        lab = ["model_name", "engine"]
        self.gen = Counter("vllm:generation_tokens", "", lab, registry=self.reg)
        self.gen.labels(model, "0")
        if k:
            mk = lambda n: Counter(n, "", lab, registry=self.reg)  # noqa: E731
            self.drafts, self.dtok, self.acc = (mk("vllm:spec_decode_num_drafts"),
                                                mk("vllm:spec_decode_num_draft_tokens"),
                                                mk("vllm:spec_decode_num_accepted_tokens"))
            self.pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "", lab + ["position"], registry=self.reg)
            for c in (self.drafts, self.dtok, self.acc):
                c.labels(model, "0")
            for p in range(k):
                self.pos.labels(model, "0", str(p))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.running = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        threading.Thread(target=self._engine, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.running = False
        self.httpd.shutdown()
        self.httpd.server_close()

    def _engine(self) -> None:
        while self.running:
            with self.lock:
                batch = list(self.active)
            if not batch:
                time.sleep(0.0005)
                continue
            B = sum(1 + self.k for _ in batch)
            time.sleep((self.base_ms + self.per_token_ms * B) / 1000)
            with self.lock:
                for r in batch:
                    n = min(1 + self.accept, r["left"])
                    r["left"] -= n
                    self.gen.labels(self.model, "0").inc(n)
                    if self.k:
                        self.drafts.labels(self.model, "0").inc()
                        self.dtok.labels(self.model, "0").inc(self.k)
                        self.acc.labels(self.model, "0").inc(n - 1)
                        for p in range(n - 1):
                            self.pos.labels(self.model, "0", str(p)).inc()
                    r["q"].put(n)
                    if r["left"] == 0:
                        self.active.remove(r)
                        r["q"].put(None)

    def _handler(self):
        eng = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _json(self, obj, status=200):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if eng.mode == "html":
                    body = b"<html><body>a web page</body></html>"
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/v1/models":
                    entry = {"id": eng.model, "object": "model"}
                    if eng.max_model_len is not None:
                        entry["max_model_len"] = eng.max_model_len
                    self._json({"object": "list", "data": [entry]})
                elif self.path == "/version":
                    self._json({"version": eng.version})
                elif self.path == "/metrics" and eng.metrics:
                    eng.gen.labels(eng.model, "0").inc(eng.other_traffic)
                    body = generate_latest(eng.reg)
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self._json({"detail": "Not Found"}, 404)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions" or eng.mode == "html":
                    return self._json({"detail": "Not Found"}, 404)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                q: queue.Queue = queue.Queue()
                with eng.lock:
                    eng.served += 1
                    nth = eng.served
                    eng.active.append({"left": req["max_tokens"], "q": q})
                sent, held = 0, 0
                while (n := q.get()) is not None:
                    sent += 1
                    if eng.mode == "coalesce" and sent % 2:  # two steps' tokens in one chunk, as a busy frontend sends them
                        held = n
                        continue
                    n, held = n + held, 0
                    if eng.mode == "drop" and nth >= 2 and sent == 3:
                        self.connection.shutdown(2)
                        return
                    if eng.mode == "stall" and sent == 3:
                        time.sleep(5)
                        return
                    if eng.mode == "error" and nth >= 2 and sent == 3:
                        self.wfile.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                        self.wfile.flush()
                        return
                    choice = {"index": 0, "text": "x" * n, "finish_reason": None}
                    if req.get("return_token_ids"):
                        choice["token_ids"] = [7] * n
                    chunk = {"id": "c", "object": "text_completion", "model": eng.model, "choices": [choice]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                if held:
                    self.wfile.write(b"data: " + json.dumps({"id": "c", "object": "text_completion", "model": eng.model,
                                     "choices": [{"index": 0, "text": "x" * held, "token_ids": [7] * held}]}).encode()
                                     + b"\n\n")
                if eng.mode != "no-usage":
                    usage = {"id": "c", "object": "text_completion", "model": eng.model, "choices": [],
                             "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": req["max_tokens"],
                                       "total_tokens": len(req["prompt"]) + req["max_tokens"]}}
                    self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        return Handler
