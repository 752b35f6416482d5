"""Remote inspect/download against a real HTTP server on 127.0.0.1 that answers like the hub's
`/{repo}/resolve/{revision}/{file}` endpoint (Range, ETag, X-Repo-Commit), counting bytes served."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from pathlib import Path

import pytest
from huggingface_hub import constants
from typer.testing import CliRunner

from dsparkctl.checkpoint import hub
from dsparkctl.checkpoint.fixtures import write_fixture
from dsparkctl.cli import console
from dsparkctl.cli.main import app

REPO = "deepseek-ai/DeepSeek-V4.1-Flash-mini"
COMMIT = "a" * 40


class FakeHub:
    """Serves `folder` as `repo` at revision main == COMMIT."""

    def __init__(self, folder: Path, repo: str = REPO):
        self.folder, self.served, self.requests = folder, 0, []
        hub_ = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool):
                hub_.requests.append((self.command, self.path, self.headers.get("Range")))
                m = re.fullmatch(rf"/{re.escape(repo)}/resolve/(main|{COMMIT})/(.+)", self.path.split("?")[0])
                if not m:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = hub_.folder / m.group(2)
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = path.read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                start, end, status = 0, len(data) - 1, 200
                rng = self.headers.get("Range")
                if rng:
                    a, b = re.fullmatch(r"bytes=(\d+)-(\d*)", rng).groups()
                    start, end, status = int(a), min(int(b) if b else len(data) - 1, len(data) - 1), 206
                chunk = data[start:end + 1]
                self.send_response(status)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(chunk)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.end_headers()
                if body:
                    self.wfile.write(chunk)
                    hub_.served += len(chunk)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file())


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    folder = write_fixture(tmp_path / "repo", "v4.1-flash")
    server = FakeHub(folder)
    monkeypatch.setenv("HF_ENDPOINT", server.url)  # dsparkctl reads it per call (huggingface_hub: at import)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    monkeypatch.setattr(console.err, "soft_wrap", True)
    yield server
    server.server.shutdown()


def test_remote_inspect_reads_only_headers(fake_hub: FakeHub):
    result = CliRunner().invoke(app, ["inspect", REPO, "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["layout"]["key"] == "v4.1-flash"
    assert report["revision"] == COMMIT
    assert report["draft"]["tensors"] == 241
    # what was served: config + index + (8 + header) per shard, nothing more
    folder = fake_hub.folder
    expected = (folder / "config.json").stat().st_size + (folder / "model.safetensors.index.json").stat().st_size
    for shard in sorted(folder.glob("model-*.safetensors")):
        raw = shard.read_bytes()
        expected += 8 + int.from_bytes(raw[:8], "little")
    assert fake_hub.served == expected == report["transferred_bytes"]
    total = fake_hub.total_bytes()
    print(f"\nremote inspect: served {fake_hub.served:,} of {total:,} bytes ({fake_hub.served / total:.1%})")
    assert all(r[0] == "GET" for r in fake_hub.requests)
    assert all(r[2] for r in fake_hub.requests if ".safetensors" in r[1] and "index" not in r[1])


def test_remote_inspect_human_table(fake_hub: FakeHub):
    result = CliRunner().invoke(app, ["inspect", REPO])
    assert result.exit_code == 0, result.stderr
    assert "draft-only download" in result.stdout and "read over the network" in result.stdout


def test_download_fetches_only_draft_shards(fake_hub: FakeHub, tmp_path: Path):
    dest = tmp_path / "dl"
    result = CliRunner().invoke(app, ["download", REPO, "--local-dir", str(dest), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    got = sorted(p.name for p in dest.glob("*.safetensors"))
    assert got == [f"model-0000{i}-of-00008.safetensors" for i in (5, 6, 7)]
    assert {s["file"] for s in doc["skipped"]} == {f"model-0000{i}-of-00008.safetensors" for i in (1, 2, 3, 4, 8)}
    assert (dest / "config.json").is_file() and (dest / "tokenizer_config.json").is_file()
    for f in got:
        assert (dest / f).read_bytes() == (fake_hub.folder / f).read_bytes()
    # a second run is a no-op thanks to hf_hub_download's local metadata (resumable / cached)
    before = fake_hub.served
    assert CliRunner().invoke(app, ["download", REPO, "--local-dir", str(dest)]).exit_code == 0
    assert fake_hub.served - before < 200_000  # headers again for planning, no shard bodies
    # and the download extracts
    out = tmp_path / "draft"
    assert CliRunner().invoke(app, ["extract", str(dest), str(out), "--verify"]).exit_code == 0
    assert (out / "model.safetensors.index.json").is_file()


def test_download_with_head_adds_head_shards(fake_hub: FakeHub, tmp_path: Path):
    res = hub.download(REPO, local_dir=tmp_path / "dl", with_head=True)
    names = {f for f, _ in res.fetched}
    assert "model-00001-of-00008.safetensors" in names  # embed
    assert "model-00004-of-00008.safetensors" in names  # head


def test_missing_repo_is_one_line_error(fake_hub: FakeHub):
    result = CliRunner().invoke(app, ["inspect", "nobody/nothing"])
    assert result.exit_code != 0
    assert len(result.stderr.strip().splitlines()) == 1 and "nobody/nothing" in result.stderr
