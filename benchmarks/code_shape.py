"""The shape figures of the codebase that issue 21 tracks, for any checkout (default: this one).

    python benchmarks/code_shape.py [ROOT] [--json]

  command bodies     non-blank lines of each CLI command's function body (options -> spec -> call -> print)
  flag messages      constructions of our errors outside dsparkctl/cli whose text names a CLI flag
                     ("--out"), not counting a flag inside a backticked command to run (`dsparkctl ...`)
  kernel modules     modules that name the CPU kernel choice (packed linears, routes, settle_kernels,
                     cpu_kernels), and of those the ones that decide or implement it
  rank checks        lines outside distributed.py that ask which torchrun rank this is
  import cycles      circles in the graph of dsparkctl's imports of its own modules, imports deferred into
                     functions included (issue 26: 0)
  deferred imports   internal imports inside a function body, outside dsparkctl/cli (issue 26: <= 10)
  largest modules    the longest modules in lines (issue 26: <= 400)
  long functions     functions and methods over 60 lines, decorators and docstrings included (issue 26: <= 3)

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


def _module_name(root: Path, f: Path) -> str:
    parts = list(f.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST, here: str, modules: set[str]) -> list[str]:
    """The dsparkctl modules an import statement loads (a name imported from a package counts as its module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = here.split(".")[:-node.level] if not here.endswith("__init__") else here.split(".")
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for n in names:
        while n and n not in modules:
            n = n.rpartition(".")[0]
        if n.startswith("dsparkctl"):
            out.append(n)
    return out


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """Edges module -> modules it imports (deferred included), and the deferred internal imports outside cli/."""
    files = {_module_name(root, f): f for f in sorted((root / "dsparkctl").rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    deferred = []
    for mod, f in files.items():
        tree = ast.parse(f.read_text())
        top = {id(n) for n in tree.body} | {id(c) for n in tree.body if isinstance(n, (ast.If, ast.Try))
                                            for c in ast.walk(n)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = [t for t in _targets(node, mod, modules) if t != mod]
            graph[mod].update(targets)
            if targets and id(node) not in top and not mod.startswith("dsparkctl.cli"):
                deferred.append(f"{f.relative_to(root)}:{node.lineno}")
    return graph, deferred


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def module_lengths(root: Path) -> list[tuple[str, int]]:
    sizes = [(str(f.relative_to(root)), len(f.read_text().splitlines())) for f in (root / "dsparkctl").rglob("*.py")]
    return sorted(sizes, key=lambda x: -x[1])


def long_functions(root: Path, limit: int = 60) -> list[str]:
    found = []
    for f in sorted((root / "dsparkctl").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > limit:
                    found.append(f"{f.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - start + 1})")
    return found


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
    graph, deferred = import_graph(a.root)
    circles = cycles(graph)
    sizes = module_lengths(a.root)
    longs = long_functions(a.root)
    doc.update({"import_cycles": len(circles), "import_cycle_members": circles,
                "deferred_internal_imports_outside_cli": len(deferred), "deferred_import_sites": deferred,
                "largest_modules": [{"module": m, "lines": n} for m, n in sizes[:5]],
                "functions_over_60_lines": len(longs), "long_functions": longs})
    if a.json:
        print(json.dumps(doc, indent=2))
        return
    print("command bodies (non-blank lines): " + ", ".join(f"{k} {v}" for k, v in bodies.items())
          + f"; total {doc['command_body_total']}")
    print(f"error messages naming a flag outside the CLI: {len(flags)}" + "".join(f"\n  {s}" for s in flags))
    print(f"modules naming the CPU kernel choice: {len(named)}; deciding or implementing it: {', '.join(decides)}")
    print(f"rank checks outside distributed.py: {doc['rank_checks_outside_distributed']} lines")
    print(f"import cycles (deferred imports included): {len(circles)}"
          + "".join(f"\n  {' -> '.join(c)}" for c in circles))
    print(f"deferred internal imports outside dsparkctl/cli: {len(deferred)}")
    print("largest modules: " + ", ".join(f"{m} {n}" for m, n in sizes[:5]))
    print(f"functions over 60 lines: {len(longs)}" + "".join(f"\n  {s}" for s in longs))


if __name__ == "__main__":
    main()
