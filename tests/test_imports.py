"""The direction of engine/'s imports: no circle at any depth, and no mechanism reading the config layer.

Every `import` and `from ... import` statement of every module is read with ast, wherever it stands (module
level, inside a function, under `if TYPE_CHECKING:`), so a circle hidden in a function-level import counts.
`from engine.a import b` is an arrow to engine.a.b when b is a submodule, else to engine.a. The implicit import
of a parent package (importing engine.optim.hybrid runs engine/optim/__init__.py first) is not an arrow: a
package's __init__ re-exporting its own modules is not a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

# mechanisms: they act on tensors and modules given to them as plain arguments; the config layer, the planner
# and the assembly (build, engine, cli) sit above them and call down, never the reverse
MECHANISMS = ("engine.optim", "engine.offload", "engine.models", "engine.megatron", "engine.dist")
ABOVE_MECHANISMS = ("engine.config", "engine.planning", "engine.build", "engine.engine", "engine.cli", "engine.bench")
LEAVES = ("engine.messages",)  # import nothing from engine: every layer may import them


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def imports_of(path: Path) -> set[str]:
    """The engine modules `path` imports, at any depth of its code."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if _within(a.name, ("engine",)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not _within(base, ("engine",)):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if _is_module(sub) else base)
    out.discard(me)
    return out


def graph(root: Path = ENGINE) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(root.rglob("*.py"))}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def wrong_way(g: dict[str, set[str]]) -> list[str]:
    """Arrows from a mechanism up into the config layer, the planner or the assembly; from a leaf into engine."""
    bad = []
    for src, targets in sorted(g.items()):
        for dst in sorted(targets):
            if _within(src, MECHANISMS) and _within(dst, ABOVE_MECHANISMS):
                bad.append(f"{src} -> {dst}")
            if _within(src, LEAVES):
                bad.append(f"{src} -> {dst}")
    return bad


def test_the_graph_is_read_whole():
    """The reader sees function-level imports and resolves submodules (what the other two tests rely on)."""
    g = graph()
    assert "engine.planning.census" in g and "engine.config.rules" in g
    assert "engine.models.gpt" in g["engine.planning.census"]  # a function-level import
    assert "engine.megatron" in g["engine.build"]  # `from engine import megatron` inside a function
    assert "engine.optim.param_groups" in g["engine.megatron.optimizer"]


def test_no_import_circle():
    assert circles(graph()) == []


def test_no_mechanism_imports_the_layers_above_it():
    assert wrong_way(graph()) == []


def test_the_checks_catch_a_planted_circle_and_a_wrong_arrow(tmp_path):
    """The two checks on a copy of engine/ with one function-level import planted into offload/groups.py."""
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(ENGINE, copy)
    groups = copy / "offload" / "groups.py"
    groups.write_text(
        groups.read_text() + "\n\ndef _planted():\n    from engine.offload.session import OffloadSession\n"
        "    from engine.config.rules import RULES\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        g = graph(copy)
    finally:
        ROOT = saved
    assert ["engine.offload.groups", "engine.offload.session"] in circles(g)
    assert "engine.offload.groups -> engine.config.rules" in wrong_way(g)


def test_engine_has_at_most_22_top_level_modules():
    """A new mechanism goes into the package of its kind (planning/, optim/, offload/, models/, ...), not beside
    engine.py: the top level stays small enough to read."""
    top = sorted(p.name for p in (Path(__file__).resolve().parent.parent / "engine").glob("*.py"))
    assert len(top) <= 22, f"{len(top)} top-level modules in engine/: {top}"
