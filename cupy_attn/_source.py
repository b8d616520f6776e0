"""CUDA source preparation shared by the CUDA backend and the emulator.

Local headers (``#include "name"``) are inlined into the source with ``#line`` directives, so a
compiled-module cache keyed on the source text covers every header (CuPy's cache hashes only the
source string: an edited header pulled in with ``-I`` would otherwise leave a stale binary), and
compiler messages still point at the real file and line.
"""
from __future__ import annotations

import re
from pathlib import Path

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[^\n]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[^\n]*$", re.MULTILINE)


def inline_local_includes(code: str, include_dirs, origin: str = "<kernel source>") -> str:
    """Replace each ``#include "x"`` found in ``include_dirs`` by the file's text, recursively.

    Files are included once (as if each had ``#pragma once``); includes that are not found
    locally are left for the compiler.
    """
    dirs = [Path(d) for d in include_dirs]
    seen: set[Path] = set()

    def expand(text: str, name: str, here: Path | None) -> str:
        out, last, line = [], 0, 1
        for match in _INCLUDE.finditer(text):
            candidates = ([here] if here else []) + dirs
            found = next((d / match.group(1) for d in candidates if (d / match.group(1)).is_file()), None)
            if found is None:
                continue
            out.append(text[last:match.start()])
            line += text.count("\n", last, match.start())
            found = found.resolve()
            if found not in seen:
                seen.add(found)
                body = _PRAGMA_ONCE.sub("", found.read_text())
                out.append(f'#line 1 "{found}"\n{expand(body, str(found), found.parent)}\n')
            out.append(f'#line {line + 1} "{name}"')
            last = match.end()
        out.append(text[last:])
        return "".join(out)

    return expand(code, origin, None)
