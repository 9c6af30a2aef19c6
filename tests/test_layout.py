"""The code layout's rules (docs/architecture.md), checked without Ray: packages import only the
layers below them (LAYERS, function-level imports included, no exceptions), only leaves sit at
the root, the driver-side packages import no torch, Ray's private modules are imported only where
the code says it depends on them, our modules import each other without a cycle, no module grows
past a screenful of screens, and no two modules share a name."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from raytrain_lm.models import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "raytrain_lm"

# The packages and root modules, lowest first: each imports only from the levels below its own (and
# from itself); two packages of one level import neither of each other. What both sides of a seam
# use (the driver and the workers; our code and Ray's private API) lives below both.
LAYERS = [
    ("errors", "env", "setting"),  # leaves: import nothing of ours
    ("console",),  # the terminal (env)
    ("models",),  # what a model is: its settings, its family's answers, its decoder
    ("config",),  # what a run is: settings, presets, checks, the layout, the workers' inputs
    ("store",),  # every byte on disk: files, runs, checkpoints, the metrics row, the summary
    ("data",),  # corpora, tokenizers, shards, the workers' loaders
    ("plan",),  # layouts' memory, traffic and time; the GPU table
    ("parallel",),  # builds the model as a rank holds it, from a Layout and the family's plan
    ("worker",),  # what runs inside a Ray Train worker
    ("ray_compat", "cluster"),  # our code on Ray's private API; reaching and running clusters
    ("track",),  # experiment tracking from the driver (MLflow, W&B): runs, sweeps, evaluate use it
    ("run",),  # the driver side of a run
    ("results",),  # what a run gives afterwards
    ("tune",),  # sweeps and lr-find, built on runs and results
    ("cli",),  # the commands
]
LEAVES = LAYERS[0] + LAYERS[1]  # the only modules at the root
LEVEL = {name: i for i, level in enumerate(LAYERS) for name in level}

# Packages (and modules) that run on the driver or in Ray's controller: importing any of their
# modules must not import torch. store/checkpoint_format.py is the checkpoint format (torch.save and
# torch.distributed.checkpoint), read and written by workers, `generate` and `export` only;
# store/safetensors_io.py reads a rank's slices of Hugging Face weights and writes an export's. In
# models/ every module but the decoders (decoder.py, attention.py and each family's, Family.decoder): the
# checks, the planner and the driver ask the families without torch.
TORCH_FREE = ("cli", "config", "run", "ray_compat", "plan", "store", "cluster", "tune", "track", "models",
              "errors", "env", "console", "data.tokenizer", "results.tables", "results.plots")
TORCH_FREE_EXCEPT = {"raytrain_lm.store.checkpoint_format", "raytrain_lm.store.safetensors_io",
                     "raytrain_lm.models.decoder", "raytrain_lm.models.attention",
                     *(f.decoder.partition(":")[0] for f in FAMILIES.values())}
# Where Ray's private API (`ray._private`, `ray.train.v2._internal`, ...) may be imported.
RAY_PRIVATE_OK = ("ray_compat", "cluster")
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def torch_free_modules() -> list[str]:
    out = []
    for name in MODULES:
        rel = name.removeprefix("raytrain_lm.")
        if name in TORCH_FREE_EXCEPT:
            continue
        if any(rel == t or rel.startswith(t + ".") for t in TORCH_FREE):
            out.append(name)
    return out


IMPORTS_TORCH = ("import importlib, sys\n"
                 "for name in sys.argv[1:]:\n"
                 "    importlib.import_module(name)\n"
                 "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))\n")


def imports_torch(*names: str, path: str = "") -> bool:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p)}
    r = subprocess.run([sys.executable, "-c", IMPORTS_TORCH, *names], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip() == "True"


def test_driver_side_modules_import_no_torch():
    """All modules of the driver-side packages, imported in one fresh interpreter, leave torch
    (and anything under it) out of sys.modules; where they do not, each is tried alone, to name
    the ones that import it."""
    names = torch_free_modules()
    assert "raytrain_lm.run.driver" in names and "raytrain_lm.ray_compat.trainer" in names
    if imports_torch(*names):
        assert [n for n in names if imports_torch(n)] == []


def test_the_check_sees_torch(tmp_path):
    """The same check names a module that brings torch into sys.modules (a stand-in that puts an
    entry there: importing torch itself would cost seconds and show the same)."""
    (tmp_path / "uses_torch.py").write_text("import sys\nsys.modules['torch'] = sys\n")
    assert imports_torch("raytrain_lm.config.settings", "uses_torch", path=str(tmp_path))
    assert not imports_torch("raytrain_lm.config.settings", path=str(tmp_path))


parse = functools.lru_cache(maxsize=None)(ast.parse)  # each module's text, parsed once


def import_nodes(tree: ast.AST, top_level_only: bool) -> list[ast.stmt]:
    """The import statements of `tree`: anywhere, or at its top level (also inside try/if, not in
    TYPE_CHECKING blocks)."""
    if not top_level_only:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    nodes = []
    todo = list(tree.body)
    while todo:
        n = todo.pop(0)
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            todo.extend(n.orelse)
        elif isinstance(n, (ast.If, ast.Try)):
            todo.extend(n.body + n.orelse + getattr(n, "handlers", []) + getattr(n, "finalbody", []))
        elif isinstance(n, ast.ExceptHandler):
            todo.extend(n.body)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            nodes.append(n)
    return nodes


def from_base(n: ast.ImportFrom, module: str) -> str:
    """The module a `from ... import` reads from, relative imports resolved against `module`."""
    base = n.module or ""
    if n.level:
        pkg = module.split(".")[: len(module.split(".")) - n.level + (1 if MODULES.get(
            module, Path()).name == "__init__.py" else 0)]
        base = ".".join(pkg + ([base] if base else []))
    return base


def imported_modules(tree: ast.AST, module: str, top_level_only: bool) -> list[tuple[str, int]]:
    """(module, line) for each import in `tree`; relative imports resolved against `module`."""
    out = []
    for n in import_nodes(tree, top_level_only):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
        else:
            base = from_base(n, module)
            out.append((base, n.lineno))
            out += [(f"{base}.{a.name}", n.lineno) for a in n.names]
    return out


def import_targets(tree: ast.AST, module: str, top_level_only: bool, known) -> list[str]:
    """The modules of `known` each import of `tree` names: `import a.b` -> a.b; `from p import n`
    -> p.n where that is a module other than this one, else p (n is p's attribute: in
    models/family.py, `from raytrain_lm.models import family` reads the registry's function)."""
    def own(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    out = []
    for n in import_nodes(tree, top_level_only):
        if isinstance(n, ast.Import):
            out += [own(a.name) for a in n.names]
            continue
        base = from_base(n, module)
        for a in n.names:
            sub = f"{base}.{a.name}"
            out.append(sub if sub in known and sub != module else own(base))
    return [t for t in out if t]


def is_ray_private(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "ray" and any(p in ("_private", "_internal") for p in parts)


def test_ray_private_api_only_in_ray_compat_and_cluster():
    """Ray's private modules are imported (at any level) only in ray_compat/ and cluster/, so a
    Ray upgrade is checked there."""
    bad = []
    for name, path in MODULES.items():
        rel = name.removeprefix("raytrain_lm.")
        if rel.split(".")[0] in RAY_PRIVATE_OK:
            continue
        text = path.read_text()
        for imported, line in imported_modules(parse(text), name, top_level_only=False):
            if is_ray_private(imported):
                bad.append(f"{path.relative_to(ROOT)}:{line} {imported}")
        if "ray._private" in text or "._internal." in text:
            bad.append(f"{path.relative_to(ROOT)}: names Ray's private modules")
    assert bad == []
    assert is_ray_private("ray.train.v2._internal.execution.controller")
    assert not is_ray_private("ray.train.v2.api.data_parallel_trainer")


def module_graph(top_level_only: bool = True, sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Our modules (or `sources`: module name -> its text) -> the modules of ours each imports
    (at module level, or anywhere: in functions and TYPE_CHECKING blocks too); a package's
    __init__ counts as imported with any of its modules, except a package the importing module
    sits in (Python has begun that one first) unless the module names that package itself
    (`from raytrain_lm.models import family` in models/family.py: the registry's __init__)."""
    sources = sources if sources is not None else {n: p.read_text() for n, p in MODULES.items()}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, text in sources.items():
        for imported in import_targets(parse(text), name, top_level_only, sources):
            if imported not in (name, "raytrain_lm"):
                graph[name].add(imported)
            # importing a.b.c imports a.b first, except where a.b is this module's own package
            while (imported := imported.rpartition(".")[0]) and imported != "raytrain_lm":
                if imported != name and not name.startswith(imported + "."):
                    graph[name].add(imported)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_module_level_import_cycle():
    """No chain of module-level imports among our modules leads back to where it started."""
    graph = module_graph()
    assert graph["raytrain_lm.config.load"] >= {"raytrain_lm.config.checks"}
    assert find_cycle(graph) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_even_through_functions():
    """Nor through imports inside functions or TYPE_CHECKING blocks, which hide a cycle from
    Python but not from a reader (config -> checks -> elastic -> config was one; models/family ->
    the registry -> moe -> models/family another). No exception."""
    assert find_cycle(module_graph(top_level_only=False)) == []


# A package whose __init__ imports its module `x` at the top, `x` importing the package back in a
# function: the circle the checks above must see (a module's own package counts where it names it).
CIRCLE_IN_A_PACKAGE = {
    "raytrain_lm.fake": "from raytrain_lm.fake.x import f\n",
    "raytrain_lm.fake.x": "def f():\n    from raytrain_lm.fake import g\n    return g\n",
    "raytrain_lm.fake.y": "from raytrain_lm.fake.x import f\n",
}


def test_the_cycle_check_sees_a_circle_through_a_function_inside_a_package():
    """The check names the circle package -> its module -> the package, made by a function-level
    import, and only with function-level imports counted; a sibling importing a module of its own
    package (y -> x, which begins the package first) adds no edge to the package."""
    assert find_cycle(module_graph(top_level_only=False, sources=CIRCLE_IN_A_PACKAGE)) == [
        "raytrain_lm.fake", "raytrain_lm.fake.x", "raytrain_lm.fake"]
    assert find_cycle(module_graph(top_level_only=True, sources=CIRCLE_IN_A_PACKAGE)) == []
    assert module_graph(sources=CIRCLE_IN_A_PACKAGE)["raytrain_lm.fake.y"] == {"raytrain_lm.fake.x"}


def is_torch(name: str) -> bool:
    """torch, or a module of it, or a library's torch binding (safetensors.torch)."""
    return "torch" in name.split(".")


def torch_at_import(sources: dict[str, str]) -> set[str]:
    """The modules of `sources` that import torch when imported: those whose module-level imports
    name torch or reach, through module-level imports, one that does."""
    direct = {name for name, text in sources.items()
              if any(is_torch(i) for i, _ in imported_modules(parse(text), name, True))}
    graph = module_graph(top_level_only=True, sources=sources)
    found, todo = set(direct), list(direct)
    while todo:
        hit = todo.pop()
        for name, imported in graph.items():
            if hit in imported and name not in found:
                found.add(name)
                todo.append(name)
    return found


TORCH_REASON = "# torch:"  # an import's line (or the one above) says why the driver side loads torch


def torch_reaching_imports(sources: dict[str, str], driver_side: list[str]) -> list[str]:
    """Every import (in functions too) of a `driver_side` module that reaches torch (torch
    itself, or a module of ours that imports it) without saying why on its line: `# torch:` and
    the reason (a command that loads a model, a function that runs on a worker), or on the line
    above it."""
    heavy = torch_at_import(sources)
    bad = []
    for name in driver_side:
        text = sources[name]
        lines = text.splitlines()
        for imported, line in imported_modules(parse(text), name, top_level_only=False):
            ours = imported
            while ours and ours not in sources:
                ours = ours.rpartition(".")[0]
            if (is_torch(imported) or ours in heavy) and TORCH_REASON not in "".join(lines[max(0, line - 2):line]):
                bad.append(f"{name}:{line} {imported}")
    return sorted(set(bad))


def test_driver_side_function_level_imports_reach_no_torch():
    """A driver-side module's imports inside functions, which the import test above never runs,
    reach no torch either, unless the line says why (`# torch: ...`): the code that loads a model
    or runs a worker's function; a pure function is imported from a pure module."""
    sources = {n: p.read_text() for n, p in MODULES.items()}
    assert "raytrain_lm.worker.loop" in torch_at_import(sources)
    assert torch_reaching_imports(sources, torch_free_modules()) == []


def test_the_torch_check_sees_a_function_level_import():
    """The check names a function-level import of torch, and one of a module of ours whose
    module-level imports reach torch through another; a line saying why passes, and so does a
    pure module."""
    sources = {
        "raytrain_lm.fake.heavy": "import torch.nn\n",
        "raytrain_lm.fake.via": "from raytrain_lm.fake.heavy import x\n",
        "raytrain_lm.fake.pure": "import math\n",
        "raytrain_lm.fake.driver": ("def a():\n    import torch\n"
                                    "def b():\n    from raytrain_lm.fake.via import y\n"
                                    "def c():\n    from raytrain_lm.fake.pure import z\n"
                                    "def d():\n    import torch  # torch: d builds a model\n"),
    }
    assert torch_reaching_imports(sources, ["raytrain_lm.fake.driver"]) == [
        "raytrain_lm.fake.driver:2 torch", "raytrain_lm.fake.driver:4 raytrain_lm.fake.via",
        "raytrain_lm.fake.driver:4 raytrain_lm.fake.via.y"]


def layer(module: str) -> str:
    """The LAYERS entry a module of ours belongs to: its package, or itself at the root."""
    return module.split(".")[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of `graph` (module -> modules it imports) that does not point down LAYERS:
    into a package of its own level or above. A package missing from LAYERS counts as above all."""
    bad = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            mine, theirs = layer(module), layer(other)
            if mine != theirs and LEVEL.get(theirs, len(LAYERS)) >= LEVEL.get(mine, -1):
                bad.append(f"{module} -> {other}")
    return bad


def test_imports_point_down_the_layers():
    """Every import of our modules (at module level, in functions, under TYPE_CHECKING) reaches
    only the layers below its package's, or its own package; every package and root module has
    its place in LAYERS, and only leaves sit at the root."""
    assert upward_imports(module_graph(top_level_only=False)) == []
    entries = {layer(name) for name in MODULES if name != "raytrain_lm"}
    assert entries <= set(LEVEL), entries - set(LEVEL)
    roots = {name.removeprefix("raytrain_lm.") for name, path in MODULES.items()
             if path.parent == PKG and path.name != "__init__.py"}
    assert roots <= set(LEAVES), roots - set(LEAVES)


def test_the_layer_check_sees_an_upward_import():
    """The check names an import into a higher layer, into a package of the same level, and
    into a package LAYERS does not place; imports down and within a package pass."""
    graph = {"raytrain_lm.config.checks": {"raytrain_lm.worker.loop", "raytrain_lm.models.family",
                                           "raytrain_lm.config.layout"},
             "raytrain_lm.cluster.jobs": {"raytrain_lm.ray_compat.trainer"},
             "raytrain_lm.run.driver": {"raytrain_lm.newpkg.x", "raytrain_lm.errors"}}
    assert upward_imports(graph) == ["raytrain_lm.cluster.jobs -> raytrain_lm.ray_compat.trainer",
                                     "raytrain_lm.config.checks -> raytrain_lm.worker.loop",
                                     "raytrain_lm.run.driver -> raytrain_lm.newpkg.x"]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


# What a sweep's saved Tune state (tuner.pkl) names by module path: the RunConfig's LiveTable and
# the TuneConfig's trial-name function, and the function the stop callback (pickled by value)
# calls. `tune --resume` unpickles it, so these keep their paths (a sweep started before a move
# would not resume): the globals a tuner.pkl's unpickler looks up (find_class), listed.
PICKLED_BY_PATH = {"raytrain_lm.tune.report": ("LiveTable",),
                   "raytrain_lm.tune.sweep": ("_trial_name", "abort_train_run"),
                   "raytrain_lm.tune.trial_tracking": ("TrackTrials",)}


def test_what_a_saved_sweep_names_by_module_path_is_still_there():
    """Each is defined at the top level of that module's file (read, not imported: importing
    tune/ imports Ray Tune)."""
    for module, names in PICKLED_BY_PATH.items():
        tree = ast.parse(MODULES[module].read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert set(names) <= defined, (module, set(names) - defined)


def test_no_two_modules_share_a_name():
    """`report.py` here and `report.py` there reads as one module in a traceback or a grep."""
    by_name = defaultdict(list)
    for path in MODULES.values():
        if path.name != "__init__.py":
            by_name[path.stem].append(str(path.relative_to(ROOT)))
    assert {k: v for k, v in by_name.items() if len(v) > 1} == {}
