"""``dctms compile --ranks R`` and ``dctms run --ranks R``: one plan per rank, run under mlx.launch.

compile writes ``FOLDER/rank<r>.plan`` for every rank (all compiled before any is written).
``run --ranks R FOLDER`` starts ``mlx.launch -n R`` (ring backend, R free local ports; or a hostfile)
running ``dctms run FOLDER --launched`` in every rank. Each rank process (``run_as_rank``):

1. joins the group (``mx.distributed.init``) and reads ``rank<r>.plan`` for its own rank;
2. checks, before allocating anything, that the plan is that rank's of a group of this size, the
   request fits it and the weights match its fingerprint;
3. tells every other rank whether it passed (one all_gather of a flag), so that a rank that refuses
   makes all stop before allocating, each saying why, instead of leaving the others blocked in their
   first collective;
4. runs the plan and writes its report (tokens, MLX peak, RSS peak, its own M_max).

Every wait for the other ranks is bounded (``--rank-timeout``): a rank that gets no answer stops
with a message naming what it waited for. mlx.launch exits 0 even when a rank fails, so the wrapper
decides from the reports: every rank must report success and the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dctms
from dctms.cli.progress import progress_printer
from dctms.cli.run_summary import EXIT_OVER_ENVELOPE
from dctms.figures.budget import shortfall
from dctms.schema.errors import DctmsError
from dctms.schema.ranks import PLAN_NAME

EXIT_REFUSED = 2
EXIT_NO_ANSWER = 4


# ------------------------------------------------------------------------------------ compile


def compile_ranks_command(args: argparse.Namespace) -> int:
    from dctms.cli.compile_options import compile_options
    from dctms.cli.hf_cache import with_hub
    from dctms.cli.inputs import model_inputs
    from dctms.schema.io import encode_plan
    from dctms.schema.model_folder import open_model
    from dctms.schema.output import check_output_folder, write_output
    from dctms.toolkit.kinds.distributed import choose_split, compile_ranks
    from dctms.views.ranks import rank_table

    if args.ranks < 2:
        raise DctmsError(f"--parallel needs --ranks of 2 or more, got {args.ranks}")
    if getattr(args, "draft", None) or getattr(args, "images", None) is not None:
        raise DctmsError("not supported yet: --ranks with --draft or --images")
    if not args.output or args.output == "-":
        raise DctmsError("--ranks writes one plan per rank: give -o FOLDER")
    folder = check_output_folder(args.output, label=f"-o {args.output}")
    progress = progress_printer(args)

    opts = compile_options(args, args.input_tokens, args.output_tokens)
    source = open_model(args.model)
    choice = None
    if args.split == "memory":
        if args.parallel != "pipeline":
            raise DctmsError("--split memory applies to --parallel pipeline only")
        choice, plans = choose_split(source, opts, progress)
    else:
        plans = compile_ranks(source, opts, progress)
    folder.mkdir(exist_ok=True)
    inputs = model_inputs(args.model)
    hub = getattr(args, "hub", {}).get("model")
    for plan in [with_hub(p, hub) for p in plans]:
        name = PLAN_NAME.format(plan.distributed.rank)
        write_output(folder / name, encode_plan(plan), inputs=inputs, label=f"-o {folder / name}")
    if not args.quiet:
        print(rank_table(plans), file=sys.stderr)
        if choice is not None:
            print(split_text(choice), file=sys.stderr)
    short = [p for p in plans if p.envelope.free is not None and p.envelope.free < 0]
    if short:
        p = short[0]
        print(
            f"dctms compile: rank {p.distributed.rank}'s {shortfall(p.envelope)}", file=sys.stderr
        )
        return 1
    return 0


def split_text(choice) -> str:
    from dctms.figures.units import MIB

    pred = ", ".join(f"{b / MIB:.3f}" for b in choice.predicted)
    return (
        f"pipeline split by count {list(choice.count)}, by memory {list(choice.memory)} "
        f"(predicted per-rank M_max {pred} MiB; the plans above are the compiled ones)"
    )


# ------------------------------------------------------------------------------------ run


def run_ranks_command(args: argparse.Namespace) -> int:
    if args.launched:
        return run_as_rank(args)
    return launch(args)


def _launcher() -> list[str]:
    beside = Path(sys.executable).parent / "mlx.launch"
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        raise DctmsError("mlx.launch not found (it comes with mlx)")
    return [found]


def free_ports(count: int, tries: int = 50) -> int:
    """The first of ``count`` consecutive local TCP ports that are free now (ring: one per rank)."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        base = rng.randrange(20000, 60000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise DctmsError(f"no {count} consecutive free local ports found")


def _rank_argv(args: argparse.Namespace, reports: str) -> list[str]:
    argv = [sys.executable, "-m", "dctms.cli.main", "run", str(Path(args.plan).resolve())]
    argv += ["--model", str(Path(args.model).resolve()), "--launched", "--rank-reports", reports]
    argv += ["--rank-timeout", str(args.rank_timeout)]
    if args.prompt is not None:
        argv += ["--prompt", args.prompt]
    else:
        argv += ["--tokens", args.tokens]
    if args.max_tokens is not None:
        argv += ["--max-tokens", str(args.max_tokens)]
    for flag in ("verify_weights", "ignore_eos", "ignore_chat_template"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    if args.system_prompt is not None:
        argv += ["--system-prompt", args.system_prompt]
    return argv


def launch(args: argparse.Namespace) -> int:
    """``mlx.launch`` the ranks, then judge the run from their reports."""
    from dctms.runner.load import check_runtime
    from dctms.schema.output import check_output_path, write_output
    from dctms.schema.ranks import read_rank_plans
    from dctms.views.ranks import rank_table

    folder = Path(args.plan)
    if args.ranks < 2:
        raise DctmsError(f"--ranks must be 2 or more, got {args.ranks}")
    if getattr(args, "draft_model", None) or getattr(args, "image", None):
        raise DctmsError("not supported yet: --ranks with --draft-model or --image")
    if not folder.is_dir():
        raise DctmsError(f"{folder}: with --ranks, PLAN is the folder of rank plans")
    plans = read_rank_plans(folder)
    if len(plans) != args.ranks:
        raise DctmsError(
            f"{folder} holds the plans of {len(plans)} ranks, not --ranks {args.ranks}"
        )
    for plan in plans:
        check_runtime(plan)
    if args.rank_timeout <= 0:
        raise DctmsError(f"--rank-timeout must be positive, got {args.rank_timeout}")
    label = f"--report {args.report}"
    if args.report is not None:  # checked before anything runs; written at the end
        check_output_path(args.report, inputs=[folder], label=label)
    with tempfile.TemporaryDirectory(prefix="dctms-ranks-") as reports:
        cmd = _launcher()
        if args.launch_backend or not args.hostfile:
            cmd += ["--backend", args.launch_backend or "ring"]
        if args.hostfile:
            cmd += ["--hostfile", args.hostfile]
        else:
            cmd += ["-n", str(args.ranks), "-p", str(free_ports(args.ranks))]
        cmd += ["--", *_rank_argv(args, reports)]
        # Every rank bounds its own waits; this bounds the launcher too (it does not notice a
        # hung rank): the longest a healthy run may take is its ranks' generation.
        _run_bounded(cmd, timeout=args.rank_timeout * 4 + 60)
        found = {}
        for r in range(args.ranks):
            path = Path(reports) / f"rank{r}.json"
            if path.is_file():
                found[r] = json.loads(path.read_text())
    status, message = judge(found, args.ranks)
    if status == 0:
        print(
            ",".join(map(str, found[0]["tokens"]))
            if found[0].get("text") is None
            else found[0]["text"]
        )
    observed = {r: rep["observed"] for r, rep in found.items() if "observed" in rep}
    print(rank_table(plans, observed), file=sys.stderr)
    if message:
        print(f"dctms run: {message}", file=sys.stderr)
    if args.report is not None:
        doc = {
            "dctms_version": dctms.__version__,
            "ranks": args.ranks,
            "status": status,
            "message": message,
            "per_rank": found,
        }
        data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        write_output(args.report, data, inputs=[folder], label=label)
    return status


def _run_bounded(cmd: list[str], timeout: float) -> None:
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def judge(reports: dict[int, dict], ranks: int) -> tuple[int, str]:
    """(exit status, message) from the ranks' reports: 0 only when every rank ran, stayed within
    its envelope and generated the same tokens."""
    missing = [r for r in range(ranks) if r not in reports]
    refused = [r for r, rep in sorted(reports.items()) if rep["status"] == "refused"]
    if refused:
        first = reports[refused[0]]
        return EXIT_REFUSED, f"rank {refused[0]} refused: {first['message']}" + (
            f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        ) + "; the other ranks stopped before allocating"
    stopped = [r for r, rep in sorted(reports.items()) if rep["status"] == "stopped"]
    if stopped:
        return EXIT_REFUSED, reports[stopped[0]]["message"]
    waited = [r for r, rep in sorted(reports.items()) if rep["status"] == "no_answer"]
    if missing or waited:
        what = f"rank(s) {missing} left no report" if missing else ""
        if waited:
            what += ("; " if what else "") + reports[waited[0]]["message"]
        return EXIT_NO_ANSWER, what
    over = [r for r, rep in sorted(reports.items()) if not rep["within_envelope"]]
    if over:
        rep = reports[over[0]]
        return EXIT_OVER_ENVELOPE, (
            f"rank {over[0]}'s observed MLX peak {rep['observed']['mlx_peak_bytes']} bytes exceeds "
            f"its provable peak {rep['provable_bytes']} bytes"
        )
    tokens = {tuple(rep["tokens"]) for rep in reports.values()}
    if len(tokens) != 1:
        return 1, "the ranks generated different tokens"
    return 0, ""


# ------------------------------------------------------------------------------------ one rank


# The watcher runs in a process of its own: a rank blocked in a collective (or in joining the ring)
# is inside MLX's C++ code holding the GIL, where no Python thread or signal handler of its own runs.
# It fires after ``seconds`` without a heartbeat (a byte on its stdin); end of input cancels it.
_WATCHER = """
import json, os, select, signal, sys
seconds, pid, path, rank, message = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
while True:
    ready, _, _ = select.select([0], [], [], seconds)
    if ready:
        if not os.read(0, 4096):
            sys.exit(0)
        continue
    doc = {"rank": rank, "status": "no_answer", "message": message}
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, sort_keys=True)
    os.replace(path + ".tmp", path)
    print("dctms run: rank %d: %s" % (rank, message), file=sys.stderr, flush=True)
    os.kill(pid, signal.SIGKILL)
    sys.exit(0)
"""


class Watchdog:
    """Bounds each wait for the other ranks: after ``seconds`` without progress a watcher process
    writes the rank's report ("no_answer", naming what it waited for), says so on stderr and ends
    the rank. ``waiting`` yields a heartbeat to call on progress (each generated token)."""

    def __init__(self, seconds: float, report_path, rank: int):
        self.seconds, self.path, self.rank = seconds, str(report_path), rank

    @contextlib.contextmanager
    def waiting(self, what: str):
        message = f"no answer from the other ranks within {self.seconds:g} s while {what}"
        watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(self.seconds), str(os.getpid()), self.path]
            + [str(self.rank), message],
            stdin=subprocess.PIPE,
        )

        def heartbeat(*_args) -> bool:
            watcher.stdin.write(b".")
            watcher.stdin.flush()
            return True

        try:
            yield heartbeat
        finally:
            watcher.stdin.close()
            watcher.wait()


def run_as_rank(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from dctms.cli.run_prompt import prompt_request
    from dctms.runner.distributed import check_rank, exchange_flags
    from dctms.runner.load import check_fingerprint, load_checked_plan
    from dctms.runner.measure import RssSampler
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    if not args.rank_reports:
        raise DctmsError("--launched needs --rank-reports (dctms run --ranks passes both)")
    reports = Path(args.rank_reports)
    state: dict = {"rank": int(os.environ.get("MLX_RANK", "-1"))}

    def report(status: str, message: str = "", **more) -> None:
        doc = {"rank": state["rank"], "status": status, "message": message, **more}
        path = reports / f"rank{state['rank']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, sort_keys=True))
        tmp.replace(path)

    dog = Watchdog(args.rank_timeout, reports / f"rank{state['rank']}.json", state["rank"])
    with dog.waiting("joining the group"):
        group = mx.distributed.init(strict=True)
    state["rank"] = rank = group.rank()
    failure = None
    try:
        plan = load_checked_plan(Path(args.plan) / PLAN_NAME.format(rank))
        check_rank(plan, rank, group.size())
        model = open_model_folder(args.model)
        request, tokenizer = prompt_request(args, plan, model)
        check_fingerprint(plan, model, args.verify_weights)
    except DctmsError as err:
        failure = str(err)
        # Reported first: the launcher may end this rank as soon as another one has stopped.
        report("refused", failure)
        print(f"dctms run: rank {rank}: {failure}", file=sys.stderr, flush=True)
    with dog.waiting("exchanging the ranks' checks"):
        flags = exchange_flags(failure is not None)
    if failure is not None:
        return EXIT_REFUSED
    if any(flags):
        bad = [k for k, f in enumerate(flags) if f]
        message = f"rank {rank}: stopping before allocating: rank(s) {bad} refused"
        report("stopped", message)
        print(f"dctms run: {message}", file=sys.stderr)
        return EXIT_REFUSED
    # Bounded per token: a rank that makes no progress for --rank-timeout stops.
    with RssSampler() as rss, dog.waiting("generating (a collective of the plan)") as beat:
        session = Session(plan, model, verify_hashes=False)
        gen = session.generate(request, on_token=beat)
    peak = mx.get_peak_memory()
    env = plan.envelope
    within = peak <= env.provable
    text = tokenizer.decode(gen.tokens) if args.prompt is not None else None
    report(
        "ok",
        tokens=gen.tokens,
        text=text,
        provable_bytes=env.provable,
        m_max_bytes=env.total,
        within_envelope=within,
        observed={"mlx_peak_bytes": peak, "rss_peak_bytes": rss.peak},
        layers=plan.distributed.layers,
    )
    return 0 if within else EXIT_OVER_ENVELOPE
