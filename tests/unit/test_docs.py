"""The documentation, checked like code: every relative link leads somewhere, the README stays short enough
for a newcomer to read, and the benchmark's results files are where its documents say."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What a user reads: the README, the docs/ folder, and the chart's and the benchmark's documents.
USER_DOCS = (
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench" / "README.md",
    ROOT / "bench" / "RESULTS.md",
    ROOT / "bench" / "history.md",
    ROOT / "helm" / "tokenmill" / "README.md",
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def prose(doc: Path) -> str:
    """The document without its fenced code blocks, where brackets are code, not links."""
    return FENCE.sub("", doc.read_text())


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lowercased, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", prose(doc), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def test_the_user_docs_exist() -> None:
    assert all(doc.is_file() for doc in USER_DOCS), [str(d) for d in USER_DOCS if not d.is_file()]
    assert len(USER_DOCS) > 8  # the docs/ folder is there and read


def test_every_relative_link_in_the_readme_and_docs_points_to_a_file_that_exists() -> None:
    broken = []
    checked = 0
    for doc in USER_DOCS:
        for target in LINK.findall(prose(doc)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not a file of the repository
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            checked += 1
            if not resolved.exists() or not resolved.is_relative_to(ROOT):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no heading #{anchor} there)")
    assert checked > 50, checked
    assert not broken, "\n".join(broken)


def test_the_readme_is_short_and_links_every_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250  # what a newcomer reads in five minutes; the rest is in docs/
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{doc.name})" in readme, f"the README does not link docs/{doc.name}"


def test_the_benchmarks_results_files_are_under_bench_results_as_their_documents_say() -> None:
    bench = ROOT / "bench"
    assert not [p.name for p in bench.iterdir() if p.suffix in (".json", ".png")], "results files at bench/'s root"
    named = set()
    for doc in (bench / "README.md", bench / "RESULTS.md", bench / "history.md", ROOT / "docs" / "development.md"):
        named |= set(re.findall(r"`bench/(results/[\w.-]+\.(?:json|png))`", prose(doc)))
    assert len(named) > 30, named
    assert not [n for n in sorted(named) if not (bench / n).is_file()], named
