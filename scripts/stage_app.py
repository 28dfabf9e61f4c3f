"""Copy vramguard's own installed files, compiled, under a staging root (a step of the Dockerfile).

    /opt/vramguard/bin/python scripts/stage_app.py /app

Run with the image's virtualenv after ``pip install --no-deps .``: every file of the installed
``vramguard`` distribution (its packages, console scripts and dist-info, as listed in its RECORD)
and the bytecode of its modules, compiled hash-based, is copied to the same path under the
staging root. The runtime stage copies that root over the dependencies' layer, so a code change
makes a layer of about a megabyte instead of one holding the whole virtualenv.
"""

from __future__ import annotations

import compileall
import importlib.metadata
import importlib.util
import os
import py_compile
import shutil
import sys
from pathlib import Path


def staged_paths(distribution: str = "vramguard") -> list[Path]:
    """The installed files of ``distribution`` and, for its modules, their compiled bytecode."""
    paths: list[Path] = []
    for file in importlib.metadata.distribution(distribution).files or []:
        path = Path(os.path.normpath(file.locate()))
        if path.suffix == ".pyc" or not path.is_file():
            continue
        paths.append(path)
        if path.suffix == ".py":
            mode = py_compile.PycInvalidationMode.UNCHECKED_HASH
            if not compileall.compile_file(str(path), quiet=1, invalidation_mode=mode):
                raise SystemExit(f"cannot compile {path}")
            paths.append(Path(importlib.util.cache_from_source(str(path))))
    return paths


def main(argv: list[str]) -> int:
    """Stage the files under ``argv[0]``; print how many."""
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    paths = staged_paths()
    for path in paths:
        target = root / path.relative_to(path.anchor)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    print(f"staged {len(paths)} files of vramguard under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
