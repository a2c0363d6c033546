"""The package's layers: imports flow one way, from the top of ``LAYERS`` to the bottom.

A module may import its own layer and the layers below it, never one above. The table is the
folder list of ``docs/ARCHITECTURE.md``; a new module must be placed in it.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "statestore_async"

# top to bottom; each entry is a package (folder) or a top-level module of statestore_async
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("spark",),
    ("client",),
    ("daemon",),
    ("wire",),
    ("files",),
    ("objectstore",),
    ("engine",),
    ("codecs", "_native", "_ref"),
    ("config", "ids", "errors", "__init__"),
]
# test support (fault proxy, S3 server, daemon process) may use anything, and nothing uses it but tests
TEST_SUPPORT = "testing"


def _rank(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"statestore_async.{unit} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md")


def _unit(module: str) -> str:
    """``statestore_async.daemon.server`` -> ``daemon``; ``statestore_async.ids`` -> ``ids``."""
    parts = module.split(".")
    assert parts[0] == "statestore_async", module
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def _imports(module: str, source: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every statestore_async import in a module, nested ones included."""
    tree = ast.parse(source, module)
    here = module.split(".")
    package = here if is_package else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "statestore_async"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "statestore_async":
                continue
            if mod == "statestore_async":  # from statestore_async import errors, __version__
                found += [(node.lineno, f"statestore_async.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, mod))
    return found


def _violations(modules: list[tuple[str, str, bool]]) -> list[str]:
    """What imports a higher layer, among ``(module name, source, is package)``."""
    wrong = []
    for module, source, is_package in modules:
        unit = _unit(module)
        if unit == TEST_SUPPORT:
            continue
        mine = _rank(unit)
        for line, mod in _imports(module, source, is_package):
            other = _unit(mod)
            if other == "__version__":
                continue
            if other == TEST_SUPPORT:
                wrong.append(f"{module}:{line} imports test support {mod}")
            elif _rank(other) < mine:
                wrong.append(f"{module}:{line} ({unit}) imports {mod} ({other}, a higher layer)")
    return wrong


def _package_modules() -> list[tuple[str, str, bool]]:
    return [(_module_name(p), p.read_text(), p.name == "__init__.py")
            for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts]


def test_no_module_imports_a_higher_layer():
    wrong = _violations(_package_modules())
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_every_package_and_top_level_module_has_a_layer():
    units = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in PACKAGE.glob("*.py")}
    for unit in sorted(units - {TEST_SUPPORT}):
        _rank(unit)


def test_the_architecture_page_lists_every_layer():
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    for units in LAYERS:
        for unit in units:
            if unit.startswith("_"):
                continue
            name = f"`{unit}/`" if (PACKAGE / unit).is_dir() else f"`{unit}`"
            assert name in text, f"docs/ARCHITECTURE.md does not name {name}"


def test_the_check_sees_a_violation():
    """The check is not vacuous: an engine module importing the daemon, relatively or not, is reported."""
    probes = [("statestore_async.engine.probe", "from statestore_async.daemon import server\n", False),
              ("statestore_async.codecs.probe", "def f():\n    from ..files import loader\n", False),
              ("statestore_async.engine", "from statestore_async.testing import faultproxy\n", True)]
    assert _violations(probes) == [
        "statestore_async.engine.probe:1 (engine) imports statestore_async.daemon (daemon, a higher layer)",
        "statestore_async.codecs.probe:2 (codecs) imports statestore_async.files (files, a higher layer)",
        "statestore_async.engine:1 imports test support statestore_async.testing",
    ]
