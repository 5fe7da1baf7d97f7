"""The documentation site's build hooks (mkdocs.yml's ``hooks``): what makes docs/ a site without a second copy.

- The home page is the README itself, read at build time (no docs/index.md to keep in step with it).
- The API reference pages are generated from the .proto and from the server's OpenAPI document
  (scripts/api_reference.py), so they cannot go stale and are not committed.
- Links are written for GitHub, relative to the file they are in. In the site, a link into docs/ becomes the
  page's, and a link to any other file of the repository (bench/RESULTS.md, the chart, the .proto) becomes the
  file on GitHub, where it is readable: the same Markdown works in both places.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

sys.path.insert(0, str(Path(__file__).resolve().parent))  # api_reference.py, beside this file

import api_reference

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# (alt or text, target): a Markdown link or image, as the docs write them (inline, no title).
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
REFERENCE: dict[str, Callable[[], str]] = {
    "reference/grpc.md": api_reference.grpc_reference,
    "reference/http.md": api_reference.http_reference,
}


def site_link(target: str, source: Path, page_uri: str, docs: Path, repo_url: str, image: bool) -> str:
    """``target``, a link in the file ``source``, as the page ``page_uri`` of the site must write it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return target
    path, hash_, anchor = target.partition("#")
    resolved = (source.parent / path).resolve()
    here = os.path.dirname(page_uri) or "."
    if resolved == README:
        return os.path.relpath("index.md", here) + hash_ + anchor
    if resolved.is_relative_to(docs):
        return os.path.relpath(resolved.relative_to(docs).as_posix(), here) + hash_ + anchor
    kind = "raw" if image else "tree" if resolved.is_dir() else "blob"
    return f"{repo_url.rstrip('/')}/{kind}/main/{resolved.relative_to(REPO).as_posix()}{hash_}{anchor}"


def rewrite_links(markdown: str, source: Path, page_uri: str, docs: Path, repo_url: str) -> str:
    """Every link of the prose (fenced code left as it is) as the site's page must write it."""

    def one(match: re.Match[str]) -> str:
        target = site_link(match[2], source, page_uri, docs, repo_url, match[1].startswith("!"))
        return match[1] + target + match[3]

    parts, last = [], 0
    for fence in FENCE.finditer(markdown):
        parts += [LINK.sub(one, markdown[last : fence.start()]), fence[0]]
        last = fence.end()
    parts.append(LINK.sub(one, markdown[last:]))
    return "".join(parts)


def on_files(files: Files, config: MkDocsConfig, **kwargs: Any) -> Files:
    docs = Path(config.docs_dir).resolve()
    home = rewrite_links(README.read_text(), README, "index.md", docs, config.repo_url or "")
    files.append(File.generated(config, "index.md", content=home))
    for uri, generate in REFERENCE.items():
        files.append(File.generated(config, uri, content=generate()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, **kwargs: Any) -> str:
    source = page.file.abs_src_path
    if page.file.generated_by or source is None:  # the home page and the references: written for the site
        return markdown
    docs = Path(config.docs_dir).resolve()
    return rewrite_links(markdown, Path(source).resolve(), page.file.src_uri, docs, config.repo_url or "")
