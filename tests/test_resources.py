"""``dctms resources``: the pool's M_max as a container's memory request and limit, each term
named; and that limit, applied as a real cgroup's hard memory limit, holds a `dctms serve` under
an 8-client load (every request answered, no OOM kill, the limit never hit)."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serve_helpers import ServerProcess, TinyServed, build_tiny_models, dctms_command

from dctms.benchmark.cgroup import CgroupUnavailable, create_group, remove_group
from dctms.figures.pool import pool_of
from dctms.figures.resources import resources_of
from dctms.figures.units import MIB
from dctms.schema.io import read_plan
from dctms.serve.allowance import serving_extras

PLANS = Path(__file__).resolve().parents[1] / "plans"


def resources_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        dctms_command("resources", *args), capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, TinyServed]:
    return build_tiny_models(tmp_path_factory.mktemp("resources"))


def test_terms_add_up_to_the_pools_m_max_and_round_up_to_whole_mib() -> None:
    plans = [(p.stem, read_plan(p)) for p in (PLANS / "qwen1.5b.plan", PLANS / "qwen7b.plan")]
    for serving in (True, False):
        pool = pool_of(plans, extras=serving_extras() if serving else ())
        res = resources_of(pool, serving)
        # the pool's M_max, and the graphs the runner records at every verified point
        recorded = sum(m.recorded for m in pool.members)
        assert recorded > 0 and res.total == pool.total + recorded
        assert res.limit % MIB == 0 and 0 <= res.limit - res.total < MIB
        names = [t.name for t in res.terms]
        assert ("server_stack" in names) == serving
        assert {"weights", "kv", "intermediate", "process_baseline", "recorded_graphs"} <= set(names)
    serve = resources_of(pool_of(plans, extras=serving_extras()), True)
    run = resources_of(pool_of(plans), False)
    assert serve.total - run.total == sum(b for _, b in serving_extras())


def test_every_format_carries_the_same_limit() -> None:
    plan = str(PLANS / "qwen7b.plan")
    data = json.loads(resources_cli(plan, "--format", "json").stdout)
    assert data["limit_bytes"] == data["request_bytes"] == data["limit_mib"] * MIB
    assert data["total_bytes"] == sum(t["bytes"] for t in data["terms"])
    mi = data["limit_mib"]
    k8s = resources_cli(plan, "--format", "k8s").stdout
    assert k8s.count(f'memory: "{mi}Mi"') == 2  # request and limit
    compose = resources_cli(plan, "--format", "compose").stdout
    assert compose.count(f"memory: {mi}M") == 2
    systemd = resources_cli(plan, "--format", "systemd").stdout
    assert f"MemoryMax={data['limit_bytes']}" in systemd.splitlines()
    text = resources_cli(plan).stdout
    assert f"{mi:,} MiB ({data['limit_bytes']:,} bytes)" in text
    for t in data["terms"]:  # every term named in the comments of each stanza
        assert t["name"] in k8s and t["name"] in compose and t["name"] in systemd


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    broken = tmp_path / "broken.plan"
    broken.write_text("{not json")
    for args in ([str(tmp_path / "missing.plan")], [str(broken)],
                 [str(PLANS / "qwen7b.plan"), "--format", "helm"]):
        proc = resources_cli(*args)
        assert proc.returncode == 2, proc
        assert "Traceback" not in proc.stderr


def _load(url: str, model: str, requests: int, clients: int) -> list[int]:
    def one(i: int) -> int:
        chat = i % 2 == 0
        body = {"model": model, "max_tokens": 8, "stream": i % 4 == 1}
        if chat:
            body["messages"] = [{"role": "user", "content": f"hello number {i}"}]
        else:
            body["prompt"] = f"count to {i}"
        req = urllib.request.Request(
            url + ("/v1/chat/completions" if chat else "/v1/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(requests)))


def serve_under_limit(specs: list[str], plans: list[str], model: str, requests: int) -> dict:
    """`dctms serve` inside a memory cgroup whose hard limit is `dctms resources`' figure, driven
    by 8 concurrent clients; what the cgroup recorded."""
    limit = json.loads(resources_cli(*plans, "--format", "json").stdout)["limit_bytes"]
    try:
        group = create_group(limit)
    except CgroupUnavailable as err:
        pytest.skip(str(err))
    try:
        args = [a for s in specs for a in ("--plan", s)]
        server = ServerProcess(args, preexec_fn=group.join)
        try:
            statuses = _load(server.url, model, requests, clients=8)
            status = server.status()
        finally:
            server.close()
        return {
            "statuses": statuses, "limit": limit, "peak": group.peak,
            "failcnt": group.failcnt, "oom_kills": group.oom_kills,
            "exit": server.proc.returncode, "status": status, "stat": group.stat(),
        }  # fmt: skip
    finally:
        remove_group(group)


def test_serve_holds_within_its_resources_limit_as_a_cgroup(tiny) -> None:
    served = list(tiny.values())
    seen = serve_under_limit(
        [s.spec() for s in served], [f"{s.name}={s.plan}" for s in served], "alpha", 32
    )
    assert seen["statuses"] == [200] * 32
    assert seen["oom_kills"] == 0 and seen["exit"] == 0
    assert seen["failcnt"] == 0, seen
    assert seen["peak"] <= seen["limit"]
    assert seen["status"]["within_envelope"] is True


@pytest.mark.slow
def test_real_model_serve_holds_within_its_resources_limit(tmp_path: Path, shared_cache) -> None:
    """The tight case: SmolLM2-135M-Instruct (fp32, 538 MB of weights), whose RSS comes within a
    few MiB of its M_max, served under a hard limit of exactly `dctms resources`' figure."""
    from dctms.convert.real_model import FetchError, prepare, real_model
    from dctms.schema.errors import DctmsError

    try:  # fetched and converted by one worker at a time (test_real_model's fixture too)
        shared_cache("smollm2", lambda _: prepare(real_model(), lambda msg: None))
        folder = prepare(real_model(), lambda msg: None)
    except (FetchError, DctmsError) as err:
        pytest.skip(f"SmolLM2 unavailable: {err}")
    plan = tmp_path / "smollm2.plan"
    proc = subprocess.run(
        dctms_command("compile", str(folder), "-N", "256", "-M", "32", "-o", str(plan)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    seen = serve_under_limit([f"demo={plan}={folder}"], [f"demo={plan}"], "demo", 16)
    print({k: v for k, v in seen.items() if k != "status"})
    assert seen["statuses"] == [200] * 16
    assert seen["oom_kills"] == 0 and seen["exit"] == 0
    assert seen["failcnt"] == 0, seen
    assert seen["status"]["within_envelope"] is True
