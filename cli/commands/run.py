"""``dctms run PLAN --model DIR (--prompt TEXT | --tokens 1,2,3)``: execute a plan, prove the envelope."""

from __future__ import annotations

import argparse
import sys

from dctms.cli.hf_cache import add_download_flag
from dctms.cli.run_prompt import prompt_request
from dctms.cli.run_summary import EXIT_OVER_ENVELOPE, envelope_verdict, length_line, summary
from dctms.cli.sampling_flags import add_sampling_options
from dctms.schema.errors import DctmsError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a plan on its weights and check observed memory against M_max",
        description=(
            "Load and verify PLAN, refuse weights that do not match its fingerprint, allocate the "
            "weights, KV cache and constants once, generate (greedily, or sampling with a plan "
            "compiled with --sampling) by executing the plan's primitives segment by segment, "
            "and compare MLX's observed peak memory with the "
            f"provable part of M_max (exit {EXIT_OVER_ENVELOPE} when it is exceeded)."
        ),
    )
    p.add_argument("plan", metavar="PLAN")
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="model folder (config + weights) or Hugging Face id ORG/NAME[@REVISION] (cached)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (needs tokenizer.json)")
    src.add_argument("--tokens", metavar="IDS", help="prompt as comma-separated token ids")
    src.add_argument(
        "--conversation",
        metavar="FILE",
        help='a multi-turn chat, {"system": TEXT, "turns": [TEXT, ...]}: each turn re-sends the '
        "conversation so far, as a chat client does (a plan compiled with --prefix-blocks "
        "reuses the earlier turns' prompt from its pool); one JSON line per turn",
    )
    src.add_argument(
        "--batch-prompts",
        metavar="FILE",
        help="JSON lines, each {\"prompt\": TEXT} or {\"tokens\": [IDS]} (optional "
        "\"max_tokens\"): run them together in a plan compiled with --batch B; more prompts "
        "than slots queue for slots; one JSON result per line on stdout",
    )
    p.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="PNG/JPEG image for a vision-language plan (repeatable; with --prompt)",
    )
    p.add_argument(
        "--serial",
        action="store_true",
        help="vision-language plan compiled with --overlap: encode every image before prefill",
    )
    p.add_argument(
        "--draft-model",
        metavar="DIR",
        help="speculative decoding with this draft model (the plan must be compiled with --draft)",
    )
    p.add_argument("--max-tokens", type=int, help="tokens to generate (default: the plan's M)")
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end the generation at the first occurrence of TEXT, which the output then omits "
        "(repeatable; matched on the decoded text, so it may span tokens)",
    )
    p.add_argument("--report", metavar="FILE", help="write the JSON run report here")
    p.add_argument(
        "--verify-weights",
        action="store_true",
        help="also compare every safetensors file's sha256 with the plan's",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    add_sampling_options(p)
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="feed --prompt as raw text even when the tokenizer has a chat template",
    )
    p.add_argument(
        "--system-prompt", metavar="TEXT", help="system message before the prompt (chat template)"
    )
    dist = p.add_argument_group("distributed (see README Distributed)")
    dist.add_argument(
        "--ranks",
        type=int,
        default=1,
        metavar="R",
        help="PLAN is the folder `dctms compile --ranks R` wrote: run its R rank plans under "
        "mlx.launch (local ring ranks by default) and check every rank",
    )
    dist.add_argument("--hostfile", metavar="FILE", help="mlx.launch hostfile (several machines)")
    dist.add_argument(
        "--backend",
        dest="launch_backend",
        help="mlx.launch backend (default ring; with --hostfile, the hostfile's own)",
    )
    dist.add_argument(
        "--rank-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="a rank waiting longer than S seconds for the others stops with a message (120)",
    )
    dist.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    dist.add_argument("--rank-reports", help=argparse.SUPPRESS)
    add_download_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.cli.inputs import model_inputs
    from dctms.schema.output import reserve_output

    if args.ranks != 1 or args.launched:
        from dctms.cli.distributed import run_ranks_command

        if args.stop:
            raise DctmsError("--stop is not supported with --ranks (distributed runs)")

        return run_ranks_command(args)

    if args.report is None:
        return _run(args, None)
    # Checked (and the file reserved) before anything is loaded or generated.
    label = f"--report {args.report or repr(args.report)}"
    inputs = [args.plan, *model_inputs(args.model)]
    if args.draft_model:
        inputs += model_inputs(args.draft_model)
    with reserve_output(args.report, inputs=inputs, label=label) as target:
        return _run(args, target)


def _run(args: argparse.Namespace, target) -> int:
    # Imports here keep `dctms run` free of the compiler's modules.

    from dctms.cli.sampling_flags import logprobs_report
    from dctms.runner.load import load_checked_plan
    from dctms.runner.measure import RssSampler
    from dctms.runner.report import build_report, report_bytes
    from dctms.runner.session import Session
    from dctms.runner.stops import StopText, finish_reason
    from dctms.schema.model_folder import open_model_folder
    from dctms.schema.slotted import slotted

    plan = load_checked_plan(args.plan)
    model = open_model_folder(args.model)
    if args.batch_prompts is not None:
        from dctms.cli.batch_run import run_batch_prompts

        if args.stop or args.draft_model or args.image:
            raise DctmsError("--batch-prompts takes no --stop, --draft-model or --image")
        return run_batch_prompts(args, plan, model, target)
    if args.conversation is not None:
        from dctms.cli.conversation_run import run_conversation

        if args.stop or args.draft_model or args.image:
            raise DctmsError("--conversation takes no --stop, --draft-model or --image")
        return run_conversation(args, plan, model, target)
    _check_stops(args, plan)
    if plan.vision is not None or args.image:
        from dctms.cli.run_vision import run_vision
        from dctms.cli.sampling_flags import sampling_params
        from dctms.runner.sampling import refuse_greedy

        refuse_greedy(sampling_params(args), plan)  # a vision plan decodes greedily

        return run_vision(args, plan, model, target)
    request, tokenizer = prompt_request(args, plan, model)
    prompt = list(request.prompt)
    stops = None
    if args.stop:
        if tokenizer is None:
            raise DctmsError(f"--stop needs the text: {model.path} has no tokenizer.json")
        stops = StopText(tokenizer.decode, args.stop)
    draft = open_model_folder(args.draft_model) if args.draft_model else None
    with RssSampler() as rss:
        recorded = None
        if draft is not None:
            from dctms.runner.speculative import SpeculativeSession

            spec = SpeculativeSession(plan, model, draft, verify_hashes=args.verify_weights)
            recorded = spec.prerecord([request])  # set-up: reported, not in TTFT
            gen = spec.generate(request)
        else:
            kind = Session
            if slotted(plan.bounds):  # one prompt through a plan in slots: one slot busy
                from dctms.runner.batch import BatchSession as kind
            session = kind(plan, model, verify_hashes=args.verify_weights)
            recorded = session.prerecord([request])  # set-up: reported, not in TTFT
            gen = session.generate(request, _until_stop(stops))
    text = None
    if args.prompt is not None:
        text = stops.text if stops is not None else tokenizer.decode(gen.tokens)
    reason = finish_reason(gen.tokens, request.stop, stops is not None and stops.stopped)
    peak = (spec.target if draft is not None else session).observed_peak()
    report = build_report(plan, gen, peak, rss.peak, rss.series, text, prompt)
    report["weights"] = (spec.target if draft is not None else session).weight_allocation.to_dict()
    if recorded is not None:
        report["setup"] = {"recorded_points": recorded.points, "record_s": recorded.seconds}
    if draft is not None:
        report["speculative"] = speculative_summary(gen)
    report["finish_reason"] = reason
    if stops is not None and stops.stopped:
        report["stop"] = stops.stopped_at
    if gen.seed is not None:
        report["seed"] = gen.seed
    if gen.logprobs:
        report["logprobs"] = logprobs_report(gen, tokenizer)
    if target is not None:
        target.write(report_bytes(report))
    print(text if text is not None else ",".join(map(str, gen.tokens)))
    if reason == "length":
        print(length_line(args.max_tokens, plan.bounds.output_tokens), file=sys.stderr)
    print(summary(report), file=sys.stderr)
    if "speculative" in report:
        sp = report["speculative"]
        print(
            f"speculative: {sp['accepted']} of {sp['proposed']} draft tokens accepted "
            f"({sp['acceptance']:.1%}) in {sp['rounds']} verify calls of K = {plan.draft.num_draft}",
            file=sys.stderr,
        )
    return envelope_verdict(report)


def _check_stops(args: argparse.Namespace, plan) -> None:
    """--stop is refused where the text is not followed token by token (speculative decoding's
    rounds, a vision-language run; distributed runs: ``run``), and when it is empty (it would end
    every generation at once)."""
    if not args.stop:
        return
    if any(s == "" for s in args.stop):
        raise DctmsError("--stop '': a stop string must not be empty")
    if args.draft_model:
        raise DctmsError("--stop is not supported with --draft-model (speculative decoding)")
    if plan.vision is not None or args.image:
        raise DctmsError("--stop is not supported for a vision-language plan")


def _until_stop(stops):
    """``Session.generate``'s ``on_token``: feed the text, end the generation at a stop string."""
    if stops is None:
        return None

    def on_token(token: int) -> bool:
        stops.push(token)
        return not stops.stopped

    return on_token


def speculative_summary(gen) -> dict:
    """What the draft did in a speculative run (the report's ``speculative`` entry)."""
    return {
        "proposed": gen.proposed,
        "accepted": gen.accepted,
        "acceptance": gen.acceptance,
        "rounds": gen.rounds,
        "accepted_per_round": gen.round_accepts,
    }
