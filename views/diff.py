"""Compare two plans: envelope by component, Table 1 figures, bounds, model fingerprint, verdict.

The rows come from ``dctms.figures.comparison`` (which the inspector's Diff screen draws too);
``diff_data`` turns them into one plain dictionary (the ``--format json`` output), and ``diff_text``
and ``diff_markdown`` only lay out its numbers, so the three formats cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dctms.figures.comparison import ENVELOPE_LABELS, Change, Delta, plan_diff
from dctms.figures.module_diff import ModuleDelta, module_deltas
from dctms.figures.roofline import prediction_profile
from dctms.figures.units import human, parse_size
from dctms.schema.errors import DctmsError
from dctms.schema.types import Plan


@dataclass(frozen=True)
class Threshold:
    """``--fail-above``: M_max may grow by at most ``percent`` % or ``bytes`` bytes."""

    text: str
    percent: float | None = None
    bytes: int | None = None

    def allowed(self, old_total: int) -> float:
        """Largest growth in bytes this threshold accepts over ``old_total``."""
        if self.percent is not None:
            return old_total * self.percent / 100
        return float(self.bytes or 0)


def parse_threshold(text: str) -> Threshold:
    """``"2%"`` or ``"2.5 %"`` (growth of M_max in percent) or a size such as ``"64MiB"``."""
    bad = DctmsError(
        f"--fail-above {text!r}: want a growth of M_max as a percentage (2%) or a size (64MiB)"
    )
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            percent = float(stripped[:-1])
        except ValueError:
            raise bad from None
        if not 0 <= percent < float("inf"):
            raise bad
        return Threshold(text, percent=percent)
    try:
        return Threshold(text, bytes=parse_size(stripped))
    except DctmsError:
        raise bad from None


# ------------------------------------------------------------------------------------------ data


def diff_data(
    old: Plan,
    new: Plan,
    old_label: str = "old",
    new_label: str = "new",
    thresholds: tuple[Threshold, ...] = (),
    budget: int | None = None,
) -> dict[str, Any]:
    """Every number the diff shows, JSON-ready (bytes as integers), from ``figures.comparison``."""
    diff = plan_diff(old, new)
    arenas = [r for r in diff.phases if r.figure == "arena"]
    return {
        "old": old_label,
        "new": new_label,
        "envelope": [_delta_row(r) for r in diff.envelope],
        "stats": [_stats_row(r) for r in diff.table1] + [_delta_row(r) for r in arenas],
        "bounds": [_change_row(c) for c in diff.bounds],
        "model": [_change_row(c) for c in diff.fingerprint],
        "roofline": {
            "profiles": {
                "old": prediction_profile(old).name,
                "new": prediction_profile(new).name,
            },
            "rows": [_roofline_row(r) for r in diff.roofline],
        },
        "modules": [_module_row(r) for r in module_deltas(old, new)],
        "verdict": verdict(old.envelope.total, new.envelope.total, thresholds, budget),
    }


def _module_row(row: ModuleDelta) -> dict[str, Any]:
    return {
        "phase": row.phase,
        "module": row.module,
        "old_peak": row.old_peak,
        "new_peak": row.new_peak,
        "peak_delta": row.peak_delta,
        "old_bytes": row.old_bytes,
        "new_bytes": row.new_bytes,
        "bytes_delta": row.bytes_delta,
    }


MODULE_ROWS_SHOWN = 12  # text and markdown; the JSON lists every changed module


def _module_title(data: dict[str, Any]) -> str:
    n = len(data["modules"])
    more = f", largest {MODULE_ROWS_SHOWN} of {n}" if n > MODULE_ROWS_SHOWN else ""
    return f"intermediate bytes by module (layers as *; at the phase's peak and all tenants{more})"


def _delta_row(row: Delta) -> dict[str, Any]:
    delta = row.delta
    return {
        "name": row.key,
        "old": row.old,
        "new": row.new,
        "delta": delta,
        "delta_mib": None if delta is None else round(row.delta_mib, 2),
        "delta_percent": _rounded(row.percent),
    }


def _stats_row(row: Delta) -> dict[str, Any]:
    if row.key == "reduction":  # a fraction; its change is shown in percentage points
        return {
            "name": row.key,
            "old": row.old,
            "new": row.new,
            "delta": round(row.delta, 6),
            "delta_percent": None,
        }
    if row.key in ("logical_tensors", "physical_buffers"):  # counts: no MiB
        return {
            "name": row.key,
            "old": row.old,
            "new": row.new,
            "delta": row.delta,
            "delta_percent": _rounded(row.percent),
        }
    return _delta_row(row)


def _roofline_row(row: Delta) -> dict[str, Any]:
    return {
        "name": row.key,
        "label": row.name,
        "old": row.old,
        "new": row.new,
        "delta": row.delta,
        "delta_percent": _rounded(row.percent),
    }


def _roofline_title(data: dict[str, Any]) -> str:
    p = data["roofline"]["profiles"]
    where = p["new"] if p["old"] == p["new"] else f"{p['old']} -> {p['new']}"
    return f"predicted at the roofline ({where})"


def _speed(v: float | None, sign: str = "") -> str:
    """3-4 significant digits: 1,376 / 3.35 / 0.298."""
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:{sign},.0f}"
    return f"{v:{sign},.2f}" if abs(v) >= 1 else f"{v:{sign}.3g}"


def _signed_speed(v: float | None) -> str:
    return _speed(v, "+")


def _change_row(change: Change) -> dict[str, Any]:
    return {"name": change.key, "old": change.old, "new": change.new, "changed": change.changed}


def _rounded(percent: float | None) -> float | None:
    return None if percent is None else round(percent, 4)


def _percent(old: int | float | None, delta: int | float | None) -> float | None:
    if old is None or delta is None or old == 0:
        return None
    return round(100 * delta / old, 4)


def verdict(
    old_total: int, new_total: int, thresholds: tuple[Threshold, ...], budget: int | None
) -> dict[str, Any]:
    """Which limits the new M_max crosses: growth above a threshold, or above the budget."""
    growth = new_total - old_total
    failures, passes = [], []
    for th in thresholds:
        allowed = th.allowed(old_total)
        line = f"M_max grew by {_signed_bytes(growth)} ({_signed_pct(_percent(old_total, growth))})"
        if growth > allowed:
            failures.append(f"{line}, above --fail-above {th.text}")
        else:
            passes.append(f"growth within --fail-above {th.text}")
    if budget is not None:
        if new_total > budget:
            failures.append(
                f"M_max {human(new_total)} exceeds the {human(budget)} budget by "
                f"{human(new_total - budget)} ({new_total - budget:,} bytes)"
            )
        else:
            passes.append(f"fits the {human(budget)} budget with {human(budget - new_total)} free")
    return {
        "ok": not failures,
        "failures": failures,
        "passes": passes,
        "thresholds": [th.text for th in thresholds],
        "budget": budget,
        "m_max_old": old_total,
        "m_max_new": new_total,
        "m_max_delta": growth,
    }


# ------------------------------------------------------------------------------------- formatting


def _signed_bytes(n: int) -> str:
    return f"{'+' if n > 0 else '-' if n < 0 else ''}{human(abs(n))}"


def _signed_pct(p: float | None) -> str:
    if p is None:
        return "n/a"
    return f"{p:+.2f} %" if p else "0.00 %"


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return str(v)


def _signed(v: int | float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:+,.{digits}f}" if v else "0"


def _stat_cells(row: dict[str, Any]) -> tuple[str, str, str, str]:
    if row["name"] == "reduction":
        return (
            f"{row['old']:.2%}",
            f"{row['new']:.2%}",
            f"{100 * row['delta']:+.2f} pp" if row["delta"] else "0",
            "",
        )
    return (
        _num(row["old"]),
        _num(row["new"]),
        _signed(row["delta"]),
        _signed_pct(row["delta_percent"]),
    )


def _short(v: Any) -> str:
    """Hashes shortened to 12 hex digits; a files map as its count (JSON keeps them whole)."""
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12]
    if isinstance(v, dict):
        return f"{len(v)} file{'s' if len(v) != 1 else ''} hashed"
    if v is None:
        return "none"
    return _num(v)


def _headline(data: dict[str, Any], arrow: str = "->") -> str:
    v = data["verdict"]
    return (
        f"M_max {_num(v['m_max_old'])} {arrow} {_num(v['m_max_new'])} bytes "
        f"({_signed_bytes(v['m_max_delta'])}, "
        f"{_signed_pct(_percent(v['m_max_old'], v['m_max_delta']))})"
    )


def _verdict_line(data: dict[str, Any]) -> str:
    v = data["verdict"]
    if not v["ok"]:
        return "FAIL: " + "; ".join(v["failures"])
    if not v["passes"]:
        return "PASS: no threshold or budget given"
    return "PASS: " + "; ".join(v["passes"])


def diff_text(data: dict[str, Any]) -> str:
    """Plain-text report for a terminal (ends with a newline)."""
    out = [f"dctms diff: {data['old']} -> {data['new']}", _headline(data), ""]
    out.append(
        f"{'memory envelope':<22} {'old bytes':>16} {'new bytes':>16} {'delta bytes':>16} "
        f"{'delta MiB':>12} {'delta %':>10}"
    )
    for r in data["envelope"]:
        out.append(
            f"  {ENVELOPE_LABELS.get(r['name'], r['name']):<20} {_num(r['old']):>16} "
            f"{_num(r['new']):>16} {_signed(r['delta']):>16} {_signed(r['delta_mib'], 2):>12} "
            f"{_signed_pct(r['delta_percent']):>10}"
        )
    out += ["", f"{'Table 1 and arena':<22} {'old':>16} {'new':>16} {'delta':>16} {'delta %':>12}"]
    for r in data["stats"]:
        cells = _stat_cells(r)
        out.append(f"  {r['name']:<20} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} {cells[3]:>12}")
    for title, key in (("bounds and target", "bounds"), ("model fingerprint", "model")):
        width = max(len(_short(r["old"])) for r in data[key]) + 2
        out += ["", f"{title:<24} {'old':<{width}} new"]
        for r in data[key]:
            mark = "  *" if r["changed"] else ""
            out.append(f"  {r['name']:<22} {_short(r['old']):<{width}} {_short(r['new'])}{mark}")
    out += [
        "",
        f"{_roofline_title(data):<46} {'old':>12} {'new':>12} {'delta':>12} {'delta %':>10}",
    ]
    for r in data["roofline"]["rows"]:
        out.append(
            f"  {r['label']:<44} {_speed(r['old']):>12} {_speed(r['new']):>12} "
            f"{_signed_speed(r['delta']):>12} {_signed_pct(r['delta_percent']):>10}"
        )
    if data["modules"]:
        out += ["", _module_title(data)]
        out.append(
            f"  {'phase':<8} {'module':<40} {'peak old':>12} {'peak new':>12} {'peak delta':>12} "
            f"{'tenants delta':>14}"
        )
        for r in data["modules"][:MODULE_ROWS_SHOWN]:
            out.append(
                f"  {r['phase']:<8} {r['module']:<40} {human(r['old_peak']):>12} "
                f"{human(r['new_peak']):>12} {_signed_bytes(r['peak_delta']):>12} "
                f"{_signed_bytes(r['bytes_delta']):>14}"
            )
    out += ["", "(* = changed)", _verdict_line(data)]
    return "\n".join(out) + "\n"


def diff_markdown(data: dict[str, Any]) -> str:
    """A PR comment: header, envelope table, Table 1, bounds/model changes, verdict line."""
    v = data["verdict"]
    icon = "✅" if v["ok"] else "❌"
    out = [
        f"### dctms plan diff: `{data['old']}` → `{data['new']}`",
        "",
        f"**{_headline(data, '→')}**",
        "",
        "| memory envelope | old (bytes) | new (bytes) | Δ bytes | Δ MiB | Δ % |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["envelope"]:
        name = ENVELOPE_LABELS.get(r["name"], r["name"])
        if r["name"] == "total":
            name = f"**{name}**"
        out.append(
            f"| {name} | {_num(r['old'])} | {_num(r['new'])} | {_signed(r['delta'])} | "
            f"{_signed(r['delta_mib'], 2)} | {_signed_pct(r['delta_percent'])} |"
        )
    out += ["", "| Table 1 and arena | old | new | Δ | Δ % |", "|---|---:|---:|---:|---:|"]
    for r in data["stats"]:
        cells = _stat_cells(r)
        out.append(f"| {r['name']} | {' | '.join(cells)} |")
    for title, key in (("bounds and target", "bounds"), ("model fingerprint", "model")):
        changed = [r for r in data[key] if r["changed"]]
        same = [r["name"] for r in data[key] if not r["changed"]]
        out.append("")
        if changed:
            out += [f"| {title} | old | new |", "|---|---|---|"]
            out += [
                f"| {r['name']} | `{_short(r['old'])}` | `{_short(r['new'])}` |" for r in changed
            ]
            if same:
                out += ["", f"Unchanged {title}: {', '.join(same)}."]
        else:
            out.append(f"No change in {title} ({', '.join(same)}).")
    out += ["", f"| {_roofline_title(data)} | old | new | Δ | Δ % |", "|---|---:|---:|---:|---:|"]
    for r in data["roofline"]["rows"]:
        out.append(
            f"| {r['label']} | {_speed(r['old'])} | {_speed(r['new'])} | "
            f"{_signed_speed(r['delta'])} | {_signed_pct(r['delta_percent'])} |"
        )
    if data["modules"]:
        out += [
            "",
            f"| {_module_title(data)} | phase | peak old | peak new | Δ peak | Δ tenants |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in data["modules"][:MODULE_ROWS_SHOWN]:
            out.append(
                f"| `{r['module']}` | {r['phase']} | {human(r['old_peak'])} | "
                f"{human(r['new_peak'])} | {_signed_bytes(r['peak_delta'])} | "
                f"{_signed_bytes(r['bytes_delta'])} |"
            )
    out += ["", f"{icon} **{_verdict_line(data)}**"]
    return "\n".join(out) + "\n"
