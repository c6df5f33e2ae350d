"""The README and docs/: every relative link resolves, the README stays short, no stale phrases.

A link is ``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)`` or an image
``![alt](path)``, outside code blocks and inline code. A relative path must name an
existing file or folder (from the linking file's folder); an anchor must be the
GitHub-style slug of a heading of the target file.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
MAX_README_LINES = 250
STALE_PHRASES = ("original lesson", "DESIGN.md", "previous version", "not explained yet")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings, duplicates numbered as GitHub numbers them."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = counts.get(base, 0)
        counts[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None  # https:, mailto:, ...


DOCUMENTS = [README, *DOCS]


def test_the_documents_are_found():
    assert README.is_file() and len(DOCS) >= 10


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path):
    broken = []
    for target in links(path):
        if is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (destination.suffix != ".md" or anchor not in anchors(destination)):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_checker_sees_links_and_skips_code():
    text = "[a](x.md) ![b](img/p.png) [c](y.md#sec) `[d](not.md)`\n```\n[e](nor.md)\n```\n[f](#here)"
    assert LINK.findall(prose(text)) == ["x.md", "img/p.png", "y.md#sec", "#here"]
    assert slug("Transient or permanent: the bucket never kills the job") == (
        "transient-or-permanent-the-bucket-never-kills-the-job"
    )
    assert slug("A `torch.distributed.checkpoint` backend") == "a-torchdistributedcheckpoint-backend"
    assert slug("How far behind is the bucket?") == "how-far-behind-is-the-bucket"


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_holds_a_stale_phrase(path: Path):
    text = path.read_text().lower()
    found = [phrase for phrase in STALE_PHRASES if phrase.lower() in text]
    assert not found, f"{path.relative_to(ROOT)} contains {found}"
