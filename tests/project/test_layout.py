"""The library's layout: the import graph of `jaxsample/` and `models/`, read with `ast`.

Nothing is imported or run: each test parses the source files. What holds:

* no import cycle (function-local imports count: they cycle at run time;
  imports under `if TYPE_CHECKING:` count too: a type checker follows them);
* no import from a lower stage into a higher one, `STAGES` being the one
  definition of the order (annotation-only imports aside);
* no module reaches another module's private (`_x`) names, by
  `from m import _x` or by `m._x` on an imported module;
* no test imports `benchmarks`, no benchmark imports the tests;
* every test that starts another process is marked `subprocess` and `slow`
  (CONTRIBUTING's markers), found through its helpers and fixtures;
* no function or method of `jaxsample/` and `models/` is longer than
  `MAX_FUNCTION_LINES` (100) lines, its docstring included.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from paths import ROOT

# The stages in import order: a module may import its own stage and the stages
# before it, never a later one. The data flow of a request reads load ->
# engine -> Generation -> reduce -> cli; the Bill (cost) and the Generation
# type sit below the engine because the engine builds them, and the Bridge
# block below it because the decode step calls it. The model folders
# (`models/`, installed as jaxsample.models) sit below everything that loads
# or runs a model: they import the base stage only (what both they and the
# caches need, such as the cache directory's paths, is there), and
# `test_models_import_only_the_base_stage` holds them to it with annotation-only
# imports counted too. Each entry is a module and its submodules ("jaxsample"
# itself: the package face only, which imports nothing statically); the longest
# match decides.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("jaxsample", "jaxsample.errors", "jaxsample.floats", "jaxsample.sharding",
              "jaxsample.sampling_params", "jaxsample.progress", "jaxsample.cache_paths",
              "jaxsample.cache_files", "jaxsample.file_hashes")),
    ("models", ("jaxsample.models",)),
    ("load", ("jaxsample.lm", "jaxsample.loading", "jaxsample.tiny", "jaxsample.xla_cache",
              "jaxsample.disk_cache", "jaxsample.weight_cache")),
    ("kernels", ("jaxsample.kernels",)),
    ("cost", ("jaxsample.cost",)),
    ("generation", ("jaxsample.generation",)),
    ("bridge", ("jaxsample.bridge",)),
    ("engine", ("jaxsample.engine",)),
    ("reduce", ("jaxsample.reduce",)),
    ("offline", ("jaxsample.llm",)),
    ("training", ("jaxsample.training",)),
    ("bridge_training", ("jaxsample.bridge_training",)),
    ("cli", ("jaxsample.cli", "jaxsample.__main__")),
)


def _module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for jaxsample/ and models/ (installed as jaxsample.models)."""
    out = {}
    for top, prefix in (("jaxsample", ("jaxsample",)), ("models", ("jaxsample", "models"))):
        for p in sorted((ROOT / top).rglob("*.py")):
            parts = list(prefix) + list(p.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _module_files()


def _resolve(importer: str, node: ast.ImportFrom) -> str | None:
    """The absolute module of `from X import ...` (relative imports resolved)."""
    if node.level == 0:
        return node.module
    base = importer.split(".")
    if not MODULES[importer].name == "__init__.py":
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, typing: bool = False) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in module `name`,
    function-local ones included; `from pkg import sub` names the submodule.
    Imports under `if TYPE_CHECKING:` (annotations only, never run) are left out
    unless `typing`."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, node)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (mod, a.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m in MODULES]


def _stage(module: str) -> int:
    best, stage = -1, None
    for i, (_, prefixes) in enumerate(STAGES):
        for p in prefixes:
            inside = module == p or (p != "jaxsample" and module.startswith(p + "."))
            if inside and len(p) > best:
                best, stage = len(p), i
    assert stage is not None, f"{module} is in no stage of STAGES"
    return stage


GRAPH = {m: sorted({dep for dep, _, _ in _imports(m)} - {m}) for m in MODULES}
# With the annotation-only imports: what a type checker follows. The package face
# (`jaxsample/__init__.py`) names its lazy exports for type checkers only: a face,
# not a dependency, so its annotation-only imports are left out.
TYPED_GRAPH = {m: sorted({dep for dep, _, _ in _imports(m, typing=m != "jaxsample")} - {m})
               for m in MODULES}


def test_every_module_has_a_stage():
    for m in MODULES:
        _stage(m)


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in TYPED_GRAPH[m]:
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_no_import_from_a_later_stage():
    bad = [f"{m} ({STAGES[_stage(m)][0]}) imports {d} ({STAGES[_stage(d)][0]}), line {line}"
           for m in MODULES for d, _, line in _imports(m) if _stage(d) > _stage(m)]
    assert not bad, "\n".join(bad)


MODELS = "jaxsample.models"


def _outside_models_and_base(dep: str) -> bool:
    """Whether a module of jaxsample.models may not import `dep`: neither a model
    folder's module nor one of the base stage."""
    return not (dep == MODELS or dep.startswith(MODELS + ".")) and _stage(dep) != 0


def test_models_import_only_the_base_stage():
    """Every module of `models/` (jaxsample.models) imports only other model modules
    and the base stage: nothing of the engine's layers (`jaxsample.lm`, the caches,
    the engine), not even for annotations. Function-local imports count."""
    bad = [f"{m}:{line} imports {d} ({STAGES[_stage(d)][0]})"
           for m in MODULES if m == MODELS or m.startswith(MODELS + ".")
           for d, _, line in _imports(m, typing=True) if _outside_models_and_base(d)]
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_module():
    bad = []
    for m, p in MODULES.items():
        for d, name, line in _imports(m):
            if name and name.startswith("_") and not name.startswith("__") and d != m:
                bad.append(f"{m}:{line} imports {d}.{name}")
        # `mod._x` on a module bound by an import
        tree = ast.parse(p.read_text(encoding="utf-8"))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = _resolve(m, node)
                for a in node.names:
                    if f"{mod}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{mod}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__") and aliases[node.value.id] != m):
                bad.append(f"{m}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def _top_imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


# Every Python file of tests/ (the helpers at its top, the test modules in their
# area folders), by module name: tests/ is on sys.path, so a stem is what imports it.
TEST_FILES = {p.stem: p for p in sorted((ROOT / "tests").rglob("*.py"))
              if "data" not in p.relative_to(ROOT / "tests").parts}
TEST_MODULES = set(TEST_FILES) | {"tests"}


# Tests of the benchmark scripts themselves (the prepared GPU run's CPU smoke):
# the only test modules that may import benchmarks/.
BENCHMARK_TESTS = {"test_gpu_run.py"}


def test_no_test_imports_benchmarks():
    bad = [p.name for p in TEST_FILES.values()
           if "benchmarks" in _top_imports(p) and p.name not in BENCHMARK_TESTS]
    assert not bad, f"tests importing benchmarks/: {bad}"


def test_no_benchmark_imports_the_tests():
    bad = [f"{p.name}: {sorted(_top_imports(p) & TEST_MODULES)}"
           for p in sorted((ROOT / "benchmarks").rglob("*.py")) if _top_imports(p) & TEST_MODULES]
    assert not bad, f"benchmarks importing tests/: {bad}"


def test_the_checks_see_what_they_check():
    """The graph is not empty and the checks would see a cycle and a late import."""
    assert len(MODULES) > 50 and sum(map(len, GRAPH.values())) > 100
    assert "jaxsample.engine.api" in GRAPH["jaxsample.reduce.adaptive"]
    assert (_stage("jaxsample.cli.app") > _stage("jaxsample.engine.api") > _stage("jaxsample.lm")
            > _stage("jaxsample.models.families.llama") > _stage("jaxsample.errors"))
    # the model folders' rule sees their imports, function-local ones included, and
    # would refuse the engine's layers
    assert "jaxsample.cache_paths" in GRAPH["jaxsample.models.cpu_kernels.cpu_kernels"]
    assert {"jaxsample.models.families.common", "jaxsample.models.cpu_kernels.cpu_kernels"} <= set(
        GRAPH["jaxsample.models.quantization.quant"])
    assert all(map(_outside_models_and_base, ("jaxsample.lm", "jaxsample.disk_cache",
                                              "jaxsample.loading", "jaxsample.engine.api")))
    assert not any(map(_outside_models_and_base, ("jaxsample.errors", "jaxsample.cache_paths",
                                                  "jaxsample.models.checkpoints.registry")))


# ---------------------------------------------------------------------------
# Test markers: a test that starts another process is marked `subprocess` and `slow`


def _mark_names(node: ast.AST) -> set[str]:
    """The X of every `pytest.mark.X` under node (a decorator, a `pytestmark` value,
    a `pytest.param(..., marks=...)`)."""
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "mark" and getattr(n.value.value, "id", None) == "pytest"}


def _starts_a_process(fn: ast.AST) -> bool:
    """`subprocess.` anywhere in fn, or a `.spawn(...)` call (benchmarks/common.py's
    worker processes)."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "subprocess":
            return True
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "spawn":
            return True
    return False


def _spawning_tests(sources: dict[str, str]) -> dict[str, dict[str, set[str]]]:
    """Module stem -> {test function that starts a process: the marks it carries (its
    decorators' and the module's `pytestmark`)}, for the given {stem: source}.

    A function starts a process when its own body does, or when it names (a call, a
    reference, a parameter naming a fixture) a function that does: one defined at the
    top of its module, imported from another module of `sources` (`from helpers
    import x`), or a fixture of `conftest`."""
    trees = {m: ast.parse(src) for m, src in sources.items()}
    defs: dict[tuple[str, str], ast.AST] = {}
    names: dict[str, dict[str, tuple[str, str]]] = {}
    for m, tree in trees.items():
        scope = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs[(m, node.name)] = node
                scope[node.name] = (m, node.name)
        for node in ast.walk(tree):  # imports from other test modules, local ones too
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in trees:
                for a in node.names:
                    scope.setdefault(a.asname or a.name, (node.module, a.name))
        names[m] = scope
    fixtures = names.get("conftest", {})

    def refs(key: tuple[str, str]) -> set[tuple[str, str]]:
        fn, scope = defs[key], names[key[0]]
        used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        used |= {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        return {scope.get(u, fixtures.get(u)) for u in used} & defs.keys()

    spawning = {k for k, fn in defs.items() if _starts_a_process(fn)}
    graph = {k: refs(k) for k in defs}
    while True:
        more = {k for k in defs if k not in spawning and graph[k] & spawning}
        if not more:
            break
        spawning |= more
    out = {}
    for m, tree in trees.items():
        module_marks = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark"
                                                    for t in node.targets):
                module_marks |= _mark_names(node.value)
        found = {fn.name: module_marks | set().union(*map(_mark_names, fn.decorator_list))
                 for (mod, name), fn in defs.items()
                 if mod == m and name.startswith("test") and (mod, name) in spawning}
        if found:
            out[m] = found
    return out


TEST_SOURCES = {m: p.read_text(encoding="utf-8") for m, p in TEST_FILES.items()}


def test_test_modules_live_in_area_folders():
    """tests/ holds the shared helpers; each test module sits in the folder of the
    area it checks (tests/engine, tests/cli, ...)."""
    top = [p.name for p in (ROOT / "tests").glob("test_*.py")]
    assert not top, f"test modules at the top of tests/ (move them to an area folder): {top}"
    areas = {p.parent.name for p in TEST_FILES.values() if p.name.startswith("test_")}
    assert len(areas) >= 10, areas


def test_a_test_that_starts_a_process_is_marked_subprocess_and_slow():
    bad = [f"{TEST_FILES[m].relative_to(ROOT)}::{name} lacks {sorted({'subprocess', 'slow'} - marks)}"
           for m, found in sorted(_spawning_tests(TEST_SOURCES).items())
           for name, marks in sorted(found.items()) if not {"subprocess", "slow"} <= marks]
    assert not bad, "\n".join(bad)


def test_the_marker_check_sees_what_it_checks():
    """A process started directly, through a module's helper, a fixture or an imported
    helper is found, and a missing mark is seen; the suite's own spawners are found."""
    sources = {
        "helpers": "import subprocess\n\ndef held():\n    subprocess.Popen(['x'])\n",
        "conftest": "import pytest\n\n@pytest.fixture\ndef worker():\n    return 1\n",
        "test_a": "import subprocess\nimport pytest\nfrom helpers import held\n\n"
                  "def _run():\n    subprocess.run(['true'])\n\n"
                  "@pytest.fixture\ndef proc():\n    return _run()\n\n"
                  "def test_direct():\n    subprocess.run(['true'])\n\n"
                  "def test_helper():\n    _run()\n\n"
                  "def test_fixture(proc):\n    pass\n\n"
                  "def test_imported():\n    with held():\n        pass\n\n"
                  "@pytest.mark.slow\n@pytest.mark.subprocess\ndef test_marked():\n    _run()\n\n"
                  "@pytest.mark.subprocess\ndef test_half_marked():\n    _run()\n\n"
                  "def test_plain(worker):\n    pass\n",
        "test_b": "import pytest\nimport subprocess\n\n"
                  "pytestmark = [pytest.mark.slow, pytest.mark.subprocess]\n\n"
                  "def test_module_marked():\n    subprocess.run(['true'])\n",
    }
    found = _spawning_tests(sources)
    assert set(found["test_a"]) == {"test_direct", "test_helper", "test_fixture",
                                    "test_imported", "test_marked", "test_half_marked"}
    assert found["test_a"]["test_marked"] == {"slow", "subprocess"}
    assert found["test_a"]["test_half_marked"] == {"subprocess"}
    assert found["test_a"]["test_direct"] == set()
    assert found["test_b"] == {"test_module_marked": {"slow", "subprocess"}}
    real = _spawning_tests(TEST_SOURCES)
    assert sum(map(len, real.values())) >= 30
    assert "test_a_second_writer_is_refused_with_the_holders_pid" in real["test_results_file"]
    assert "test_a_worker_past_its_timeout_is_killed" in real["test_gpu_run"]
    assert set(real["test_packaging"]) == {"test_the_wheel_holds_the_named_configs_and_kernel_sources",
                                           "test_a_named_config_resolves_from_the_installed_wheel"}


# ---------------------------------------------------------------------------
# Function length: a function longer than this is split into named helpers, one
# concept each (never cut into arbitrary chunks).

MAX_FUNCTION_LINES = 100


def _long_functions(sources: dict[str, str], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """"path:line name (n lines)", in file and line order, of every function and method
    (nested ones too) in {path: source} whose `def` line to its last line (docstring
    included, decorators not) spans more than `limit` lines."""
    out = []
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append((path, node.lineno, f"{path}:{node.lineno} {node.name} ({n} lines)"))
    return [line for _, _, line in sorted(out)]


def test_no_function_is_longer_than_100_lines():
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
               for top in ("jaxsample", "models") for p in sorted((ROOT / top).rglob("*.py"))}
    assert len(sources) > 50
    bad = _long_functions(sources)
    assert not bad, (f"functions over {MAX_FUNCTION_LINES} lines (split each by concept "
                     "into named helpers):\n" + "\n".join(bad))


def test_the_length_check_sees_what_it_checks():
    """A function, a method and a nested function one line over the limit are named;
    one at the limit is not."""
    body = lambda n: "".join(f"    x{i} = {i}\n" for i in range(n))  # noqa: E731
    source = (f"def at_limit():\n{body(99)}\n"
              f"def over():\n{body(100)}\n"
              f"class C:\n    def method(self):\n{body(100).replace('    ', '        ')}\n"
              f"def outer():\n    def inner():\n{body(100).replace('    ', '        ')}"
              f"    return inner\n")
    found = _long_functions({"m.py": source})
    lines = source.splitlines()
    assert found == [f"m.py:{lines.index(head) + 1} {name} ({n} lines)" for head, name, n in (
        ("def over():", "over", 101), ("    def method(self):", "method", 101),
        ("def outer():", "outer", 103), ("    def inner():", "inner", 101))]

