"""Contract options of ``equivalent_to`` about views and errors: ``aliases=`` (which outputs
must, or must not, be views of which input), ``error_inputs=`` (examples on which both sides
must raise) and ``raises=``/``match=`` (the error a spec expects), validated at decoration time;
and :class:`ErrorArgs`, the mark an ``error_inputs=`` example carries through the runner.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from hypothesis.strategies import SearchStrategy

from equiv._args import Args, as_args
from equiv.errors import InvalidArgument


class ErrorArgs(Args):
    """An example drawn from ``error_inputs=``: both sides must raise on it."""

    @classmethod
    def of(cls, value: Any) -> "ErrorArgs":
        a = as_args(value)
        return cls(*a.args, **a.kwargs)


def validate_contracts(sig: Any, impl_name: str, aliases: Any, error_inputs: Any,
                       raises: Any, match: Any) -> tuple[dict[Any, str | None], Any, Any, Any]:
    """Decoration-time validation of ``aliases=``, ``error_inputs=``, ``raises=``, ``match=``."""
    params = list(sig.parameters)
    out: dict[Any, str | None] = {}
    if aliases is not None:
        if not isinstance(aliases, Mapping):
            raise InvalidArgument(
                f"equivalent_to(aliases={aliases!r:.60}) maps output locations ('out', an index "
                "or a key of the result) to the argument they are a view of, or to None (a new "
                "tensor), e.g. aliases={'out': 'x'} or aliases={0: None}."
            )
        for loc, arg in aliases.items():
            if isinstance(loc, bool) or not (loc == "out" or isinstance(loc, (int, str))):
                raise InvalidArgument(
                    f"equivalent_to(aliases={{{loc!r}: ...}}): the location must be 'out' (the "
                    "whole result), an int index or a str key into the result."
                )
            if arg is not None and arg not in params:
                raise InvalidArgument(
                    f"equivalent_to(aliases={{{loc!r}: {arg!r}}}) names {arg!r}, which is not a "
                    f"parameter of {impl_name}; use one of {params}, or None for a new tensor."
                )
            out[loc] = arg
    if error_inputs is not None and not isinstance(error_inputs, SearchStrategy):
        raise InvalidArgument(
            f"equivalent_to(error_inputs=...) must be a Hypothesis strategy of argument tuples "
            f"(or equiv.Args) on which both sides raise, got {type(error_inputs).__name__}."
        )
    if raises is not None and not (isinstance(raises, type)
                                   and issubclass(raises, BaseException)):
        raise InvalidArgument(
            f"equivalent_to(raises={raises!r:.60}) must be an exception type, e.g. ValueError."
        )
    if match is not None:
        try:
            re.compile(match)
        except (re.error, TypeError) as e:
            raise InvalidArgument(f"equivalent_to(match={match!r:.60}) is not a regex: {e}."
                                  ) from None
    return out, error_inputs, raises, match
