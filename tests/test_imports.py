"""No import cycles among dtrain's modules, nor among its packages: each module's job, and
each package's, sits on one side of a seam.

Every import statement counts, wherever it is in a file (inside a function, under
``TYPE_CHECKING``): a lazy or type-only import still ties two modules together. So does the
package ``__init__`` that importing a module of another package runs first. Between packages,
a module's import of any module of another package counts as an import of that package (a
top-level module such as ``dtrain.cli`` is a package of its own here), so ``parallel ->
checkpoint`` and ``checkpoint -> parallel`` through different modules is a cycle too.

And the tree says who runs what (docs/architecture.md): the package root holds the user API,
the entry points and leaves only; the parent's package (``launch``) imports nothing of the
worker's loop, and the in-place recovery sits below the loop and the launcher that call it."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from dtrain.parallel import strategy_class, strategy_names

SRC = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, module: str) -> Iterator[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            # `from package import module` imports that module.
            yield from (f"{base}.{alias.name}" for alias in node.names)


def ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(src: Path = SRC, package: str = "dtrain") -> dict[str, set[str]]:
    """Module -> the dtrain modules it imports. Importing ``a.b.c`` runs the ``__init__`` of
    ``a.b`` first: that counts as an import of the package too, unless it is a package this
    module lives in (a package's ``__init__`` importing its own modules is no cycle)."""
    files = {module_name(p, src): p for p in (src / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        own = ancestors(module) | {module}
        edges = set()
        for name in imported_names(path, module):
            for target in {name} | ancestors(name):
                if target in files and target not in own:
                    edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checker_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_a_package_init_counts_for_modules_of_other_packages(tmp_path: Path) -> None:
    # top/a/__init__ imports top.b.mod, which imports top.a.base: importing top.a.base runs
    # top/a/__init__ first, which waits on top.b.mod -- a cycle the plain edges do not show.
    # top/a/__init__ importing its own top.a.base is none.
    files = {
        "top/__init__.py": "",
        "top/a/__init__.py": "from top.a.base import X\nfrom top.b.mod import Y\n",
        "top/a/base.py": "X = 1\n",
        "top/b/__init__.py": "",
        "top/b/mod.py": "from top.a.base import X\nY = X\n",
    }
    write_tree(tmp_path, files)
    assert cycles(import_graph(tmp_path, "top")) == [["top.a", "top.b.mod"]]


def test_no_module_of_dtrain_imports_itself_back() -> None:
    graph = import_graph()
    assert "dtrain.train.trainer" in graph and "dtrain.parallel.base" in graph  # it read the tree
    assert cycles(graph) == []


def package_of(module: str, src: Path = SRC) -> str:
    """``dtrain.X`` for a module of the subpackage ``dtrain/X/`` (at any depth); a module
    directly under ``dtrain/`` is its own."""
    parts = module.split(".")
    if len(parts) > 2 or (src / Path(*parts)).is_dir():
        return ".".join(parts[:2])
    return module


def package_graph(graph: dict[str, set[str]], src: Path = SRC) -> dict[str, set[str]]:
    """Package -> the packages its modules import (a package's own modules do not count)."""
    out: dict[str, set[str]] = {package_of(m, src): set() for m in graph}
    for module, targets in graph.items():
        mine = package_of(module, src)
        out[mine] |= {package_of(t, src) for t in targets} - {mine}
    return out


def test_the_package_graph_finds_a_cycle_through_different_modules(tmp_path: Path) -> None:
    # top.a.one imports top.b.two, and top.b.three imports top.a.four: no module cycle, but
    # the packages a and b import each other.
    files = {
        "top/__init__.py": "",
        "top/a/__init__.py": "",
        "top/a/one.py": "import top.b.two\n",
        "top/a/four.py": "",
        "top/b/__init__.py": "",
        "top/b/two.py": "",
        "top/b/three.py": "import top.a.four\n",
    }
    write_tree(tmp_path, files)
    graph = import_graph(tmp_path, "top")
    assert cycles(graph) == []
    assert cycles(package_graph(graph, tmp_path)) == [["top.a", "top.b"]]


def test_no_package_of_dtrain_imports_itself_back() -> None:
    packages = package_graph(import_graph())
    assert {"dtrain.parallel", "dtrain.checkpoint", "dtrain.config"} <= set(packages)
    assert cycles(packages) == []


# The package root: the user API (``__init__``, ``task``, ``hf``), the entry points
# (``__main__``, ``worker``; the command line is the package ``cli/``) and leaves. A new module
# goes into the package of its role.
ROOT_MODULES = {
    "__init__.py",
    "task.py",
    "hf.py",
    "__main__.py",
    "worker.py",
    "errors.py",
    "fsutil.py",
    "console.py",
    "process_exit.py",
}


def test_the_package_root_holds_the_api_the_entry_points_and_leaves() -> None:
    files = {path.name for path in (SRC / "dtrain").glob("*.py")}
    assert len(files) <= 10
    assert files <= ROOT_MODULES, f"a new module at the root: {sorted(files - ROOT_MODULES)}"


def test_the_architecture_page_names_every_package_and_root_module() -> None:
    page = (SRC.parent / "docs" / "architecture.md").read_text()
    tree = page[page.index("## The tree, by role") :]
    packages = {p.name for p in (SRC / "dtrain").iterdir() if (p / "__init__.py").exists()}
    missing = [f"{name}/" for name in sorted(packages) if f"`{name}/`" not in tree]
    missing += [name for name in sorted(ROOT_MODULES) if f"`{name[:-3]}`" not in tree]
    assert missing == [], f"docs/architecture.md's tree does not name {missing}"


def test_each_role_imports_only_what_runs_in_its_process() -> None:
    packages = package_graph(import_graph())
    importers = {p: {q for q, targets in packages.items() if p in targets} for p in packages}
    # The leaves import nothing of dtrain (fsutil: only errors, for its one-line error).
    for leaf in ("dtrain.errors", "dtrain.console", "dtrain.process_exit"):
        assert packages[leaf] == set(), leaf
    assert packages["dtrain.fsutil"] == {"dtrain.errors"}
    # The parent trains nothing: the launcher imports none of the loop, the strategies, the
    # data, the model's numerics or weights; only the command line starts it.
    worker_side = {"dtrain.train", "dtrain.parallel", "dtrain.data", "dtrain.compute"}
    assert packages["dtrain.launch"].isdisjoint(
        worker_side | {"dtrain.balance", "dtrain.weights", "dtrain.worker"}
    )
    assert importers["dtrain.launch"] <= {"dtrain.cli"}
    # The worker's loop is wired by the entry points only, and by the own-loop API, which
    # drives the same trainer from a loop of the user's (the worker starts it).
    assert importers["dtrain.train"] <= {"dtrain.cli", "dtrain.worker", "dtrain.loop"}
    assert importers["dtrain.loop"] <= {"dtrain", "dtrain.worker"}  # dtrain.Run
    # fault.recovery = 'inplace' is called by the loop and the launcher, never the other way.
    assert packages["dtrain.recovery"].isdisjoint(
        {"dtrain.train", "dtrain.launch", "dtrain.worker", "dtrain.cli"}
    )


def test_the_loop_knows_in_place_recovery_only_through_its_seam() -> None:
    """Of the worker's side, only the in-place worker (which runs a trainer per membership
    generation) and the worker entry that starts it import ``dtrain.recovery``; the trainer and
    the rest of the loop know it as ``train/recovery_seam.RecoverySeam``."""
    graph = import_graph()
    importers = {
        module
        for module, targets in graph.items()
        if any(t == "dtrain.recovery" or t.startswith("dtrain.recovery.") for t in targets)
        and not module.startswith("dtrain.recovery")
    }
    assert importers <= {
        "dtrain.train.inplace_worker",
        "dtrain.worker",
        "dtrain.launch.launcher",  # its layout for fault.recovery = 'inplace'
        "dtrain.launch.reports",  # a failed in-place worker named by its member id
    }, importers
    assert "dtrain.train.recovery_seam" in graph["dtrain.train.trainer.loop"]


# torch modules that importing dtrain's launcher, worker and data-parallel strategies must not
# bring in, ~1.2 s of imports together: the launcher and every worker paid them while the
# strategy registry imported every strategy up front. (At run time torch itself imports
# TorchDynamo in a worker, from its optimizers and DDP; the launcher never does.)
HEAVY = ("torch.distributed.pipelining", "torch.distributed.tensor", "torch._dynamo")


def loaded_after(code: str, modules: tuple[str, ...] = HEAVY) -> set[str]:
    """Which of ``modules`` a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


def test_the_launcher_and_a_ddp_worker_import_no_model_parallel_machinery() -> None:
    launcher = "import dtrain.cli, dtrain.train.job, dtrain.launch.launcher"
    worker = (
        "import dtrain.worker\n"
        "from dtrain.parallel import strategy_class\n"
        "for name in ('ddp', 'allreduce', 'localsgd', 'diloco'):\n"
        "    strategy_class(name)"
    )
    assert loaded_after(launcher) == set()
    assert loaded_after(worker) == set()
    # The probe sees them when they are there: the pipeline strategy needs them.
    pipeline = "from dtrain.parallel import strategy_class\nstrategy_class('pipeline')"
    assert {"torch.distributed.pipelining", "torch.distributed.tensor"} <= loaded_after(pipeline)


# The worker's loop, which `dtrain train`'s parent loads configs beside but never runs.
LOOP = (
    "dtrain.train.trainer",
    "dtrain.train.step",
    "dtrain.data.loader",
    "dtrain.balance.balancer",
)


def test_the_parent_loads_configs_without_the_workers_loop() -> None:
    launcher = "import dtrain.cli, dtrain.cli.train, dtrain.train.job, dtrain.launch.launcher"
    assert loaded_after(launcher, LOOP) == set()
    # The probe sees them when they are there: building a trainer needs them.
    assert loaded_after("import dtrain.train.trainer", LOOP) == set(LOOP)


def test_every_registered_strategy_has_its_name() -> None:
    for name in strategy_names():
        assert strategy_class(name).name == name


def test_commands_that_read_run_folders_do_not_import_torch() -> None:
    # `dtrain status` is run in a loop beside a job: 0.1 s, where importing torch takes 1.2 s.
    code = "import dtrain.cli, dtrain.report.status\nfrom dtrain.cli import main"
    assert loaded_after(code, ("torch",)) == set()
    assert loaded_after("from dtrain import Task", ("torch",)) == {"torch"}  # still exported


def test_opt_in_extensions_are_off_the_core_path() -> None:
    """No module outside ``dtrain.ext`` imports an extension: each is found by the config
    value that names it (``comm.transport``: :mod:`dtrain.comm.transport`'s registry) and
    imported only when a run asks for it; a worker of the default job never loads one."""
    graph = import_graph()
    importers = {
        module
        for module, targets in graph.items()
        if any(t == "dtrain.ext" or t.startswith("dtrain.ext.") for t in targets)
        and not module.startswith("dtrain.ext")
    }
    assert importers == set(), importers
    core = "import dtrain.worker, dtrain.cli, dtrain.comm.compression, dtrain.parallel.ddp"
    assert loaded_after(core, ("dtrain.ext.shm",)) == set()
    named = "from dtrain.comm.transport import transport_module\ntransport_module('shm')"
    assert loaded_after(named, ("dtrain.ext.shm",)) == {"dtrain.ext.shm"}  # the probe sees it
