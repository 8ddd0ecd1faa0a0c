"""``dctms run PLAN --model DIR --prompt TEXT [--image FILE ...]`` for a vision-language plan.

Not a subcommand of its own: ``run`` hands a vision-language plan (or ``--image``) over here. Every
bound (images, image size after preprocessing, prompt tokens, generated tokens) is checked before
the session allocates anything in MLX."""

from __future__ import annotations

import argparse
import sys


def run_vision(args: argparse.Namespace, plan, model, target) -> int:

    from dctms.cli.commands.run import envelope_verdict, length_line, summary
    from dctms.runner.measure import RssSampler
    from dctms.runner.report import build_report, report_bytes
    from dctms.runner.request import validate_request
    from dctms.runner.stops import finish_reason
    from dctms.runner.tokenize import Tokenizer, eos_ids
    from dctms.runner.vision_input import image_processor, prepare, read_images
    from dctms.runner.vision_session import VisionSession
    from dctms.schema.errors import DctmsError

    if plan.vision is None:
        raise DctmsError("--image: the plan is not a vision-language plan (compile with --images)")
    if args.prompt is None:
        raise DctmsError("a vision-language plan runs a --prompt (its image tokens are expanded)")
    processor = image_processor(model.path) if args.image else None
    images = read_images(args.image or [], plan, processor)
    tokenizer = Tokenizer(model.path)
    inputs = prepare(plan, model.path, tokenizer, args.prompt, images, processor)
    max_tokens = args.max_tokens if args.max_tokens is not None else plan.bounds.output_tokens
    stop = set() if args.ignore_eos else eos_ids(model.path, tokenizer)
    request = validate_request(plan, inputs.prompt, max_tokens, stop)
    with RssSampler() as rss:
        session = VisionSession(plan, model, verify_hashes=args.verify_weights)
        gen = session.generate_vision(request, inputs, serial=args.serial)
    text = tokenizer.decode(gen.tokens)
    report = build_report(
        plan, gen, session.observed_peak(), rss.peak, rss.series, text, list(inputs.prompt)
    )
    report["weights"] = session.weight_allocation.to_dict()
    report["vision"] = {
        "images": len(inputs.pixels),
        "image_processor": inputs.processor,
        "overlap": plan.vision.overlap and not args.serial and bool(inputs.pixels),
    }
    report["finish_reason"] = finish_reason(gen.tokens, request.stop, stopped=False)
    if target is not None:
        target.write(report_bytes(report))
    print(text)
    if report["finish_reason"] == "length":
        print(length_line(args.max_tokens, plan.bounds.output_tokens), file=sys.stderr)
    print(summary(report), file=sys.stderr)
    return envelope_verdict(report)
