"""A run of a plan: refuse mismatches, allocate everything once, generate, measure.

Order of events (each step only after the previous succeeded), each check made once:
1. the plan (``load.load_checked_plan``: schema, verifier, MLX version, backend, phases) and the
   request (``request.validate_request``: prompt <= N, tokens <= M, ids < vocab_size), pure;
2. the weights folder's fingerprint against the plan (headers only: nothing is read yet);
3. MLX configured for the plan (device, limits), weights loaded, the static state (KV cache at plan
   capacity) allocated once and checked to hold every index a valid request feeds, constants made;
4. prefill in ``prefill_chunk`` pieces (last one padded, masked by position), then decode steps.
MLX's peak memory is reset before step 3, so the observed peak covers the whole run.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from dctms.runner.execute import PhaseProgram
from dctms.runner.load import check_fingerprint, configure_mlx, load_weights
from dctms.runner.mlx_lm_calls import START, prefill_like_mlx_lm
from dctms.runner.prerecord import decode_point, prefill_chunks, union_points
from dctms.runner.primitives import dtype_from_name
from dctms.runner.request import Request
from dctms.runner.sampling import TokenLogprobs, read_logprobs
from dctms.runner.sampling import prepare as prepare_sampling
from dctms.schema.access import state_writes, token_gathers
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import ModelFolder
from dctms.schema.sizes import FREE_RUN_AHEAD
from dctms.schema.slotted import slotted
from dctms.schema.types import Plan, Scratch


def check_allocation(plan: Plan, weights: dict[str, mx.array], state: dict[str, mx.array]) -> None:
    """The arrays this session allocated hold every index a valid request makes the runner feed:
    token ids below ``model.vocab_size`` into the embedding rows, and write positions into the KV
    state up to the padded prompt and N + M - 1. Checked against the arrays themselves, not the
    plan's claims about them (MLX does not bounds-check either access)."""
    b = plan.bounds
    vocab = plan.model.vocab_size
    padded = -(-b.input_tokens // b.prefill_chunk) * b.prefill_chunk
    # The last start position each phase is called with (request.py bounds N and M).
    last_start = {
        "prefill": padded - b.prefill_chunk,
        "decode": max(0, b.input_tokens + b.output_tokens - 2),
        # a quantised cache's float calls: the first prompt piece, or those starting below its
        # quantized_start T (runner.mlx_lm_calls)
        START: _last_float_start(b),
        "decode_start": b.kv.quantized_start - 1,
        "verify": max(0, b.input_tokens + b.output_tokens - 2),  # speculative decoding's
    }
    if slotted(b):  # runner.batch: a row without a sequence writes at the spare last position
        last_start["decode"] = last_start["decode_one"] = b.kv_capacity - 1
        last_start["load_block"] = padded - b.prefill_chunk  # a block of a prompt's whole chunks
        _check_slots(plan, state)
    for phase in plan.phases:
        if phase.name not in last_start:
            continue
        for g in token_gathers(phase):
            shape = weights[g.weight].shape if g.weight in weights else ()
            rows = shape[g.axis] if 0 <= g.axis < len(shape) else 0
            if rows < vocab:
                raise DctmsError(
                    f"weight {g.weight} has {rows} rows along axis {g.axis}, fewer than the "
                    f"plan's vocab_size {vocab}: token ids could index past it"
                )
        writes, stray = state_writes(phase)
        if stray:
            raise DctmsError(
                f"{phase.name} op {stray[0].op_position} writes state "
                f"{stray[0].state} at an index the runner does not bound"
            )
        for w in writes:
            shape = state[w.state].shape if w.state in state else ()
            size = shape[w.axis] if w.axis < len(shape) else 0
            # a sliding-window ring: position mod slots, never wrapping (the verifier's rule)
            end = w.modulus if w.modulus is not None else last_start[phase.name] + w.extent
            if w.clamp is not None:  # at min(position, clamp): a rotating cache's kept tokens
                end = w.clamp + w.extent
            if end > size:
                raise DctmsError(
                    f"{phase.name} writes {w.state} up to position {end}, but the array "
                    f"allocated for it holds {size} along axis {w.axis}"
                )


def _check_slots(plan: Plan, state: dict[str, mx.array]) -> None:
    """A batched plan's KV arrays hold B slots of kv_capacity positions: every slot and position
    ``runner.batch`` feeds (slot < B, position <= kv_capacity - 1) addresses inside them."""
    b = plan.bounds
    for name, array in state.items():
        shape = array.shape
        if name.endswith(".pool"):  # a prefix pool (toolkit.prefix_pool): blocks of one chunk
            if len(shape) != 4 or shape[0] < b.prefix_blocks or shape[2] < b.prefill_chunk:
                raise DctmsError(
                    f"state {name} of shape {list(shape)} does not hold {b.prefix_blocks} "
                    f"blocks of {b.prefill_chunk} positions"
                )
            continue
        if len(shape) != 4 or shape[0] < b.batch or shape[2] < b.kv_capacity:
            raise DctmsError(
                f"state {name} of shape {list(shape)} does not hold {b.batch} slots of "
                f"{b.kv_capacity} positions"
            )


def _last_float_start(b) -> int:
    """The last start of a ``prefill_start`` call: 0, or the last chunk start below T."""
    t = b.kv.quantized_start
    return (t - 1) // b.prefill_chunk * b.prefill_chunk if t > 0 else 0


def op_allocations(phase) -> list[int]:
    """What each op of ``phase`` allocates: its outputs that are not views or state, plus its
    scratch."""
    made = [0] * len(phase.ops)
    producer = {t: k for k, op in enumerate(phase.ops) for t in op.outputs}
    for t in phase.tensors:
        if t.view_of is not None or t.kind == "state":
            continue
        if isinstance(t, Scratch):
            k = t.op if 0 <= t.op < len(phase.ops) else None
        else:
            k = producer.get(t.id)
        if k is not None:
            made[k] += t.bytes
    return made


def throttle_limit(plan: Plan) -> int:
    """The MLX memory limit a run needs. A plan widened by MLX's own run-ahead bound
    (``FREE_RUN_AHEAD``) needs no throttle: the limit is the provable envelope, a brake that a
    correct plan never reaches. A throttled plan: the envelope minus the largest allocation one op
    makes (its arena outputs plus scratch), so that an op started just under the limit still ends
    within the envelope."""
    if plan.target.run_ahead_dispatches >= FREE_RUN_AHEAD:
        return plan.envelope.provable
    phases = [*plan.phases, *(plan.draft.phases if plan.draft else ())]
    largest = max((max(op_allocations(p), default=0) for p in phases), default=0)
    return plan.envelope.provable - largest


@dataclass(frozen=True)
class Prerecorded:
    points: int  # length points whose graphs were recorded
    seconds: float


@dataclass
class Generation:
    tokens: list[int]
    ttft_s: float
    token_latencies_s: list[float] = field(default_factory=list)
    # A sampling plan's: the seed its draws followed, and each token's log-probabilities when
    # the request asked for them.
    seed: int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # A plan with a prefix pool's: the prompt tokens loaded from the pool instead of prefilled.
    cached_tokens: int | None = None

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.token_latencies_s)
        return len(self.token_latencies_s) / total if total > 0 else 0.0


class Session:
    """Weights, static state and the two phase programs, allocated once for many generations."""

    TAKES_IMAGES = False  # a vision-language plan needs runner.vision_session.VisionSession
    BATCHED = False  # a batched plan's slots need runner.batch.BatchSession

    def __init__(self, plan: Plan, model: ModelFolder, verify_hashes: bool = False):
        """``plan`` as ``load_checked_plan`` returns it (verified, runtime-checked: not again here).
        Refuses weights that differ from the plan before reading them, and arrays that could not
        hold the indices the runner feeds before generating anything."""
        if plan.vision is not None and not self.TAKES_IMAGES:
            raise DctmsError(
                "a vision-language plan: run it with `dctms run PLAN --model DIR --prompt TEXT "
                "--image FILE` (this command does not take images yet)"
            )
        if slotted(plan.bounds) != self.BATCHED:
            raise DctmsError(
                f"a plan with batch {plan.bounds.batch} runs in a BatchSession "
                "(`dctms run PLAN --batch-prompts FILE`)"
                if slotted(plan.bounds)
                else "a batch-1 plan runs in a Session"
            )
        check_fingerprint(plan, model, verify_hashes)
        self.plan = plan
        configure_mlx(plan)
        # What others already hold in this process (nothing in a `dctms run` of its own; the
        # caller's arrays when the runner is used as a library): not this session's memory.
        self.baseline = mx.get_active_memory()
        self.apply_limits()
        mx.reset_peak_memory()
        self.weights, self.weight_allocation = load_weights(model, self.plan)
        self.state = {
            s.name: mx.zeros(s.shape, dtype=dtype_from_name(s.dtype))
            for s in plan.state
            if s.kind == "kv"
        }
        mx.eval(list(self.state.values()))
        check_allocation(plan, self.weights, self.state)
        phases = {p.name: p for p in plan.phases}
        self.prefill = PhaseProgram(phases["prefill"])
        self.decode = PhaseProgram(phases["decode"])
        self.prefill_start = PhaseProgram(phases[START]) if START in phases else None
        # float decode steps below a quantised cache's quantized_start (runner.mlx_lm_calls)
        self.decode_start = (
            PhaseProgram(phases["decode_start"]) if "decode_start" in phases else None
        )
        self.quantized_start = plan.bounds.kv.quantized_start
        self.recurrent = any(s.recurrent for s in plan.state)
        # a rotating cache that keeps tokens: mlx-lm's call boundaries decide what a query sees
        self.keeps = any(s.window is not None and s.window.keep for s in plan.state)
        self.chunk = plan.bounds.prefill_chunk

    def held_bytes(self) -> int:
        """What this session keeps allocated between calls: weights, KV state, constants."""
        arrays = [*self.weights.values(), *self.state.values()]
        arrays += [*self.prefill.constants.values(), *self.decode.constants.values()]
        for extra in (self.prefill_start, self.decode_start):
            if extra is not None:
                arrays += extra.constants.values()
        return sum(a.nbytes for a in arrays)

    def observed_peak(self) -> int:
        """MLX's peak since the session started, above what the process held before it."""
        return mx.get_peak_memory() - self.baseline

    def apply_limits(self, foreign_bytes: int | None = None) -> None:
        """MLX's memory limit = the provable envelope; its buffer cache as the plan assumes: off
        when the plan counts no allocator slack (a reused cached buffer may be larger than asked
        for), else limited to M_intermediate (the runtime allowance covers it). ``foreign_bytes``
        defaults to what the process held when the session started."""
        if foreign_bytes is None:
            foreign_bytes = self.baseline
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
        self,
        request: Request,
        on_token: Callable[[int], bool] | None = None,
        on_logprobs: Callable[[TokenLogprobs], None] | None = None,
    ) -> Generation:
        """The tokens for a request ``validate_request`` made for this session's plan: greedy, or
        as its sampling settings ask of a plan compiled with --sampling (``runner.sampling``).
        ``on_token`` sees each token as it is read (a server streams them); when it returns False
        the generation ends there, as at a stop token. ``on_logprobs`` sees each token's
        log-probabilities (when the request asks for them) just before ``on_token`` sees it."""
        if request.plan is not self.plan:
            raise ValueError("the request was validated for another plan")
        prompt, max_tokens, stop = list(request.prompt), request.max_tokens, request.stop
        sampling = prepare_sampling(self.plan, request.sampling)
        # a sampling plan's inputs: the constant settings, the key and window the calls thread
        feeds = None
        if sampling is not None:
            feeds = {**sampling.feeds, "key": sampling.key, "recent": sampling.recent(prompt)}
        top = request.sampling.top_logprobs
        reads_logprobs = sampling is not None and (request.sampling.logprobs or top > 0)
        start = time.perf_counter()
        if self.prefill_start is None and not self.recurrent and not self.keeps:
            out = self._prefill_outputs(prompt, feeds)
        else:  # mlx-lm's call boundaries decide what is quantised; a recurrent state takes no pad
            out = {"next_token": prefill_like_mlx_lm(self, prompt, whole_chunks=self.recurrent)}
        token = int(out["next_token"].item())
        t0 = time.perf_counter()  # each token's latency runs from the one before it
        gen = Generation([token], t0 - start, seed=sampling.seed if sampling else None)
        if reads_logprobs:
            gen.logprobs.append(read_logprobs(out, top))
            if on_logprobs is not None:
                on_logprobs(gen.logprobs[-1])
        if on_token is not None and on_token(token) is False:
            return gen
        position = len(prompt)
        # Pipelined like mlx-lm's generate_step: step t+1 is built while step t computes, fed
        # with step t's next_token array; the host reads each token as it becomes available.
        inflight = None
        if len(gen.tokens) < max_tokens and token not in stop:
            feeds = _threaded(feeds, out)
            inflight = self._decode_outputs(out["next_token"], position, feeds)
        while inflight is not None:
            position += 1
            more = len(gen.tokens) + 1 < max_tokens
            feeds = _threaded(feeds, inflight)
            following = (
                self._decode_outputs(inflight["next_token"], position, feeds) if more else None
            )
            token = int(inflight["next_token"].item())
            if reads_logprobs:
                gen.logprobs.append(read_logprobs(inflight, top))
                if on_logprobs is not None:
                    on_logprobs(gen.logprobs[-1])
            now = time.perf_counter()
            gen.token_latencies_s.append(now - t0)
            t0 = now
            gen.tokens.append(token)
            wanted = on_token is None or on_token(token) is not False
            if (token in stop or not wanted) and following is not None:
                mx.eval(following)  # let the step already launched finish; its token is dropped
                following = None
            inflight = following
        return gen

    def prerecord(self, requests: Sequence[Request] | None = None) -> Prerecorded:
        """Check the bound and record the graphs of every point ``requests`` will use (None: every
        verified point) now, before any call: set-up time, reported, instead of a point's first
        use slowing a call. Nothing is computed (``PhaseProgram.prepare``)."""
        start = time.perf_counter()
        pre = dec = None
        if requests is not None:
            pre, dec = union_points(
                self.prefill.lengths,
                self.decode.lengths,
                self.chunk,
                [(len(r.prompt), r.max_tokens) for r in requests],
            )
        done = self.prefill.prepare(self.weights, self.state, pre)
        done += self.decode.prepare(self.weights, self.state, dec)
        return Prerecorded(done, time.perf_counter() - start)

    def _decode(self, token: mx.array, position: int) -> mx.array:
        """One decode call's next_token array (still computing)."""
        return self._decode_outputs(token, position)["next_token"]

    def _prefill(self, prompt: list[int]) -> mx.array:
        """The prompt's prefill calls; the last one's next_token array (evaluated)."""
        return self._prefill_outputs(prompt)["next_token"]

    def _decode_outputs(
        self, token: mx.array, position: int, feeds: dict[str, mx.array] | None = None
    ) -> dict[str, mx.array]:
        """One decode call's outputs (still computing); ``feeds``: a sampling plan's inputs."""
        program = self.decode
        if self.decode_start is not None and position < self.quantized_start:
            program = self.decode_start  # before mlx-lm would have quantised its cache
        point = decode_point(program.lengths, position)
        return program.run(
            {"tokens": token, "position": mx.array(position, dtype=mx.int32), **(feeds or {})},
            self.weights,
            self.state,
            wait=False,
            point=point,
        )

    def _prefill_outputs(
        self, prompt: list[int], feeds: dict[str, mx.array] | None = None
    ) -> dict[str, mx.array]:
        """The prompt in ``prefill_chunk`` pieces, each built while the previous one computes, each
        at the smallest verified length point that holds it (a piece padded to its token length,
        masked by position; attention over the window that holds the positions so far); returns
        the last piece's outputs, its next_token evaluated. ``feeds``: a sampling plan's inputs,
        the same for every piece (only the last piece's draw is kept)."""
        out: dict[str, mx.array] = {}
        for c in prefill_chunks(self.prefill.lengths, self.chunk, len(prompt)):
            piece = prompt[c.start : c.start + c.length]
            padded = piece + [0] * (c.tokens - c.length)
            out = self.prefill.run(
                {
                    "tokens": mx.array([padded], dtype=mx.int32),
                    "position": mx.array(c.start, dtype=mx.int32),
                    "last_index": mx.array(c.length - 1, dtype=mx.int32),
                    **(feeds or {}),
                },
                self.weights,
                self.state,
                wait=False,
                point=c.point,
            )
        mx.eval(out["next_token"])
        return out


def _threaded(feeds: dict[str, mx.array] | None, out: dict[str, mx.array]):
    """A sampling plan's inputs for the next decode call: the key and the repetition window the
    previous call returned (prefill returns no window: its input already ends with the prompt)."""
    if feeds is None:
        return None
    return {**feeds, "key": out["next_key"], "recent": out.get("next_recent", feeds["recent"])}
