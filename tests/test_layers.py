"""The package's layers: imports flow one way, from the top of ``LAYERS`` to the bottom.

A module may import its own layer and the layers below it, never one above. The table is the
folder list of ``docs/ARCHITECTURE.md``; a new module must be placed in it.

The compiled modules are held to the same rule through their ``cimport``s: ``_ext/<name>.pyx``
(``statestore_async._native.<name>``) belongs to the layer of the one module that imports it (its
facade: ``_native.table`` is ``engine``'s, ``_native.payloads`` the ``daemon``'s), and the shared
``.pxd`` headers to the bottom of ``codecs``. And the engine reads no wire format: no engine module,
Python or compiled, imports the frame and payload codecs or cimports ``_wire``.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "statestore_async"
EXT = PACKAGE.parent / "_ext"

# top to bottom; each entry is a package (folder) or a top-level module of statestore_async
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("spark",),
    ("state",),
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
# spark/ by who runs the code, top to bottom: the package's re-exports; the driver (which ships the
# task's entry points to Spark); the task runtime; then what users write against (api) and what
# driver and tasks share (shared), which do not import each other. Every module is in one of them.
SPARK_LAYERS: list[tuple[str, ...]] = [("__init__",), ("driver",), ("task",), ("api", "shared")]
SPARK_PEERS = {("api", "shared"), ("shared", "api")}
# .pxd headers of _ext/ that are no module of their own (inlined into each module that cimports them)
SHARED_PXD = {"_bytes": "codecs", "_spans": "codecs", "_wire": "codecs", "_records": "engine", "_refsort": "engine"}
# the wire format (frames, batch payloads): nothing in these layers may import or cimport it
NO_WIRE_LAYERS = ("engine",)
WIRE_FORMAT = ("statestore_async.wire", "statestore_async.codecs.framing", "statestore_async.codecs.packed",
               "statestore_async.codecs.arrowframes", "_wire")
# cimports of Cython's and C's own declarations
_C_LEVEL = ("cython", "cpython", "libc", "libcpp", "numpy")
_CIMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+cimport\b|cimport\s+([\w.]+))", re.M)


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


def _imports(module: str, source: str, is_package: bool, names: bool = False) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every statestore_async import in a module, nested ones included;
    with ``names``, a ``from m import a`` also gives ``m.a`` (``a`` may be a module)."""
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
                if names:
                    found += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return found


def _is_wire(mod: str) -> bool:
    return any(mod == w or mod.startswith(w + ".") for w in WIRE_FORMAT)


def _violations(modules: list[tuple[str, str, bool]]) -> list[str]:
    """What imports a higher layer (or, in the engine, the wire format), among ``(module name,
    source, is package)``."""
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
        if unit in NO_WIRE_LAYERS:
            seen = set()
            for line, mod in _imports(module, source, is_package, names=True):
                if _is_wire(mod) and line not in seen:
                    seen.add(line)
                    wrong.append(f"{module}:{line} ({unit}) imports the wire format {mod}")
    return wrong


def _spark_unit(module: str) -> str | None:
    """``statestore_async.spark.task.perkey`` -> ``task``; ``statestore_async.spark`` -> ``__init__``;
    None outside spark/."""
    parts = module.split(".")
    if parts[:2] != ["statestore_async", "spark"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def _spark_rank(unit: str) -> int:
    for i, units in enumerate(SPARK_LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"statestore_async.spark.{unit} is in no sub-package of spark/: add it to SPARK_LAYERS")


def _spark_violations(modules: list[tuple[str, str, bool]]) -> list[str]:
    """What imports, inside spark/, a higher sub-package or a peer one (api and shared)."""
    wrong = []
    for module, source, is_package in modules:
        unit = _spark_unit(module)
        if unit is None:
            continue
        for line, mod in _imports(module, source, is_package):
            other = _spark_unit(mod)
            if other is None or other == unit:
                continue
            if _spark_rank(other) < _spark_rank(unit):
                wrong.append(f"{module}:{line} (spark.{unit}) imports {mod} (spark.{other}, a higher sub-package)")
            elif (unit, other) in SPARK_PEERS:
                wrong.append(f"{module}:{line} (spark.{unit}) imports {mod} (spark.{other}, which it stands beside)")
    return wrong


def _runtime_imports(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The package modules ``module`` imports when it runs (at import time or inside a function), not
    those it names for type checking only (``if TYPE_CHECKING:``): ``from p import m`` names module
    ``p.m`` when it is one, else ``p``."""
    tree = ast.parse(source, module)
    typing_only = {id(n) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for n in ast.walk(block)}
    here = module.split(".")
    package = here if is_package else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{mod}.{a.name}"
                found |= {full} if full in known else ({mod} if mod in known else set())
    return found - {module}


def _cycles(modules: list[tuple[str, str, bool]]) -> list[list[str]]:
    """The import cycles among ``modules`` (strongly connected groups of two or more), each sorted."""
    known = {m for m, _, _ in modules}
    graph = {m: _runtime_imports(m, src, pkg, known) for m, src, pkg in modules}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return cycles


def _cimports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every cimport of a Cython source but Cython's and C's own."""
    found = []
    for m in _CIMPORT.finditer(source):
        mod = m.group(1) or m.group(2)
        if mod.split(".")[0] not in _C_LEVEL:
            found.append((source.count("\n", 0, m.start()) + 1, mod))
    return found


def _facades(modules: list[tuple[str, str, bool]]) -> dict[str, str]:
    """Compiled module name -> the layer of the package module that imports it (its facade)."""
    facades: dict[str, set[str]] = {}
    for module, source, is_package in modules:
        unit = _unit(module)
        if unit in ("_native", "_ref"):
            continue
        for _, mod in _imports(module, source, is_package):
            parts = mod.split(".")
            if parts[:2] == ["statestore_async", "_native"] and len(parts) == 3:
                facades.setdefault(parts[2], set()).add(unit)
    for name, units in facades.items():
        assert len(units) == 1, f"statestore_async._native.{name} is imported from several layers: {sorted(units)}"
    return {name: units.pop() for name, units in facades.items()}


def _compiled_layer(name: str, facades: dict[str, str]) -> str:
    """The layer of a cimported name: a shared header, or a compiled module (by its facade)."""
    if name in SHARED_PXD:
        return SHARED_PXD[name]
    short = name.removeprefix("statestore_async._native.")
    assert short in facades, f"_ext/{short}: no module of the package imports statestore_async._native.{short}"
    return facades[short]


def _cython_violations(sources: list[tuple[str, str]], facades: dict[str, str]) -> list[str]:
    """What a Cython source (``(file name, source)``: ``_ext/*.pyx``, ``*.pxd``) cimports against
    the layers."""
    wrong = []
    # a .pxi is part of the .pyx that includes it
    owner = {inc: name.split("/")[-1].split(".")[0] for name, source in sources if name.endswith(".pyx")
             for inc in re.findall(r'^include\s+"([^"]+)"', source, re.M)}
    for filename, source in sources:
        base = filename.split("/")[-1]
        stem = owner.get(base, base.split(".")[0]) if base.endswith(".pxi") else base.split(".")[0]
        unit = _compiled_layer(stem, facades)
        for line, mod in _cimports(source):
            other = _compiled_layer(mod, facades)
            if _rank(other) < _rank(unit):
                wrong.append(f"{filename}:{line} ({unit}) cimports {mod} ({other}, a higher layer)")
            elif unit in NO_WIRE_LAYERS and _is_wire(mod):
                wrong.append(f"{filename}:{line} ({unit}) cimports the wire format {mod}")
    return wrong


def _cython_sources() -> list[tuple[str, str]]:
    files = sorted(EXT.glob("*.pyx")) + sorted(EXT.glob("*.pxi")) + sorted(EXT.glob("*.pxd")) \
        + sorted((PACKAGE / "_native").glob("*.pxd"))
    return [(str(p.relative_to(PACKAGE.parent)), p.read_text()) for p in files]


def _package_modules() -> list[tuple[str, str, bool]]:
    return [(_module_name(p), p.read_text(), p.name == "__init__.py")
            for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts]


def test_no_module_imports_a_higher_layer():
    wrong = _violations(_package_modules())
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_spark_sub_packages_import_one_way():
    wrong = _spark_violations(_package_modules())
    assert not wrong, "imports against spark/'s sub-packages:\n" + "\n".join(wrong)


def test_every_spark_module_is_in_a_sub_package():
    spark = PACKAGE / "spark"
    loose = sorted(p.name for p in spark.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules directly under spark/ (put each in the sub-package of who runs it): {loose}"
    for sub in sorted(p.name for p in spark.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        _spark_rank(sub)


def test_the_spark_check_sees_a_violation():
    probes = [("statestore_async.spark.task.probe", "from statestore_async.spark.driver import operator\n", False),
              ("statestore_async.spark.api.probe", "def f():\n    from ..shared import hooks\n", False),
              ("statestore_async.spark.driver.probe", "from statestore_async.spark.task import partition\n", False)]
    assert _spark_violations(probes) == [
        "statestore_async.spark.task.probe:1 (spark.task) imports statestore_async.spark.driver (spark.driver, "
        "a higher sub-package)",
        "statestore_async.spark.api.probe:2 (spark.api) imports statestore_async.spark.shared (spark.shared, "
        "which it stands beside)",
    ]


def test_no_import_cycle():
    """No module imports, when it runs, one that imports it back (through any chain); a name only
    for type checking (``if TYPE_CHECKING:``) does not count."""
    cycles = _cycles(_package_modules())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle():
    probes = [("statestore_async.spark.driver.a", "from statestore_async.spark.driver import b\n", False),
              ("statestore_async.spark.driver.b", "def f():\n    from .a import x\n", False),
              ("statestore_async.spark.driver.c", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
               "    from statestore_async.spark.driver.b import y\n", False),
              ("statestore_async.spark.driver.d", "from statestore_async.spark.driver.c import z\n", False)]
    assert _cycles(probes) == [["statestore_async.spark.driver.a", "statestore_async.spark.driver.b"]]


def test_no_compiled_module_cimports_a_higher_layer():
    sources = _cython_sources()
    assert any(name.endswith(".pyx") for name, _ in sources), f"no Cython sources under {EXT}"
    wrong = _cython_violations(sources, _facades(_package_modules()))
    assert not wrong, "cimports against the layers:\n" + "\n".join(wrong)


def test_every_compiled_module_has_a_facade():
    facades = _facades(_package_modules())
    for pyx in sorted(EXT.glob("*.pyx")):
        assert pyx.stem in facades, f"_ext/{pyx.name}: no module of the package imports statestore_async._native.{pyx.stem}"


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
    wire = [("statestore_async.engine.probe", "from statestore_async.codecs.packed import PackedList\n", False),
            ("statestore_async.engine.probe2", "def f():\n    from ..codecs import framing\n", False),
            ("statestore_async.daemon.probe", "from statestore_async.codecs import framing\n", False)]
    assert _violations(wire) == [
        "statestore_async.engine.probe:1 (engine) imports the wire format statestore_async.codecs.packed",
        "statestore_async.engine.probe2:2 (engine) imports the wire format statestore_async.codecs.framing",
    ]


def test_the_cimport_check_sees_a_violation():
    """The same for the compiled modules: a codec cimporting the engine's table, the engine's table
    cimporting the wire format's header; a comment or a string naming them is not a cimport."""
    facades = {"table": "engine", "payloads": "daemon", "framing": "codecs"}
    sources = [("_ext/framing.pyx", "from libc.stdint cimport uint8_t\nfrom statestore_async._native.table cimport Found\n"),
               ("_ext/table.pyx", "cimport cython\n# from _wire cimport rd32\nfrom _wire cimport payload_count\n"),
               ("_ext/payloads.pyx", "from _wire cimport walk_list\nfrom statestore_async._native.table cimport Found\n")]
    assert _cython_violations(sources, facades) == [
        "_ext/framing.pyx:2 (codecs) cimports statestore_async._native.table (engine, a higher layer)",
        "_ext/table.pyx:3 (engine) cimports the wire format _wire",
    ]
    # an included .pxi is held to its module's layer
    sources = [("_ext/table.pyx", 'include "table_views.pxi"\n'), ("_ext/table_views.pxi", "from _wire cimport rd32\n")]
    assert _cython_violations(sources, facades) == ["_ext/table_views.pxi:1 (engine) cimports the wire format _wire"]
