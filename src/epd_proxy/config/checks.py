"""How a configuration names its mistakes: every one of them, one line each, naming the flag.

Each concern's settings check themselves (``sections.py``), and what another module owns is
checked beside it (``api.app.validate_config`` gathers them): this is the currency they share.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable


class ConfigErrors(ValueError):
    """Every mistake found in a configuration, not only the first: an operator fixes a
    file in one pass. ``errors`` holds one line each; the text joins them."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = list(errors)


def gather(checks: Iterable[Callable[[], object]]) -> None:
    """Run every check, then raise one ``ConfigErrors`` with what they all raised."""
    errors: list[str] = []
    for check in checks:
        try:
            check()
        except ConfigErrors as exc:
            errors.extend(exc.errors)
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise ConfigErrors(errors)


def check_range(errors: list[str], flag: str, value: float, low: float | None = None, high: float | None = None,
                *, above: bool = False) -> None:
    """Append why ``value`` of ``flag`` is out of range: ``low`` (exclusive when ``above``) to
    ``high``, and finite (a NaN passes every comparison, so it is named here)."""
    if isinstance(value, float) and not math.isfinite(value):
        errors.append(f"{flag} must be a finite number, not {value}")
    elif low is not None and high is not None and not low <= value <= high:
        errors.append(f"{flag} must be in {low}..{high}, not {value}")
    elif low is not None and high is None and (value <= low if above else value < low):
        errors.append(f"{flag} must be {'>' if above else '>='} {low:g}, not {value:g}")
