"""The prompt options of ``dctms run`` (``--prompt``/``--tokens``, chat template, ``--max-tokens``,
EOS, sampling) turned into a validated request: shared by a single-process run and a distributed
rank, so neither imports the other for it.
"""

from __future__ import annotations

import argparse

from dctms.schema.errors import DctmsError


def prompt_request(args: argparse.Namespace, plan, model):
    """The validated request (and the tokenizer, when one is used) that the prompt options ask for."""
    from dctms.cli.sampling_flags import sampling_params
    from dctms.runner.request import GREEDY, validate_request
    from dctms.runner.tokenize import Tokenizer, encode_chat, eos_ids, parse_token_list

    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise DctmsError("--prompt is not valid UTF-8 text") from None
    tokenizer = None
    if args.prompt is not None or (model.path / "tokenizer.json").is_file():
        tokenizer = Tokenizer(model.path)
    if args.prompt is None:
        prompt = parse_token_list(args.tokens)
    elif args.ignore_chat_template:
        prompt = tokenizer.encode(args.prompt)
    else:
        # As mlx_lm.generate: the chat template with a user message, when the tokenizer has one.
        prompt = encode_chat(tokenizer, args.prompt, args.system_prompt)
    max_tokens = args.max_tokens if args.max_tokens is not None else plan.bounds.output_tokens
    stop = set() if args.ignore_eos else eos_ids(model.path, tokenizer)
    sampling = sampling_params(args) if hasattr(args, "temp") else GREEDY
    return validate_request(plan, prompt, max_tokens, stop, sampling), tokenizer
