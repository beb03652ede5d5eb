"""The house rules of ``ringviz/README.md``, read from the source: wings import downwards only.

The wings, lowest first: the taught ring (``ringviz/*.py`` but the CLI), ``book`` (what only the
book uses), ``hf``, ``conformance``, ``models``, ``bench``, the CLI. The core never imports
transformers, matplotlib, widgets or hypothesis; no wing imports a higher one; no module-level
import circle. Modules are split by concept, never by a line count. A step crosses few files.
"""

import ast
import sys
from pathlib import Path

import pytest
import torch

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


def files_entered(fn) -> list[str]:
    """The ringviz source files whose functions ``fn()`` calls (sys.setprofile)."""
    seen: set[str] = set()

    def profile(frame, event, arg) -> None:
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.is_relative_to(ROOT):
            seen.add(path.relative_to(ROOT).as_posix())

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def test_a_step_crosses_few_files():
    """The data path reads in few places: a validated decode step of the core ring enters
    its ring, its checks and its attention; a whole ``ringviz.hf.generate`` on a Gemma 3
    (sliding and full layers) adds the window rule and the four ``hf`` modules it needs."""
    from ringviz import RingKVCache, hf
    from tests.tiny_models import prompt, tiny_gemma

    ring = RingKVCache(1, 2, window=4, head_dim=8, dtype=torch.float64)
    x = torch.randn(1, 4, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ring.step(x, x[:, :2], x[:, :2], torch.arange(6)[None])
    one = x[:, :, -1:]
    step = files_entered(lambda: ring.step(one, one[:, :2], one[:, :2], torch.tensor([[6]])))
    assert step == ["attention.py", "cache.py", "checks.py"]
    model, ids = tiny_gemma(), prompt(9)
    generate = files_entered(lambda: hf.generate(model, ids, max_new_tokens=4, do_sample=False))
    assert generate == ["attention.py", "cache.py", "checks.py", "hf/attention.py",
                        "hf/cache.py", "hf/config.py", "hf/generation.py", "masks.py"]
