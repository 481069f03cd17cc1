"""Every relative link in the repository's markdown resolves, and none leaves the repository.

For each markdown file under the repository root (README.md, docs/, bench/README.md, bench/results/*.md, the
model cards...): every relative link or image must name an existing file or folder inside the repository;
a `#anchor` (on its own, or after a markdown file) must name a heading of that file, by GitHub's slug rule;
no link may climb out of the repository (`../` past the root) or point into a `shared/` folder, which is not
part of it. Links with a scheme (https:, mailto:) are not followed: no network. Code blocks and inline code
are not read for links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SKIP_DIRS = {"node_modules", "__pycache__", "build", "dist"}  # plus every hidden folder (.git, .venv, ...)

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files(root: Path = ROOT) -> list[Path]:
    found = []
    for path in sorted(root.rglob("*.md")):
        parts = path.relative_to(root).parts[:-1]
        if any(p.startswith(".") or p in _SKIP_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        found.append(path)
    return found


def _prose_lines(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code removed unless keep_code."""
    lines, fence = [], None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            continue
        if fence is None:
            lines.append((no, line if keep_code else _INLINE_CODE.sub("", line)))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower-cased, with everything but letters, digits,
    spaces, hyphens and underscores removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file defines: its headings' slugs (repeats numbered -1, -2, ... as GitHub
    does) and explicit <a name/id> anchors."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    prev = ""
    for _, line in _prose_lines(path.read_text(encoding="utf-8"), keep_code=True):
        m = _ATX.match(line)
        setext = _SETEXT.match(line) if prev.strip() and not _ATX.match(prev) else None
        heading = m.group(2) if m else (prev if setext else None)
        if heading is not None:
            slug = github_slug(heading)
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            result.add(slug if n == 0 else f"{slug}-{n}")
        result.update(a.lower() for a in _HTML_ANCHOR.findall(line))
        prev = line
    return result


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link, image and reference definition outside code."""
    found = []
    for no, line in _prose_lines(path.read_text(encoding="utf-8")):
        found += [(no, t) for t in _LINK.findall(line)]
        m = _REF_DEF.match(line)
        if m:
            found.append((no, m.group(1)))
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the links of one markdown file: one message per bad link."""
    errors = []
    rel = path.relative_to(root)
    for no, target in links(path):
        if not target or _SCHEME.match(target):
            continue
        where = f"{rel}:{no}: {target}"
        file_part, _, anchor = target.partition("#")
        file_part = file_part.split("?", 1)[0]
        if file_part:
            base = root if file_part.startswith("/") else path.parent
            dest = (base / file_part.lstrip("/")).resolve()
            try:
                inside = dest.relative_to(root.resolve())
            except ValueError:
                errors.append(f"{where}: points outside the repository")
                continue
            if "shared" in inside.parts[:1] or "/shared/" in f"/{file_part}":
                errors.append(f"{where}: points into shared/, which is not part of the repository")
                continue
            if not dest.exists():
                errors.append(f"{where}: no such file")
                continue
        else:
            dest = path
        if anchor and dest.suffix == ".md" and dest.is_file() and anchor.lower() not in anchors(dest):
            errors.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root.resolve())}")
    return errors


def test_the_repository_has_its_documentation():
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "bench/README.md", "docs/architecture.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve_inside_the_repository(path):
    errors = broken_links(path)
    assert not errors, "\n".join(errors)


def test_the_checker_finds_bad_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Two words (`code.py`)\n\nText\n====\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#two-words-codepy) [ok](docs/a.md#text) [ok](#top) [ok](https://x.y/z)\n"
        "<a name=\"top\"></a>\n"
        "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n"
        "[gone](docs/missing.md)\n[anchor](docs/a.md#nope)\n[self](#nowhere)\n"
        "[out](../elsewhere.md)\n[shared](shared/notes.md)\n[ref]: docs/nothing.md\n",
        encoding="utf-8")
    errors = broken_links(tmp_path / "README.md", root=tmp_path)
    assert [e.split(": ", 2)[1] for e in errors] == [
        "docs/missing.md", "docs/a.md#nope", "#nowhere", "../elsewhere.md", "shared/notes.md", "docs/nothing.md"]
    assert "outside the repository" in errors[3] and "shared/" in errors[4]


@pytest.mark.parametrize("heading, slug", [
    ("Tandem against vLLM and HF on CPU (`bench_peer_cpu.py`)", "tandem-against-vllm-and-hf-on-cpu-bench_peer_cpupy"),
    ("CPU GEMM / prefill by instruction-set level", "cpu-gemm--prefill-by-instruction-set-level"),
    ("Several choices: `n` and `best_of`", "several-choices-n-and-best_of"),
    ("Serve's [HAProxy](https://x) ingress", "serves-haproxy-ingress"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug
