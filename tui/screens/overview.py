"""Overview: bounds, the envelope bar (M_max, device, free), the top findings of ``dctms explain``
(from the plan alone: what drives each component, the module behind each peak), Table 1, arena vs
lower bound, and the plan on its target's roofline (predicted decode tok/s and TTFT)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from dctms.figures.explain import explain
from dctms.figures.overview import (
    PARTS_RULE,
    arena_rows,
    bounds_rows,
    header,
    model_part_rows,
    speculative_line,
    table1,
)
from dctms.figures.ranks import largest_rank, rank_rows
from dctms.figures.roofline import (
    phase_lines,
    plan_roofline,
    seconds_text,
    tokens_per_s_text,
)
from dctms.figures.units import human
from dctms.tui.screens.base import InspectorScreen
from dctms.tui.widgets.envelope_bar import EnvelopeBar
from dctms.tui.widgets.scroll import PageScroll


class OverviewScreen(InspectorScreen):
    MODE = "overview"
    TITLE = "Overview"

    def compose_body(self) -> ComposeResult:
        plan = self.inspection.plan
        h = header(plan)
        with PageScroll(id="overview"):
            yield Static(
                f"[b]{h.architecture}[/b], {h.num_layers} layers, {h.weight_tensors:,} weight "
                f"tensors, target {h.backend} (alignment {h.alignment})  [dim]schema "
                f"v{h.schema_version}; {h.generator}[/dim]",
                id="header",
            )
            if self.inspection.ranks is not None:
                yield Static(self._ranks(), id="ranks", classes="figure")
            yield Static("[b]Memory envelope[/b]", classes="section")
            yield EnvelopeBar(plan.envelope, id="envelope")
            yield Static("[dim]findings: computing...[/dim]", id="findings", classes="figure")
            if plan.draft is not None:
                yield Static(self._models(), id="models", classes="figure")
            with Horizontal(id="figures"):
                yield Static(self._bounds(), id="bounds", classes="figure")
                yield Static(self._table1(), id="table1", classes="figure")
            yield Static(self._arena(), id="arena", classes="figure")
            # Filled in after the first paint: ~0.1-0.3 s for a 7B plan's 6,400 ops here.
            yield Static("[dim]roofline: computing...[/dim]", id="roofline", classes="figure")

    def on_mount(self) -> None:
        self.call_after_refresh(lambda: self.set_timer(0.05, self._show_roofline))

    def _show_roofline(self) -> None:
        self.query_one("#findings", Static).update(self._findings())
        self.query_one("#roofline", Static).update(self._roofline())

    def _findings(self) -> str:
        lines = explain(self.inspection.plan).findings
        return "[b]Findings[/b] [dim](dctms explain PLAN adds what each knob changes)[/dim]\n" + (
            "\n".join(f"  • {escape(line)}" for line in lines)
        )

    def _ranks(self) -> Table:
        """Every rank's envelope (bytes); ▶ marks the rank on view, the largest M_max is flagged."""
        ranks = self.inspection.ranks or []
        largest = largest_rank(ranks)
        d = self.inspection.plan.distributed
        table = Table(
            title=f"{d.ranks} ranks, {d.mode} parallel [dim](r / R: next / previous rank)[/dim]",
            title_justify="left",
            box=None,
        )
        table.add_column("")
        table.add_column("rank", justify="right")
        table.add_column("layers")
        table.add_column("shard")
        for name in ("weights", "kv", "intermediate", "M_max"):
            table.add_column(f"{name} bytes", justify="right")
        table.add_column("")
        for r in rank_rows(ranks):
            table.add_row(
                "▶" if r.rank == self.inspection.rank else "",
                str(r.rank),
                r.layers,
                r.shard or "-",
                *(f"{v:,}" for v in (r.weights, r.kv, r.intermediate, r.total)),
                "largest" if r.rank == largest else "",
            )
        return table

    def _bounds(self) -> Table:
        table = Table(title="Bounds", title_justify="left", show_header=False, box=None)
        table.add_column(style="dim")
        table.add_column()
        for name, value in bounds_rows(self.inspection.plan):
            table.add_row(name, value)
        return table

    def _models(self) -> Table:
        """The envelope's parts per model (a speculative plan: target and draft)."""
        plan = self.inspection.plan
        table = Table(
            title=speculative_line(plan), title_justify="left", caption=PARTS_RULE, box=None
        )
        for name in ("model", "architecture", "layers"):
            table.add_column(name)
        for name in ("weights", "kv", "persistent", "intermediate", "provable peak"):
            table.add_column(name, justify="right")
        for r in model_part_rows(plan):
            plan_row = r.model == "plan"
            table.add_row(
                r.model,
                "sum; max" if plan_row else r.architecture,
                "" if plan_row else str(r.num_layers),
                *(human(v) for v in (r.weights, r.kv, r.persistent, r.intermediate, r.provable)),
            )
        return table

    def _table1(self) -> Table:
        t1 = table1(self.inspection.plan)
        table = Table(title="Table 1: interval colouring", title_justify="left", box=None)
        table.add_column("")
        table.add_column("this plan", justify="right")
        table.add_column("paper", justify="right")
        table.add_row("logical tensors", f"{t1.logical_tensors:,}", f"{t1.paper_logical:,}")
        table.add_row("physical buffers", f"{t1.physical_buffers:,}", f"{t1.paper_physical:,}")
        table.add_row("reduction", f"{t1.reduction:.2%}", f"{t1.paper_reduction:.2%}")
        return table

    def _arena(self) -> Table:
        table = Table(title="Arena vs lower bound", title_justify="left", box=None)
        table.add_column("phase")
        table.add_column("arena bytes", justify="right")
        table.add_column("lower bound bytes", justify="right")
        table.add_column("arena / bound", justify="right")
        for row in arena_rows(self.inspection.plan):
            ratio = "n/a" if row.ratio is None else f"{row.ratio:.3f}"
            table.add_row(row.name, f"{row.arena:,}", f"{row.lower_bound:,}", ratio)
        return table

    def _roofline(self) -> Table:
        roof = plan_roofline(self.inspection.plan)
        rate = tokens_per_s_text(roof.decode_tokens_per_s)
        table = Table(
            title=(
                f"Roofline on {roof.profile.name} (ridge {roof.ridge:,.2f} FLOP/byte): decode "
                f"{rate} tok/s, TTFT {seconds_text(roof.ttft_s)} for {roof.prompt_tokens:,} tokens"
            ),
            title_justify="left",
            box=None,
        )
        table.add_column("phase")
        table.add_column("tokens/call", justify="right")
        table.add_column("GFLOP", justify="right")
        table.add_column("moved", justify="right")
        table.add_column("FLOP/byte", justify="right")
        table.add_column("bound")
        table.add_column("time/call", justify="right")
        for line in phase_lines(roof):
            intensity = "-" if line.intensity is None else f"{line.intensity:,.2f}"
            table.add_row(
                line.name,
                f"{line.tokens:,}",
                f"{line.flops / 1e9:,.3f}",
                human(line.bytes),
                intensity,
                line.bound,
                seconds_text(line.seconds),
            )
        return table
