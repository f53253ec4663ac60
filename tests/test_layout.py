"""The package's architecture, checked from its source (no import runs): no import cycles
between its modules, no module outside ``hvd_slowmo/comm/`` naming a concrete transport, and
every module and folder named on the layout page (docs/development.md)."""

import ast
import os
import re

from horovod_launch import ROOT

PACKAGE = os.path.join(ROOT, "hvd_slowmo")
#: The concrete transports and the thread world: only hvd_slowmo/comm/ may name them.
CONCRETE = {
    "HorovodCommunicator",
    "MPICommunicator",
    "ThreadCommunicator",
    "ThreadWorld",
    "TorchDistCommunicator",
    "run_threads",
}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                name = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
                with open(path, encoding="utf-8") as fh:
                    out[name] = ast.parse(fh.read(), path)
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package modules that module ``name`` imports, at any depth (lazy imports count)."""
    is_package = os.path.exists(os.path.join(ROOT, *name.split("."), "__init__.py"))
    here = name if is_package else name.rsplit(".", 1)[0]  # what `from .` means in this module
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                mod = f"{base}.{mod}" if mod else base
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` of a module
    return {m for m in found if m in known and m != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}
    # A package imports its own submodules by design (its __init__ re-exports them): a
    # submodule importing its package's __init__ back would be the cycle.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + " | ".join(cycles)
    assert graph["hvd_slowmo.optimizer"], "the import graph is empty: the parser found nothing"


def _concrete_names(tree: ast.Module) -> list[str]:
    """Where a module names a concrete transport: ``"line name"`` for each occurrence."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            ident = node.id
        elif isinstance(node, ast.Attribute):
            ident = node.attr
        elif isinstance(node, ast.alias):
            ident = node.name
        else:
            continue
        if ident in CONCRETE:
            out.append(f"{getattr(node, 'lineno', '?')} {ident}")
    return out


def test_only_comm_names_concrete_communicators():
    modules = _modules()
    names = {name: _concrete_names(tree) for name, tree in modules.items()}
    # The check sees what it looks for: the package's modules were found, and the transports'
    # own folder does name them (else an empty walk or a blind parser would pass).
    assert "hvd_slowmo.optimizer" in modules, f"no package modules found under {PACKAGE}"
    inside = {n for n, found in names.items() if n.startswith("hvd_slowmo.comm") and found}
    assert {"hvd_slowmo.comm.factory", "hvd_slowmo.comm.local"} <= inside, inside
    offenders = [
        f"{name}:{where}"
        for name, found in names.items()
        if not name.startswith("hvd_slowmo.comm")
        for where in found
    ]
    assert not offenders, "only hvd_slowmo/comm/ may name a concrete communicator: " + ", ".join(
        offenders
    )


LAB = os.path.join(ROOT, "slowmo_lab")
#: The library's public modules: the names in their ``__all__`` are what slowmo_lab may use.
PUBLIC = {"hvd_slowmo": "hvd_slowmo/__init__.py", "hvd_slowmo.comm": "hvd_slowmo/comm/__init__.py"}


def _public_names(module: str) -> set[str]:
    with open(os.path.join(ROOT, PUBLIC[module]), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{PUBLIC[module]} has no __all__")


def test_lab_uses_only_the_public_api():
    # slowmo_lab (report, sweep, metrics, emulated network) sits beside the library: it may import
    # the names hvd_slowmo and hvd_slowmo.comm export, nothing deeper; the library never imports
    # the lab.
    used: list[str] = []
    offenders = []
    for f in sorted(os.listdir(LAB)):
        if not f.endswith(".py"):
            continue
        with open(os.path.join(LAB, f), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hvd_slowmo"):
                public = _public_names(node.module) if node.module in PUBLIC else set()
                for a in node.names:
                    used.append(f"{node.module}.{a.name}")
                    if a.name not in public:
                        offenders.append(f"{f}:{node.lineno} {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                deep = [a.name for a in node.names if a.name.startswith("hvd_slowmo.")]
                offenders += [f"{f}:{node.lineno} {name}" for name in deep]
    assert used, "slowmo_lab imports nothing from hvd_slowmo: the check sees nothing"
    assert not offenders, "slowmo_lab reaches into hvd_slowmo's internals: " + ", ".join(offenders)
    modules = _modules().items()
    back = [n for n, tree in modules if any("slowmo_lab" in i for i in _imports_any(tree))]
    assert not back, f"the library imports slowmo_lab: {back}"


def _imports_any(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
    return found


def test_the_layout_page_names_every_module_and_folder():
    # docs/development.md is the one layout page: a module or folder added to the package (or
    # renamed) fails here until the page's tree says what it holds.
    with open(os.path.join(ROOT, "docs", "development.md"), encoding="utf-8") as f:
        tree = f.read().split("```\nhvd_slowmo/\n", 1)[1].split("```", 1)[0]
    named = set(re.findall(r"\b(\w+(?:\.py|/))", tree))
    entries = {
        f + "/" if os.path.isdir(os.path.join(PACKAGE, f)) else f
        for f in os.listdir(PACKAGE)
        if (f.endswith(".py") and f != "__init__.py")
        or os.path.exists(os.path.join(PACKAGE, f, "__init__.py"))
    }
    assert entries <= named, sorted(entries - named)
