"""``dctms run``'s sampling options (mlx_lm.generate's names), as ``runner.sampling.SamplingParams``."""

from __future__ import annotations

import argparse

from dctms.schema.errors import DctmsError


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sampling (a plan compiled with --sampling; mlx-lm's make_sampler / make_logits_processors)"
    )
    g.add_argument("--temp", type=float, default=0.0, metavar="T", help="temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=0.0, metavar="P", help="nucleus sampling (0: off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="the K likeliest tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="M", help="min-p sampling (0: off)")
    g.add_argument(
        "--repetition-penalty", type=float, metavar="R", help="repetition penalty (default: none)"
    )
    g.add_argument(
        "--repetition-context-size",
        type=int,
        default=20,
        metavar="C",
        help="tokens the repetition penalty looks back over (20)",
    )
    g.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=V",
        help="add V to token ID's logit (repeatable)",
    )
    g.add_argument("--seed", type=int, metavar="S", help="random seed (as mx.random.seed; default: random)")
    g.add_argument(
        "--logprobs",
        type=int,
        default=0,
        metavar="K",
        help="report each token's log-probability and the K largest in the --report JSON",
    )


def sampling_params(args: argparse.Namespace):
    """The options as mlx-lm's settings (``runner.sampling.SamplingParams``, imported here: parsing
    loads no MLX); a malformed --logit-bias is one line naming it."""
    from dctms.runner.sampling import SamplingParams

    return SamplingParams(
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        repetition_context_size=args.repetition_context_size,
        logit_bias=_logit_bias(args.logit_bias),
        seed=args.seed,
        top_logprobs=args.logprobs,
        logprobs=args.logprobs > 0,
    )


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    bias: dict[int, float] = {}
    for text in pairs:
        token, sep, value = text.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise DctmsError(f"--logit-bias {text!r}: expected ID=VALUE, e.g. 42=-5") from None
    return bias


def logprobs_report(gen, tokenizer) -> list[dict]:
    """Each generated token's log-probability and the largest ones (``--logprobs``)."""
    def name(i: int) -> str | None:
        return tokenizer.decode([i]) if tokenizer is not None else None

    return [
        {
            "id": tok,
            "token": name(tok),
            "logprob": lp.logprob,
            "top_logprobs": [{"id": i, "token": name(i), "logprob": v} for i, v in lp.top],
        }
        for tok, lp in zip(gen.tokens, gen.logprobs, strict=False)
    ]
