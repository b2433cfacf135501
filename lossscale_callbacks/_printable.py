"""The one escaping rule for names and words the ``report`` command prints as text.

A run folder's name, a tag, a layer name or a reader's message comes from the disk and may hold
anything: a newline would forge a row of the table, an escape sequence would drive the terminal,
a byte that is not UTF-8 (decoded by Python as a lone surrogate) would stop ``print``. Every line
``report`` prints goes through :func:`printable`, which writes such characters the way Python
writes them in a string literal (``\\n``, ``\\x1b``, ``\\u202e``, ``\\udcff``). It escapes only
what it would never print itself, so escaping twice changes nothing. JSON needs none of this: the
encoder escapes them already.

Example:
    >>> printable("run\\n  b  999  OK")
    'run\\\\n  b  999  OK'
    >>> printable("\\x1b[2Jrun") == printable(printable("\\x1b[2Jrun"))
    True
"""

from __future__ import annotations

import re

__all__ = ["printable"]

# Control characters (C0, DEL, C1), the Unicode line and paragraph separators, the bidirectional
# controls that reorder what a terminal shows, and lone surrogates (undecodable bytes of a file name).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on written as an escape (see the module)."""
    return _UNSAFE.sub(_escape, text)
