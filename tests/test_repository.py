"""The repository is self-contained: no file points outside it. The design lives in docs/design.md; nothing
names the old design file kept next to the checkout, no path climbs out of it, and every relative link of
every Markdown file reaches a file or folder of the repository (and a heading there, when it names one).
docs/README.md indexes every page of docs/, and docs/design.md keeps the section numbers others cite."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Spelled in pieces so that this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        [
            "DESIGN" + r"(?:\.md|\s*§|'s)",  # the old design file, in any of the ways it was cited
            re.escape(".." + "/shared"),  # a path out of the repository into the shared folder beside it
            re.escape("/work" + "/shared"),
            "beside the " + "repository",
        ]
    )
)
# [text](target) and ![alt](target), with an optional "title"; reference definitions `[id]: target`
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^[ ]{0,3}\[[^\]]+\]:[ \t]*<?([^\s>]+)>?(?:[ \t]+.*)?$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")
HEADING = re.compile(r"^#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$", re.MULTILINE)


def repository_files() -> list[Path]:
    """Tracked files, and new ones not yet committed that git does not ignore (they are about to be)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = sorted({ROOT / p for p in out.decode().split("\0") if p})
    return [p for p in paths if p.is_file() and not p.is_symlink()]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def outside_references(files: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in files:
        text = text_of(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            m = OUTSIDE.search(line)
            if m:
                found.append(f"{path.relative_to(root)}:{n}: {m.group()!r} points outside the repository")
    return found


def link_targets(markdown: str) -> list[str]:
    """Every link target of a Markdown text, outside fenced code blocks and code spans."""
    prose = CODE_SPAN.sub("", FENCE.sub("", markdown))
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens,
    ``-1``, ``-2``… for repeats."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """Relative links that leave ``root`` or reach nothing, and anchors into Markdown files that name no heading
    (anchors within the same file are left to the renderer)."""
    found = []
    for path in files:
        if path.suffix.lower() != ".md":
            continue
        text = text_of(path)
        if text is None:
            continue
        for target in link_targets(text):
            if target.startswith(EXTERNAL) or target.startswith("#"):
                continue
            where, _, anchor = target.partition("#")
            where = where.split("?", 1)[0]
            resolved = (root / where.lstrip("/")) if where.startswith("/") else (path.parent / where)
            resolved = resolved.resolve()
            if not resolved.is_relative_to(root):
                found.append(f"{path.relative_to(root)}: link {target!r} leaves the repository")
            elif not resolved.exists():
                found.append(f"{path.relative_to(root)}: link {target!r} reaches nothing")
            elif anchor and resolved.suffix.lower() == ".md" and anchor not in anchors(resolved.read_text()):
                found.append(f"{path.relative_to(root)}: link {target!r} names no heading of {where}")
    return found


def test_no_file_points_outside_the_repository() -> None:
    assert outside_references(repository_files()) == []


def test_every_relative_markdown_link_resolves_inside_the_repository() -> None:
    assert broken_links(repository_files()) == []


def test_the_checks_bite(tmp_path: Path) -> None:
    """A citation of the old file, a path out of the repository, a link to a missing file, one leaving the
    repository and one to a heading that is not there are caught; links in code, external links, anchors of
    the same file and existing targets are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# design\n\n## 1. The pieces\n")
    bad = tmp_path / "docs" / "bad.md"
    bad.write_text(
        "See " + "DESIGN" + ".md §3.\nAnd " + ".." + "/shared/notes.\n"
        "[ok](design.md#1-the-pieces) [anchor](#x) [web](https://example.com) [dir](../docs/)\n"
        "[missing](nowhere.md) ![img](../../outside.png) [lost](design.md#2-the-contract)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "[ref]: design.md\n[refbad]: gone.md\n"
    )
    files = [tmp_path / "docs" / "design.md", bad]
    assert outside_references(files, tmp_path) == [
        "docs/bad.md:1: 'DESIGN" + ".md' points outside the repository",
        "docs/bad.md:2: '.." + "/shared' points outside the repository",
    ]
    assert broken_links(files, tmp_path) == [
        "docs/bad.md: link 'nowhere.md' reaches nothing",
        "docs/bad.md: link '../../outside.png' leaves the repository",
        "docs/bad.md: link 'design.md#2-the-contract' names no heading of design.md",
        "docs/bad.md: link 'gone.md' reaches nothing",
    ]


def test_the_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    linked = {Path(t.split("#", 1)[0]).name for t in link_targets(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages - linked == set()


def test_design_keeps_its_section_numbers() -> None:
    """Code, tests and docs cite docs/design.md by section number: §1 to §11, §10.1-§10.6 and §11.1-§11.6."""
    headings = re.findall(
        r"^#{2,3} (\d+(?:\.\d+)?)\.? ", (ROOT / "docs" / "design.md").read_text(), re.MULTILINE
    )
    want = [str(n) for n in range(1, 12)]
    want[10:10] = [f"10.{i}" for i in range(1, 7)]
    want += [f"11.{i}" for i in range(1, 7)]
    assert headings == want


def test_the_readme_stays_a_newcomers_page() -> None:
    """README says what loraserve is, the two commands, the pieces, one gRPC and one HTTP example and where to
    start reading, in at most 120 lines; development detail lives in docs/development.md, HTTP fields in
    docs/http.md."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    for must in (
        "TPU in\nproduction",
        "make demo",
        "make test",
        "docs/development.md",
        "Where to start reading",
    ):
        assert must.replace("\n", " ") in readme.replace("\n", " "), must
