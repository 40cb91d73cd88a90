"""Which fastrl a result measured: the commit, and whether the measured tree was that commit's.

A lent GPU machine gets a copy of the working tree, not the repository. ``python -m bench.provenance stamp PATH``
(bench/device_wheels.sh) writes the commit, whether the tree was clean, and a digest of the tracked files; on the
GPU :func:`provenance` recomputes the digest: equal means the measured tree is the stamped one. Standard library
only (it runs before any install).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import subprocess
import sys
from pathlib import Path

__all__ = ["stamp", "provenance", "STAMP"]

REPO_ROOT = Path(__file__).resolve().parent.parent
STAMP = REPO_ROOT / ".whl" / "COMMIT.json"  # where bench/device_wheels.sh writes it (carried with the wheels)
TRACKED = ("fastrl", "kernels", "bench", "tests", "pyproject.toml")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def _digest(paths: list[str]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        f = REPO_ROOT / p
        h.update(p.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"<missing>") + b"\0")
    return h.hexdigest()


def stamp(path: Path = STAMP) -> dict:
    """Write the commit, cleanliness and file digest of this checkout to ``path``; returns what was written."""
    paths = [p for p in _git("ls-files", "--", *TRACKED).splitlines() if not p.startswith("bench/results/")]
    dirty = _git("status", "--porcelain", "--", *TRACKED)
    info = {"commit": _git("rev-parse", "HEAD"), "clean": not dirty, "digest": _digest(paths), "paths": paths,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=1))
    return info


def provenance(path: Path = STAMP) -> dict:
    """``{"fastrl_commit", "tree_clean", "provenance"}`` of the tree this process runs from: from a stamp when one
    is here (its digest recomputed), else from git; ``tree_clean`` None when neither can say."""
    if path.is_file():
        info = json.loads(path.read_text())
        same = _digest(info["paths"]) == info["digest"]
        return {"fastrl_commit": info["commit"], "tree_clean": bool(info["clean"] and same),
                "provenance": f"stamp of {info['created']}: " + (
                    "the tree is the stamped one" if same else "files changed since the stamp")
                + ("" if info["clean"] else "; the stamped checkout had uncommitted changes")}
    try:
        dirty = _git("status", "--porcelain", "--", *TRACKED)
        return {"fastrl_commit": _git("rev-parse", "HEAD"), "tree_clean": not dirty, "provenance": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"fastrl_commit": "unknown", "tree_clean": None, "provenance": "no stamp and no git"}


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] != "stamp":
        print("usage: python -m bench.provenance stamp [PATH]   (default .whl/COMMIT.json)", file=sys.stderr)
        sys.exit(2)
    info = stamp(Path(sys.argv[2]) if len(sys.argv) == 3 else STAMP)
    print(f"stamped {info['commit'][:10]} ({'clean' if info['clean'] else 'UNCOMMITTED CHANGES'}), "
          f"{len(info['paths'])} files")
