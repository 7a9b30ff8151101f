"""The house rules of ARCHITECTURE.md that a move could break: imports go down the layers only, benchmarks/ is
sorted by topic and uses the measurement library rather than the CLI, and every documented import path works.

Read from the source with `ast` (no module is imported to check its imports), so a rule broken inside a
function body is caught as well as one at the top of a file.
"""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lookup_decode"


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imports_of(folder: Path) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imported_modules(p) for p in sorted(folder.rglob("*.py"))}


def offenders(folder: Path, forbidden) -> list[str]:
    return [f"{file}: {name}" for file, names in imports_of(folder).items() for name in sorted(names)
            if forbidden(name)]


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_core_imports_no_engine_and_nothing_above_it():
    assert offenders(PACKAGE / "core", lambda n: under(n, "transformers", "vllm", "lookup_decode.sources",
                                                      "lookup_decode.engines", "lookup_decode.cli",
                                                      "lookup_decode.measure")) == []


def test_sources_import_only_core():
    assert offenders(PACKAGE / "sources", lambda n: under(n, "transformers", "vllm", "lookup_decode.engines",
                                                         "lookup_decode.cli", "lookup_decode.measure")) == []


def test_engines_and_measure_never_import_the_cli():
    assert offenders(PACKAGE / "engines", lambda n: under(n, "lookup_decode.cli", "lookup_decode.measure")) == []
    assert [n for n in imported_modules(PACKAGE / "measure.py") if under(n, "lookup_decode.cli")] == []


def test_nothing_in_the_package_imports_benchmarks_or_tests():
    assert offenders(PACKAGE, lambda n: under(n, "benchmarks", "tests")) == []


def test_benchmarks_use_the_measurement_library_not_the_cli():
    assert offenders(ROOT / "benchmarks", lambda n: under(n, "lookup_decode.cli")) == []


def test_benchmarks_are_sorted_by_topic():
    flat = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.is_file())
    assert flat == ["README.md", "__init__.py"]


@pytest.mark.parametrize("path", ["lookup_decode.generate", "lookup_decode.lookup_decoding",
                                  "lookup_decode.DecodeStats", "lookup_decode.Memory", "lookup_decode.References",
                                  "lookup_decode.SuffixIndex", "lookup_decode.LookupConfig",
                                  "lookup_decode.load_model", "lookup_decode.vllm.LookupDrafter",
                                  "lookup_decode.vllm.PredictedOutputs", "lookup_decode.code_model",
                                  "lookup_decode.hf.lookup_decoding", "lookup_decode.measure.run_variant"])
def test_documented_import_paths(path):
    module, name = path.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is not None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))


def test_no_module_imports_a_private_name_of_another():
    """`from x import _name` reaches past another module's interface (issue 34's rule)."""
    bad = []
    for path in project_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and under(node.module, "lookup_decode", "benchmarks") and node.module != module_name(path):
                bad += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def test_no_import_circles_lazy_imports_included():
    """No module reaches itself through the modules it imports, at any depth of its code; a module importing its
    own parent package (its __init__) does not count, as Python runs that first anyway."""
    known = {module_name(p): p for p in project_files()}

    def targets(path: Path) -> set[str]:       # `from a.b import c` names a.b and, where c is a module, a.b.c
        names = set(imported_modules(path))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.update(f"{node.module}.{a.name}" for a in node.names)
        return names

    def edges(mod: str) -> set[str]:
        out = set()
        for name in targets(known[mod]):
            while name and name not in known:         # `from a.b import c`: a.b, or a.b.c when c is a module
                name = name.rpartition(".")[0]
            if name and name != mod and not under(mod, name):
                out.add(name)
        return out

    graph = {m: edges(m) for m in known}
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                circles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []
