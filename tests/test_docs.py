"""The docs stay true to the code: the configuration reference is the schema's, the README stays
short, and every relative link points to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.core.config.docs_page import COMMAND, DOCS_PATH, reference_markdown

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# bytes: the README is the front page (depth goes to docs/); benchmarks/README.md is a reference of
# each benchmark's latest figures (earlier ones live in git history)
SIZE_LIMITS = {"README.md": 15 * 1024, "benchmarks/README.md": 60 * 1024}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_configuration_reference_is_generated_from_the_schema():
    assert DOCS_PATH == ROOT / "docs" / "configuration.md"
    committed = DOCS_PATH.read_text(encoding="utf-8") if DOCS_PATH.exists() else ""
    assert committed == reference_markdown(), f"docs/configuration.md is stale: regenerate it with `{COMMAND}`"


@pytest.mark.parametrize("page, limit", SIZE_LIMITS.items(), ids=list(SIZE_LIMITS))
def test_the_readmes_stay_within_their_size(page: str, limit: int):
    size = len((ROOT / page).read_bytes())
    assert size <= limit, f"{page} is {size} bytes (at most {limit}): move depth to docs/, history to git"


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings as GitHub makes them: lower case, punctuation but ``-`` and
    ``_`` dropped, spaces as ``-``, a repeated one suffixed ``-1``, ``-2``..."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        repeat = counts.get(slug, 0)
        counts[slug] = repeat + 1
        found.add(f"{slug}-{repeat}" if repeat else slug)
    return found


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page: Path):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL (http:, mailto:)
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files or headings: {broken}"
