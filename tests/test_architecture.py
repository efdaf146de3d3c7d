"""The dependency arrows between the packages, checked by parsing every module's imports:
the base (tensor, ops, nn, optim) never reaches mpi4py, only comm imports it, data never
calls MPI, and each parallel module stands alone."""

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpitrain"
BASE = ("mpitrain.tensor", "mpitrain.autograd", "mpitrain.ops", "mpitrain.nn", "mpitrain.optim", "mpitrain.rng",
        "mpitrain.gradcheck", "mpitrain.flat", "mpitrain.schedules")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking(node: ast.AST) -> bool:
    """Whether ``node`` is ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``), whose imports never run."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if type_checking(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def imports_of(path: Path) -> set[str]:
    """Every module an 'import' or 'from ... import' in the file names, at any depth (but
    under ``if TYPE_CHECKING:``, which never runs), with relative imports ('from ..comm
    import x') resolved to absolute names."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            named = {f"{module}.{a.name}" for a in node.names}
            found.update(named)
            if not all(is_module(name) for name in named):  # names the package defines: its __init__ itself
                found.add(module)
    return found


def is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of mpitrain (``from mpitrain.plan import shapes``
    names the module ``shapes``; the package's ``__init__`` runs first, as for any import of a module in it)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return name.startswith("mpitrain.") and (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file())


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def closure(start: str, g: dict[str, set[str]]) -> set[str]:
    """All modules reachable from ``start`` (package imports include their __init__)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for dep in g.get(m, ()):
            if dep in seen:
                continue
            seen.add(dep)
            parts = dep.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                prefix = ".".join(parts[:i])
                if prefix in g and prefix not in seen:
                    seen.add(prefix)
                    todo.append(prefix)
            if dep in g:
                todo.append(dep)
    return seen


def is_under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_import_parser_sees_mpi4py_and_relative_imports(tmp_path, monkeypatch):
    g = {"a": {"mpitrain.b"}, "mpitrain.b": {"mpi4py.MPI"}}
    assert "mpi4py.MPI" in closure("a", g)
    pkg = tmp_path / "mpitrain" / "parallel"
    pkg.mkdir(parents=True)
    f = pkg / "zero.py"
    f.write_text("from ..comm import Comm\nfrom . import pipeline\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "mpitrain")
    assert {"mpitrain.comm", "mpitrain.comm.Comm", "mpitrain.parallel.pipeline"} <= imports_of(f)
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mpitrain.data import reader\n"
                 "else:\n    import json\ndef f():\n    import mpitrain.plan\n")
    assert {"json", "mpitrain.plan"} <= imports_of(f) and "mpitrain.data" not in imports_of(f)  # types only: never run


def test_base_layers_never_reach_mpi4py():
    g = graph()
    base = [m for m in g if is_under(m, BASE)]
    assert len(base) > 10
    for m in base:
        reach = closure(m, g)
        bad = sorted(d for d in reach if d.split(".")[0] == "mpi4py"
                     or is_under(d, ("mpitrain.comm", "mpitrain.parallel", "mpitrain.train", "mpitrain.cli",
                                     "mpitrain.config")))
        assert not bad, f"{m} imports {bad}"


def test_only_comm_imports_mpi4py():
    for m, deps in graph().items():
        if any(d.split(".")[0] == "mpi4py" for d in deps):
            assert is_under(m, ("mpitrain.comm",)), f"{m} imports mpi4py directly"


def test_data_never_calls_mpi():
    g = graph()
    for m in (m for m in g if is_under(m, ("mpitrain.data",))):
        reach = closure(m, g)
        assert not any(d.split(".")[0] == "mpi4py" or is_under(d, ("mpitrain.comm",)) for d in reach), m


def test_parallel_modules_stand_alone():
    """A strategy's module imports no other; the seam they share (``GradSync``, in the
    package's ``__init__``) is not a module of its own."""
    g = graph()
    for m, deps in g.items():
        if is_under(m, ("mpitrain.parallel",)) and m != "mpitrain.parallel":
            others = [d for d in deps if is_under(d, ("mpitrain.parallel",)) and d != "mpitrain.parallel" and d in g]
            assert not others, f"{m} imports {others}"


def test_only_the_tools_on_top_import_the_cluster_emulator():
    """mpitrain.cluster builds namespaces and launches mpiexec: the command line, the
    benches and the report use it; strategies, the trainer, comm and data only read the
    environment it sets (mpitrain.runtime)."""
    g = graph()
    below = ("mpitrain.parallel", "mpitrain.train", "mpitrain.comm", "mpitrain.data", "mpitrain.tensor",
             "mpitrain.ops", "mpitrain.nn", "mpitrain.optim", "mpitrain.runtime", "mpitrain.config")
    for m, deps in g.items():
        if is_under(m, below):
            assert "mpitrain.cluster" not in deps, f"{m} imports mpitrain.cluster"


def test_setup_cfg_lists_every_package():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(PACKAGE.parent / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found | {"mpitrain_datasets"} == listed
    assert cfg["options"]["package_dir"].split() == ["mpitrain_datasets", "=", "datasets"]
    assert (PACKAGE.parent / "datasets" / "__init__.py").is_file()


def test_dataset_recipes_use_the_data_layer_only():
    recipes = PACKAGE.parent / "datasets"
    for path in recipes.glob("*.py"):
        for dep in imports_of(path):
            assert dep.split(".")[0] != "mpi4py", f"{path.name} imports {dep}"
            assert not is_under(dep, ("mpitrain.comm", "mpitrain.train", "mpitrain.cli", "mpitrain.parallel")), (
                f"{path.name} imports {dep}")


def test_importing_the_package_does_not_start_mpi():
    code = ("import mpitrain, mpitrain.nn, mpitrain.ops, mpitrain.optim, mpitrain.train, mpitrain.cli, "
            "mpitrain.config, mpitrain.data, mpitrain.bench.step, mpitrain.bench.io, mpitrain.comm, "
            "mpitrain_datasets, sys; "
            "print('mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # mpi4py is imported by comm.world(), not at import time


STRATEGY_CLASSES = {"DataParallel", "Zero1", "Zero2", "Zero3", "ParameterServer", "LocalSync"}
STRATEGY_NAMES = {"ddp", "zero1", "zero2", "zero3", "ps", "local"}  # the values of parallel.sync
# where strategy names are read: building a run, its config, and the planner, which predicts each strategy's needs
BUILDING = ("mpitrain.train.build", "mpitrain.config", "mpitrain.plan")


def strategy_choices(tree: ast.AST) -> list[str]:
    """Places that choose by strategy: isinstance on a strategy class, a comparison
    with a strategy name or with ``parallel.sync`` / ``parallel.strategy``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                     if isinstance(n, (ast.Name, ast.Attribute))}
            found += [f"line {node.lineno}: isinstance(..., {n})" for n in names & STRATEGY_CLASSES]
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for n in ast.walk(side):
                    if isinstance(n, ast.Constant) and n.value in STRATEGY_NAMES:
                        found.append(f"line {node.lineno}: compares with {n.value!r}")
                    if isinstance(n, ast.Attribute) and n.attr in ("sync", "strategy"):
                        found.append(f"line {node.lineno}: compares .{n.attr}")
    return found


def test_the_strategy_choice_is_made_only_while_building():
    """The loop, the watchdog, the checkpoints and the command line hold no isinstance on a
    strategy and no comparison with a strategy's name: the loop is one seam for every strategy."""
    for path in PACKAGE.rglob("*.py"):
        if is_under(module_name(path), BUILDING):
            continue
        choices = strategy_choices(ast.parse(path.read_text(encoding="utf-8")))
        assert not choices, f"{path.relative_to(PACKAGE.parent)} chooses by strategy: {choices}"


def test_the_strategy_check_sees_what_it_looks_for():
    code = ("if isinstance(s, (Zero1, x.DataParallel)): pass\n"
            "if cfg.parallel.sync == 'zero1': pass\n"
            "ok = kind == 'gpt'\n")
    found = strategy_choices(ast.parse(code))
    assert len(found) == 4 and not any("gpt" in f for f in found), found


# The shapes cost formulas take in code: a collective's share (P-1)/P, the pipeline bubble
# (p-1)/(m+p-1), ZeRO's bytes per parameter, Korthikanti's activation count, Megatron's
# FLOPs, the product FLOPs 2 x m x k x n. Each lives in mpitrain/cost.py alone.
FORMULA_SHAPES = {
    "a collective's share (P-1)/P": r"\(\s*(\w+)\s*-\s*1\s*\)\s*(\*[^*\n]*)?/\s*\(?\s*\1\b",
    "the bubble (p-1)/(m+p-1)": r"/\s*\(\s*\w+\s*\+\s*\w+\s*-\s*1\s*\)",
    "ZeRO's bytes per parameter": r"\b(8\s*\+\s*8|4\s*\+\s*12|16)\s*/\s*(P|ranks|size)\b",
    "Korthikanti's 34 + 5 a s / h": r"\b34\s*\+\s*5\s*\*",
    "Megatron's 72 B s L h^2": r"\b72\s*\*",
    "a product's 2 x m x k x n FLOPs": r"\b2\s*\*\s*2\s*\*\s*\w+\s*\*|\bfwd\s*=\s*2\s*\*|\b2\s*\*\s*\w+\s*\*\*\s*3\b",
    "training's 2 x 3 FLOPs a multiply-add": r"\b2\s*\*\s*3\s*\*|\b3\s*\*\s*2\s*\*",
}


def code_of(path: Path) -> str:
    """The file's code without its strings and comments (docstrings state formulas in words)."""
    import io
    import tokenize

    kept = [t.string if t.type not in (tokenize.STRING, tokenize.COMMENT) else '""'
            for t in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)]
    return " ".join(kept)


def formulas_in(code: str) -> list[str]:
    import re

    return [name for name, shape in FORMULA_SHAPES.items() if re.search(shape, code)]


def test_the_formula_check_sees_each_shape():
    samples = ["2 * (P - 1) / P * n", "(p - 1) / (m + p - 1)", "8 + 8 / P", "s * b * h * (34 + 5 * a * s / h)",
               "72 * B * s", "fwd = 2 * B * T * C", "per_sample = 2 * 3 * r['multiply_adds']"]
    assert [formulas_in(s) for s in samples] == [[name] for name in FORMULA_SHAPES]
    assert formulas_in("flops = 2 * N**3") == ["a product's 2 x m x k x n FLOPs"]
    assert not formulas_in("for s in range(P - 1): pass") and not formulas_in("x = (n - 1) // 2")


def test_no_formula_outside_the_cost_module():
    """Cost knowledge lives once: the code, the tests' assertions and the benchmarks call
    mpitrain.cost; no other module of the package writes a formula."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "cost.py" and path.parent == PACKAGE:
            continue
        found = formulas_in(code_of(path))
        assert not found, f"{path.relative_to(PACKAGE.parent)} writes {found}: call mpitrain.cost"


# The one import circle the package has: the designed tensor/ops one. (An import under "if
# TYPE_CHECKING:" never runs, and "from package import module" is an arrow to the module:
# neither makes a circle.) No other may appear, and it may not grow.
KNOWN_CIRCLES = (
    {"mpitrain.autograd", "mpitrain.tensor", "mpitrain.ops", "mpitrain.ops._util", "mpitrain.ops.attention",
     "mpitrain.ops.conv", "mpitrain.ops.elementwise", "mpitrain.ops.embedding", "mpitrain.ops.linalg",
     "mpitrain.ops.loss", "mpitrain.ops.norm", "mpitrain.ops.reduce", "mpitrain.ops.shape",
     "mpitrain.ops.transformer"},  # designed: a tensor's methods are the ops, the ops make tensors
)


def circles(g: dict[str, set[str]]) -> list[set[str]]:
    """The import circles of ``g``: its strongly connected components of more than one
    module, over the imports that name a module of the package (Tarjan's algorithm, without
    recursion)."""
    edges = {m: sorted(d for d in deps if d in g and d != m) for m, deps in g.items()}
    index, low, on, stack, found, counter = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                part = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    part.add(w)
                    if w == v:
                        break
                if len(part) > 1:
                    found.append(part)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def test_the_circle_finder_sees_a_circle_and_a_chain():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "numpy"}, "d": {"a"}, "e": {"e"}}
    assert circles(g) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_but_the_known_ones():
    """Every circle of the package lies inside one of :data:`KNOWN_CIRCLES`: a new one, or
    a known one that drew in another module, fails here."""
    new = [sorted(c) for c in circles(graph()) if not any(c <= known for known in KNOWN_CIRCLES)]
    assert not new, f"new import circles: {new}"


def test_mpi_marked_tests_live_in_the_mpi_tiers_files():
    """The MPI tier's commands collect ``tests/test_mpi_*.py`` (README.md); a test marked
    ``mpi`` anywhere else would never run there."""
    tests = Path(__file__).resolve().parent
    elsewhere = [p.name for p in tests.glob("test_*.py")
                 if not p.name.startswith("test_mpi_") and re.search(r"^\s*@pytest\.mark\.mpi\b", p.read_text(
                     encoding="utf-8"), re.M)]
    assert not elsewhere, f"tests marked mpi outside tests/test_mpi_*.py: {elsewhere}"
