"""A griffe extension for the API reference: reST roles in docstrings become code spans.

gradest's docstrings name other objects as reST roles (``:class:`~gradest.Surrogate```),
which Markdown would print as they stand, and whose colon the Google-style parser would
take for a ``type: description`` separator in a ``Returns:`` section. Before the
docstrings are parsed, each role becomes a code span of its target (`` `Surrogate` `` for
``~gradest.Surrogate``, the last component, as reST's tilde means; the title of
``title <target>``). Configured in mkdocs.yml (the mkdocstrings handler's
``extensions``); not part of the site (``exclude_docs``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:func|meth|class|mod|data|attr|exc|obj|const|type):`(?P<body>[^`]+)`"
)
TITLED = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^>]+)>$")


def role_as_code(match: re.Match[str]) -> str:
    body = match["body"].strip()
    titled = TITLED.match(body)
    if titled:
        text = titled["title"]
    elif body.startswith("~"):
        text = body[1:].rsplit(".", 1)[-1]
    else:
        text = body
    return f"`{text}`"


def plain_roles(text: str) -> str:
    return ROLE.sub(role_as_code, text)


class RstRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
