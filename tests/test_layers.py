"""The package keeps its shape (issue 26): the commands on one floor (dsparkctl/app), the library
below it in the layers pyproject.toml's import contract names, and the figures that say whether a
newcomer can follow the code, read from source by benchmarks/code_shape.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import code_shape  # noqa: E402


def test_the_import_contract_holds():
    """pyproject.toml's layers, checked by import-linter (a dev dependency `make setup` installs)."""
    r = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                        "lint_imports_command(['--no-cache', '--no-logo'])"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_no_import_cycles_even_through_deferred_imports():
    graph, _ = code_shape.import_graph(ROOT)
    assert code_shape.cycles(graph) == []


def test_imports_are_at_the_top_of_library_modules():
    _, deferred = code_shape.import_graph(ROOT)
    assert len(deferred) <= 10, deferred


def test_modules_and_functions_stay_readable():
    sizes = code_shape.module_lengths(ROOT)
    assert sizes[0][1] <= 400, sizes[:3]
    longs = code_shape.long_functions(ROOT)
    assert len(longs) <= 3, longs


def test_every_command_has_its_own_module_on_the_command_floor():
    from typer.main import get_command

    from dsparkctl.cli.main import app

    names = set(get_command(app).commands)
    modules = {p.stem for p in (ROOT / "dsparkctl" / "app").glob("*.py")}
    assert {n.replace("-", "_") for n in names} <= modules, sorted(names)
