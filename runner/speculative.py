"""Greedy speculative decoding on a plan with a draft (``dctms compile --draft``).

The rounds are mlx-lm's ``speculative_generate_step`` with the greedy sampler: both models prefill
the prompt but its last token; each round the draft decodes k = min(K, tokens left) tokens one at
a time, then the target's verify phase scores [last token, k drafts] (padded to K + 1) at the
write position p and returns its greedy id after each. The drafts are kept up to the first one
that differs from the target's id, and the target's id there is emitted too, so the output is the
target's own greedy output. The rejected suffix is rewound by moving the write positions: the
next round writes from p + n + 1 on (over the rejected entries; attention masks by position).
When every draft was kept, the draft has not yet seen its last draft token: it decodes that one
and the target's token (two decode calls) before proposing again.

The plan's envelope counts one arena for both models: their calls never overlap, because each
model's state is evaluated before the other model's next call is built (``_drain``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import msgspec

from dctms.runner.execute import PhaseProgram
from dctms.runner.load import check_fingerprint, check_runtime, load_weights
from dctms.runner.prerecord import decode_point, prefill_chunks
from dctms.runner.primitives import dtype_from_name
from dctms.runner.request import Request
from dctms.runner.session import Generation, Prerecorded, Session, check_allocation
from dctms.schema.draft import VERIFY, draft_view
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import ModelFolder
from dctms.schema.types import Plan


@dataclass
class SpeculativeGeneration(Generation):
    """A generation with what the draft did: tokens it proposed and how many the target kept."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    round_accepts: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        """Fraction of the proposed draft tokens the target kept."""
        return self.accepted / self.proposed if self.proposed else 0.0


class _Draft:
    """The draft model's weights, static cache and phase programs (its part of the plan)."""

    def __init__(self, view: Plan, folder: ModelFolder, num_draft: int):
        self.weights, self.weight_allocation = load_weights(folder, view)
        self.state = {
            s.name: mx.zeros(s.shape, dtype=dtype_from_name(s.dtype))
            for s in view.state
            if s.kind == "kv"
        }
        mx.eval(list(self.state.values()))
        # The draft decodes up to K - 1 positions past the target's last verify start.
        reach = msgspec.structs.replace(
            view.bounds, output_tokens=view.bounds.output_tokens + num_draft
        )
        check_allocation(msgspec.structs.replace(view, bounds=reach), self.weights, self.state)
        phases = {p.name: p for p in view.phases}
        self.prefill = PhaseProgram(phases["prefill"])
        self.decode = PhaseProgram(phases["decode"])


class SpeculativeSession:
    """The target's Session plus the draft and the target's verify phase, allocated once."""

    def __init__(
        self,
        plan: Plan,
        model: ModelFolder,
        draft_model: ModelFolder,
        verify_hashes: bool = False,
    ):
        """Refuses a plan without a draft, and a draft folder (or a target folder) that differs
        from the plan, before anything is allocated."""
        if plan.draft is None:
            raise DctmsError(
                "--draft-model: the plan has no draft model; compile it with --draft DRAFT"
            )
        view = draft_view(plan)
        check_runtime(view)
        try:
            check_fingerprint(view, draft_model, verify_hashes)
        except DctmsError as err:
            raise DctmsError(f"--draft-model: {err}") from None
        check_fingerprint(plan, model, verify_hashes)
        self.plan, self.num_draft = plan, plan.draft.num_draft
        self.target = Session(plan, model, verify_hashes=False)  # checked just above
        self.draft = _Draft(view, draft_model, self.num_draft)
        self.verify = PhaseProgram(next(p for p in plan.phases if p.name == VERIFY))

    def prerecord(self, requests: Sequence[Request]) -> Prerecorded:
        """Record the graphs of every length point ``requests`` may use, before any call (as
        ``Session.prerecord``): the prompts but their last token in both models' prefill chunks,
        every verify window up to the last round, every draft decode position up to K - 1 past it.
        Set-up time, reported, instead of a point's first use slowing a round."""
        start = time.perf_counter()
        chunk, k = self.plan.bounds.prefill_chunk, self.num_draft
        t_pre: set = set()
        d_pre: set = set()
        verify: set = set()
        d_dec: set = set()
        for r in requests:
            head, last = len(r.prompt) - 1, len(r.prompt) - 1 + r.max_tokens - 1
            t_pre |= {c.point for c in prefill_chunks(self.target.prefill.lengths, chunk, head)}
            d_pre |= {c.point for c in prefill_chunks(self.draft.prefill.lengths, chunk, head)}
            for p in range(head, last + 1):
                verify.add(self.verify.lengths.pick({"window": p + k + 1}))
            for p in range(head, last + k):
                d_dec.add(decode_point(self.draft.decode.lengths, p))
        t, d = self.target, self.draft
        done = t.prefill.prepare(t.weights, t.state, sorted(t_pre))
        done += self.verify.prepare(t.weights, t.state, sorted(verify))
        done += d.prefill.prepare(d.weights, d.state, sorted(d_pre))
        done += d.decode.prepare(d.weights, d.state, sorted(d_dec))
        return Prerecorded(done, time.perf_counter() - start)

    def held_bytes(self) -> int:
        """What this session keeps allocated between calls: both models' weights, KV caches and
        constants."""
        arrays = [*self.draft.weights.values(), *self.draft.state.values()]
        for program in (self.draft.prefill, self.draft.decode, self.verify):
            arrays += program.constants.values()
        return self.target.held_bytes() + sum(a.nbytes for a in arrays)

    def generate(self, request: Request) -> SpeculativeGeneration:
        """Greedy tokens for ``request`` (validated for this plan), proposed by the draft and
        verified by the target; stops at ``max_tokens`` or a stop token."""
        if request.plan is not self.plan:
            raise ValueError("the request was validated for another plan")
        prompt, max_tokens, stop = list(request.prompt), request.max_tokens, request.stop
        start = time.perf_counter()
        head = prompt[:-1]
        if head:
            self.target._prefill(head)
            self._drain(self.target.state)
            self._prefill_draft(head)
            self._drain(self.draft.state)
        gen = SpeculativeGeneration([], 0.0)
        y, p = prompt[-1], len(prompt) - 1  # the last accepted token and its position
        pending = [(y, p)]  # tokens the draft has still to process, with their positions
        t0 = start
        while True:
            k = min(max_tokens - len(gen.tokens), self.num_draft)
            drafts = self._propose(pending, k)
            scored = self._score([y, *drafts], p)
            n = 0
            while n < k and scored[n] == drafts[n]:
                n += 1
            gen.proposed += k
            gen.accepted += n
            gen.rounds += 1
            gen.round_accepts.append(n)
            done = False
            emitted = scored[: n + 1]
            now = time.perf_counter()
            for token in emitted:
                if not gen.tokens:
                    gen.ttft_s = now - start
                else:
                    gen.token_latencies_s.append((now - t0) / len(emitted))
                gen.tokens.append(token)
                if token in stop or len(gen.tokens) == max_tokens:
                    done = True
                    break
            t0 = now
            if done:
                return gen
            y = scored[n]
            if n == k:  # the draft has not processed its last draft token yet
                pending = [(drafts[-1], p + k), (y, p + k + 1)]
            else:
                pending = [(y, p + n + 1)]
            p += n + 1

    def _propose(self, pending: list[tuple[int, int]], k: int) -> list[int]:
        """The draft's k greedy tokens after the ``pending`` ones (fed back as arrays, each call
        built while the previous one computes); the draft's state is drained before returning."""
        token = None
        for tok, pos in pending:
            token = self._draft_decode(mx.array([tok], dtype=mx.uint32), pos)
        proposed = [token]
        position = pending[-1][1]
        for _ in range(k - 1):
            position += 1
            proposed.append(self._draft_decode(proposed[-1], position))
        ids = [int(t.item()) for t in proposed]
        self._drain(self.draft.state)
        return ids

    def _draft_decode(self, token: mx.array, position: int) -> mx.array:
        point = decode_point(self.draft.decode.lengths, position)
        out = self.draft.decode.run(
            {"tokens": token, "position": mx.array(position, dtype=mx.int32)},
            self.draft.weights,
            self.draft.state,
            wait=False,
            point=point,
        )
        return out["next_token"]

    def _score(self, tokens: list[int], position: int) -> list[int]:
        """The target's greedy id after each of ``tokens`` (padded to K + 1) at ``position``."""
        width = self.num_draft + 1
        padded = tokens + [0] * (width - len(tokens))
        point = self.verify.lengths.pick({"window": position + width})
        out = self.verify.run(
            {
                "tokens": mx.array([padded], dtype=mx.int32),
                "position": mx.array(position, dtype=mx.int32),
            },
            self.target.weights,
            self.target.state,
            point=point,
        )
        ids = out["next_token"].reshape(-1).tolist()
        self._drain(self.target.state)
        return ids[: len(tokens)]

    def _prefill_draft(self, prompt: list[int]) -> None:
        """The draft's prefill, in chunks like the target's (``Session._prefill``)."""
        chunk = self.plan.bounds.prefill_chunk
        out = {}
        for c in prefill_chunks(self.draft.prefill.lengths, chunk, len(prompt)):
            piece = prompt[c.start : c.start + c.length]
            out = self.draft.prefill.run(
                {
                    "tokens": mx.array([piece + [0] * (c.tokens - c.length)], dtype=mx.int32),
                    "position": mx.array(c.start, dtype=mx.int32),
                    "last_index": mx.array(c.length - 1, dtype=mx.int32),
                },
                self.draft.weights,
                self.draft.state,
                wait=False,
                point=c.point,
            )
        mx.eval(out["next_token"])

    @staticmethod
    def _drain(state: dict[str, mx.array]) -> None:
        # One model's call must be finished (its cache writes too) before the other's starts:
        # the envelope counts one arena for both.
        mx.eval(list(state.values()))
