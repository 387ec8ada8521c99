"""The house's walls, checked on a whole source tree (`check_tree`): tests/test_house_walls.py
runs it on this repository and on copies with a violation planted."""

from __future__ import annotations

import ast
from pathlib import Path

PRODUCT = ("probes", "engine_worker", "gateway", "probex")
ENGINES = ("vllm", "sglang")
ENGINE_FOLDERS = tuple(f"engine_worker.{engine}" for engine in ENGINES)
# A package may import only those below it: probes < engine_worker < probex; gateway < probex.
MAY_IMPORT = {
    "probes": set(),
    "engine_worker": {"probes"},
    "gateway": {"probes"},
    "probex": {"probes", "engine_worker", "gateway"},
}
FORBIDDEN_THIRD_PARTY = {
    "probes": {*ENGINES, "fastapi", "starlette", "uvicorn"},
    "gateway": {*ENGINES, "torch"},
}
MAX_LINES = {"product": 600, "bench": 800}


def _modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    base = root / package
    if not base.is_dir():
        return found
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path, module: str) -> list[str]:
    """Every module `path` imports, anywhere in it (functions and TYPE_CHECKING blocks too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base)
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            names.append(target)
            # `from pkg import module` imports pkg.module: an edge of the graph, not another name
            names += [f"{target}.{alias.name}\0" for alias in node.names]
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def check_tree(root: Path) -> list[str]:
    """Every violation of the walls in the tree at `root`, one line each."""
    problems: list[str] = []
    modules: dict[str, Path] = {}
    for package in PRODUCT:
        modules.update(_modules(root, package))
    bench = _modules(root, "bench")
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = _top(module)
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES["product"]:
            problems.append(f"{path.relative_to(root)}: {lines} lines (product files: at most {MAX_LINES['product']})")
        edges = graph.setdefault(module, set())
        for name in _imports(path, module):
            if name.endswith("\0"):
                target = name[:-1]
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module and _top(target) in PRODUCT:
                    edges.add(target)
                continue
            top = _top(name)
            if top in ENGINES and not any(_in(module, folder) for folder in ENGINE_FOLDERS):
                problems.append(f"{module} imports the engine {name} (only engine_worker/<engine>/ may)")
            if top in FORBIDDEN_THIRD_PARTY.get(package, ()):
                problems.append(f"{module} imports {name} ({package}/ may not)")
            if top == "bench":
                problems.append(f"{module} imports the lab ({name}): bench/ stays outside the product")
            if top in PRODUCT and top != package and top not in MAY_IMPORT[package]:
                problems.append(f"{module} imports {name}: {package}/ may import only {sorted(MAY_IMPORT[package])}")
            if (package == "engine_worker" and not any(_in(module, f) for f in ENGINE_FOLDERS)
                    and any(_in(name, f) for f in ENGINE_FOLDERS)):
                problems.append(f"{module} imports {name}: the core never imports an engine folder")
            if top in PRODUCT:
                target = name
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
    for module, path in bench.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES["bench"]:
            problems.append(f"{path.relative_to(root)}: {lines} lines (bench modules: at most {MAX_LINES['bench']})")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm).
    A package's __init__ importing its own submodules is not a cycle worth reporting."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def edges(node: str) -> list[str]:
        return [t for t in graph.get(node, ()) if not (_in(t, node) or _in(node, t))]

    def visit(node: str) -> None:
        work = [(node, iter(edges(node)))]
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        while work:
            current, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges(child))))
                elif child in on_stack:
                    low[current] = min(low[current], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[current])
            if low[current] == index[current]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == current:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
