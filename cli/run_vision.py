"""``dctms run PLAN --model DIR --prompt TEXT [--image FILE ...]`` for a vision-language plan.

Not a subcommand of its own: ``run`` hands a vision-language plan (or ``--image``) over here. Every
bound (images, image size after preprocessing, prompt tokens, generated tokens) is checked before
the session allocates anything in MLX."""

from __future__ import annotations

import argparse
import sys


def chat_prompt(
    tokenizer, config: dict, prompt: str, images: int, system: str | None
) -> tuple[str, bool]:
    """The prompt through the folder's chat template as mlx-vlm's generate renders it (its own
    ``apply_chat_template``: the family's message format puts the image markers), and whether
    tokenizing it adds special tokens (not where the template holds them: mlx-vlm's
    ``should_add_special_tokens``)."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import should_add_special_tokens

    from dctms.schema.errors import DctmsError

    chat = tokenizer.chat_tokenizer()
    message = prompt if system is None else [{"role": "system", "content": system}, prompt]
    try:
        text = apply_chat_template(chat, config, message, num_images=images)
    except Exception as err:  # jinja2 errors, or the template's own raise_exception
        raise DctmsError(f"{tokenizer.folder}: the chat template fails: {err}") from None
    return text, should_add_special_tokens(config.get("model_type", ""), chat)


def run_vision(args: argparse.Namespace, plan, model, target) -> int:

    from dctms.cli.run_summary import envelope_verdict, length_line, summary
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
    text, special = args.prompt, True
    if tokenizer.has_chat_template and not args.ignore_chat_template:
        text, special = chat_prompt(tokenizer, model.config, args.prompt, len(images),
                                    args.system_prompt)  # fmt: skip
    inputs = prepare(plan, model.path, tokenizer, text, images, processor,
                     add_special_tokens=special)
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
