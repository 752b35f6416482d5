"""What a newcomer reads: every command's `--help` renders, a flag reads as a flag (`--json`, not
`--json <bool>`), a repeatable option shows one value's type and says how to repeat it, a
comma-separated option shows an example, and no help text cites an issue number.

In-process through typer's CliRunner (no model is loaded), at a wide terminal so that no phrase is
wrapped apart, and on the raw help strings as well."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from dsparkctl.cli.main import app

runner = CliRunner()
COMMANDS = sorted(typer.main.get_command(app).commands)  # hidden ones included
FORBIDDEN = [(re.compile(r"<bool>"), "a flag shown as taking a value"),
             (re.compile(r"list\["), "a Python list type"),
             (re.compile(r"\bissue\s*#?\d", re.I), "an issue number"),
             (re.compile(r"<\w+ range>"), "a Python range type")]


def render(argv: list[str]) -> str:
    res = runner.invoke(app, [*argv, "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert res.exit_code == 0, (argv, res.output, res.exception)
    assert "Usage:" in res.output, res.output
    return res.output


def command(name: str):
    return typer.main.get_command(app).commands[name]


def test_the_commands_are_all_here():
    assert {"generate", "eval-acceptance", "train", "served", "convert"} <= set(COMMANDS)


@pytest.mark.parametrize("argv", [[]] + [[c] for c in COMMANDS], ids=lambda a: " ".join(a) or "dsparkctl")
def test_help_renders_and_reads_as_plain_text(argv):
    text = render(argv)
    for pattern, what in FORBIDDEN:
        m = pattern.search(text)
        assert m is None, f"dsparkctl {' '.join(argv)} --help shows {what}: {text[max(0, m.start() - 80):m.end() + 40]!r}"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_strings(name):
    """The raw strings, wherever they wrap: no issue numbers; a repeatable option says how to repeat
    it; a comma-separated one shows an example (in its help or as its default)."""
    cmd = command(name)
    texts = [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]
    for t in texts:
        assert not re.search(r"\bissue\s*#?\d", t, re.I), (name, t)
    for p in cmd.params:
        if p.param_type_name != "option" or getattr(p, "hidden", False):
            continue
        help_text = p.help or ""
        if p.multiple:
            assert "repeat" in help_text.lower(), f"{name} {p.opts[0]}: say how to repeat it ({help_text!r})"
        if "comma-separated" in help_text.lower():
            example = f"{help_text} {p.default if isinstance(p.default, str) else ''}"
            assert re.search(r"\w,\w", example), f"{name} {p.opts[0]}: give an example ({help_text!r})"


@pytest.mark.parametrize("name", COMMANDS)
def test_flags_read_as_flags(name):
    """Each flag's row names the flag (and its --no- half) and then its help, no value between."""
    text = render([name])
    cmd = command(name)
    for p in cmd.params:
        if p.param_type_name == "option" and getattr(p, "is_flag", False) and not getattr(p, "hidden", False):
            row = next(line for line in text.splitlines()
                       if re.match(rf"^│\s*\*?\s*{re.escape(p.opts[0])}(?![\w-])", line))  # its own row
            between = row.split(p.opts[0], 1)[1]
            for no in p.secondary_opts:
                between = between.replace(no, "", 1)
            first_words = (p.help or "").split()[:2]
            assert re.match(r"^[\s│]*" + re.escape(" ".join(first_words)), between), (name, row)


def test_repeatable_options_show_one_value():
    """`--draft <str>` with its help saying how to repeat it; `--trace <path>` as a single path shows."""
    text = render(["eval-acceptance"])
    assert re.search(r"--draft\s+<str>\s+Draft model", text), text
    assert re.search(r"--trace\s+<path>", render(["sweep-scheduler"]))
    assert re.search(r"TRACES\.\.\.\s+<path>", render(["calibrate"]))


def test_usage_names_arguments_in_capitals():
    assert "dsparkctl extract [OPTIONS] {SOURCE} {OUT}" in render(["extract"])
    assert "[PROMPTS]..." in render(["generate"])


def test_the_top_level_help_defines_its_terms():
    text = render([])
    for term in ("γ =", "τ =", "SPS table ="):
        assert term in text, text
