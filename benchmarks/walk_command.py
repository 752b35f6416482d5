"""Walk one command from option to result: which dsparkctl modules it enters, in order, how often a
call climbs back up a layer, and how many times each check runs (issue 26's walk, measured).

    python benchmarks/walk_command.py [--json] -- generate --prompt hi --max-new-tokens 4 --policy static:2

Runs the command in this process under `sys.setprofile` and records every call into dsparkctl code
(the command's own output is printed as usual, before the walk). A check is a function whose name
starts with `check_` or is one of EXTRA_CHECKS, counted per value checked where it is a plain value; a climb is a call from a module into a module on a
higher layer of pyproject.toml's import contract (a callback handed down, such as a progress bar).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport dsparkctl depends on there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
EXTRA_CHECKS = {"local_inputs", "settle_kernels", "plan_policy", "load_recipe", "read_latest", "check_outputs"}


def layers() -> list[list[str]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = cfg["tool"]["importlinter"]["contracts"][0]
    return [[m.strip() for m in layer.split("|")] for layer in contract["layers"]]


def layer_of(module: str, table: list[list[str]]) -> int | None:
    for i, layer in enumerate(table):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    return None


def _first_arg(frame) -> str:
    """The value a check was given (its first argument, when plain), so the same check of two
    different values counts apart."""
    code = frame.f_code
    if not code.co_argcount:
        return ""
    first = code.co_varnames[0]
    if first == "self" and code.co_argcount > 1:
        first = code.co_varnames[1]
    v = frame.f_locals.get(first)
    return repr(v)[:40] if isinstance(v, (int, float, str, Path)) else ""


def walk(argv: list[str]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from dsparkctl.cli.main import main

    table = layers()
    entered: list[str] = []
    checks: collections.Counter[str] = collections.Counter()
    climbs: collections.Counter[str] = collections.Counter()

    def profiler(frame, event, arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith("dsparkctl"):
            return
        if mod not in entered:
            entered.append(mod)
        name = frame.f_code.co_name
        if name.startswith("check_") or name in EXTRA_CHECKS:
            checks[f"{mod}.{name}({_first_arg(frame)})"] += 1
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        lc, lm = layer_of(caller, table), layer_of(mod, table)
        if caller.startswith("dsparkctl") and lc is not None and lm is not None and lm < lc:
            climbs[f"{caller} -> {mod}"] += 1

    sys.argv = ["dsparkctl", *argv]
    sys.setprofile(profiler)
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    finally:
        sys.setprofile(None)
    return {"command": argv, "exit_code": code, "modules_entered": entered, "module_count": len(entered),
            "checks": dict(sorted(checks.items())), "checks_run_more_than_once":
                {k: v for k, v in sorted(checks.items()) if v > 1},
            "climbs": dict(climbs.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the dsparkctl command line, after --")
    a = ap.parse_args()
    argv = a.command[1:] if a.command[:1] == ["--"] else a.command
    doc = walk(argv)
    if a.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"\n{' '.join(argv)}: exit {doc['exit_code']}, {doc['module_count']} dsparkctl modules entered:")
    print("  " + " -> ".join(m.removeprefix("dsparkctl.") for m in doc["modules_entered"]))
    print("checks (calls): " + ", ".join(f"{k.removeprefix('dsparkctl.')} {v}" for k, v in doc["checks"].items()))
    print("checks run more than once: " + (", ".join(f"{k.removeprefix('dsparkctl.')} x{v}" for k, v in
                                                     doc["checks_run_more_than_once"].items()) or "none"))
    print("calls climbing a layer: " + (", ".join(f"{k} x{v}" for k, v in doc["climbs"].items()) or "none"))


if __name__ == "__main__":
    main()
