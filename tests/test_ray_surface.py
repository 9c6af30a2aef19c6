"""Ray's private surface (ray_compat/surface.py) pinned against the installed Ray: every touch
holds, the check names a touch that no longer does, and the code touches nothing the list does not
name (imports from private modules or of private names, `ray._...` attribute chains, and, in
ray_compat/ and cluster/, private attributes and methods that are not our own)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from raytrain_lm.ray_compat.surface import TOUCHES, Touch, problems

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "raytrain_lm"
RAY_SIDE = ("ray_compat", "cluster")


def test_every_touch_of_rays_private_api_holds_in_the_installed_ray():
    """Each name exists, each call takes the parameters we pass, each overridden method has the
    parameters we override it with, each attribute is still set by Ray's class."""
    assert problems() == []


def test_the_check_names_a_touch_that_no_longer_holds():
    """A renamed module or name, a call without a parameter we pass, an overridden method whose
    parameters changed, an attribute Ray no longer sets: each gives one line naming our module,
    Ray's name and why we touch it."""
    v2 = "ray.train.v2._internal"
    gone = [Touch(f"{v2}.execution.no_such_module:X", "name", "ray_compat.x", "why-1"),
            Touch(f"{v2}.execution.controller:NoSuchController", "name", "ray_compat.x", "why-2"),
            Touch(f"{v2}.execution.preemption:PreemptionWatcher", "call", "ray_compat.x", "why-3",
                  ("poll_interval_s", "no_such_parameter")),
            Touch(f"{v2}.execution.worker_group:WorkerGroup", "method", "ray_compat.x", "why-4",
                  ("_get_worker_runtime_env", "renamed_argument")),
            Touch(f"{v2}.execution.controller:TrainController", "attr", "ray_compat.x", "why-5",
                  ("_no_such_attribute",))]
    found = problems(gone)
    assert len(found) == len(gone)
    for touch, line in zip(gone, found):
        assert line.startswith(f"ray_compat.x -> {touch.target}") and touch.why in line, line
    assert "no_such_parameter" in found[2] and "renamed_argument" in found[3] and "_no_such_attribute" in found[4]


@functools.cache
def _parsed() -> tuple:
    """Our modules' trees, each node knowing its parent (only whole attribute chains are read)."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node
        out.append((path, tree))
    return tuple(out)


def _modules():
    return _parsed()


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _private_module(module: str) -> bool:
    return module.startswith("ray.") and any(p.startswith("_") for p in module.split("."))


def used_private_names() -> set[str]:
    """'module.name' of every private module's name imported, of every private name imported
    from Ray, and every `ray._...` attribute chain, in all of our code."""
    out = set()
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
                for alias in node.names:
                    if _private_module(node.module) or alias.name.startswith("_"):
                        out.add(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if _private_module(a.name)}
            elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
                chain = _dotted(node)
                if chain.startswith("ray._"):
                    out.add(chain)
    return out


def declared(name: str) -> bool:
    """Whether `name` (a module, or a dotted chain through one) is a touch, or lies inside one's
    target (`ray._private.state.state.get_draining_nodes` inside `ray._private.state:state`), or
    is a module whose names are all touches' (`import ray._private.ray_constants as ...`)."""
    targets = {t.target.replace(":", ".") for t in TOUCHES}
    return any(name == t or name.startswith(t + ".") for t in targets) or \
        any(t.startswith(name + ".") for t in targets)


def test_the_code_touches_only_what_the_surface_names():
    used = used_private_names()
    assert "ray._private.worker.blocking_get_inside_async_warned" in used
    assert sorted(n for n in used if not declared(n)) == []


def own_private_names() -> set[str]:
    """Private names our code defines itself: functions and classes, and attributes it assigns
    (`self._x = ...`) where no touch says the attribute is Ray's."""
    out = set()
    for _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Attribute) and n.attr.startswith("_"):
                            out.add(n.attr)
    return out


def test_private_attributes_on_the_ray_side_are_ours_or_declared():
    """In ray_compat/ and cluster/, every private attribute or method read (`x._name`) is a
    touch's or one our code defines; Ray's that we also assign are touches (a new one is caught
    where it is only read, not where we assign it first: the declaration's reason says why)."""
    ray_names = {t.params[0] for t in TOUCHES if t.kind in ("attr", "method")} | \
        {t.name.rpartition(".")[2] for t in TOUCHES}
    assigned_by_us = own_private_names() - ray_names
    unknown = []
    for path, tree in _modules():
        if path.relative_to(PKG).parts[0] not in RAY_SIDE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if _dotted(node).startswith("ray."):  # a chain through Ray's modules: the test above
                    continue
                if node.attr not in ray_names and node.attr not in assigned_by_us:
                    unknown.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert unknown == []
