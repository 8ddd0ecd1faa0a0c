"""``dctms serve --plan PLAN=MODEL_DIR ... [--memory SIZE] [--host H --port P]``: an
OpenAI-compatible server for a pool of plans that refuses to start unless the pool fits."""

from __future__ import annotations

import argparse
import sys

from dctms.cli.hf_cache import add_download_flag
from dctms.schema.errors import DctmsError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server for one or more plans within one memory budget",
        description=(
            "Serve /v1/models, /v1/completions and /v1/chat/completions (streaming or not, greedy) "
            "for every --plan; the request's model name picks the plan. The plans' pool envelope "
            "(`dctms pool`, calls one at a time) must fit --memory or the server does not start. "
            "Every MLX call runs on one worker thread: a batch-1 plan's requests one at a time, a "
            "batched plan's (compile --batch B) up to B at once, each in a slot it takes at a step "
            "boundary and gives back when it ends; the others queue meanwhile. /status (JSON) and "
            "/metrics (Prometheus) report the envelope, MLX's observed peak, the queue and, per "
            "model, its slots. Only requests whose Host names this server are served (DNS rebinding); POST "
            "bodies must be application/json. Needs the `serve` extra: pip install 'dctms[serve]'."
        ),
    )
    p.add_argument(
        "--plan",
        action="append",
        required=True,
        metavar="PLAN=MODEL_DIR",
        help="a plan and its model folder (or Hugging Face id ORG/NAME[@REVISION]), served as "
        "the plan file's stem; NAME=PLAN=MODEL_DIR picks the name (repeat for several models)",
    )
    p.add_argument("--memory", metavar="SIZE", help="budget, e.g. 16GiB (default: physical RAM)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests that may wait for the worker or a slot; more get HTTP 503 (default 64)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="require Authorization: Bearer KEY on every request (default: $DCTMS_API_KEY; "
        "none: no key)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a further name the Host header may carry, e.g. a proxy's (repeatable; the loopback "
        "names and --host are always allowed; '*' switches the check off)",
    )
    p.add_argument(
        "--max-body-bytes",
        default="1MiB",
        metavar="SIZE",
        help="largest request body; larger ones get HTTP 413 (default 1MiB)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level; info also logs every request (default warning)",
    )
    p.add_argument(
        "--prerecord",
        action="store_true",
        help="record every length point's graphs at start instead of on first use: no request "
        "waits for a recording, and the resident set is at its largest from the start (the "
        "recorded_graphs term of `dctms resources`)",
    )
    p.add_argument(
        "--no-pool-answers",
        dest="pool_answers",
        action="store_false",
        help="with a plan's prefix pool (compile --prefix-blocks): do not prefill a finished "
        "chat turn's answer again while the server is idle (by default it does, one chunk at a "
        "time, so the next turn, which re-sends that answer, finds it in the pool); the CPU stays "
        "idle between requests instead",
    )
    add_download_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    import psutil

    from dctms.figures.pool import pool_of, pool_summary
    from dctms.figures.units import human, parse_size
    from dctms.runner.load import load_checked_plan
    from dctms.serve.allowance import serving_extras
    from dctms.serve.security import allowed_hosts, exposure_warning, resolve_api_key
    from dctms.serve.spec import parse_plan_specs

    try:
        from dctms.serve import app as app_mod
        from dctms.serve import server
        from dctms.serve.worker import Worker
    except ModuleNotFoundError as err:
        raise DctmsError(
            f"dctms serve needs {err.name}: pip install 'dctms[serve]' (starlette, uvicorn)"
        ) from None

    if args.max_queue < 1:
        raise DctmsError(f"--max-queue must be at least 1, got {args.max_queue}")
    api_key = resolve_api_key(args.api_key, os.environ)
    hosts = allowed_hosts(args.host, args.allowed_host)
    max_body = _max_body_bytes(args.max_body_bytes, parse_size)
    specs = [hub_folder(s, args.download) for s in parse_plan_specs(args.plan)]
    plans = [load_checked_plan(s.plan) for s in specs]
    for s, plan in zip(specs, plans, strict=True):
        if plan.distributed is not None:
            d = plan.distributed
            raise DctmsError(
                f"{s.plan}: rank {d.rank} of {d.ranks} of a {d.mode} split; dctms serve runs "
                "single-process plans (run rank plans with dctms run --ranks)"
            )
    if args.memory is None:
        budget = psutil.virtual_memory().total
    else:
        try:
            budget = parse_size(args.memory)
        except DctmsError as err:
            raise DctmsError(f"--memory: {err}") from None
    pool = pool_of(
        [(s.name, p) for s, p in zip(specs, plans, strict=True)],
        budget=budget,
        extras=serving_extras(),
    )
    if not pool.fits:
        raise DctmsError(
            f"the pool of {len(plans)} plan(s) needs {human(pool.total)} ({pool.total:,} bytes), "
            f"{human(-(pool.free or 0))} more than the {human(budget)} budget; "
            "serve fewer plans or give more --memory (see `dctms pool`)"
        )
    sock = server.bind(args.host, args.port)
    worker = Worker(
        list(zip(specs, plans, strict=True)),
        max_queue=args.max_queue,
        prerecord=args.prerecord,
        pool_answers=args.pool_answers,
    )
    try:
        worker.start()
        recorded = ""
        points = sum(r.points for r in worker.recorded.values())
        if points:
            seconds = sum(r.seconds for r in worker.recorded.values())
            recorded = f"; recorded {points} length points' graphs in {seconds:.1f} s"
        print(
            f"dctms serve: {', '.join(s.name for s in specs)}; pool M_max {human(pool.total)} "
            f"(provable peak {human(pool.provable)}) of {human(budget)}, "
            f"{human(pool.free or 0)} free{recorded}",
            file=sys.stderr,
        )
        warning = exposure_warning(args.host, api_key)
        if warning:
            print(warning, file=sys.stderr)
        app, state = app_mod.build_app(worker, pool_summary(pool), hosts, api_key, max_body)
        server.run(app, sock, args.log_level, on_shutdown=state.begin_shutdown)
    except KeyboardInterrupt:
        pass  # uvicorn already shut down gracefully; it re-raises the signal it caught
    finally:
        worker.stop()
        sock.close()
    print("dctms serve: stopped", file=sys.stderr)
    return 0


def hub_folder(spec, download: bool):
    """``spec`` with a model named by its Hugging Face id replaced by its cached snapshot folder."""
    import dataclasses

    from dctms.cli.hf_cache import resolve_model

    hub = resolve_model(str(spec.model_dir), download)
    return spec if hub is None else dataclasses.replace(spec, model_dir=hub.path)


def _max_body_bytes(text: str, parse_size) -> int:
    try:
        size = parse_size(text)
    except DctmsError as err:
        raise DctmsError(f"--max-body-bytes: {err}") from None
    if not 1 <= size <= 2**30:
        raise DctmsError(f"--max-body-bytes must be between 1 byte and 1GiB, got {text}")
    return size

