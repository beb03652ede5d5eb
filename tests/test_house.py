"""The house rules of ``ringviz/README.md``, read from the source: wings import downwards only.

The wings, lowest first: the taught ring (``ringviz/*.py`` but the CLI), ``book`` (what only the
book uses), ``hf``, ``conformance``, ``models``, ``bench``, the CLI. The core never imports
transformers, matplotlib, widgets or hypothesis; no wing imports a higher one; no module-level
import circle. Modules are split by concept, never by a line count.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ringviz"
ABOVE_CORE = ("ringviz.hf", "ringviz.models", "ringviz.book", "ringviz.bench",
              "ringviz.conformance", "ringviz.cli")
HEAVY = ("transformers", "matplotlib", "ipywidgets", "anywidget", "hypothesis", "IPython")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, top_level_only: bool) -> set[str]:
    """Absolute names ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
CORE = {m: p for m, p in MODULES.items()
        if p.parent == ROOT and m not in ("ringviz.cli", "ringviz.__main__")}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("module", sorted(CORE))
def test_core_imports_nothing_heavy_and_nothing_above_it(module):
    names = imports(CORE[module], top_level_only=False)
    assert not {n for n in names if within(n, HEAVY)}
    assert not {n for n in names if within(n, ABOVE_CORE)}


WINGS = ("ringviz.book", "ringviz.hf", "ringviz.conformance", "ringviz.models", "ringviz.bench",
         "ringviz.cli")  # above the core, lowest first


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, WINGS)))
def test_no_wing_imports_a_higher_one(module):
    wing = next(i for i, w in enumerate(WINGS) if within(module, (w,)))
    names = imports(MODULES[module], top_level_only=False)
    assert not {n for n in names if within(n, WINGS[wing + 1:])}


def test_no_module_level_import_circle():
    graph = {m: {n for n in imports(p, top_level_only=True) if n in MODULES and n != m}
             for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if n.startswith(m + "."):  # a package importing its own submodule is no circle
                continue
            assert state.get(n) != 1, " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_rules_see_the_modules():
    """The checks above would pass vacuously if the walk found nothing."""
    assert {"ringviz.cache", "ringviz.masks", "ringviz.attention"} <= set(CORE)
    assert "ringviz.hf.cache" in MODULES and "ringviz.models.drive" in MODULES
    assert "ringviz.masks" in imports(CORE["ringviz.cache"], top_level_only=True)
