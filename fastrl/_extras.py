"""Optional dependencies: which extra brings what, and the error that says which one to install.

The core library (``fused_logprobs``, ``policy_loss``, ``value_loss``, ``fastrl.reference``) needs torch alone.
The trainers, the demo and the examples need the ``trl`` extra; a missing package there should say so in
words a user can act on, not as a bare ``No module named 'trl'``.
"""

from __future__ import annotations

import importlib.util

__all__ = ["DISTRIBUTION", "TRL_EXTRA", "missing_modules", "extra_error", "require_extra"]

# the name fastrl is published and installed under (pyproject.toml's [project] name; the import name stays
# `fastrl`): the package index's `fastrl` is an unrelated project
DISTRIBUTION = "fastrl-kernels"

# top-level modules the `trl` extra installs (pyproject.toml, [project.optional-dependencies] trl)
TRL_EXTRA = ("trl", "transformers", "accelerate", "datasets", "tokenizers")


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    """The names in ``modules`` that cannot be imported here (not installed)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or half-imported package counts as missing
            found = False
        if not found:
            out.append(name)
    return out


def extra_error(what: str, missing: str | list[str], extra: str = "trl") -> ModuleNotFoundError:
    """``ModuleNotFoundError`` saying that ``what`` needs ``missing`` and which extra brings it."""
    names = [missing] if isinstance(missing, str) else list(missing)
    listed = ", ".join(repr(n) for n in names)
    err = ModuleNotFoundError(
        f"{what} needs the package{'s' if len(names) > 1 else ''} {listed}, which {'are' if len(names) > 1 else 'is'} "
        f"not installed. Install fastrl's '{extra}' extra: pip install \"{DISTRIBUTION}[{extra}]\" "
        f"(from a checkout of the repository: pip install -e \".[{extra}]\").",
        name=names[0],
    )
    return err


def require_extra(what: str, modules: tuple[str, ...] = TRL_EXTRA, extra: str = "trl") -> None:
    """Raise :func:`extra_error` when any of ``modules`` is missing."""
    missing = missing_modules(modules)
    if missing:
        raise extra_error(what, missing, extra)
