"""The docs stay true to the code: the configuration reference is the schema's, the README stays
short, and every relative link points to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.core.config.reference import COMMAND, DOCS_PATH, reference_markdown

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 15_360  # bytes: the README is the front page; depth goes to docs/
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_configuration_reference_is_generated_from_the_schema():
    assert DOCS_PATH == ROOT / "docs" / "configuration.md"
    committed = DOCS_PATH.read_text(encoding="utf-8") if DOCS_PATH.exists() else ""
    assert committed == reference_markdown(), f"docs/configuration.md is stale: regenerate it with `{COMMAND}`"


def test_the_readme_is_at_most_15_kib():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes (at most {README_LIMIT}): move depth to docs/"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file(page: Path):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"
