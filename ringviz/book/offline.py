"""Sphinx extension that keeps the rendered book offline and its pages free of script errors.

Add ``ringviz.book.offline`` to ``sphinx: extra_extensions`` in _config.yml. On every page it

* drops repeated inline scripts: Sphinx 7.4 re-adds, in ``prepare_writing``, each body-only
  script that an extension registered after builder init, with ``filename=''`` instead of
  ``None``, so the copies do not compare equal. sphinx-thebe's ``const THEBE_JS_URL = ...`` is one:
  twice on a page it throws "Identifier 'THEBE_JS_URL' has already been declared";
* warns (an error under ``-W``) about any script or stylesheet loaded from the web, so a CDN
  asset cannot slip in through a theme or extension update.
"""

from __future__ import annotations

from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)


def _key(asset: Any) -> tuple:
    """What makes two script/stylesheet entries the same tag on the page."""
    filename = getattr(asset, "filename", asset) or ""
    attributes = getattr(asset, "attributes", {})
    return (filename, tuple(sorted((k, str(v)) for k, v in attributes.items())))


def _check_page(app: Sphinx, pagename: str, templatename: str, context: dict,
                doctree: Any) -> None:
    """Remove duplicate script tags; warn about remote scripts and stylesheets."""
    for name in ("script_files", "css_files"):
        assets = context.get(name)
        if not assets:
            continue
        unique: dict[tuple, Any] = {}
        for asset in assets:
            unique.setdefault(_key(asset), asset)  # the first of equal tags wins
        context[name] = list(unique.values())
        for asset in context[name]:
            url = str(getattr(asset, "filename", asset) or "")
            if "://" in url or url.startswith("//"):
                logger.warning(f"{pagename}: {name} loads {url} from the web; the book must "
                               "work offline", location=pagename)


def setup(app: Sphinx) -> dict:
    app.connect("html-page-context", _check_page, priority=900)  # after other extensions add
    return {"parallel_read_safe": True, "parallel_write_safe": True}
