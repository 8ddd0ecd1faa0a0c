"""A vision-language plan's memory split by stream: one stacked bar per step of the run (the
vision stream's call, then the text stream's), against the envelope's M_intermediate.

The rows are ``dctms.figures.streams.stream_steps``; this module only draws them.
"""

from __future__ import annotations

from rich.markup import escape
from textual.widgets import Static

from dctms.figures.streams import StreamStep
from dctms.figures.units import human

VISION_COLOUR = "#c678dd"
TEXT_COLOUR = "#61afef"
ENVELOPE_COLOUR = "#e5c07b"
BAR_WIDTH = 40  # cells for M_intermediate


def bar_cells(step: StreamStep, envelope: int, width: int = BAR_WIDTH) -> tuple[int, int]:
    """(vision cells, text cells) of a step's bar; a call holding any bytes gets at least one."""
    scale = width / max(envelope, step.total, 1)

    def cells(b: int) -> int:
        return max(1, round(b * scale)) if b else 0

    vision, text = cells(step.vision_bytes), cells(step.text_bytes)
    return vision, min(text, width - vision)  # rounding never pushes a bar past the envelope


def stream_lines(steps: list[StreamStep], envelope: int, overlap: bool) -> list[str]:
    """Rich-markup lines: a title, then one stacked bar per step with its bytes per stream."""
    how = (
        "vision on MLX stream 1 overlapping prefill"
        if overlap
        else "the streams take turns on one MLX stream"
    )
    lines = [
        f"[b]streams[/b] ({how}): [{VISION_COLOUR}]█ vision[/] [{TEXT_COLOUR}]█ text[/] "
        f" [{ENVELOPE_COLOUR}]│[/] M_intermediate {envelope:,} B"
    ]
    label_width = max((len(s.label) for s in steps), default=0)
    for step in steps:
        vision, text = bar_cells(step, envelope)
        pad = max(0, BAR_WIDTH - vision - text)
        both = (
            f"{human(step.vision_bytes)} + {human(step.text_bytes)} = {step.total:,} B"
            if step.vision_bytes and step.text_bytes
            else f"{step.total:,} B"
        )
        sync = f" [dim]→ {escape(step.sync)}[/dim]" if step.sync else ""
        lines.append(
            f"{escape(step.label):<{label_width}} [{VISION_COLOUR}]{'█' * vision}[/]"
            f"[{TEXT_COLOUR}]{'█' * text}[/]{' ' * pad}[{ENVELOPE_COLOUR}]│[/] {both}{sync}"
        )
    return lines


class StreamBars(Static):
    """The stacked per-stream bars of a vision-language plan (the Memory screen shows it)."""

    def show_steps(self, steps: list[StreamStep], envelope: int, overlap: bool) -> None:
        self.update("\n".join(stream_lines(steps, envelope, overlap)))
