"""``dctms resources``' output: the terms as a table, or the memory stanza of a Kubernetes pod
spec, a Compose service or a systemd unit, each carrying the terms as comments."""

from __future__ import annotations

import json

from dctms.figures.resources import Resources
from dctms.figures.units import MIB

FORMATS = ("text", "k8s", "compose", "systemd", "json")


def render(res: Resources, fmt: str) -> str:
    return {
        "text": _text,
        "k8s": _k8s,
        "compose": _compose,
        "systemd": _systemd,
        "json": _json,
    }[fmt](res)


def _who(res: Resources) -> str:
    kind = "dctms serve" if res.serving else "dctms run"
    return f"{kind} of {', '.join(res.plans)}"


def _comments(res: Resources, mark: str) -> list[str]:
    lines = [
        f"{mark} memory for {_who(res)}: the pool's M_max and the runner's recorded graphs, "
        "rounded up to whole MiB"
    ]
    lines += [f"{mark}   {t.name:<17}{t.bytes:>16,} B  {t.why}" for t in res.terms]
    lines.append(f"{mark}   {'total':<17}{res.total:>16,} B")
    return lines


def _text(res: Resources) -> str:
    rows = [f"{'term':<18}{'bytes':>16}{'MiB':>12}  source", ]
    rows += [f"{t.name:<18}{t.bytes:>16,}{t.bytes / MIB:>12,.2f}  {t.why}" for t in res.terms]
    rows += [
        f"{'total':<18}{res.total:>16,}{res.total / MIB:>12,.2f}",
        "",
        f"memory request = limit: {res.limit_mib:,} MiB ({res.limit:,} bytes) for {_who(res)}",
        "(--format k8s|compose|systemd prints it as a deployment stanza)",
    ]
    return "\n".join(rows) + "\n"


def _k8s(res: Resources) -> str:
    q = f"{res.limit_mib}Mi"
    lines = _comments(res, "#") + [
        "resources:",
        "  requests:",
        f'    memory: "{q}"',
        "  limits:",
        f'    memory: "{q}"',
    ]
    return "\n".join(lines) + "\n"


def _compose(res: Resources) -> str:
    q = f"{res.limit_mib}M"  # Compose's "M" is binary (MiB), as Docker's --memory
    lines = _comments(res, "#") + [
        "deploy:",
        "  resources:",
        "    limits:",
        f"      memory: {q}",
        "    reservations:",
        f"      memory: {q}",
    ]
    return "\n".join(lines) + "\n"


def _systemd(res: Resources) -> str:
    lines = _comments(res, "#") + [
        "[Service]",
        f"MemoryMax={res.limit}",
        "MemorySwapMax=0",
    ]
    return "\n".join(lines) + "\n"


def _json(res: Resources) -> str:
    data = {
        "plans": list(res.plans),
        "serving": res.serving,
        "terms": [{"name": t.name, "bytes": t.bytes, "source": t.why} for t in res.terms],
        "total_bytes": res.total,
        "limit_bytes": res.limit,
        "limit_mib": res.limit_mib,
        "request_bytes": res.limit,
    }
    return json.dumps(data, indent=2) + "\n"
