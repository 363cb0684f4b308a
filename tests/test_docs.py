"""The README and docs/: every relative link resolves (file and #anchor), and nothing points
outside the repository (a reader of the repository has no ../shared)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_EXTERNAL = ("http://", "https://", "mailto:")


def prose(path: Path) -> str:
    """The Markdown outside fenced code blocks and inline code."""
    text = _FENCE.sub("", path.read_text())
    return re.sub(r"`[^`\n]*`", "", text)


def links(path: Path) -> list[str]:
    return [target for target in _LINK.findall(prose(path)) if not target.startswith(_EXTERNAL)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _FENCE.sub("", path.read_text()), re.M)
    return {slug(h) for h in headings}


def test_the_docs_exist() -> None:
    names = {p.name for p in DOCS}
    assert {"README.md", "architecture.md", "benchmarks.md", "configuration.md",
            "deployment.md"} <= names  # fmt: skip


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif ROOT not in (dest, *dest.parents):
            broken.append(f"{target} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert broken == [], f"{doc.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    assert "../shared" not in text and "DESIGN.md" not in text


def test_the_readme_is_a_front_door() -> None:
    """The two commands, the request flow, the module map and the docs links stay on top."""
    readme = (ROOT / "README.md").read_text()
    for needle in ("./run_server.sh", "./wick test", "AsyncLLM", "EngineCore", "KVCacheManager",
                   "ModelRunner", "docs/architecture.md", "docs/configuration.md",
                   "docs/deployment.md", "docs/benchmarks.md"):  # fmt: skip
        assert needle in readme, needle
    assert len(readme) < 20_000, "keep the README short: details belong in docs/"


def test_the_link_checker_sees_broken_links(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n[a](missing.md) [b](#title) [c](https://docs.example)\n"
                   "```\n[d](in-code.md)\n```\n")  # fmt: skip
    assert links(doc) == ["missing.md", "#title"]
    assert anchors(doc) == {"title"}
    assert slug("run_server.sh: the whole stack") == "run_serversh-the-whole-stack"
