"""The layers stay layers: what each package may import, a config import and a cached run that stay
cheap, and a flow that names no stage."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from helpers import environment_without_services

from infra.core.fingerprints import imported_modules
from trainers.catalog import STAGES

PROJECT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "prefect", "mlflow", "datasets")
COMPUTE = ("torch", "transformers")  # what only a task that computes needs


def within(imported: set[str], forbidden: set[str]) -> set[str]:
    """Those of ``imported`` that are one of ``forbidden`` or inside one."""
    return {m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden)}


@cache
def source(path: Path) -> str:
    return path.read_text()


@cache
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once for every test here (none changes a tree)."""
    return ast.parse(source(path))


def forbidden_imports(path: Path, forbidden: set[str]) -> set[str]:
    return within(imported_modules(parsed(path)), forbidden)


def loaded_after(statement: str, watched: tuple[str, ...]) -> list[str]:
    """Those of ``watched`` that a fresh interpreter has imported once it ran ``statement``."""
    probe = f"import json, sys; {statement}; print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


@pytest.mark.slow
def test_validating_a_config_imports_no_torch_transformers_prefect_or_mlflow():
    assert loaded_after("from infra.core.config import load_config; load_config('configs/default.yaml')", HEAVY) == []


@pytest.mark.slow
def test_importing_the_flows_imports_no_torch_or_transformers():
    assert loaded_after("import flows.pipeline, flows.evaluation", COMPUTE) == []


@pytest.mark.flow
def test_a_run_that_finds_everything_cached_imports_no_torch_or_transformers(tmp_path, prefect_api_url):
    """The second identical run of a config reuses every stage, reference entry and score: the
    process (``alignflow run`` as ``main()``, on the session's Prefect API) never imports either
    library, while the first run's does. (The ``alignflow`` command itself also imports torch
    while its temporary server starts: :func:`infra.ops.cli.run_flow`.)"""
    env = environment_without_services() | {"ALIGNFLOW_HOME": str(tmp_path), "PREFECT_API_URL": prefect_api_url}
    probe = (
        "import json, sys; from infra.ops.cli import main; code = main(['run', 'configs/minimal.yaml']); "
        f"print('LOADED', code, json.dumps(sorted(m for m in {COMPUTE!r} if m in sys.modules)))"
    )
    loaded = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        code, modules = re.search(r"^LOADED (\d+) (.*)$", result.stdout, re.MULTILINE).groups()
        assert code == "0", result.stderr[-3000:]
        loaded.append(json.loads(modules))
    assert loaded == [sorted(COMPUTE), []]


# Each project module's layer and what it may not import. A layer imports only those below it:
# trainers < infra.core < tasks < flows < infra.ops (the shell, which may import anything).
LAYERS = {
    "trainers": {"prefect", "mlflow", "tasks", "flows", "infra"},  # pure ML, usable from a plain script
    "infra.core": {"tasks", "flows", "infra.ops"},
    "tasks": {"flows", "infra.ops"},
    "flows": {"infra.ops"},
    "infra.ops": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def project_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for package in ("trainers", "tasks", "flows", "infra")
        for p in PROJECT.glob(f"{package}/**/*.py")
    }


def layer_of(module: str) -> str | None:
    matches = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    return max(matches, key=len, default=None)


@pytest.mark.unit
def test_each_layer_imports_only_the_layers_below_it():
    modules = project_modules()
    unplaced = sorted(m for m in modules if layer_of(m) is None and m != "infra")
    assert not unplaced, f"modules in no layer: {unplaced}"
    violations = {
        module: sorted(found)
        for module, path in modules.items()
        if module != "infra" and (found := forbidden_imports(path, LAYERS[layer_of(module)]))
    }
    assert violations == {}


def imports_of(tree: ast.AST, lazy: bool = True) -> set[str]:
    """Every module ``tree`` imports, in function bodies too unless not ``lazy`` (a lazy import only
    hides a cycle from the interpreter), except under ``if TYPE_CHECKING:``; ``from a import b`` names
    ``a`` and ``a.b``."""
    names: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            pending.extend(node.orelse)
            continue
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        pending.extend(ast.iter_child_nodes(node))
    return names


@cache
def project_import_graph(lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name is resolved to its longest project module);
    those its functions import too unless not ``lazy``."""
    modules = project_modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        found = {resolve(name) for name in imports_of(parsed(path), lazy)}
        graph[module] = {m for m in found if m is not None and m != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                cycles.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


@pytest.mark.unit
def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    lazy = ast.parse("def f():\n    import trainers.dpo.trainer\nif TYPE_CHECKING:\n    import tasks.train\n")
    assert imports_of(lazy) == {"trainers.dpo.trainer"}


@pytest.mark.unit
def test_no_import_cycles_among_project_modules():
    assert import_cycles(project_import_graph()) == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The project modules ``start`` imports, directly or through others (lazy imports counted)."""
    seen, pending = set(), [start]
    while pending:
        module = pending.pop()
        if module not in seen:
            seen.add(module)
            pending.extend(graph.get(module, ()))
    return seen


@pytest.mark.unit
def test_a_launched_rank_imports_no_prefect():
    """Every process of a launched stage, reference pass or evaluation imports what it runs, and
    Prefect is not part of it (~1 s of imports per rank): the train task makes sure of the
    reference entry, and rank 0 logs to MLflow through ``tasks.mlflow_runs``."""
    modules = project_modules()
    rank = reachable(project_import_graph(), "tasks.launched_rank")
    assert {"tasks.stage_trainer", "tasks.reference_columns", "tasks.trainer_callback"} <= rank
    assert {module for module in rank if forbidden_imports(modules[module], {"prefect"})} == set()


@pytest.mark.unit
def test_a_rank_that_does_not_log_imports_no_mlflow():
    """A launched stage's ranks other than rank 0 build their trainer with nothing that logs
    (:func:`tasks.stage_trainer.tracked_trainer`), so MLflow (~0.9 s of imports) is imported only
    where a run is tracked: no module a training rank imports as it starts names it."""
    modules = project_modules()
    eager = project_import_graph(lazy=False)
    rank = reachable(eager, "tasks.launched_rank") | reachable(eager, "tasks.stage_trainer")
    assert {"infra.core.stage_io", "trainers.catalog", "trainers.runtime.callbacks"} <= rank
    at_start = {module: imports_of(parsed(modules[module]), lazy=False) for module in rank}
    assert {module for module, names in at_start.items() if within(names, {"mlflow"})} == set()


@pytest.mark.unit
def test_another_machines_part_imports_no_prefect():
    """``python -m tasks.machine`` (another machine's part of a launch) joins the gang as soon as its
    interpreter is up: Prefect is not imported on the way (nor MLflow, which only functions it does
    not call import: 0.9 s for the module here, against 2.8 s for ``tasks.launch``)."""
    modules = project_modules()
    part = reachable(project_import_graph(), "tasks.machine")
    assert {"infra.core.gang", "infra.core.stage_io", "infra.core.launching"} <= part
    assert "tasks.launch" not in part
    assert {module for module in part if forbidden_imports(modules[module], {"prefect"})} == set()


ALGORITHM_PACKAGES = {f"trainers.{name}" for name in ("sft", "dpo", "kto", "reward", "distill", "grpo")}


def names_a_stage(path: Path) -> set[str]:
    """The stage names among ``path``'s string constants, and the algorithm packages it imports."""
    tree = parsed(path)
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return (strings & set(STAGES)) | within(imported_modules(tree), ALGORITHM_PACKAGES)


@pytest.mark.unit
def test_no_task_or_flow_names_a_stage():
    """Tasks and flows read a stage's spec (``trainers.catalog.STAGES``): none names a stage or
    imports an algorithm's package, so a new stage needs no change to either."""
    modules = project_modules()
    named = {
        m: sorted(found)
        for m, path in modules.items()
        if m.startswith(("tasks", "flows")) and (found := names_a_stage(path))
    }
    assert named == {}


@pytest.mark.unit
def test_a_module_that_names_a_stage_is_found(tmp_path):
    named = tmp_path / "named.py"
    named.write_text('from trainers.grpo.section import GRPOStageConfig\nSTAGE = "dpo"\n')
    assert names_a_stage(named) == {"dpo", "trainers.grpo.section", "trainers.grpo.section.GRPOStageConfig"}


def called_name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


LAUNCHING_CALL = re.compile(r"\b(launch_command|launch_worker)\b")


def launched_entry_modules() -> set[str]:
    """Every module the project's code, tests and benchmarks start under ``accelerate launch``: the
    module of each ``launch_command`` call and each tests/helpers ``launch_worker`` call, a string
    literal or ``tasks.machine.RANK_MODULE``."""
    from tasks.machine import RANK_MODULE

    found: set[str] = set()
    for folder in ("trainers", "tasks", "flows", "infra", "tests", "benchmarks"):
        for path in PROJECT.glob(f"{folder}/**/*.py"):
            if not LAUNCHING_CALL.search(source(path)):  # no call to parse for (most files)
                continue
            for call in (node for node in ast.walk(parsed(path)) if isinstance(node, ast.Call)):
                if called_name(call) == "launch_command":
                    given = [k.value for k in call.keywords if k.arg == "module"] or call.args[1:2]
                elif called_name(call) == "launch_worker":
                    given = call.args[:1]
                else:
                    continue
                for node in given:
                    if isinstance(node, ast.Constant):
                        found.add(node.value)
                    elif isinstance(node, ast.Name) and node.id == "RANK_MODULE":
                        found.add(RANK_MODULE)
    return found


@pytest.mark.unit
def test_every_launched_entry_module_ends_its_ranks_without_interpreter_teardown():
    """A rank whose interpreter tears down torch's state after its job now and then aborts (SIGABRT,
    "terminate called without an active exception"; trainers.runtime.fast_exit): every entry module ends
    through ``trainers.runtime.launched_process.run_as_launched_process``, directly or through the
    test workers' ``worker_results.run_worker``. benchmarks/sharded_check.py did not, and failed a CI so."""
    worker_entry = {
        called_name(n) for n in ast.walk(parsed(PROJECT / "tests" / "worker_results.py")) if isinstance(n, ast.Call)
    }
    assert "run_as_launched_process" in worker_entry
    entries = launched_entry_modules()
    assert {"tasks.launched_rank", "fsdp_cpu", "fsdp_vllm_cpu", "sharded_check"} <= entries
    search = (PROJECT, PROJECT / "tests", PROJECT / "benchmarks")
    without = []
    for module in sorted(entries):
        relative = Path(*module.split(".")).with_suffix(".py")
        path = next(folder / relative for folder in search if (folder / relative).is_file())
        calls = {called_name(n) for n in ast.walk(parsed(path)) if isinstance(n, ast.Call)}
        if not calls & {"run_as_launched_process", "run_worker"}:
            without.append(module)
    assert without == []


# trainers/'s packages in dependency order: a module imports only from its own package and from the
# packages before it. The algorithms share one place in the order and import none of each other.
TRAINERS_ORDER = (
    ("trainers", "trainers.registry", "trainers.sections", "trainers.lazy"),  # the ground
    ("trainers.models",),
    ("trainers.data",),
    ("trainers.runtime",),
    ("trainers.scoring",),
    ("trainers.generation",),
    ("trainers.stages",),
    ("trainers.sft", "trainers.dpo", "trainers.kto", "trainers.reward", "trainers.distill", "trainers.grpo"),
    ("trainers.evaluation",),
    ("trainers.catalog", "trainers.plugins"),  # on top: every stage registered; plugins
)


def trainers_package(module: str) -> str:
    """The entry of :data:`TRAINERS_ORDER` that holds ``module``."""
    names = [name for level in TRAINERS_ORDER for name in level]
    return max((n for n in names if module == n or module.startswith(n + ".")), key=len)


def trainers_level(module: str) -> int:
    package = trainers_package(module)
    return next(i for i, level in enumerate(TRAINERS_ORDER) if package in level)


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each trainers module's imports of a package after its own, or of another package of its place."""
    found = {}
    for module, imported in graph.items():
        if not module.startswith("trainers"):
            continue
        level, package = trainers_level(module), trainers_package(module)
        wrong = sorted(
            other
            for other in imported
            if other.startswith("trainers")
            and (
                trainers_level(other) > level
                or (trainers_level(other) == level and level > 0 and trainers_package(other) != package)
            )
        )
        if wrong:
            found[module] = wrong
    return found


@pytest.mark.unit
def test_trainers_packages_import_only_their_own_and_those_before_them():
    modules = [m for m in project_modules() if m.startswith("trainers")]
    unplaced = [m for m in modules if m.count(".") > 1 and trainers_package(m) == "trainers"]
    assert unplaced == [], "a trainers package not in TRAINERS_ORDER"
    assert upward_imports(project_import_graph()) == {}


@pytest.mark.unit
def test_an_import_of_a_later_package_or_between_algorithms_is_found():
    graph = {"trainers.data.rows": {"trainers.grpo.rewards"}, "trainers.grpo.stage": {"trainers.reward.stage"}}
    graph |= {"trainers.grpo.trainer": {"trainers.grpo.losses", "trainers.models.pretrained"}}
    assert upward_imports(graph) == {
        "trainers.data.rows": ["trainers.grpo.rewards"],
        "trainers.grpo.stage": ["trainers.reward.stage"],
    }
