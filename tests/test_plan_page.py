"""``mpitrain plan ... --html FILE`` (mpitrain/plan/page.py): one self-contained page (no
network, no script), its figures inline, the verdict in its text; and, where Debian's
Chromium is installed, the page rendered headless is not blank."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["jobs/tinyshakespeare_gpt.toml", "-n", "4", "--set", "parallel.pp=2", "--set", "parallel.tp=2", "--set",
         "train.micro_batches=4"]
GPT3 = ["--model", "gpt3-175b", "--hardware", "a100-80g", "--nodes", "128", "--gpus-per-node", "8", "--network",
        "ib-hdr", "--set", "parallel.tp=8", "--set", "parallel.pp=16", "--set", "parallel.sync=zero1", "--set",
        "train.precision=bf16", "--set", "model.checkpoint_activations=true", "--set", "train.micro_batches=64"]


def plan(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "mpitrain", "plan", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=240, check=False)


def self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and not re.search(r"""(src|href)=["']?(https?:|//)""", page)


def test_a_plan_page_holds_its_figures_and_verdict(tmp_path):
    out = tmp_path / "deep" / "plan.html"
    done = plan(*SMALL, "--html", str(out))
    assert done.returncode == 0, done.stderr
    page = out.read_text(encoding="utf-8")
    self_contained(page)
    assert page.count("<svg") == 4  # memory, time, bytes, the pipeline's schedule
    verdict = next(line for line in done.stdout.splitlines() if line.startswith("verdict: "))
    assert f'<p class="verdict">{verdict}</p>' in page and f"wrote {out}" in done.stdout
    assert [p.name for p in out.parent.iterdir()] == ["plan.html"]  # written whole, nothing left beside it


def test_gpt3s_page_shows_the_largest_rank_of_each_part(tmp_path):
    """1,024 ranks in 18 groups, one bar each: a part of the model (the inner stages' slices
    alike, the first and last stages' slice 0, with the embedding's and the head's first
    rows, apart from their other slices; on GPUs tier 1's memory, the same for every
    replica of a part)."""
    from mpitrain import cli
    from mpitrain import plan as planner
    from mpitrain.plan import page, show

    plan = planner.from_args(cli.build_parser().parse_args(["plan", *GPT3]))[0]
    assert len(plan.ranks) == 18 and len(page.shown(plan)) == 18
    out = page.write(tmp_path / "gpt3.html", plan, "text", "GPT-3")
    text = out.read_text(encoding="utf-8")
    self_contained(text)
    assert text.count("<svg") == 4 and f'<p class="verdict">{show.verdict(plan)}</p>' in text


def test_a_search_page_shows_every_layout_against_memory(tmp_path):
    out = tmp_path / "search.html"
    done = plan("jobs/tinyshakespeare_gpt.toml", "-n", "2", "--search", "--html", str(out))
    assert done.returncode == 0, done.stderr
    page = out.read_text(encoding="utf-8")
    self_contained(page)
    assert "Every layout: step time against peak memory" in page and page.count("<svg") >= 4
    assert "the fastest:" in page


def test_html_with_a_command_that_writes_no_plan_is_refused():
    done = plan("--calibrate", "--html", "x.html")
    assert done.returncode == 2 and "--html: writes a plan, a search or a validation" in done.stderr


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="needs Debian's chromium (apt-get install chromium) to render the page")
def test_the_page_renders_in_a_browser(tmp_path):
    """Headless Chromium's screenshot of the 4-rank plan's page: neither blank nor one
    colour, and most of it the page's white."""
    import matplotlib.image

    out, shot = tmp_path / "plan.html", tmp_path / "plan.png"
    assert plan(*SMALL, "--html", str(out)).returncode == 0
    done = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1200,1600", f"--screenshot={shot}", out.as_uri()], capture_output=True,
                          text=True, timeout=120, check=False, cwd=tmp_path)
    assert shot.exists(), done.stderr[-2000:]
    pixels = matplotlib.image.imread(str(shot))[..., :3]
    ink = (pixels.sum(axis=-1) < 2.9).mean()  # not white
    assert pixels.std() > 0.05 and 0.02 < ink < 0.6, (pixels.std(), ink)
