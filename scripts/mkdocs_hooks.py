"""mkdocs hooks: the site's front page is the repository's README; links that leave docs/ become text.

README.md links to ``docs/x.md`` (right on the repository's front page); on the site those are ``x.md``.
A link to a file outside docs/ (``exporters/README.md``, ``../deploy/collector``) has no page on the
site: its text stays, as code, and the strict build still fails on a broken link inside docs/.
"""

from __future__ import annotations

import os
import re

_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _outside(target: str, page_dir: str, docs_dir: str) -> bool:
    if re.match(r"^[a-z]+://|^#|^mailto:", target):
        return False
    path = os.path.normpath(os.path.join(page_dir, target.split("#", 1)[0]))
    return not path.startswith(os.path.normpath(docs_dir) + os.sep) and path != os.path.normpath(docs_dir)


def on_page_markdown(markdown, page, config, files):
    docs_dir = config["docs_dir"]
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    if page.file.src_uri == "index.md":
        with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
            markdown = f.read()
        page_dir = root
    else:
        page_dir = os.path.dirname(os.path.join(docs_dir, page.file.src_uri))

    def fix(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if page.file.src_uri == "index.md" and target.startswith("docs/"):
            return f"[{text}]({target[len('docs/'):]})"
        if _outside(target, page_dir, docs_dir):
            return text if text.startswith("`") else f"`{text}`"
        return m.group(0)

    return _LINK.sub(fix, markdown)
