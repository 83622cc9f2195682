"""The one `implementation=` switch of the project, and how a backend says what it supports.

Every op that has a kernel takes `implementation=` with the same meaning, and the model
(`v41jax.nn`) passes its own straight through:

| implementation       | what runs                                                             |
|----------------------|-----------------------------------------------------------------------|
| 'xla'                | the op's definition in `v41jax.ops` (jnp, float32, any shape/format)  |
| 'pallas'             | the op's Pallas kernel, compiled for the GPU (Hopper, Mosaic GPU)     |
| 'pallas_interpret'   | the same kernel run by the Pallas interpreter on the CPU (tests)      |

A kernel backend declares the calls it takes with a `supports(...)` function returning a
`Support`: truthy when it takes the call, else falsy with one `Limit` per unmet condition (the
argument, what the backend expects, what it got). Callers ask it instead of copying a kernel's
limits (tokamax's `supported_on`); the kernel entry points raise `Support.error()` themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

Implementation = Literal["xla", "pallas", "pallas_interpret"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("xla", "pallas", "pallas_interpret")
KERNEL_IMPLEMENTATIONS: tuple[Implementation, ...] = ("pallas", "pallas_interpret")
"""The entries of `IMPLEMENTATIONS` that run a Pallas kernel."""


def check_implementation(
    implementation: str, allowed: tuple[str, ...] = IMPLEMENTATIONS, *, where: str = ""
) -> None:
    """Raise ValueError unless `implementation` is one of `allowed` (`where` says for what)."""
    if implementation not in allowed:
        suffix = f" for {where}" if where else ""
        raise ValueError(
            f"implementation: expected one of {allowed}{suffix}, got {implementation!r}"
        )


def interpret(implementation: str) -> bool:
    """Whether `implementation` runs its kernel in the Pallas interpreter (on the CPU)."""
    return implementation == "pallas_interpret"


class Limit(NamedTuple):
    """One condition a backend needs and a call does not meet.

    Attributes:
      argument: the argument of the op (or the property of one, e.g. 'dim' for q's last axis).
      expected: what the backend takes, in words ('256 or 512', "'nvfp4'", '<= 256').
      got: the value the call has.
    """

    argument: str
    expected: str
    got: object

    def __str__(self) -> str:
        return f"{self.argument}: expected {self.expected}, got {self.got!r}"


@dataclasses.dataclass(frozen=True)
class Support:
    """Whether `backend` takes a call: truthy when `limits` is empty.

    Attributes:
      backend: the backend's name, for messages.
      limits: the conditions the call does not meet.
    """

    backend: str
    limits: tuple[Limit, ...] = ()

    def __bool__(self) -> bool:
        return not self.limits

    def error(self) -> ValueError:
        """The error to raise for an unsupported call (names every unmet condition)."""
        return ValueError(
            f"{self.backend} cannot take this call: " + "; ".join(map(str, self.limits))
        )


def support(backend: str, *conditions: tuple[bool, str, str, object]) -> Support:
    """A `Support` from `(ok, argument, expected, got)` conditions; the unmet ones become limits."""
    return Support(backend, tuple(Limit(a, e, g) for ok, a, e, g in conditions if not ok))
