"""Which kind of plan a compile makes -- text, vision-language or speculative -- and the one call
that makes it. ``dctms compile``, ``dctms fit`` and ``dctms check`` all go through
``compile_kind``, so a plan kind one of them knows the others know too (a speculative plan checked
by re-compiling only its target would always read as stale).

The vision and speculative compilers are imported only when such a plan is made: text-only use never
loads mlx-vlm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dctms.schema.draft import DEFAULT_NUM_DRAFT
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import ModelFolder, model_from_config
from dctms.schema.types import CompileRequest, Plan
from dctms.toolkit.compiler import CompileOptions, compile_plan


@dataclass(frozen=True)
class Images:
    """``--images K --image-size HxW``: the image bounds of a vision-language plan."""

    images: int
    height: int
    width: int
    overlap: bool = False  # --overlap: vision calls on a second MLX stream beside prefill


@dataclass(frozen=True)
class PlanKind:
    images: Images | None = None  # a vision-language plan
    draft: ModelFolder | None = None  # speculative decoding: the draft model
    num_draft: int = DEFAULT_NUM_DRAFT

    @property
    def name(self) -> str:
        return "vision" if self.images else "speculative" if self.draft else "text"


TEXT = PlanKind()


def compile_kind(
    source: ModelFolder,
    opts: CompileOptions,
    kind: PlanKind = TEXT,
    progress: Callable[[str], None] | None = None,
    *,
    probe: bool = False,
) -> Plan:
    """The plan of ``kind`` for ``source`` under ``opts`` (``probe``: a text plan for its envelope
    only, ``toolkit.compiler.compile_plan``; the other kinds compile in full)."""
    if kind.images is not None and kind.draft is not None:
        raise DctmsError(
            "--draft with --images: speculative vision-language plans are not supported"
        )
    if opts.sampling and kind is not TEXT and kind.name != "text":
        raise DctmsError(f"--sampling is not supported for {kind.name} plans yet")
    if opts.target not in (None, "cpu") and kind.name != "text":
        raise DctmsError(f"--target {opts.target} is not supported for {kind.name} plans yet")
    if kind.images is not None:
        from dctms.toolkit.vision.compiler import VisionOptions, compile_vlm_plan

        i = kind.images
        vision = VisionOptions(i.images, i.height, i.width, overlap=i.overlap)
        return compile_vlm_plan(source, opts, vision, progress)
    if kind.draft is not None:
        from dctms.toolkit.kinds.speculative import compile_speculative

        return compile_speculative(source, kind.draft, opts, kind.num_draft, progress)
    return compile_plan(source, opts, progress, probe=probe)


def kind_of(request: CompileRequest) -> PlanKind:
    """The plan kind a recorded compile request asks for (the draft from its recorded config)."""
    images = None
    if request.vision is not None:
        v = request.vision
        images = Images(v.images, v.height, v.width, v.overlap)
    draft = None
    if request.draft_config is not None:
        draft = model_from_config(request.draft_config)
    return PlanKind(images, draft, request.num_draft or DEFAULT_NUM_DRAFT)


def kind_flags(request: CompileRequest, draft: str = "DRAFT") -> list[str]:
    """The ``dctms compile`` flags that ask for the request's plan kind."""
    words: list[str] = []
    if request.vision is not None:
        v = request.vision
        words += ["--images", str(v.images), "--image-size", f"{v.height}x{v.width}"]
        words += ["--overlap"] if v.overlap else []
    if request.draft_config is not None:
        words += ["--draft", draft]
        if request.num_draft != DEFAULT_NUM_DRAFT:
            words += ["--num-draft", str(request.num_draft)]
    return words
