"""The layout's rules, checked on the source tree with `ast` (nothing is imported):

* imports run one way: no cycle among the library's modules, lazy imports inside functions included;
* ``kernels/`` is a leaf: it imports nothing of the library outside ``kernels/``;
* the library never imports ``scripts/``;
* the tracked tree narrates no development history.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package (pyproject.toml's package-dir)
PACKAGES = {"ft_transformers": "ft_transformers", "kernels": "ft_transformers.kernels",
            "patches": "ft_transformers.patches", "scripts": "scripts"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the library modules it imports anywhere in its source (functions included). ``from p
    import x`` counts as an import of ``p.x`` when that is a module, else of ``p``; a submodule's
    import does not count as an import of its parent packages (Python runs them, but they are not
    this module's dependency)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        base = name if _is_package(path) else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    pkg = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg for a in node.names]
            else:
                continue
            for t in targets:
                # the longest known module that ``t`` names or lies inside
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a closed path [a, b, …, a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


GRAPH = import_graph(_modules())


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_graph_sees_relative_and_lazy_imports():
    # the package's own entry point imports its API modules; a check that saw no edges would pass vacuously
    assert {"ft_transformers.protect", "ft_transformers.attention"} <= GRAPH["ft_transformers"]
    assert any(m.startswith("ft_transformers.kernels.") for deps in GRAPH.values() for m in deps)


def test_no_import_cycle():
    cycle = find_cycle({m: d for m, d in GRAPH.items() if not m.startswith("scripts")})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_are_a_leaf():
    bad = {m: sorted(d for d in deps if not d.startswith("ft_transformers.kernels"))
           for m, deps in GRAPH.items() if m.startswith("ft_transformers.kernels")}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"kernels/ imports the library: {bad}"


def test_library_never_imports_scripts():
    bad = {m: sorted(d for d in deps if d.startswith("scripts"))
           for m, deps in GRAPH.items() if m.startswith("ft_transformers")}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"the library imports scripts/: {bad}"


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.splitlines()
            if Path(f).suffix in {".py", ".md", ".txt", ".toml", ".sh", ".cfg", ".json", ".jsonl", ".csv"}]


def _lines_matching(pattern: re.Pattern) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{i}" for p in _tracked_text_files() if p.is_file()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]


def test_no_history_narration():
    hits = _lines_matching(re.compile("[Ss]ess" + r"ions? [0-9]+"))  # split so this file does not match itself
    assert not hits, f"{len(hits)} lines name a development session, e.g. {hits[:5]}"


def test_papers_named_by_title():
    hits = _lines_matching(re.compile("[Ss]ee" + r"ds? 00[0-9]"))  # the source documents' file numbers
    assert not hits, f"{len(hits)} lines name a paper by its file number, e.g. {hits[:5]}"
