"""``--draft DRAFT`` and ``--num-draft K`` (speculative decoding), shared by ``dctms compile`` and
``dctms fit``: a plan of the target with the draft beside it (``toolkit.speculative``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from dctms.schema.errors import DctmsError

if TYPE_CHECKING:
    from dctms.schema.model_folder import ModelFolder
    from dctms.schema.types import Plan
    from dctms.toolkit.compiler import CompileOptions

DEFAULT_NUM_DRAFT = 3  # as mlx_lm.generate --num-draft-tokens


def add_draft_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft",
        metavar="DRAFT",
        help="speculative decoding: also plan this draft model (folder or config.json; same "
        "vocabulary) and the target's verify phase, in one envelope",
    )
    parser.add_argument(
        "--num-draft",
        type=int,
        metavar="K",
        help=f"tokens the draft proposes per verify call (default {DEFAULT_NUM_DRAFT}; "
        "needs --draft)",
    )


def draft_inputs(args: argparse.Namespace) -> list[Path]:
    """The draft's files (no output may be written onto them)."""
    from dctms.cli.inputs import model_inputs

    check_draft_options(args)
    return model_inputs(args.draft) if args.draft else []


def check_draft_options(args: argparse.Namespace) -> None:
    if args.num_draft is not None and not args.draft:
        raise DctmsError("--num-draft needs --draft DRAFT (the draft model)")


def compile_with_draft(
    args: argparse.Namespace, source: ModelFolder, opts: CompileOptions, progress=None
) -> Plan:
    """The plan of ``source`` (with its draft when ``--draft`` was given)."""
    check_draft_options(args)
    if not args.draft:
        from dctms.toolkit.compiler import compile_plan

        return compile_plan(source, opts, progress)
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.speculative import compile_speculative

    k = DEFAULT_NUM_DRAFT if args.num_draft is None else args.num_draft
    return compile_speculative(source, open_model(args.draft), opts, k, progress)
