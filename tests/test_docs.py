"""The README and the docs hold together: short README, figures from the generated results page, no dead paths."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
NUMBER = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# a backticked path into the tree: a top-level folder of the project, then a file or folder name
PATH = re.compile(r"`((?:bench|experiments|learner|simulator|streamer|dashboard|docs|examples|tests|docker)/[\w./-]*)")


def section(text: str, title: str) -> str:
    """The body of a `## title` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"no '## {title}' section"
    return match.group(1)


def numbers(text: str) -> set[str]:
    return {n.lstrip("+-−") for n in NUMBER.findall(text)}


def test_numbers_finds_figures_and_skips_names():
    assert numbers("SAO 0.503, GRPO -0.174 in 6,605.2 s; v1.6 and lr 4e-4") == {"0.503", "0.174", "6,605.2", "4"}


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_figure_of_the_readme_results_comes_from_the_results_page():
    quoted = numbers(section(README.read_text(), "Results"))
    page = (ROOT / "docs" / "results.md").read_text()
    missing = sorted(n for n in quoted if n not in numbers(page))
    assert quoted and not missing, f"README figures not in docs/results.md: {missing}"


def test_every_relative_link_of_the_docs_resolves():
    dead = [f"{page.relative_to(ROOT)} -> {target}" for page in PAGES for target in LINK.findall(page.read_text())
            if "://" not in target and not (page.parent / target).exists()]
    assert dead == []


def test_every_path_the_docs_name_exists():
    dead = []
    for page in PAGES:
        for name in PATH.findall(page.read_text()):
            name = name.rstrip(".")
            is_path = name.endswith("/") or "." in name.rsplit("/", 1)[-1]  # not a metric name like learner/ess_frac
            if is_path and "<" not in name and "*" not in name and not (ROOT / name).exists():
                dead.append(f"{page.relative_to(ROOT)}: {name}")
    assert dead == []
