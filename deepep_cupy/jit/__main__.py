"""``python -m deepep_cupy.jit <command>``; the one command is ``precompile`` (see
:mod:`deepep_cupy.jit.precompile`)."""

from __future__ import annotations

import sys

_USAGE = "usage: python -m deepep_cupy.jit precompile [--arch ARCH ...] [--jobs N] [family ...]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    if args[0] != "precompile":
        print(f"{_USAGE}\nunknown command {args[0]!r}", file=sys.stderr)
        return 2
    from .precompile import main as precompile

    return precompile(args[1:])


if __name__ == "__main__":
    sys.exit(main())
