"""Checks shared by fastrl's option dataclasses (``PolicyLossConfig``, ``GRPOConfig``): a number outside the range
where it means something, and a keyword that names no option, each answered with what was expected.

    number("PolicyLossConfig", "epsilon_low", 1.5, low=0, high=1, high_open=True, why="...")
    @suggest_keywords(aliases={"epsilon_low": "epsilon"})   # on a dataclass: 'did you mean ...' for a misspelling
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math

__all__ = ["is_finite_number", "number", "suggest_keywords", "unknown_keyword_message"]


def is_finite_number(value: object) -> bool:
    # comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float may be symbolic
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -math.inf < value < math.inf


def _range(low, high, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"a finite number {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"a finite number {'<' if high_open else '<='} {high}"
    return "a finite number"


def number(owner: str, name: str, value: object, *, low=None, high=None, low_open: bool = False,
           high_open: bool = False, optional: bool = False, why: str = "") -> None:
    """Raise ``ValueError("{owner}.{name} must be [None or ]{range}, got {value!r}[: {why}]")`` unless ``value`` is a
    finite number (not a bool) in the range (``None`` too when ``optional``). ``why`` says what goes wrong outside."""
    if optional and value is None:
        return
    ok = is_finite_number(value) and (low is None or (value > low if low_open else value >= low)) and (
        high is None or (value < high if high_open else value <= high))
    if not ok:
        expected = ("None or " if optional else "") + _range(low, high, low_open, high_open)
        raise ValueError(f"{owner}.{name} must be {expected}, got {value!r}" + (f": {why}" if why else ""))


def unknown_keyword_message(owner: str, keyword: str, names, aliases: dict[str, str] | None = None) -> str:
    """"{owner} got an unexpected keyword argument 'x'; did you mean 'y'?" with the closest option names
    (``aliases``: other spellings of an option, e.g. another library's name for it, pointing at ours)."""
    aliases = aliases or {}
    candidates = {n: n for n in names}
    candidates.update({alias: target for alias, target in aliases.items() if target in candidates})
    close = difflib.get_close_matches(keyword, list(candidates), n=3, cutoff=0.6)
    suggestions = list(dict.fromkeys(candidates[c] for c in close))
    message = f"{owner} got an unexpected keyword argument {keyword!r}"
    if suggestions:
        return message + "; did you mean " + " or ".join(repr(s) for s in suggestions) + "?"
    if len(candidates) <= 30:
        return message + f"; its options are {', '.join(sorted(names))}"
    return message + f"; see help({owner}) for its options"


def suggest_keywords(cls=None, *, aliases: dict[str, str] | None = None):
    """Class decorator for a dataclass: a keyword that names none of its fields raises ``TypeError`` with the
    closest field names ("did you mean ...") instead of Python's bare "unexpected keyword argument". Everything
    else about ``__init__`` (its signature included) is the dataclass's."""

    def wrap(cls):
        init = cls.__init__
        names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
        known = frozenset(names)

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            for keyword in kwargs:
                if keyword not in known:
                    raise TypeError(unknown_keyword_message(cls.__name__, keyword, names, aliases))
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls

    return wrap if cls is None else wrap(cls)
