"""Printing what comes from the disk: one line of text a terminal shows as it is, never acts on.

A run folder's name, a tag, a layer name or a reader's message comes from the disk and may hold anything:
a newline would forge a row of the table, an escape sequence would drive the terminal, a byte that is not
UTF-8 (decoded by Python as a lone surrogate) would stop ``print``. Every line ``report`` prints, and
every error line of the command line, goes through :func:`printable`. JSON needs none of this: the
encoder escapes them. The run model imports it without loading any command line.
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
    """``text`` with every character a terminal would act on written as Python writes it in a string
    literal (``\\n``, ``\\x1b``, ``\\u202e``, ``\\udcff``); only what it would never print itself, so
    escaping twice changes nothing.

    Example:
        >>> printable("run\\n  b  999  OK")
        'run\\\\n  b  999  OK'
        >>> printable("\\x1b[2Jrun") == printable(printable("\\x1b[2Jrun"))
        True
    """
    return _UNSAFE.sub(_escape, text)
