"""Code-completion prompts from Python's own standard library, as a prompts file (issue 29).

Every prompt is one public function's signature and docstring with its body left out, the way a
user asks a model to write a function. The shipped draft trained on ShareGPT chats only; this is
a second task family for its data (the standard library is under the PSF license). Functions are
read with `ast` (nothing is imported or run), sorted by module and line, de-duplicated, and
shuffled with a fixed seed, so the same Python version writes the same file.

    .venv/bin/python benchmarks/code_prompts.py --out recipes/data/stdlib-functions.jsonl [--limit 1024]
    .venv/bin/python benchmarks/code_prompts.py --offset 1024 --limit 64 --out unseen-code.jsonl  # prompts no stage trained on
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import textwrap
from pathlib import Path

from dsparkctl.files.atomic import atomic_open, cannot_write_file

SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
             "dist-packages", "__pycache__", "pydoc_data", "venv"}


def function_prompts(root: Path, min_doc: int = 40, max_doc: int = 900, max_lines: int = 40) -> list[str]:
    """Signature-and-docstring snippets of the public functions and methods under `root`."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]) or path.name.startswith("test_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or not min_doc <= len(doc.strip()) <= max_doc or len(node.body) < 2:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            end = node.body[0].end_lineno  # the docstring's last line
            if end is None or end - first > max_lines:
                continue
            out.append(textwrap.dedent("\n".join(lines[first:end])).rstrip() + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=1024)
    ap.add_argument("--offset", type=int, default=0, help="skip this many (in the seeded order) first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = list(dict.fromkeys(function_prompts(root)))
    random.Random(args.seed).shuffle(prompts)
    if args.offset < 0 or args.limit < 1:
        ap.error("--offset must be >= 0 and --limit >= 1")
    if why := cannot_write_file(args.out):
        ap.error(f"--out {args.out}: {why}")
    picked = prompts[args.offset: args.offset + args.limit]
    with atomic_open(args.out) as fh:  # whole or not at all
        fh.write("".join(json.dumps({"prompt": p}) + "\n" for p in picked))
    print(f"wrote {len(picked)} of {len(prompts)} function prompts from {root} to {args.out}")


if __name__ == "__main__":
    main()
