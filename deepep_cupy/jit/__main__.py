"""``python -m deepep_cupy.jit <command>``; the one command is ``precompile`` (see
:mod:`deepep_cupy.jit.precompile`)."""

from __future__ import annotations

import argparse
import sys
import textwrap

PROG = "python -m deepep_cupy.jit"
COMMANDS = {
    "precompile": "compile the shipped kernels into the kernel cache ahead of time, or verify and repair the "
                  "entries already there (default: every kernel family, for the first visible GPU's "
                  "architecture, else sm_90)",
}


def command_line() -> argparse.ArgumentParser:
    """The top-level parser, for its help: each command parses its own options."""
    width = max(len(name) for name in COMMANDS) + 2
    listing = "\n".join(textwrap.fill(text, 100, initial_indent=f"  {name:<{width}}",
                                      subsequent_indent=" " * (width + 2)) for name, text in COMMANDS.items())
    return argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [-h] command [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="deepep_cupy's kernel compiler (NVRTC and nvJitLink; no GPU needed) and its kernel cache\n"
        "($DEEPEP_CUPY_CACHE_DIR). Kernels compile on their first use anyway; these commands do it ahead of\n"
        f"time.\n\ncommands:\n{listing}",
        epilog=f"`{PROG} <command> --help` shows a command's options and their defaults.",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names; returns the exit status (2 for a usage error)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "precompile":
        from .precompile import main as precompile

        return precompile(args[1:])
    parser = command_line()
    if args and args[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    parser.print_usage(sys.stderr)
    problem = f"unknown command {args[0]!r}" if args else "no command given"
    print(f"{PROG}: error: {problem}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
