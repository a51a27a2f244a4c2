"""The README serves the decision to adopt (issue 42, finding 10): a short opening, then install,
the code and the launch; the figures in one table linked to where they were measured; a
"supported / not yet" section; the two set-up commands (a contract: Makefile, .ci/run); and no
relative link, in the README or docs/gpu.md, to a file or heading that does not exist."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINKED = ["README.md", "docs/gpu.md"]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def text(path=README):
    return path.read_text(encoding="utf-8")


def sections(markdown):
    """``{heading: body}`` for the ``## `` sections, in order (code blocks stay in the body)."""
    parts = re.split(r"^## (.+)$", markdown, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def section(name):
    """The body of the README's section whose heading starts with ``name``."""
    found = [body for heading, body in sections(text()).items() if heading.startswith(name)]
    assert found, f"the README has no section '## {name}'"
    return found[0]


def code_lines(markdown):
    """Every line inside a fenced code block."""
    return [line.strip() for block in FENCE.findall(markdown) for line in block.splitlines()]


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = heading.strip().lower()
    kept = "".join(c for c in heading
                   if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path):
    found = set()
    for line in FENCE.sub("", text(path)).splitlines():
        if line.startswith("#"):
            name = slug(line.lstrip("#"))
            n = 1
            while name + ("" if n == 1 else f"-{n - 1}") in found:
                n += 1
            found.add(name + ("" if n == 1 else f"-{n - 1}"))
    return found


def test_the_readme_opens_with_a_few_lines_then_install_code_launch():
    markdown = text()
    opening = markdown.split("\n## ", 1)[0].splitlines()[1:]
    prose = [line for line in opening if line.strip()]
    assert len(prose) <= 10, f"the opening is {len(prose)} lines before the first section"
    names = list(sections(markdown))
    order = [next((i for i, name in enumerate(names) if name.startswith(want)), None)
             for want in ("Install", "An elastic training script", "Launching", "Figures",
                          "Supported / not yet")]
    assert None not in order and order == sorted(order), names


def test_the_readme_shows_the_two_set_up_commands():
    lines = code_lines(text())
    for command in ("make demo", "make test"):
        assert any(line.startswith(command + " ") or line == command for line in lines), command


def test_the_readme_shows_both_launch_forms_and_a_scheduler():
    launching = section("Launching")
    lines = code_lines(launching)
    assert any(line.startswith("elastic-hvd-run -np ") for line in lines)
    assert any(line.startswith("mpirun --with-ft ulfm ") for line in lines)
    assert "Slurm" in launching and "srun" in launching


def test_the_figures_are_one_short_table_each_row_linked_to_its_measurement():
    figures = section("Figures")
    rows = [line for line in figures.splitlines() if line.startswith("|")]
    tables = re.findall(r"(?:^\|.*\n)+", figures, flags=re.M)
    assert len(tables) == 1 and 3 <= len(rows) - 2 <= 8, rows
    for row in rows[2:]:
        assert re.search(r"\]\(docs/(benchmarks|measurements|multi-host|growth)\.md", row), row


def test_the_readme_says_what_is_supported_and_what_not_yet():
    box = section("Supported / not yet")
    for needed in ("TensorFlow 2.21", "Keras 3", "tf_keras", "TensorFlow 2.15", "Keras 2", "CPU",
                   "GPU", "host memory", "without CUDA", "docs/gpu.md", "simulated hosts",
                   "Slurm", "process sets", "PyTorch"):
        assert needed in box, needed


def test_the_readme_links_the_security_and_gpu_pages():
    for page in ("docs/security.md", "docs/gpu.md"):
        assert f"]({page})" in text(), page


@pytest.mark.parametrize("name", LINKED)
def test_every_relative_link_points_to_an_existing_file_and_heading(name):
    path = ROOT / name
    assert path.is_file(), f"{name} does not exist"
    broken = []
    for target in LINK.findall(FENCE.sub("", text(path))):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading in {linked.relative_to(ROOT)}")
    assert not broken, f"{name}: " + "; ".join(broken)
