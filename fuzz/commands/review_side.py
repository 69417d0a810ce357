"""One side of a baseline comparison, run as a process of its own:
``python -m kvspec.fuzz.commands.review_side REQUEST.json``.

The request (written by ``kvspec.fuzz.commands.review``) says what to run (an
example-bounded conformance search, an example-bounded fuzz run, or
replays of minimal traces) and where the engine comes from: ``path``
lists import folders put first on ``sys.path`` before anything imports
the engine, and ``isolate`` drops the current folder from ``sys.path``
(a base never imports the head's checkout it is run from). The result is
written as JSON to the request's ``result`` file; the exit status is 0
when the side ran, 3 when it could not (the error is in the result).

Only the standard library is imported before ``sys.path`` is set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    request = json.loads(Path(argv[0]).read_text())
    if request.get("isolate"):
        here = os.getcwd()
        sys.path[:] = [p for p in sys.path if p not in ("", ".", here)]
    for folder in reversed(request.get("path", [])):
        sys.path.insert(0, folder)
    if request.get("isolate"):
        from kvspec.fuzz import targets

        targets.FROM_CWD = False  # nor through a user's module:attr target
    from kvspec.fuzz.commands.review import serve

    return serve(request)


if __name__ == "__main__":  # pragma: no cover - run as a process
    sys.exit(main())
