"""The interface of a sampling plan (``compile --sampling``): the per-call inputs the runner feeds
its prefill and decode phases and the outputs it reads, by name, with their shapes and dtypes.

The compiler (``toolkit.sampling``) traces them, the verifier (``rules_sampling``) checks a plan
has exactly these, and the runner (``runner.sampling``) feeds them; the sizes a plan serves (the
repetition window, the logit-bias slots, the top log-probabilities) are read from its bindings.
"""

from __future__ import annotations

TOP_LOGPROBS = 20  # the most top_logprobs OpenAI's API accepts
RECENT_CAPACITY = 256  # the longest repetition_context_size a plan compiles for
BIAS_SLOTS = 300  # the most logit_bias pairs a plan compiles for

# Per-call inputs after tokens / position (/ last_index): name -> (shape, dtype); "R" and "B" are
# the repetition window and the logit-bias slots.
INPUTS: dict[str, tuple[tuple, str]] = {
    "key": ((2,), "uint32"),  # the random key before this call's split (mlx.random.key)
    "inv_temperature": ((), "float32"),  # 1 / temp; 0: greedy
    "top_p": ((), "float32"),  # outside (0, 1): off
    "log_min_p": ((), "float32"),  # log(min_p); -inf: off
    "top_k": ((), "int32"),  # 0: off
    "penalty": ((), "float32"),  # repetition penalty; 1: off
    "context": ((), "int32"),  # repetition_context_size, 1..R
    "recent": (("R",), "uint32"),  # the last R token ids, oldest first
    "bias_ids": (("B",), "uint32"),
    "bias_values": (("B",), "float32"),
}
# Outputs after next_token: name -> (shape, dtype); "K" is the number of top log-probabilities.
OUTPUTS: dict[str, tuple[tuple, str]] = {
    "next_key": ((2,), "uint32"),
    "logprob": ((1, 1), None),  # the chosen token's log-probability, in the logits' dtype
    "top_ids": ((1, "K"), "uint32"),  # the K largest log-probabilities' ids, ascending
    "top_logprobs": ((1, "K"), None),
}
# The decode phase also returns its window with the token it was fed appended.
DECODE_OUTPUTS = {**OUTPUTS, "next_recent": (("R",), "uint32")}
SAMPLED_PHASES = ("prefill", "decode")
RECOMPILE = "--sampling"  # the compile flag a greedy plan needs to sample


def outputs_for(phase: str) -> dict[str, tuple[tuple, str]]:
    """The sampling outputs ``phase`` returns besides next_token."""
    return DECODE_OUTPUTS if phase == "decode" else OUTPUTS


def samples(plan) -> bool:
    """Whether ``plan`` was compiled with --sampling (its phases take the sampling inputs)."""
    return plan.compile is not None and plan.compile.sampling
