"""A run of a plan: refuse mismatches, allocate everything once, generate greedily, measure.

Order of events (each step only after the previous succeeded):
1. the plan (schema, verifier, MLX version, backend) and the request (prompt <= N, tokens <= M);
2. the weights folder's fingerprint against the plan (headers only: nothing is read yet);
3. weights loaded, the static state (KV cache at plan capacity) allocated once, constants made;
4. prefill in ``prefill_chunk`` pieces (last one padded, masked by position), then decode steps.
MLX's peak memory is reset before step 3, so the observed peak covers the whole run.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

import mlx.core as mx

from dctms.runner.execute import PhaseProgram
from dctms.runner.load import ModelFolder, check_fingerprint, check_runtime, load_weights
from dctms.runner.primitives import dtype_from_name
from dctms.schema.errors import DctmsError
from dctms.schema.types import Plan, Scratch


def check_request(plan: Plan, prompt_tokens: int, max_tokens: int) -> None:
    b = plan.bounds
    if prompt_tokens < 1:
        raise DctmsError("empty prompt: at least one token is needed")
    if prompt_tokens > b.input_tokens:
        raise DctmsError(
            f"prompt has {prompt_tokens} tokens, the plan allows N = {b.input_tokens}; "
            "recompile with a larger -N"
        )
    if max_tokens < 1:
        raise DctmsError(f"--max-tokens must be at least 1, got {max_tokens}")
    if max_tokens > b.output_tokens:
        raise DctmsError(
            f"--max-tokens {max_tokens} exceeds the plan's M = {b.output_tokens}; "
            "recompile with a larger -M"
        )
    if b.batch != 1:
        raise DctmsError(f"this runner executes batch-1 plans; the plan has batch {b.batch}")


def check_token_ids(plan: Plan, prompt: list[int]) -> None:
    """Every id must index the embedding: MLX's gather does not bounds-check (out of range is a
    segmentation fault or garbage, not an error)."""
    vocab = plan.model.vocab_size
    for i, t in enumerate(prompt):
        if t < 0 or (vocab and t >= vocab):
            raise DctmsError(
                f"prompt token {i} is {t}, outside the model's vocabulary [0, {vocab}) "
                "(wrong tokenizer or token ids?)"
            )


def throttle_limit(plan: Plan) -> int:
    """The MLX memory limit a run needs: the provable envelope minus the largest allocation one op
    makes (its arena outputs plus scratch), so that an op started just under the limit still ends
    within the envelope."""
    largest = 0
    for phase in plan.phases:
        position = {op.index: k for k, op in enumerate(phase.ops)}
        made = [0] * len(phase.ops)
        producer = {t: k for k, op in enumerate(phase.ops) for t in op.outputs}
        for t in phase.tensors:
            if t.view_of is not None or t.kind == "state":
                continue
            if isinstance(t, Scratch):
                k = position.get(t.op)
            else:
                k = producer.get(t.id)
            if k is not None:
                made[k] += t.bytes
        largest = max(largest, max(made, default=0))
    return plan.envelope.provable - largest


@dataclass
class Generation:
    tokens: list[int]
    ttft_s: float
    token_latencies_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.token_latencies_s)
        return len(self.token_latencies_s) / total if total > 0 else 0.0


class Session:
    """Weights, static state and the two phase programs, allocated once for many generations."""

    def __init__(self, plan: Plan, model: ModelFolder, verify_hashes: bool = False):
        check_runtime(plan)
        check_fingerprint(plan, model, verify_hashes)
        self.plan = plan
        self.apply_limits()
        mx.reset_peak_memory()
        self.weights = load_weights(model)
        self.state = {
            s.name: mx.zeros(s.shape, dtype=dtype_from_name(s.dtype))
            for s in plan.state
            if s.kind == "kv"
        }
        mx.eval(list(self.state.values()))
        phases = {p.name: p for p in plan.phases}
        self.prefill = PhaseProgram(phases["prefill"])
        self.decode = PhaseProgram(phases["decode"])
        self.chunk = plan.bounds.prefill_chunk

    def held_bytes(self) -> int:
        """What this session keeps allocated between calls: weights, KV state, constants."""
        arrays = [*self.weights.values(), *self.state.values()]
        arrays += [*self.prefill.constants.values(), *self.decode.constants.values()]
        return sum(a.nbytes for a in arrays)

    def apply_limits(self, foreign_bytes: int = 0) -> None:
        """MLX's memory limit = the provable envelope; its buffer cache as the plan assumes: off
        when the plan counts no allocator slack (a reused cached buffer may be larger than asked
        for), else limited to M_intermediate (the runtime allowance covers it)."""
        env = self.plan.envelope
        # MLX pauses the host after an op while active memory is above this limit (and a full task
        # is outstanding): that throttle is what keeps its run-ahead within the plan's
        # run_ahead_dispatches, and one op may add its allocation on top of the limit.
        # ``foreign_bytes``: memory others hold in this process (a benchmark's second model), which
        # the limit must cover too or the throttle would stall the runner for a foreign reason.
        mx.set_memory_limit(throttle_limit(self.plan) + foreign_bytes)
        mx.set_cache_limit(env.intermediate if self.plan.target.allocator_slack else 0)
        if platform.system() == "Darwin" and self.plan.target.backend == "gpu":
            # Keep the plan's provable bytes wired so the OS cannot page them out mid-run.
            info = mx.metal.device_info() if mx.metal.is_available() else {}
            cap = info.get("max_recommended_working_set_size", env.provable)
            mx.set_wired_limit(min(env.provable, cap))

    def generate(
        self, prompt: list[int], max_tokens: int, stop: set[int] | None = None
    ) -> Generation:
        check_request(self.plan, len(prompt), max_tokens)
        check_token_ids(self.plan, prompt)
        stop = stop or set()
        start = time.perf_counter()
        token_array = self._prefill(prompt)
        token = int(token_array.item())
        gen = Generation([token], time.perf_counter() - start)
        position = len(prompt)
        # Pipelined like mlx-lm's generate_step: step t+1 is built while step t computes, fed
        # with step t's next_token array; the host reads each token as it becomes available.
        inflight = None
        if len(gen.tokens) < max_tokens and token not in stop:
            inflight = self._decode(token_array, position)
        t0 = time.perf_counter()
        while inflight is not None:
            position += 1
            more = len(gen.tokens) + 1 < max_tokens
            following = self._decode(inflight, position) if more else None
            token = int(inflight.item())
            now = time.perf_counter()
            gen.token_latencies_s.append(now - t0)
            t0 = now
            gen.tokens.append(token)
            if token in stop and following is not None:
                mx.eval(following)  # let the step already launched finish; its token is dropped
                following = None
            inflight = following
        return gen

    def _decode(self, token: mx.array, position: int) -> mx.array:
        # The smallest verified attention window that holds positions 0..position.
        point = self.decode.lengths.pick({"window": position + 1})
        out = self.decode.run(
            {"tokens": token, "position": mx.array(position, dtype=mx.int32)},
            self.weights,
            self.state,
            wait=False,
            point=point,
        )
        return out["next_token"]

    def _prefill(self, prompt: list[int]) -> mx.array:
        """The prompt in ``prefill_chunk`` pieces, each built while the previous one computes, each
        at the smallest verified length point that holds it (a piece padded to its token length,
        masked by position; attention over the window that holds the positions so far); returns
        the last piece's next_token array (evaluated)."""
        lengths = self.prefill.lengths
        out: dict[str, mx.array] = {}
        for start in range(0, len(prompt), self.chunk):
            piece = prompt[start : start + self.chunk]
            point = lengths.pick({"tokens": len(piece), "window": start + len(piece)})
            tokens = lengths.value(point, "tokens", self.chunk)
            padded = piece + [0] * (tokens - len(piece))
            out = self.prefill.run(
                {
                    "tokens": mx.array([padded], dtype=mx.int32),
                    "position": mx.array(start, dtype=mx.int32),
                    "last_index": mx.array(len(piece) - 1, dtype=mx.int32),
                },
                self.weights,
                self.state,
                wait=False,
                point=point,
            )
        token = out["next_token"]
        mx.eval(token)
        return token
