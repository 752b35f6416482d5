"""The docs match the CLI and stand on their own.

1. Every command's synopsis lists exactly the flags its `--help` shows.

   Convention: each command has ONE doc page (`DOC_PAGE` below). Its synopsis is the first
   ```-fenced block of that page holding a line that starts with `dsparkctl <command>` (followed
   by a space or the end of the line; example blocks start with `$ dsparkctl` and never count).
   The synopsis is every such line of that block plus the indented continuation lines after it,
   so one block may hold the synopses of several commands (one line each, or more for a command
   with several forms). A trailing ` # comment` is ignored. Each `--flag` written there (both
   halves of `--chat/--no-chat`) must be an option of the command, and each option the
   command's `--help` shows (hidden options excepted, `--help` itself excepted) must be there.
   A command registered without a page in `DOC_PAGE` fails, so a new command needs a synopsis.
   Beyond the synopses, every `dsparkctl <command>` line in any doc's fenced blocks may pass only
   flags that command has.

2. No doc cites a repository path that does not exist (`cited_paths` says what is checked), so
   nothing the docs point at lives outside the repository.

Only the typer app is imported: no model, no torch work; the whole file runs in about a second.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# command -> the doc page (relative to the repository root) holding its synopsis
DOC_PAGE: dict[str, str] = {
    "inspect": "docs/checkpoint.md",
    "download": "docs/checkpoint.md",
    "extract": "docs/checkpoint.md",
    "convert": "docs/checkpoint.md",
    "dev-fixture": "docs/checkpoint.md",
    "generate": "docs/generate.md",
    "profile-sps": "docs/generate.md",
    "eval-acceptance": "docs/eval.md",
    "calibrate": "docs/scheduling.md",
    "sweep-scheduler": "docs/scheduling.md",
    "audit": "docs/scheduling.md",
    "serve-config": "docs/serving.md",
    "served": "docs/serving.md",
    "train": "docs/train.md",
}

FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


# ---------------------------------------------------------------------------------------------
# 1. synopses


@pytest.fixture(scope="module")
def commands() -> dict:
    """The registered click commands of the real typer app, by name (hidden ones included)."""
    import typer

    from dsparkctl.cli.main import app

    return dict(typer.main.get_command(app).commands)


def help_flags(command) -> set[str]:
    """The flags `dsparkctl <command> --help` lists: every non-hidden option's spellings. (Typer
    ships its own copy of click, so options are told by `param_type_name`, not by class.)"""
    flags: set[str] = set()
    for param in command.params:
        if param.param_type_name == "option" and not getattr(param, "hidden", False):
            flags.update(param.opts)
            flags.update(param.secondary_opts)
    flags.discard("--help")
    return flags


def fenced_blocks(text: str) -> list[list[str]]:
    """The lines inside each ```- (or ~~~-) fenced block, in document order."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    fence = ""
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            m = re.match(r"(`{3,}|~{3,})", stripped)
            if m:
                current, fence = [], m.group(1)
        elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            blocks.append(current)
            current = None
        else:
            current.append(line)
    return blocks


def synopsis(command: str, text: str) -> list[str] | None:
    """The synopsis lines of `command` in a page's text (see the module docstring), or None."""
    head = re.compile(rf"dsparkctl {re.escape(command)}(\s|$)")
    for block in fenced_blocks(text):
        lines: list[str] = []
        taking = False
        for line in block:
            if head.match(line):
                taking = True
                lines.append(line)
            elif taking and line[:1].isspace() and line.strip():
                lines.append(line)
            else:
                taking = False
        if lines:
            return lines
    return None


def synopsis_flags(lines: list[str]) -> set[str]:
    return {flag for line in lines for flag in FLAG.findall(re.sub(r"\s#.*", "", line))}


def test_every_command_has_a_doc_page(commands):
    registered, documented = set(commands), set(DOC_PAGE)
    assert registered == documented, (
        f"commands without a doc page in DOC_PAGE: {sorted(registered - documented)}; "
        f"DOC_PAGE names commands that do not exist: {sorted(documented - registered)}")


@pytest.mark.parametrize("name", sorted(DOC_PAGE))
def test_synopsis_flags_match_help(name, commands):
    if name not in commands:
        pytest.fail(f"`dsparkctl {name}` is not a registered command; update DOC_PAGE")
    page = DOC_PAGE[name]
    lines = synopsis(name, (ROOT / page).read_text(encoding="utf-8"))
    assert lines is not None, (f"{page} has no synopsis for `dsparkctl {name}`: add a ```-fenced block "
                               f"with a line starting `dsparkctl {name}` listing its flags")
    expected, written = help_flags(commands[name]), synopsis_flags(lines)
    missing, extra = sorted(expected - written), sorted(written - expected)
    assert not missing and not extra, (
        f"{page}: the synopsis of `dsparkctl {name}` disagrees with its --help.\n"
        f"  missing from the synopsis: {missing}\n"
        f"  in the synopsis but not an option: {extra}\n"
        "synopsis:\n" + "\n".join(lines))


def test_doc_examples_pass_only_real_flags(commands):
    """Every `dsparkctl <command> ...` line in a fenced block of any doc (an example, a synopsis,
    `$ dsparkctl ...`, `torchrun ... -m dsparkctl ...`) passes only flags the command has."""
    invocation = re.compile(r"(?:^|\s)dsparkctl ([a-z][a-z-]*)(.*)")
    wrong = []
    for doc in DOCS:
        for block in fenced_blocks(doc.read_text(encoding="utf-8")):
            for line in "\n".join(block).replace("\\\n", " ").splitlines():
                m = invocation.search(line)
                if not m or m.group(1) not in commands:
                    continue
                args = re.split(r"\s(?:\||&&|;|>)\s", re.sub(r"\s#.*", "", m.group(2)))[0]
                unknown = set(FLAG.findall(args)) - help_flags(commands[m.group(1)]) - {"--help"}
                if unknown:
                    wrong.append(f"{doc.relative_to(ROOT)}: `dsparkctl {m.group(1)}` has no {sorted(unknown)}: "
                                 f"{line.strip()}")
    assert not wrong, "doc examples pass flags the command does not have:\n  " + "\n  ".join(wrong)


def test_synopsis_parser():
    text = ("intro\n```\n$ dsparkctl demo --not-this\n```\n"
            "```bash\ndsparkctl other --x\ndsparkctl demo ARG [--a A] [--b/--no-b]  # --c is a comment\n"
            "               [--d]\nnot a continuation --e\ndsparkctl demo ARG --f   # second form\n```\n"
            "```\ndsparkctl demo --later-block\n```\n")
    lines = synopsis("demo", text)
    assert synopsis_flags(lines) == {"--a", "--b", "--no-b", "--d", "--f"}
    assert synopsis("dem", text) is None


# ---------------------------------------------------------------------------------------------
# 2. cited paths

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "recipes" / "README.md"]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
# top-level folders of the repository: a path starting with one of them is a repository path
REPO_DIRS = ("docs", "benchmarks", "recipes", "dsparkctl", "tests", "scripts", ".ci")
EXT = r"(?:md|py|sh|json|jsonl|toml|png|txt|pt|safetensors|csv)"
PATH_CHARS = r"[\w.{}*,-]"
# a file name with an extension (optionally `a.json|png` for two files), or a path under a
# repository folder without one; never the tail of a longer token, an absolute path or a URL
FILE_REF = re.compile(rf"(?<![\w./{{}}~$-])((?:\.\./)*{PATH_CHARS}+(?:/{PATH_CHARS}+)*\.{EXT}(?:\|{EXT})*)(?![\w/])")
DIR_REF = re.compile(rf"(?<![\w./{{}}~$-])((?:(?:\.\./)+|(?:{'|'.join(map(re.escape, REPO_DIRS))})/)(?:{PATH_CHARS}+/?)*)")
MODULE_REF = re.compile(r"(?<![\w.])dsparkctl(?:\.[A-Za-z_]\w*)+")


def expand(ref: str) -> list[str]:
    """`a/{b,c}.py` -> a/b.py, a/c.py; `x{1..3}.png` -> x1.png, x2.png, x3.png;
    `a.json|png` -> a.json, a.png."""
    m = re.search(r"\{([^{}]*)\}", ref)
    if m:
        span = re.fullmatch(r"(\d+)\.\.(\d+)", m.group(1))
        alternatives = ([str(i) for i in range(int(span.group(1)), int(span.group(2)) + 1)] if span
                        else m.group(1).split(","))
        return [p for alt in alternatives for p in expand(ref[:m.start()] + alt + ref[m.end():])]
    if "|" in ref:
        first, *exts = ref.split("|")
        stem = first.rsplit(".", 1)[0]
        return [first, *(f"{stem}.{ext}" for ext in exts)]
    return [ref]


def subpackages() -> set[str]:
    return {p.parent.name for p in (ROOT / "dsparkctl").glob("*/__init__.py")}


def cited_paths(text: str) -> list[str]:
    """The repository paths a doc cites, as written (expanded). Checked:
    - paths under a top-level folder of the repository (`docs/…`, `benchmarks/…`, `dsparkctl/…`,
      …), with or without an extension;
    - paths inside the package written from it (`engine/decode.py`, `train/loss.py`: their first
      folder is a subpackage of dsparkctl);
    - `*.md` file names, and files or folders (`../x/`) starting with `../` (they must not leave
      the repository; `../../etc/passwd`, an example of a hostile input, is no citation).
    Not checked: other bare names (`calib.json`, `serve.sh`: files a user makes), paths a user
    creates (`drafts/stage5`), `~/…` and `$VAR/…`, absolute paths, URLs, and other projects'
    files (`srt/models/dspark.py`)."""
    found: list[str] = []
    packages = subpackages()
    files = list(FILE_REF.finditer(text))
    starts = {m.start() for m in files}
    for m in [*files, *(m for m in DIR_REF.finditer(text) if m.start() not in starts)]:
        for ref in expand(m.group(1).rstrip(".,")):
            first = ref.split("/", 1)[0]
            if ref.startswith("../"):  # a file or a folder (`../x/`); not `../../etc/passwd`, a hostile input
                if m.re is FILE_REF or ref.endswith("/"):
                    found.append(ref)
            elif (first in REPO_DIRS and "/" in ref) or ref.endswith(".md") or (first in packages and "/" in ref):
                found.append(ref)
    return found


def exists(ref: str, doc: Path) -> bool:
    """Whether `ref` names something in the repository, from the root or from the doc's folder
    (a package-relative path also from dsparkctl/)."""
    bases = [ROOT, doc.parent]
    if ref.split("/", 1)[0] in subpackages():
        bases.append(ROOT / "dsparkctl")
    for base in bases:
        for hit in glob.glob(str(base / ref)):
            if Path(hit).resolve().is_relative_to(ROOT):
                return True
    return False


def module_exists(dotted: str) -> bool:
    """`dsparkctl.a.b.name`: all parts but at most the last one must be modules or packages."""
    parts = dotted.split(".")
    depth = 1
    for i in range(2, len(parts) + 1):
        path = ROOT.joinpath(*parts[:i])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            depth = i
        else:
            break
    return depth >= len(parts) - 1


DESIGN = sorted((ROOT / "docs" / "design").glob("*.md")) + [ROOT / "CHANGELOG.md"]


def doc_texts() -> list[tuple[Path, str]]:
    """Every page a reader follows a path from: the user docs, the contributors' pages, the recipes' comments."""
    texts = [(doc, doc.read_text(encoding="utf-8")) for doc in [*DOCS, *DESIGN] if doc.is_file()]
    for recipe in RECIPES:  # a recipe's comments are its documentation
        lines = recipe.read_text(encoding="utf-8").splitlines()
        texts.append((recipe, "\n".join(line[line.index("#"):] for line in lines if "#" in line)))
    return texts


def test_docs_cite_only_paths_the_repository_has():
    missing = []
    for doc, text in doc_texts():
        for ref in cited_paths(text):
            if not exists(ref, doc):
                missing.append(f"{doc.relative_to(ROOT)}: {ref}")
        for dotted in MODULE_REF.findall(text):
            if not module_exists(dotted):
                missing.append(f"{doc.relative_to(ROOT)}: {dotted} (no such module)")
    assert not missing, "docs cite paths that are not in the repository:\n  " + "\n  ".join(sorted(set(missing)))


def test_cited_paths_extraction():
    package = sorted(subpackages())[0]
    module = f"{package}/{sorted((ROOT / 'dsparkctl' / package).glob('*.py'))[0].name}"  # e.g. engine/decode.py
    text = ("See `../shared/reference/DSPARK.md`, [the page](docs/eval.md), DSPARK.md and "
            "`dsparkctl/math/{sps,audit}.py`, `benchmarks/results/a_{1..2}.json|png`, "
            f"`{module}`, the folder `docs/`, and write `calib.json`, `drafts/stage5`, "
            "`~/.cache/dsparkctl/x.json`, /tmp/fx/model.safetensors, https://example.org/README.md, "
            "`srt/models/dspark.py`, `../seeds/`, a hub id `../../etc/passwd`.")
    assert cited_paths(text) == [
        "../shared/reference/DSPARK.md", "docs/eval.md", "DSPARK.md", "dsparkctl/math/sps.py",
        "dsparkctl/math/audit.py", "benchmarks/results/a_1.json", "benchmarks/results/a_1.png",
        "benchmarks/results/a_2.json", "benchmarks/results/a_2.png", module, "docs/", "../seeds/"]
    doc = ROOT / "docs" / "x.md"
    assert not exists("../shared/reference/DSPARK.md", doc)  # outside the repository, even where it exists
    assert not exists("DSPARK.md", doc)
    assert exists("docs/eval.md", doc) and exists("eval.md", doc) and exists(module, doc)
    assert module_exists("dsparkctl.errors.option") and not module_exists("dsparkctl.no_such.thing")
