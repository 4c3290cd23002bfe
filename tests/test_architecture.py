"""The layers of minidp, as README.md's "Architecture" section draws them, kept true by reading the imports.

Every ``import`` in ``minidp/`` counts, inside functions too. The rules:

* no import circle anywhere in the package;
* the primitives (the five steps and what they stand on) reach nothing above them, directly or through
  another module: not the tracer, the replica cache, verify, the wrapper or the command line;
* the tracer and the command line are imported by nothing below them;
* no module imports the package's face (``import minidp``, ``from minidp import scatter``,
  ``from . import scatter``): ``minidp/__init__.py`` re-exports every floor, so an import of it is
  an arrow from the importer up to all of them. Modules import what they use from the module that
  defines it (``from .step1_scatter import scatter``); importing a module (``from . import comm``) is
  importing that module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import minidp

from .helpers import fresh_python


@pytest.fixture(autouse=True)
def dataparallel_configuration():
    """Reading the sources does not depend on DataParallel's defaults: once, not under both configurations."""


PACKAGE = Path(minidp.__file__).resolve().parent

# The bottom floor: the steps, the tensor-level copies, and what they stand on.
PRIMITIVES = {
    "hooks", "nested", "device_ids", "ext", "comm", "replica_group", "parallel_backward", "cpu_threads",
    "torch_versions", "step1_scatter", "step2_replicate", "step3_parallel_apply", "step4_gather", "step5_reduce",
}


def module_name(path: Path) -> str:
    """``minidp/tracing/views.py`` -> ``tracing.views``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


FACE = ""  # the package root, minidp/__init__.py, by its module name


def resolve(importer: str, node: ast.AST) -> set[str]:
    """The minidp modules an import statement in module ``importer`` loads.

    The package root counts (as ``FACE``) only where the statement imports the face itself: ``import
    minidp``, or a name from the root that is not a module (``from minidp import scatter``, ``from .
    import scatter``); every other import loads the root only as the parent of its module.
    """
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == "minidp" or (alias.name.startswith("minidp.") and alias.asname is None):
                found.add(FACE)  # binds the name `minidp`: the face, whatever module it loads besides
            if alias.name.startswith("minidp."):
                found.add(alias.name.removeprefix("minidp."))
        return found & MODULES.keys()
    assert isinstance(node, ast.ImportFrom)
    if node.level == 0:
        if not (node.module or "").startswith("minidp"):
            return set()
        base = (node.module or "").removeprefix("minidp").lstrip(".")
    else:
        is_package = MODULES[importer].name == "__init__.py"
        anchor = importer.split(".") if importer else []
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    if base and not (importer == base or importer.startswith(base + ".")):
        found.add(base)  # a module's own packages are loaded before it: not an edge
    for alias in node.names:  # `from . import comm` and `from .tracing import views` load modules too
        candidate = f"{base}.{alias.name}" if base else alias.name
        if candidate in MODULES:
            found.add(candidate)
        elif base == FACE:  # `from minidp import scatter`: a name the face re-exports
            found.add(FACE)
    return {name for name in found if name in MODULES and name != importer}


def imports_of(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= resolve(name, node)
    return found - {name}


GRAPH = {name: imports_of(name) for name in MODULES}  # the root, FACE, re-exports every floor


def reachable(start: str) -> set[str]:
    seen: set[str] = set()
    stack = list(GRAPH[start])
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(GRAPH.get(name, ()))
    return seen


def test_the_import_graph_is_read_from_the_sources():
    """A check that finds nothing proves nothing: the graph must see the edges everyone knows are there."""
    assert "comm" in GRAPH["step1_scatter"]
    assert "step5_reduce" in GRAPH["step2_replicate"]
    assert "tracing.recorder" in GRAPH["tracing"]
    assert "hooks" in GRAPH["tracing.recorder"]
    assert {"step1_scatter", "wrapper", "tracing"} <= GRAPH[FACE]


@pytest.mark.parametrize(
    "importer,statement,imported",
    [
        ("criterion", "import minidp", {FACE}),
        ("criterion", "from minidp import scatter", {FACE}),
        ("criterion", "from . import scatter", {FACE}),
        ("distributed.ddp", "from .. import DataParallel", {FACE}),
        ("distributed.ddp", "import minidp.wrapper", {FACE, "wrapper"}),
        ("criterion", "from . import comm", {"comm"}),
        ("criterion", "from .step1_scatter import scatter", {"step1_scatter"}),
        ("distributed.ddp", "from ..wrapper import DataParallel", {"wrapper"}),
        ("distributed.ddp", "import minidp.wrapper as wrapper", {"wrapper"}),
    ],
)
def test_an_import_of_the_face_is_told_from_an_import_of_a_module(importer, statement, imported):
    assert resolve(importer, ast.parse(statement).body[0]) == imported


def test_no_module_imports_the_packages_face():
    """``import minidp`` inside the package draws an arrow up to every floor (caught by the tests below
    too, as a circle); this one names the statements and says what to write instead."""
    found = [
        f"minidp/{MODULES[name].relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}"
        for name in MODULES if name != FACE
        for node in ast.walk(ast.parse(MODULES[name].read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom)) and FACE in resolve(name, node)
    ]
    assert not found, ("import what you use from the module that defines it (from .step1_scatter import scatter), "
                       "not from the package's face:\n" + "\n".join(found))


def test_there_is_no_import_circle_in_minidp():
    circles = sorted(name for name in GRAPH if name in reachable(name))
    assert not circles, f"modules that import themselves through others: {circles}"


@pytest.mark.parametrize("primitive", sorted(PRIMITIVES))
def test_a_primitive_reaches_nothing_above_the_primitives(primitive):
    above = sorted(reachable(primitive) - PRIMITIVES)
    assert not above, f"{primitive} reaches {above}, which stand above the primitives"


# Who may import the tracer and the command line: the layers above them.
ABOVE = {"tracing": ("cli", "__main__", "distributed"), "cli": ("__main__",)}


@pytest.mark.parametrize("top", sorted(ABOVE))
def test_the_tracer_and_the_command_line_are_imported_by_nothing_below_them(top):
    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    importers = sorted(
        name for name, imported in GRAPH.items()
        if name != FACE and not inside(name, top) and not any(inside(name, allowed) for allowed in ABOVE[top])
        and any(inside(i, top) for i in imported)
    )
    assert not importers, f"{importers} import {top}"


def test_no_module_is_hidden_by_a_function_of_the_same_name():
    """``minidp.<name>`` for a module file ``minidp/<name>.py`` is that module, not a function re-exported over it."""
    hidden = sorted(
        name for name in MODULES if name and "." not in name and not hasattr(getattr(minidp, name, None), "__file__")
        and hasattr(minidp, name)
    )
    assert not hidden, f"minidp.<name> is not the module minidp/<name>.py for {hidden}"


@pytest.mark.fresh_interpreter
def test_importing_minidp_warns_of_nothing_so_a_program_run_with_warnings_as_errors_imports_it():
    # the package imports minidp.distributed (so that a SyncBatchNorm synchronises in a job): whatever of torch that
    # loads at import must not warn (torch's functional optimizers warn of torch.jit.script's deprecation as they load)
    done = fresh_python("-c", "import torch, warnings; warnings.simplefilter('error'); import minidp", timeout=120)
    assert done.returncode == 0, done.stderr

