"""The shape of app/: no import cycles, no stage importing a later one, and no dispatch on task
names outside the task registry (a new task is a registry entry, not new branches)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

APP = Path(__file__).resolve().parents[2] / "app"
# Layers, lowest first; a module may import its own layer or a lower one, never a higher one.
# Each prefix is a whole package: no module is placed apart from its package's layer.
LAYERS = [
    ("app.tasks", 10),  # a folder per task: what it adds at every stage, over the machinery
    ("app.pipeline", 9),  # the stages composed (jobs.prepare, jobs.pipeline)
    ("app.predict", 7),
    ("app.serve", 6),
    ("app.export", 6),
    ("app.evaluate", 5),
    ("app.train", 4),
    ("app.runtime", 2),  # what runs an artifact: export verifies with it, serve and predict run it
    ("app.models", 2),  # plain torch.nn families; they take data of a kind
    ("app.data", 1),  # what a pretrained folder or a task gives it is handed down to it
    ("app", 0),  # config, errors, storage, cli, plots, pretrained folders
]
# The names of the task axis: tasks and the dataset / source kinds only one task trains on.
TASK_NAMES = {"classify", "lm", "tokens"}
# The two tables: tasks by name, kinds of data by kind. Nothing else looks either up.
TABLES = {"registry.py", "data/kinds/__init__.py"}


def modules() -> dict[str, Path]:
    found = {}
    for path in APP.rglob("*.py"):
        parts = path.relative_to(APP.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The app modules `path` imports: at the top, inside functions, and for type checking
    alone (an annotation that names a later stage is an upward arrow too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("app"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found if m in known}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def layer(module: str) -> int:
    return next(n for prefix, n in LAYERS if module == prefix or module.startswith(prefix + "."))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_app_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_stage_imports_a_later_stage():
    upward = [
        f"{m} -> {d}"
        for m, deps in sorted(import_graph().items())
        for d in sorted(deps)
        if layer(d) > layer(m)
    ]
    assert upward == []


def test_each_layer_is_a_whole_package():
    """No module is ranked apart from its package: the layers have no exemptions."""
    assert [prefix for prefix, _ in LAYERS if prefix.count(".") != 1] == ["app"]


# A task folder's modules that a replica or a predict actor imports.
SERVING_MODULES = {"replica", "predict", "chat"}


def test_serving_and_batch_inference_run_the_runtime_and_import_nothing_from_export():
    graph = import_graph()
    found = [
        f"{m} -> {d}"
        for m, deps in sorted(graph.items())
        if m.startswith(("app.serve", "app.predict", "app.runtime"))
        or m.rsplit(".", 1)[-1] in SERVING_MODULES
        for d in sorted(deps)
        if d.startswith(("app.export", "app.train")) or d.rsplit(".", 1)[-1] in ("export", "train")
    ]
    assert found == []


def test_the_task_registry_imports_only_config_and_errors():
    assert import_graph()["app.registry"] <= {"app.config", "app.errors"}


def dispatches_on_task_names(source: str) -> list[int]:
    """Lines comparing with, or matching on, a task-axis name."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            values = [s for s in sides if isinstance(s, ast.Constant)]
            for s in sides:
                if isinstance(s, ast.Tuple | ast.List | ast.Set):
                    values += [e for e in s.elts if isinstance(e, ast.Constant)]
            if any(v.value in TASK_NAMES for v in values):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant):
            if node.value.value in TASK_NAMES:
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript):  # TABLE[task.name], HANDLERS[kind]
            key = node.slice
            named = key.attr if isinstance(key, ast.Attribute) else getattr(key, "id", None)
            if named in ("task", "task_name") or (
                isinstance(key, ast.Attribute) and key.attr == "name" and "task" in ast.unparse(key)
            ):
                lines.append(node.lineno)
    return lines


def test_no_dispatch_on_task_names_outside_the_registry():
    found = []
    for path in sorted(APP.rglob("*.py")):
        relative = path.relative_to(APP).as_posix()
        if relative.startswith("tasks/") or relative in TABLES:
            continue
        found += [f"{relative}:{n}" for n in dispatches_on_task_names(path.read_text())]
    assert found == []


def _is_kind(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "kind"
    if isinstance(node, ast.Attribute) and node.attr == "kind":  # numpy's dtype.kind is not ours
        return not (isinstance(node.value, ast.Attribute) and node.value.attr == "dtype")
    return False


def dispatches_on_kind(source: str) -> list[int]:
    """Lines that compare, match or look up a name or attribute called `kind`: choosing what to
    do by the kind of data, which only its table does (by subject, not by the kinds' names,
    which are also column and tensor names)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Compare)
            and any(_is_kind(side) for side in [node.left, *node.comparators])
            or isinstance(node, ast.Match)
            and _is_kind(node.subject)
            or isinstance(node, ast.Subscript)
            and _is_kind(node.slice)
        ):
            lines.append(node.lineno)
    return lines


def test_no_dispatch_on_the_kind_of_data_outside_its_table():
    found = []
    for path in sorted(APP.rglob("*.py")):
        relative = path.relative_to(APP).as_posix()
        if relative not in TABLES:
            found += [f"{relative}:{n}" for n in dispatches_on_kind(path.read_text())]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "if pre.kind == 'text': pass",
        "x = 'image' != manifest.kind",
        "match spec.kind:\n    case 'text': pass",
        "cls = TABLE[kind]",
        "ok = kind in ('tabular', 'image')",
    ],
)
def test_the_kind_check_sees_each_form(source):
    assert len(dispatches_on_kind(source)) == 1


@pytest.mark.parametrize(
    "source",
    [
        "if manifest.kind == 'tokens': pass",
        "x = kind in ('lm', 'other')",
        "match task:\n    case 'classify': pass",
        "export = EXPORTS[task.name]",
        "server = SERVERS[task]",
    ],
)
def test_the_dispatch_check_sees_each_form(source):
    assert len(dispatches_on_task_names(source)) == 1


def long_prose_lines(text: str, limit: int = 100) -> list[str]:
    """Lines of prose over `limit` characters (tables and fenced code are exempt)."""
    long, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("|") and len(line) > limit:
            long.append(line[:60])
    return long


def test_the_prose_check_sees_a_long_line_and_exempts_tables_and_code():
    text = "x" * 101 + "\n|" + "y" * 200 + "|\n```\n" + "z" * 200 + "\n```\n"
    assert long_prose_lines(text) == ["x" * 60]


def test_the_readme_stays_short_and_nothing_reads_as_a_lab_notebook():
    repo = APP.parent
    readme = (repo / "README.md").read_text()
    assert len(readme) <= 20_000  # the benchmark table lives in bench/README.md
    assert long_prose_lines(readme) == []
    assert len((repo / "docs/architecture.md").read_text().splitlines()) <= 300
    texts = [repo / "README.md", *sorted((repo / "docs").glob("*.md")), repo / "bench/README.md"]
    texts += sorted(APP.rglob("*.py"))
    stale = ("last stop", "the run before", "this stop")
    found = [
        f"{path.relative_to(repo)}: {phrase!r}"
        for path in texts
        for phrase in stale
        if phrase in path.read_text().lower()
    ]
    assert found == []


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def broken_links(path: Path) -> list[str]:
    """Relative links and images in a Markdown file whose target does not exist (from the
    file's own folder, as GitHub resolves them)."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:|#", target) or target.startswith('"'):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                out.append(f"{path.name}:{number}: {target}")
    return out


def test_the_link_check_sees_a_broken_link_and_skips_urls(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    page.write_text("[a](there.md) [b](gone.md#x) ![c](https://x/y.png) [d](#top)\n")
    assert broken_links(page) == ["page.md:1: gone.md#x"]


def test_every_relative_link_and_image_in_the_docs_resolves():
    repo = APP.parent
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md")), repo / "bench/README.md"]
    assert [b for page in pages for b in broken_links(page)] == []


def test_no_doc_or_docstring_names_an_issue():
    """Issues live in the tracker, not in the repository: text says what the code does."""
    repo = APP.parent
    texts = [repo / "README.md", *sorted((repo / "docs").glob("*.md")), repo / "bench/README.md"]
    texts += [
        p for d in ("app", "jobs", "tests", "bench", "tools") for p in (repo / d).rglob("*.py")
    ]
    named = re.compile(r"\b(issue \d+|issue #\d+|(reliability|structure) \d+\b)", re.IGNORECASE)
    found = [
        f"{p.relative_to(repo)}: {m.group(0)}"
        for p in texts
        for m in named.finditer(p.read_text())
        if p.name != "test_structure.py"
    ]
    assert found == []


def test_no_function_in_app_is_longer_than_80_lines():
    long = [
        f"{path.relative_to(APP)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(APP.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert long == []


# --- a folder per task, one meaning per name --------------------------------------------------

TASKS = APP / "tasks"
# What a file name means wherever it repeats: a task folder's parts (inside app/tasks/ only), an
# endpoint's three modules, and the two sides of a stage that runs on workers.
TASK_ROLES = {"task", "train", "evaluate", "export", "predict", "replica", "smoke"}
ENDPOINT_ROLES = {"router", "protocol", "serving"}
STAGE_SIDES = {"driver", "worker"}
# app/'s own root holds shared modules, no stage: a stage is a package.
ROOT_MODULES = {
    "__init__", "chat_template", "cli", "errors", "hooks", "plots", "pretrained", "ray_private",
    "ray_runtime", "registry", "storage",
}  # fmt: skip


def task_folders() -> list[Path]:
    return sorted(p for p in TASKS.iterdir() if (p / "__init__.py").exists())


def test_each_built_in_task_is_a_folder_with_its_spec_registered_by_one_line():
    from app.tasks.builtin import TASKS as BUILT_IN

    for folder in task_folders():
        assert (folder / "task.py").exists(), folder.name
        assert "def spec() -> Task" in (folder / "task.py").read_text(), folder.name
    assert sorted(BUILT_IN) == [p.name for p in task_folders()]
    assert [p.name for p in task_folders()] == ["classify", "index", "lm", "retrieval"]


def repeated_names(paths: list[Path]) -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for path in paths:
        if path.stem != "__init__":
            where.setdefault(path.stem, []).append(path.relative_to(APP).as_posix())
    return {name: places for name, places in where.items() if len(places) > 1}


def misused(repeated: dict[str, list[str]]) -> list[str]:
    """Repeated file names that are not one role in each place."""
    bad = []
    for name, places in sorted(repeated.items()):
        in_tasks = all(p.startswith("tasks/") for p in places)
        if name in ENDPOINT_ROLES | STAGE_SIDES or (name in TASK_ROLES and in_tasks):
            continue
        bad.append(f"{name}.py: {', '.join(places)}")
    return bad


def test_a_file_name_means_one_thing_wherever_it_is():
    assert misused(repeated_names(sorted(APP.rglob("*.py")))) == []


def test_the_name_check_sees_a_name_with_two_meanings():
    paths = [APP / "runtime/index.py", APP / "config/index.py", APP / "tasks/lm/train.py"]
    paths += [APP / "tasks/classify/train.py", APP / "train/export.py", APP / "tasks/lm/export.py"]
    assert misused(repeated_names(paths)) == [
        "export.py: train/export.py, tasks/lm/export.py",
        "index.py: runtime/index.py, config/index.py",
    ]


def test_no_stage_module_is_loose_at_the_root_of_app():
    assert {p.stem for p in APP.glob("*.py")} <= ROOT_MODULES


def test_config_is_a_package_with_a_module_per_section():
    from pydantic import BaseModel

    from app.config import Config

    for key, field in Config.model_fields.items():
        section = next(
            (a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
             if isinstance(a, type) and issubclass(a, BaseModel)),
            None,
        )  # fmt: skip
        if section is not None:
            assert section.__module__ == f"app.config.{key}_config", key


def test_http_routes_are_grouped_by_endpoint():
    """Routers live in app/serve/http/routes (v1, v2: every model's) or in a task's http folder,
    beside its protocol (request bodies)."""
    for path in sorted(APP.rglob("*.py")):
        relative = path.relative_to(APP).as_posix()
        if "APIRouter()" in path.read_text():
            assert relative.startswith("serve/http/routes/") or relative.endswith("/http/router.py")
    for folder in task_folders():
        if (folder / "http").exists():
            assert {"router.py", "protocol.py"} <= {p.name for p in (folder / "http").iterdir()}


def test_the_driver_hands_each_rank_a_typed_plan():
    import dataclasses
    import inspect

    from app.train.worker import WorkerPlan, train_loop

    assert dataclasses.is_dataclass(WorkerPlan)
    assert "WorkerPlan" in str(inspect.signature(train_loop).parameters["loop_config"].annotation)


# The parts a task binds that are classes or objects of its own: each lives in its task's folder.
OWN_PARTS = ("server", "predictor", "export")


def part_modules(part: object) -> set[str]:
    """The modules that define a bound part: a class's, or an ExportParts' functions'."""
    import dataclasses

    if dataclasses.is_dataclass(part) and not isinstance(part, type):
        return {str(v.__module__) for v in vars(part).values() if callable(v)}
    return {str(getattr(part, "__module__", ""))}


def test_every_class_bound_as_a_task_part_lives_in_its_own_task_folder():
    from app.registry import task_named
    from app.tasks.builtin import TASKS as BUILT_IN

    misplaced = []
    for name in BUILT_IN:
        for part_name, part in task_named(name).parts.items():
            for module in part_modules(part) if part_name in OWN_PARTS else ():
                if not module.startswith(f"app.tasks.{name}."):
                    misplaced.append(f"{name}.{part_name}: {module}")
    assert misplaced == []


def test_each_task_binds_export_parts_of_the_same_names():
    import dataclasses

    from app.export.exporter import EXPORT, ExportParts
    from app.registry import task_named
    from app.tasks.builtin import TASKS as BUILT_IN

    names = [f.name for f in dataclasses.fields(ExportParts)]
    for task in [task_named(n) for n in BUILT_IN if task_named(n).has(EXPORT)]:
        parts = task.part(EXPORT)
        assert isinstance(parts, ExportParts), task.name
        for field in names[1:]:  # `splits` is data; every other part is the same-named function
            assert getattr(parts, field).__name__ == field, (task.name, field)


def test_every_model_replica_is_built_on_the_one_base():
    from app.registry import task_named
    from app.serve.control.builders import SERVER
    from app.serve.replicas.apps import SelfServing
    from app.serve.replicas.base import Replica
    from app.tasks.builtin import TASKS as BUILT_IN

    for name in BUILT_IN:
        server = task_named(name).part(SERVER)
        assert issubclass(server, Replica) and issubclass(server, SelfServing), name
        own = set(vars(server.__mro__[2]))  # the task's replica state, under its Serve class
        assert not own & {"reconfigure", "infer"}, (name, own & {"reconfigure", "infer"})
