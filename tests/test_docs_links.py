"""Every relative link in README.md and docs/*.md resolves: the file exists, and a `#anchor`
names a heading of that file under GitHub's rules. Plain text processing, no jax import."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before de-duplication): the rendered text,
    lower-cased, with everything but letters, digits, spaces, '-' and '_' removed and
    spaces turned into '-'."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a page: heading slugs, with GitHub's -1, -2 ... for repeats."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    found |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    return found


def links(path: Path):
    """(line number, target) of every link and reference definition outside code."""
    for number, line in prose_lines(path.read_text()):
        ref = _REF_DEF.match(line)
        if ref:
            yield number, ref.group(1)
            continue
        prose = _CODE_SPAN.sub("", line)
        for match in _LINK.finditer(prose):
            yield number, match.group(1)


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{_shown(path)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in "
                            f"{_shown(dest)}")
    return problems


def test_slugs_follow_github():
    assert github_slug("Actor-critic PPO (`algo.name: ppo`)") == "actor-critic-ppo-algoname-ppo"
    assert github_slug("Cloud runs (`gs://`)") == "cloud-runs-gs"
    assert github_slug("Models (`model_defs`)") == "models-model_defs"
    assert (github_slug("Behaviour corrections (rollout–training mismatch)")
            == "behaviour-corrections-rollouttraining-mismatch")
    assert github_slug('The "sum and count" form') == "the-sum-and-count-form"


def test_checker_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Two words\n\n[ok](#two-words) [bad](#three) "
                    "[gone](missing.md) `[code](#x)`\n\n```\n[fenced](#y)\n```\n")
    assert [p.split(": ")[1] for p in broken_links(page)] == ["#three", "missing.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []
