"""The package's shape, checked from the source (ast): small modules and classes, no import cycle,
no module using another module's private names. See docs/architecture.md."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("rl_ckpt", "actors")
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 250

# Modules known to break a rule, each with who is fixing it. xfail(strict): once fixed, the test
# passes, the xfail turns into a failure, and the entry must be removed.
KNOWN: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _params(rule: str) -> list:
    return [
        pytest.param(m, id=m, marks=pytest.mark.xfail(reason=KNOWN[(rule, m)], strict=True))
        if (rule, m) in KNOWN
        else pytest.param(m, id=m)
        for m in sorted(MODULES)
    ]


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if _is_package(module) else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Imports run when the module is imported: top level, and inside top-level try/if blocks,
    but not under ``if TYPE_CHECKING:`` (never run)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def _imported_modules(module: str, tree: ast.Module, all_imports: bool = False) -> set[str]:
    """Our modules ``module`` imports (at import time, or anywhere with ``all_imports``)."""
    nodes = (
        [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        if all_imports
        else _top_level_imports(tree)
    )
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
            continue
        source = _absolute(module, node)
        if source in MODULES:
            found.add(source)
        found |= {f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in MODULES}
    return found - {module}


@pytest.mark.parametrize("module", _params("size"))
def test_modules_and_classes_are_small(module):
    tree, lines = TREES[module], MODULES[module].read_text().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{MODULES[module]} has {lines} lines (> {MAX_MODULE_LINES}): split it"
    big = {
        n.name: n.end_lineno - n.lineno + 1
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES
    }
    assert not big, f"{MODULES[module]}: classes over {MAX_CLASS_LINES} lines: {big}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycle():
    graph = {m: _imported_modules(m, TREES[m]) for m in MODULES}
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other (at import time): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_uses(module: str, tree: ast.Module) -> list[str]:
    """``from ours import _name`` and ``ours_module._name`` in ``module`` (dunders are not private)."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] not in PACKAGES or source == module:
                continue
            for a in node.names:
                if private(a.name):
                    found.append(f"line {node.lineno}: from {source} import {a.name}")
                if f"{source}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            found.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return found


# Private names of other libraries that rl_ckpt uses on purpose, each with why (no public equivalent).
THIRD_PARTY_PRIVATE = {
    "_exit": "os._exit: the standard library's exit without cleanup (a crash drill's kill)",
    "_metadata": "OrderedDict._metadata: torch's state_dict convention (module versions), saved and restored",
    "_call_s3": "s3fs's coroutine call (the sync call_s3 cannot run inside the upload's event loop)",
    "_np_random": "gymnasium env RNG: the demo saves and restores env state exactly (no public setter)",
    "_np_random_seed": "gymnasium env seed: as _np_random",
    "_elapsed_steps": "gymnasium TimeLimit's counter: as _np_random",
    "_has_reset": "gymnasium OrderEnforcing's flag: as _np_random",
    "_actor_id": "a Ray actor handle's id (no public accessor on the handle)",
    "_value_buffer": "moto's FakeKey holds an object's bytes there: the test S3 endpoint serves a ranged GET from it",
    # RLlib's SingleAgentEnvRunner between two sample() calls: saved and restored for an exact resume (no public
    # accessor or setter; integrations/_rllib_runners.py)
    "_ongoing_episodes": "RLlib EnvRunner's episodes in progress: saved and restored for an exact resume",
    "_ongoing_episodes_for_metrics": "RLlib EnvRunner's chunks of episodes in progress, for their metrics: as above",
    "_done_episodes_for_metrics": "RLlib EnvRunner's finished episodes not yet counted in metrics: as above",
    "_cached_to_module": "RLlib EnvRunner's env-to-module output for its next action: as above",
    "_shared_data": "RLlib EnvRunner's connectors' shared data: as above",
    "_needs_initial_reset": "RLlib EnvRunner's flag: reset the envs at the next sample(): as above",
    "_autoreset_envs": "gymnasium SyncVectorEnv's pending auto-resets: as above",
    "_worker_manager": "RLlib EnvRunnerGroup's actor manager: its handles (actors()) take a save's request for the "
    "EnvRunners' state directly, collected on the save's writer (RLlib's own request bookkeeping is not thread-safe)",
    "_set_optimizer_state": "RLlib TorchLearner's restore of its optimizers: compared (not called) to know it is "
    "torch's load_state_dict, before reading the moments into the optimizers' own tensors",
}


def _private_attributes(tree: ast.Module) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self``/``cls`` and ``_name`` is not this module's own (defined or set
    on ``self`` here): reaching into another object's privates."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and private(node.id):
            own.add(node.id)
    return sorted(
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and private(node.attr)
        and node.attr not in own
        and node.attr not in THIRD_PARTY_PRIVATE
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    )


@pytest.mark.parametrize("module", _params("private"))
def test_no_private_attribute_of_another_object(module):
    uses = _private_attributes(TREES[module])
    assert not uses, (
        f"{MODULES[module]} reaches into another object's private attributes (make them public, or "
        f"add a third-party name with its reason to THIRD_PARTY_PRIVATE): {uses}"
    )


def test_private_attribute_finder():
    tree = ast.parse(
        "class A:\n    def f(self, other, storage):\n        self._mine = 1\n"
        "        return other._mine, storage._observed_fsync(), self._x, torch.a._traverse\n"
    )
    assert _private_attributes(tree) == ["line 4: storage._observed_fsync", "line 4: torch.a._traverse"]


@pytest.mark.parametrize("module", _params("private"))
def test_no_private_name_of_another_module(module):
    uses = _private_uses(module, TREES[module])
    assert not uses, f"{MODULES[module]} uses other modules' private names (make them public or move them): {uses}"


def test_private_name_finder():
    tree = ast.parse(
        "from rl_ckpt._run.commit import _x, Attempt\nfrom rl_ckpt._run import catalog as c\n"
        "def f():\n    from .layout import _y\n    return c._z, c.Catalog\n"
    )
    assert _private_uses("rl_ckpt._run.gc", tree) == [
        "line 1: from rl_ckpt._run.commit import _x",
        "line 4: from rl_ckpt._run.layout import _y",
        "line 5: rl_ckpt._run.catalog._z",
    ]


# The package's layers, lowest first. A module may import (at import time, or later inside a
# function: a lazy import that goes up counts too) modules of its own layer and of the layers below,
# never above. A module belongs to the layer of its longest listed prefix; the top-level package
# ``rl_ckpt`` itself (the public facade, re-exporting the engine) sits at the top.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("rl_ckpt.errors", "rl_ckpt.config", "rl_ckpt.components", "rl_ckpt.data")),
    ("storage", ("rl_ckpt._storage",)),
    ("format", ("rl_ckpt._format",)),
    ("run", ("rl_ckpt._run",)),
    ("sharded state", ("rl_ckpt._sharded",)),
    ("commit", ("rl_ckpt._commit",)),
    ("the manager client", ("rl_ckpt.integrations._managed",)),
    ("recovery", ("rl_ckpt._recovery",)),
    ("core", ("rl_ckpt._core",)),
    ("fronts", ("rl_ckpt.integrations", "rl_ckpt._export", "rl_ckpt._timeline", "actors")),
    ("applications and tools", ("rl_ckpt", "rl_ckpt.cli", "rl_ckpt.demo", "rl_ckpt.tools")),
)


def _layer(module: str) -> int | None:
    """Index in ``LAYERS`` of ``module`` (longest matching prefix; ``rl_ckpt`` matches only itself)."""
    best, best_len = None, -1
    for i, (_name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = module == p or (p != "rl_ckpt" and module.startswith(p + "."))
            if hit and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _runtime_imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import in the module: at import time, inside functions, and under ``if TYPE_CHECKING:`` (a type-only
    import still ties the module to the one it names: the layers hold for it too)."""
    out = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return sorted(out, key=lambda n: n.lineno)


def _import_targets(module: str, node: ast.stmt) -> list[str]:
    """Our modules an import statement loads: ``from pkg import sub`` is ``pkg.sub``, ``from pkg import name``
    is ``pkg``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    source = _absolute(module, node)
    if source not in MODULES:
        return []
    return sorted({f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names})


def _upward_imports(module: str, tree: ast.Module) -> list[str]:
    own = _layer(module)
    found = []
    for node in _runtime_imports(tree):
        for target in _import_targets(module, node):
            layer = _layer(target)
            if target != module and layer is not None and own is not None and layer > own:
                found.append(f"line {node.lineno}: {module} ({LAYERS[own][0]}) imports {target} ({LAYERS[layer][0]})")
    return found


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if _layer(m) is None]
    assert not unplaced, f"modules in no layer of LAYERS (place their package there): {unplaced}"


@pytest.mark.parametrize("module", _params("layers"))
def test_imports_point_down_the_layers(module):
    up = _upward_imports(module, TREES[module])
    assert not up, (
        f"{MODULES[module]} imports upward (move what it needs down, or the importer up; layers, "
        f"lowest first: {[name for name, _ in LAYERS]}): {up}"
    )


def test_layer_checker_sees_lazy_type_only_and_facade_imports():
    tree = ast.parse(
        "from rl_ckpt._format.manifest import Manifest\nfrom rl_ckpt import errors\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rl_ckpt._core.engine import E\n"
        "def f():\n    from rl_ckpt._core.reader import load_component\n"
        "    from rl_ckpt import CheckpointEngine\n    import rl_ckpt._recovery.plan\n"
    )
    assert _upward_imports("rl_ckpt._run.gc", tree) == [
        "line 5: rl_ckpt._run.gc (run) imports rl_ckpt._core.engine (core)",
        "line 7: rl_ckpt._run.gc (run) imports rl_ckpt._core.reader (core)",
        "line 8: rl_ckpt._run.gc (run) imports rl_ckpt (applications and tools)",
        "line 9: rl_ckpt._run.gc (run) imports rl_ckpt._recovery.plan (recovery)",
    ]
    assert (
        _layer("rl_ckpt.integrations._managed")
        < _layer("rl_ckpt._core.engine")
        < _layer("rl_ckpt.integrations.ray_train")
    )
    assert _layer("rl_ckpt._storage.local") < _layer("rl_ckpt._format.manifest") < _layer("rl_ckpt._run.catalog")


def test_every_error_class_lives_in_errors_and_is_exported():
    """Product errors have one home, ``rl_ckpt/errors.py``, and the facade exports each; tools and tests keep their
    own (they are not product)."""
    import rl_ckpt
    from rl_ckpt import errors

    elsewhere = []
    for module, tree in TREES.items():
        if module == "rl_ckpt.errors" or module.startswith("rl_ckpt.tools"):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and (
                node.name.endswith("Error") or any(ast.unparse(b).endswith("Error") for b in node.bases)
            ):
                elsewhere.append(f"{module}.{node.name}")
    assert not elsewhere, f"error classes outside rl_ckpt/errors.py: {elsewhere}"
    defined = [
        v
        for v in vars(errors).values()
        if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == errors.__name__
    ]
    assert all(issubclass(cls, errors.CheckpointError) for cls in defined)
    missing = sorted(cls.__name__ for cls in defined if cls.__name__ not in rl_ckpt.__all__)
    assert not missing, f"errors not exported from rl_ckpt: {missing}"


# The topology seam (rl_ckpt/_core/topology.py): who a process is in a save (Solo, TorchDistributed, Managed) is
# chosen once; these modules ask the topology and never branch on it themselves.
TOPOLOGY_CLIENTS = (
    "rl_ckpt._core.engine",
    "rl_ckpt._core.save_pipeline",
    "rl_ckpt._core.restorer",
    "rl_ckpt._core.snapshot_loader",
    "rl_ckpt._core.run_handle",
    "rl_ckpt._core.registry",
    "rl_ckpt._core.scheduler",
)
TOPOLOGY_FLAGS = {"managed", "distributed", "multi", "manager_client", "heartbeat"}  # (torch.distributed is torch's)
TOPOLOGY_OBJECTS = {"manager", "manager_client", "client", "heartbeat"}
TOPOLOGY_CLASSES = {"Topology", "Solo", "TorchDistributed", "Managed", "ParticipantCommit", "DistributedCommit"}


def _topology_branches(tree: ast.Module) -> list[str]:
    """Flags read (``reg.managed``, ``self.distributed``), a manager/client tested against None, and topology or
    commit classes tested with ``isinstance``: a module branching on who it is instead of asking its topology."""

    def tail(node: ast.AST) -> str | None:
        return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in TOPOLOGY_FLAGS
            and not (isinstance(node.value, ast.Name) and node.value.id == "torch")
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for op in node.ops
        ):
            if any(tail(side) in TOPOLOGY_OBJECTS for side in [node.left, *node.comparators]):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and tail(node.func) in ("isinstance", "type") and node.args:
            if {tail(n) for arg in node.args[1:] for n in ast.walk(arg)} & TOPOLOGY_CLASSES:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("module", TOPOLOGY_CLIENTS)
def test_engine_pipeline_and_restorer_ask_the_topology(module):
    branches = _topology_branches(TREES[module])
    assert not branches, (
        f"{MODULES[module]} branches on who this process is; ask the topology "
        f"(rl_ckpt/_core/topology.py) instead: {branches}"
    )


def test_topology_branch_finder():
    tree = ast.parse(
        "def f(self, reg, torch):\n    if reg.managed or self.registry.distributed:\n        pass\n"
        "    if self.manager is None and client is not None:\n        pass\n"
        "    ok = isinstance(self.commit, (DistributedCommit, int)) or reg.multi\n"
        "    return torch.distributed.is_initialized(), self.topology.agree(1, 'full', False)\n"
    )
    assert _topology_branches(tree) == [
        "line 2: reg.managed",
        "line 2: self.registry.distributed",
        "line 4: self.manager is None",
        "line 4: client is not None",
        "line 6: isinstance(self.commit, (DistributedCommit, int))",
        "line 6: reg.multi",
    ]


# The internal-module rule: a module is internal when a part of its dotted name starts with one underscore
# (`rl_ckpt._core.engine`, `actors._memory.store`, `rl_ckpt.data._sampler`); everything else is the public surface,
# listed here, and users are shown only that. Applications (the `rl-ckpt` commands' packages) are public as
# commands: nothing in the library imports them (the layers check that).
PUBLIC_MODULES = {
    "rl_ckpt",
    "rl_ckpt.cli",
    "rl_ckpt.components",
    "rl_ckpt.config",
    "rl_ckpt.errors",
    "rl_ckpt.data",
    "rl_ckpt.integrations",
    "rl_ckpt.integrations.memory_tier",
    "rl_ckpt.integrations.ray_train",
    "rl_ckpt.integrations.rllib",
    "rl_ckpt.integrations.samples",
    "actors",
    "actors.manager",
    "actors.memory_tier",
    "actors.policy_versions",
    "actors.weight_subscriber",
    "actors.rollout_pool",
}
APPLICATIONS = ("rl_ckpt.demo", "rl_ckpt.tools")


def _internal(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


def _application(module: str) -> bool:
    return any(module == app or module.startswith(app + ".") for app in APPLICATIONS)


def test_every_module_is_marked_internal_or_listed_public():
    def public(m: str) -> bool:  # a public package's __main__ is its `python -m` command
        return m in PUBLIC_MODULES or (m.endswith(".__main__") and m.rsplit(".", 1)[0] in PUBLIC_MODULES)

    unmarked = sorted(m for m in MODULES if not _internal(m) and not _application(m) and not public(m))
    assert not unmarked, (
        f"modules neither marked internal nor listed public: {unmarked}; rename them with a leading underscore "
        "(or their package), or add them to PUBLIC_MODULES and document them"
    )
    gone = sorted(PUBLIC_MODULES - set(MODULES))
    assert not gone, f"PUBLIC_MODULES lists modules that do not exist: {gone}"
    marked = sorted(m for m in PUBLIC_MODULES if _internal(m))
    assert not marked, f"public modules with an internal name: {marked}"


def _imports_in_text(text: str) -> set[str]:
    """Modules of ours that ``from X import`` / ``import X`` lines in ``text`` name (code blocks and scripts)."""
    import re

    found = set()
    for m in re.finditer(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", text, re.M):
        name = m.group(1) or m.group(2)
        if name.split(".")[0] in PACKAGES:
            found.add(name)
    return found


def _user_facing_texts() -> dict[str, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]
    files += sorted((ROOT / "configs").glob("*")) if (ROOT / "configs").is_dir() else []
    return {str(p.relative_to(ROOT)): p.read_text() for p in files if p.is_file()}


def test_users_are_shown_only_the_public_surface():
    shown = {(f, name) for f, text in _user_facing_texts().items() for name in _imports_in_text(text)}
    assert shown, "no import of rl_ckpt or actors found in the README, docs and examples: the scan is broken"
    internal = sorted(f"{f}: {name}" for f, name in shown if _internal(name))
    assert not internal, f"user-facing text imports internal modules (export the names publicly): {internal}"


def test_the_rule_sees_each_kind():
    assert _internal("rl_ckpt._core.engine") and _internal("actors._memory.store") and _internal("rl_ckpt.data._hf")
    assert not _internal("rl_ckpt.data") and not _internal("rl_ckpt.demo.__main__")
    assert _application("rl_ckpt.tools.bench.memory") and not _application("rl_ckpt.toolsx")
    assert _imports_in_text("x\n    from rl_ckpt._core.engine import E\nimport actors._manager.x\nimport os\n") == {
        "rl_ckpt._core.engine",
        "actors._manager.x",
    }


def test_actors_shows_its_subsystems():
    """``actors/`` holds its public fronts and one internal package per subsystem (the manager, the memory tier,
    policy versions), not a flat folder of internal modules."""
    top = sorted(p.name for p in (ROOT / "actors").iterdir() if p.suffix == ".py" and p.name != "__init__.py")
    assert top == sorted(f"{m.split('.')[1]}.py" for m in PUBLIC_MODULES if m.startswith("actors.")), top
    packages = sorted(p.name for p in (ROOT / "actors").iterdir() if (p / "__init__.py").is_file())
    assert packages == ["_manager", "_memory", "_versions"], packages
