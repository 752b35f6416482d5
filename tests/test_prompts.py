"""Prompt files are user input (issue 20, class 4): every way a file can fail to hold prompts is
one InputError line naming the file (exit 2 through the CLI), never an internal error; a
built-in set's name is never shadowed by a file of that name in the current folder."""

from __future__ import annotations

import gzip

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.data.prompts import load_conversations, load_prompts, prompt_texts
from dsparkctl.errors import InputError

CASES = [
    ("utf16.txt", "hello\nworld\n".encode("utf-16"), "is UTF-16, not UTF-8"),
    ("utf16.json", '["hello"]'.encode("utf-16"), "is UTF-16, not UTF-8"),
    ("random.txt", bytes(range(128, 256)), "not UTF-8 (byte 0x80 at offset 0)"),
    ("random.jsonl", b'{"prompt": "a"}\n\xff\xfe\x00', "not UTF-8"),
    ("random.json", b"\xc3\x28", "not UTF-8"),
    ("text.parquet", b"just some text\n", "not a parquet file"),
    ("fake.parquet", b"PAR1 but not really", "damaged parquet file"),
    ("data5.json", b'{"data": 5}', 'expected a list of prompts'),
    ("rows-str.json", b'{"rows": "abc"}', 'expected a list of prompts'),
    ("number.json", b"5", "expected a list of prompts"),
    ("surrogate.json", b'["ok", "bad \\udcff byte"]', "holds bytes that are not UTF-8"),
    ("surrogate.jsonl", b'{"prompt": "\\ud800"}\n', "holds bytes that are not UTF-8"),
    ("nul.txt", b"a\x00b\n", "holds a NUL character"),
    ("nan.jsonl", b'{"prompt": "a", "x": NaN}\n', "not valid JSON"),
    ("dup.json", b'[{"prompt": "a", "prompt": "b"}]', "not valid JSON (duplicate key"),
    ("deep.json", b"[" * 100000, "not valid JSON"),
    ("broken.jsonl.gz", b"not gzip", "not a readable gzip file"),
]


@pytest.mark.parametrize("name,content,message", CASES, ids=[c[0] for c in CASES])
def test_a_bad_prompt_file_is_one_input_error(tmp_path, name, content, message):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(InputError) as e:
        load_prompts(str(p))
    assert message in e.value.one_line() and "\n" not in e.value.one_line()


@pytest.mark.parametrize("name,content,message", CASES[:5] + CASES[10:11], ids=[c[0] for c in CASES[:5] + CASES[10:11]])
def test_through_the_cli_it_is_exit_2_and_one_line(tmp_path, monkeypatch, name, content, message):
    monkeypatch.setattr(console.err, "soft_wrap", True)
    p = tmp_path / name
    p.write_bytes(content)
    r = CliRunner().invoke(app, ["generate", "--prompts-file", str(p), "--target", str(tmp_path / "none")])
    assert r.exit_code == 2 and r.output.startswith("error:") and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and sorted(q.name for q in tmp_path.iterdir()) == [name]


def test_responses_files_are_read_the_same_way(tmp_path):
    p = tmp_path / "c.json"
    p.write_bytes('[{"q": "a", "r": "b"}]'.encode("utf-16"))
    with pytest.raises(InputError, match="UTF-16"):
        load_conversations(str(p), "q", "r")


def test_good_files_still_read(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufeffhéllo\nwörld\n".encode("utf-8"))
    assert load_prompts(str(tmp_path / "a.txt")) == ["héllo", "wörld"]
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as fh:
        fh.write('{"prompt": "x"}\n')
    assert load_prompts(str(tmp_path / "b.jsonl.gz")) == ["x"]
    (tmp_path / "c.json").write_text('{"data": [{"prompt": "y"}]}')
    assert load_prompts(str(tmp_path / "c.json")) == ["y"]


def test_an_argument_prompt_with_undecodable_bytes_is_refused():
    with pytest.raises(InputError, match="prompt argument 2: the prompt holds bytes that are not UTF-8"):
        prompt_texts(["fine", "bad \udcff"], None, None, None, None, "x")


@pytest.mark.parametrize("name", ["humaneval", "mt-bench"])
def test_a_file_named_like_a_builtin_set_does_not_shadow_it(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text("not a prompt set\n")
    assert len(load_prompts(name, limit=3)) == 3  # the built-in set
    with pytest.raises(InputError, match="unsupported prompt file type"):
        load_prompts(f"./{name}")  # the local file, spelled as a path
