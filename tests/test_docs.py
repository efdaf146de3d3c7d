"""The documentation against the code (unit tier).

* ``jobs/CONFIG.md`` is what :func:`mpitrain.config.reference` generates from
  ``mpitrain/config/fields.py``, and every config field has a ``#:`` comment saying what it means;
* no docstring states a measured figure: those live in ``mpitrain/bench/README.md``.
"""

import ast
import re
from pathlib import Path

import pytest

from mpitrain import config

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_is_current():
    committed = (ROOT / "jobs" / "CONFIG.md").read_text(encoding="utf-8")
    assert committed == config.reference(), (
        "jobs/CONFIG.md differs from what mpitrain/config/ generates; regenerate it with: "
        "mpitrain config reference --out jobs/CONFIG.md")


def test_config_reference_names_every_field_and_refuses_a_field_without_a_meaning(tmp_path, monkeypatch):
    page = config.reference()
    for section, fields in config.Config().to_dict().items():
        assert f"## [{section}]" in page
        for name in fields:
            assert f"| `{name}` |" in page, f"{section}.{name}"
    source = Path(config.fields.__file__).read_text(encoding="utf-8")
    stripped = tmp_path / "fields.py"
    stripped.write_text(source.replace("keep: int = 3  #:", "keep: int = 3  #"), encoding="utf-8")
    monkeypatch.setattr(config.fields, "__file__", str(stripped))
    with pytest.raises(ValueError, match=r"run\.keep: no '#:' comment"):
        config.reference()


# A measured figure: a duration, a rate, a percentage or a speed-up written with digits.
# Formulas are not figures: "2(P-1)/P x n", "16 bytes per parameter", "8 + 8/P",
# "2^-8", "1e-12", sizes ("4 KiB", "38 MB") and multiples of a symbol ("2x its forward").
FIGURE = re.compile(r"""
    (?<![\w.])\d[\d,.]*\s*(?-i:ns|us|µs|ms|s|seconds?|min|minutes?)\b(?!/)     # a duration (lower case: 16 S is a count)
  | (?<![\w.])\d[\d,.]*\s*(?:[kKMGT]i?B|[kMGT]?bit|[GMT]?FLOP|samples|tokens|steps)/s\b  # a rate
  | (?<![\w.])\d[\d,.]*\s*%                                                    # a percentage
  | (?<![\w.])\d[\d,.]*\s*(?:x|times)\s+(?:faster|slower|as\s+(?:fast|long|slow|much))  # a speed-up
  | \bx\d+\.\d+\b                                                            # a speed-up: x1.76
""", re.X | re.I)
# Numbers with units that are settings or published rules, not measurements of this code.
NOT_MEASURED = (
    "2 ms of the link",  # the bucket-size rule (mpitrain.cluster.link_bucket_mb), a setting
    "enough calls to take about 20 ms",  # bench allreduce's timing target, a setting
    "less than 90% of the", "share above 10%",  # DLIO's criterion of an I/O-bound run (observe/io.py)
)
def _prose(path: Path):
    """(line, text) of every docstring in ``path``, and in the command line's modules
    (``cli*.py``) every string constant too (their help texts)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if (doc := ast.get_docstring(node, clean=False)) is not None:
                yield node.body[0].lineno, doc
        elif path.name.startswith("cli") and isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_measured_figures_in_docstrings():
    """Docstrings and the command line's help say what the code does and why; measured
    figures (times, rates, percentages, speed-ups) live in one place,
    mpitrain/bench/README.md. Heuristic: FIGURE finds numbers with units of time or
    rate, percentages and speed-ups in every docstring under mpitrain/ and
    in the cli*.py modules' strings; NOT_MEASURED lists the few that are settings or published rules."""
    found = []
    for path in sorted((ROOT / "mpitrain").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, text in _prose(path):
            for row, part in enumerate(text.splitlines()):
                if FIGURE.search(part) and not any(phrase in part for phrase in NOT_MEASURED):
                    found.append(f"{name}:{line + row}: {part.strip()}")
    assert not found, ("measured figures belong in mpitrain/bench/README.md (the docstring can say "
                       "'measured faster: mpitrain/bench/README.md'):\n" + "\n".join(found))


@pytest.mark.parametrize("text, figure", [
    ("the exchange hid 65-70% of the communication", True), ("took 150 us for a 512 KB chunk", True),
    ("from 70 to 52 ms per step", True), ("reached 4.6-6.4 GB/s from 256 KiB", True),
    ("ran at 60 GFLOP/s", True), ("bf16 elementwise about 10x slower than fp32", True),
    ("speed-up x1.76", True), ("ten pairs of processes: 72.1 -> 70.2 ms", True), ("in 6 s", True),
    ("``2(P - 1)/P x n`` per rank", False), ("16 bytes per parameter", False), ("8 + 8/P with Adam", False),
    ("within about (P - 1) x 2^-8", False), ("a 38 MB column matrix", False), ("2 MiB huge pages", False),
    ("costs 2x its forward FLOPs rather than 3x", False), ("on uint64s", False), ("to 1e-12 in float64", False),
    ("push ``N x s + 16 S``, pull ``N x s + 8 S``", False),
])
def test_figure_pattern_tells_measurements_from_formulas(text, figure):
    assert bool(FIGURE.search(text)) == figure


PAGES = ("README.md", "jobs/README.md", "jobs/CONFIG.md", "datasets/README.md", "mpitrain/README.md",
         "mpitrain/bench/README.md", "tests/README.md")


def _anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation but '-' dropped,
    spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S),
                          flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("name", PAGES)
def test_documentation_links_resolve(name):
    """Every relative link of the documentation pages names a file that exists, and an
    anchor that is one of that page's headings."""
    page = ROOT / name
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or anchor and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{name}: broken links {broken}"


def test_the_readme_holds_the_test_command_that_ci_runs():
    """.ci/run takes the first line starting `python3 -m venv` after the marker."""
    after = (ROOT / "README.md").read_text(encoding="utf-8").split("<!-- test-command -->\n", 1)[1]
    command = next(line for line in after.splitlines() if line.startswith("python3 -m venv"))
    assert "python -m pytest -q" in command and "mpiexec -n 2 python -m pytest -q --with-mpi -m mpi" in command
