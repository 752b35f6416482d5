"""Prompt filters a training recipe may apply to its dataset (`data.prompt_filter`): name -> test.

A filter picks which of a dataset's prompts are regenerated; the replay (`data.extra_responses`)
is never filtered. A filter's behaviour is part of the data it selects, so changing one changes
the prompts behind a cached dataset under the same key: add a new name instead.
"""

from __future__ import annotations

import re

_CODE = re.compile(
    r"```|^\s*(def|class|import|from \S+ import|function|const|let|var|public|private|#include|SELECT|CREATE)\b"
    r"|[;{}]\s*$|</?[a-zA-Z][\w-]*[ />]|=>|\w\(\)|\b(code|program|script|python|java|javascript|typescript|sql|html"
    r"|css|react|api|json|regex|bash|excel formula|c\+\+|c#)\b", re.IGNORECASE | re.MULTILINE)


def is_prose(text: str) -> bool:
    """A request for prose: Latin script, at least 20 characters, and neither code nor a request
    about code (fences, statements, markup, programming words)."""
    return len(text) >= 20 and all(ord(c) < 0x250 or c in "‘’“”–—…" for c in text) \
        and _CODE.search(text) is None


PROMPT_FILTERS = {"prose": is_prose}
