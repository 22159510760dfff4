"""What every output records about how it was made: one helper for all of them.

:func:`record` returns the provenance dict that every result of the collection layer
(:mod:`posteriorzoo.collection`) writes into its JSON: the tool and command, when, the
library versions, the git commit of the source tree when it is a git checkout, the input
files with their SHA-256, the seeds and the options. :func:`library_versions` is also
what the store writes into every checkpoint's ``versions`` column.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from posteriorzoo.hashing import sha256_file

#: Seconds allowed to ``git rev-parse`` (an output never waits on a slow file system).
_GIT_TIMEOUT = 5.0


def library_versions() -> dict[str, str]:
    """Versions of Python and of the libraries that shape a checkpoint's bytes."""
    import h5py
    import numpy as np
    import torch

    from posteriorzoo import __version__

    return {
        "posteriorzoo": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "h5py": h5py.__version__,
    }


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The commit of the posteriorzoo source tree (``-dirty`` if it has uncommitted
    changes), or None when it is not a git checkout or git is missing."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=_GIT_TIMEOUT,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=_GIT_TIMEOUT, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def describe_input(path: str | os.PathLike, digest: str | None = None) -> dict[str, Any]:
    """``{"path", "sha256", "bytes"}`` of an input file (``digest`` if already known)."""
    path = Path(path)
    return {"path": str(path), "sha256": digest or sha256_file(path),
            "bytes": path.stat().st_size}


def record(tool: str, *, command: str | None = None,
           inputs: Mapping[str, Any] | None = None, seeds: Mapping[str, Any] | None = None,
           options: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The provenance of one output.

    Parameters
    ----------
    tool : str
        What produced it, e.g. ``"posteriorzoo mmd"``.
    command : str, optional
        The command line, when it came from one.
    inputs : mapping, optional
        Name -> :func:`describe_input` dict (or any JSON value) of every input.
    seeds : mapping, optional
        Every seed used (None values say that nothing random was drawn).
    options : mapping, optional
        The validated options.
    **extra
        Further JSON-serialisable facts.
    """
    return {"tool": tool, "command": command,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": library_versions(), "git_commit": git_commit(),
            "inputs": dict(inputs or {}), "seeds": dict(seeds or {}),
            "options": dict(options or {}), **extra}
