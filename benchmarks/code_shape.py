"""The shape figures of the codebase that issue 21 tracks, for any checkout (default: this one).

    python benchmarks/code_shape.py [ROOT] [--json]

  command bodies     non-blank lines of each CLI command's function body (options -> spec -> call -> print)
  flag messages      constructions of our errors outside dsparkctl/cli whose text names a CLI flag
                     ("--out"), not counting a flag inside a backticked command to run (`dsparkctl ...`)
  kernel modules     modules that name the CPU kernel choice (packed linears, routes, settle_kernels,
                     cpu_kernels), and of those the ones that decide or implement it
  rank checks        lines outside distributed.py that ask which torchrun rank this is

Reads source text only (ast and regular expressions); imports nothing from the checkout.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

ERRORS = {"UsageError", "InputError", "CheckpointError", "ModelMismatchError", "DsparkError", "NonFiniteLoss"}
FLAG = re.compile(r"--[a-z][a-z-]+")
KERNELS = re.compile(r"packed_linear|kernel_choice|settle_kernels|PackedLinear|route_of|apply_route|\bRoute\b|"
                     r"stock_rows|CPU_KERNELS|cpu_kernels")
DECIDES = re.compile(r"^from dsparkctl\.models\.(packed_linear|cpu_kernels) import|^def resolve\(|class PackedLinear|"
                     r"def settle_kernels", re.M)
RANKS = re.compile(r"world\(\)\.(main|rank|size|distributed)|\bw\.(main|rank|size|distributed)\b|split_work\(\)|"
                   r"replicate_work\(\)")


def command_bodies(root: Path) -> dict[str, int]:
    out = {}
    for f in sorted((root / "dsparkctl/cli").glob("*.py")):
        src = f.read_text()
        tree = ast.parse(src)
        names = {}
        for c in ast.walk(tree):  # app.command("name", ...)(function)
            if (isinstance(c, ast.Call) and isinstance(c.func, ast.Call) and isinstance(c.func.func, ast.Attribute)
                    and c.func.func.attr == "command" and c.args and isinstance(c.args[0], ast.Name)):
                names[c.args[0].id] = c.func.args[0].value
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                lines = src.splitlines()[node.body[0].lineno - 1:node.end_lineno]
                out[names[node.name]] = sum(1 for line in lines if line.strip())
    return out


def flag_messages(root: Path) -> list[str]:
    found = []
    for f in sorted((root / "dsparkctl").rglob("*.py")):
        if f.relative_to(root / "dsparkctl").parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in ERRORS:
                text = "".join(c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str))
                if FLAG.search(re.sub(r"`[^`]*`", "", text)):
                    found.append(f"{f.relative_to(root)}:{node.lineno}")
    return found


def kernel_modules(root: Path) -> tuple[list[str], list[str]]:
    named, decides = [], []
    for f in sorted((root / "dsparkctl").rglob("*.py")):
        src = f.read_text()
        if KERNELS.search(src):
            named.append(str(f.relative_to(root)))
            if DECIDES.search(src):
                decides.append(str(f.relative_to(root)))
    return named, decides


def rank_checks(root: Path) -> int:
    return sum(len(RANKS.findall(line)) > 0 for f in (root / "dsparkctl").rglob("*.py") if f.name != "distributed.py"
               for line in f.read_text().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    bodies = command_bodies(a.root)
    flags = flag_messages(a.root)
    named, decides = kernel_modules(a.root)
    doc = {"command_bodies": bodies, "command_body_total": sum(bodies.values()), "flag_messages": len(flags),
           "flag_message_sites": flags, "kernel_modules": len(named), "kernel_modules_deciding": decides,
           "rank_checks_outside_distributed": rank_checks(a.root)}
    if a.json:
        print(json.dumps(doc, indent=2))
        return
    print("command bodies (non-blank lines): " + ", ".join(f"{k} {v}" for k, v in bodies.items())
          + f"; total {doc['command_body_total']}")
    print(f"error messages naming a flag outside the CLI: {len(flags)}" + "".join(f"\n  {s}" for s in flags))
    print(f"modules naming the CPU kernel choice: {len(named)}; deciding or implementing it: {', '.join(decides)}")
    print(f"rank checks outside distributed.py: {doc['rank_checks_outside_distributed']} lines")


if __name__ == "__main__":
    main()
