"""`dctms` command line: one subcommand per module in ``dctms.cli.commands``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

import dctms
from dctms.cli.hf_cache import MODEL_ARGUMENTS, resolve_model_arguments
from dctms.schema.errors import DctmsError

# Each module defines ``register(subparsers)`` which adds its parser with ``set_defaults(func=...)``;
# ``func(args) -> int`` returns the exit status.
COMMANDS = [
    "validate",
    "show",
    "compile",
    "run",
    "demo",
    "bench",
    "diff",
    "dot",
    "trace",
    "fit",
    "pack",
    "pool",
    "resources",
    "serve",
    "roofline",
    "convert-gguf",
    "check",
    "explain",
    "simulate",
    "selftest",
]

# The commands that compute with MLX: started with an optimised BLAS when MLX carries the
# reference one (dctms.runner.blas; DCTMS_BLAS=off keeps MLX's own).
FAST_BLAS_COMMANDS = {
    "run",
    "bench",
    "demo",
    "compile",
    "fit",
    "serve",
    "roofline",
    "check",
    "explain",
}


# The commands that run MLX: refused at start, in one line, on an MLX whose graph export and
# allocators dctms does not know (dctms.schema.targets.SUPPORTED_MLX).
MLX_COMMANDS = FAST_BLAS_COMMANDS | {"convert-gguf", "selftest"}


def _check_mlx() -> None:
    from dctms.schema.targets import mlx_refusal

    why = mlx_refusal()
    if why is not None:
        raise DctmsError(why)


def one_line(text: str) -> str:
    """A message on one line (MLX's own errors span several)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, like every other refusal (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dctms",
        description="Deterministic compile-time memory plans for MLX LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"dctms {dctms.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"dctms.cli.commands.{name.replace('-', '_')}").register(sub)
    return parser


def start_fast_blas(argv: list[str]) -> None:
    """Re-execute this process once with OpenBLAS preloaded when the subcommand computes."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in FAST_BLAS_COMMANDS:
        from dctms.runner.blas import reexec_with_fast_blas

        reexec_with_fast_blas()


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the console entry point (an in-process call passes its argv)
        try:
            start_fast_blas(sys.argv[1:])
        except DctmsError as err:
            print(f"dctms: {err}", file=sys.stderr)
            return err.exit_code
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in MLX_COMMANDS:
            _check_mlx()
        if args.command in MODEL_ARGUMENTS:  # ORG/NAME[@REVISION]: its cached snapshot folder
            resolve_model_arguments(args)
        return int(args.func(args) or 0)
    except DctmsError as err:
        print(f"dctms {args.command}: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"dctms {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except RecursionError:
        print(f"dctms {args.command}: input nested too deeply", file=sys.stderr)
        return 2
    except Exception as err:  # a bug in dctms: still one line, never a traceback (DCTMS_DEBUG=1)
        if os.environ.get("DCTMS_DEBUG"):
            raise
        print(
            f"dctms {args.command}: internal error: {type(err).__name__}: {one_line(err)} "
            "(a bug in dctms; DCTMS_DEBUG=1 shows where)",
            file=sys.stderr,
        )
        return 70


if __name__ == "__main__":
    sys.exit(main())
