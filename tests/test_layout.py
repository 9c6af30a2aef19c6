"""The code layout's rules (docs/architecture.md), checked without Ray: packages import only the
layers below them (LAYERS, function-level imports included, no exceptions), only leaves sit at
the root, the driver-side packages import no torch, Ray's private modules are imported only where
the code says it depends on them, our modules import each other without a cycle, no module grows
past a screenful of screens, and no two modules share a name."""

from __future__ import annotations

import ast
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
    ("errors", "env"),  # leaves: import nothing of ours
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


def imported_modules(tree: ast.AST, module: str, top_level_only: bool) -> list[tuple[str, int]]:
    """(module, line) for each import in `tree`; relative imports resolved against `module`."""
    out = []
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # a module's top level: also inside try/if, not in TYPE_CHECKING blocks
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
            else:
                nodes.append(n)
    for n in nodes:
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                pkg = module.split(".")[: len(module.split(".")) - n.level + (1 if MODULES.get(
                    module, Path()).name == "__init__.py" else 0)]
                base = ".".join(pkg + ([base] if base else []))
            out.append((base, n.lineno))
            out += [(f"{base}.{a.name}", n.lineno) for a in n.names]
    return out


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
        for imported, line in imported_modules(ast.parse(text), name, top_level_only=False):
            if is_ray_private(imported):
                bad.append(f"{path.relative_to(ROOT)}:{line} {imported}")
        if "ray._private" in text or "._internal." in text:
            bad.append(f"{path.relative_to(ROOT)}: names Ray's private modules")
    assert bad == []
    assert is_ray_private("ray.train.v2._internal.execution.controller")
    assert not is_ray_private("ray.train.v2.api.data_parallel_trainer")


def module_graph(top_level_only: bool = True) -> dict[str, set[str]]:
    """Our modules -> the modules of ours each imports (at module level, or anywhere: in
    functions and TYPE_CHECKING blocks too); a package's __init__ counts as imported with any of
    its modules."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        for imported, _ in imported_modules(ast.parse(path.read_text()), name, top_level_only):
            while imported and imported not in MODULES:
                imported = imported.rpartition(".")[0]
            # importing a.b.c imports a.b first, except where a.b is this module's own package
            while imported and imported != "raytrain_lm":
                if imported != name and not name.startswith(imported + "."):
                    graph[name].add(imported)
                imported = imported.rpartition(".")[0]
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
    """No chain of module-level imports among our modules leads back to where it started (a
    module's own package is not counted as imported by it: Python has begun that one first)."""
    graph = module_graph()
    assert graph["raytrain_lm.config.load"] >= {"raytrain_lm.config.checks"}
    assert find_cycle(graph) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_even_through_functions():
    """Nor through imports inside functions or TYPE_CHECKING blocks, which hide a cycle from
    Python but not from a reader (config -> checks -> elastic -> config was one). No exception."""
    assert find_cycle(module_graph(top_level_only=False)) == []


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
