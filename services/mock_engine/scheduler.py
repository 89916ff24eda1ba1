"""The engine stand-in's scheduler: vLLM V1's step loop over one rank's requests, without a clock.

Pure and synchronous: `plan()` says what the next engine step computes and how long it takes
(the shared `TimingModel`), `finish(step, now)` applies it once that time has passed and says
which tokens came out. The shell (`engine.py`) sleeps in between on the real clock; a test can
drive it on any clock.

One step, as vLLM V1 schedules it (chunked prefill on, first come first served):

1. running requests first, in admission order: a request still prefilling takes its next prompt
   chunk from the step's token budget (`max_num_batched_tokens`), a decoding one takes 1 token;
2. then waiting requests, in arrival order, while fewer than `max_num_seqs` run, the budget lasts
   and the cache can hold the prompt (its cached prefix is reused: those tokens cost nothing);
   the first waiting request that does not fit stops admission (no overtaking);
3. at the end of the step a request whose prompt is complete samples its first token (the time
   to first token ends here); a decoding request computes the KV of its last token (a block that
   fills is cached and published) and samples the next one; a request with `max_tokens` tokens
   is finished and its blocks are freed (a prefill for a remote decode engine's are held until
   that engine reads them: `held`).

A request may wait with its sequence already admitted (`EngineRequest.seq` set): a decode
request whose prompt blocks were read from a prefill engine (`PrefixCache.load`) is admitted
without a cache lookup and computes only what is left of its prompt.

When a decoding request needs a block and none is free, the most recently admitted running
request is preempted as vLLM does (its blocks freed, back to the front of the queue, its prompt
and output so far recomputed later, mostly from the cache).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dynamo_lite.base.timing import TimingModel

from .cache import CacheFull, PrefixCache, Sequence_

FINISHED_LENGTH = "length"
FINISHED_ABORT = "abort"


@dataclass(slots=True)
class EngineRequest:
    """One request on one rank."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float
    lora_name: str | None = None
    cache_salt: str | None = None
    seq: Sequence_ | None = None
    output_token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = -1  # prompt tokens served from the cache (set at first admission)
    first_token_at: float | None = None
    last_token_at: float | None = None  # the engine shell's clock, for the inter-token latency
    finished: str | None = None
    preemptions: int = 0
    # A prefill for a remote decode engine (`kv_transfer_params.do_remote_decode`): at the end its
    # blocks are held under this id for the decode engine to read, not freed.
    transfer_id: str | None = None
    held_block_ids: list[int] | None = None  # the blocks it held when it finished (its answer names them)

    @property
    def prefilled(self) -> bool:
        seq = self.seq
        return seq is not None and seq.computed >= len(seq.token_ids) - (1 if self.output_token_ids else 0)


@dataclass(slots=True)
class Output:
    """What a step produced for one request: its new token (if any) and whether it finished."""

    request: EngineRequest
    token_id: int | None
    finished: str | None


@dataclass(slots=True)
class Step:
    prefill: list[tuple[EngineRequest, int]]  # (request, prompt tokens computed this step)
    decode: list[EngineRequest]
    seconds: float
    rejected: list[EngineRequest] = field(default_factory=list)  # can never fit in the pool

    @property
    def prefill_tokens(self) -> int:
        return sum(tokens for _, tokens in self.prefill)


TokenSource = Callable[[EngineRequest, int], int]
"""The `index`-th generated token of a request (deterministic filler)."""


class Scheduler:
    """One rank's waiting queue, running batch and step plan (see the module docstring)."""

    def __init__(self, cache: PrefixCache, timing: TimingModel, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, next_token: TokenSource) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.cache = cache
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.next_token = next_token
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.preemptions = 0
        # Finished prefills' blocks held for a remote decode engine, by transfer id.
        self.held: dict[str, Sequence_] = {}

    # --- requests in and out ----------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not request.prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        self.waiting.append(request)

    def abort(self, request: EngineRequest) -> None:
        """The client went away: stop the request now and free its blocks."""
        if request.finished is not None:
            return
        request.finished = FINISHED_ABORT
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self._release(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self) -> int:
        """vLLM's internal data-parallel balancing score: waiting count 4x, plus running."""
        return 4 * len(self.waiting) + len(self.running)

    # --- one step ---------------------------------------------------------------------------

    def plan(self) -> Step | None:
        """The next step's work, admitting waiting requests; None when there is none."""
        budget = self.max_num_batched_tokens
        prefill: list[tuple[EngineRequest, int]] = []
        decode: list[EngineRequest] = []
        rejected: list[EngineRequest] = []
        for request in self.running:
            if budget <= 0:
                break
            seq = request.seq
            assert seq is not None
            if request.prefilled:
                decode.append(request)
                budget -= 1
            else:
                chunk = min(budget, len(seq.token_ids) - seq.computed)
                prefill.append((request, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            tokens = request.prompt_token_ids + request.output_token_ids
            seq = request.seq  # admitted already: its prompt's blocks were read from a prefill engine
            if seq is None:
                seq = self.cache.admit(request.request_id, tokens, lora_name=request.lora_name,
                                       cache_salt=request.cache_salt)
            if seq is None:
                if not self.running:
                    # Not even an empty pool holds it (the API refuses such prompts): it can
                    # never run, so it ends now rather than blocking the queue for good.
                    self.waiting.popleft()
                    request.finished = FINISHED_ABORT
                    rejected.append(request)
                    continue
                break
            self.waiting.popleft()
            request.seq = seq
            if request.cached_tokens < 0:
                request.cached_tokens = seq.cached_tokens
            self.running.append(request)
            chunk = min(budget, len(tokens) - seq.computed)
            prefill.append((request, chunk))
            budget -= chunk
        if not prefill and not decode and not rejected:
            return None
        seconds = self.timing.step_seconds(sum(tokens for _, tokens in prefill), len(decode))
        return Step(prefill, decode, seconds, rejected)

    def finish(self, step: Step, now: float) -> list[Output]:
        """Apply `step` at time `now`: computed KV, sampled tokens, finished requests."""
        outputs = [Output(request, None, FINISHED_ABORT) for request in step.rejected]
        for request, tokens in step.prefill:
            if request.finished is not None or request.seq is None:
                continue
            self.cache.compute(request.seq, tokens)
            if request.prefilled:
                outputs.append(self._sample(request, now))
        for request in step.decode:
            if request.finished is not None or request.seq is None:
                continue
            if not self._append_last_token(request):
                continue  # preempted: it goes on later
            outputs.append(self._sample(request, now))
        return outputs

    # --- internals --------------------------------------------------------------------------

    def _sample(self, request: EngineRequest, now: float) -> Output:
        token = self.next_token(request, len(request.output_token_ids))
        request.output_token_ids.append(token)
        if request.first_token_at is None:
            request.first_token_at = now
        if len(request.output_token_ids) >= request.max_tokens:
            request.finished = FINISHED_LENGTH
            self.running.remove(request)
            seq = request.seq
            if request.transfer_id is not None and seq is not None and seq.blocks:
                # vLLM's NixlConnector delays freeing a remote decode's blocks until it read them.
                request.held_block_ids = [block.block_id for block in seq.blocks]
                self.held[request.transfer_id] = seq
                request.seq = None
            else:
                self._release(request)
        return Output(request, token, request.finished)

    def release_held(self, transfer_id: str) -> Sequence_ | None:
        """Free the blocks held for `transfer_id` (read, or expired); None when none are."""
        seq = self.held.pop(transfer_id, None)
        if seq is not None:
            self.cache.release(seq)
        return seq

    def _append_last_token(self, request: EngineRequest) -> bool:
        """Compute the KV of the request's last sampled token, preempting the newest running
        requests while the pool has no block for it; False when `request` itself was."""
        seq = request.seq
        assert seq is not None
        while True:
            try:
                self.cache.append_token(seq, request.output_token_ids[-1])
                return True
            except CacheFull:
                seq.token_ids.pop()  # append_token added it before finding no block
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    return False

    def _preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self._release(request)
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: EngineRequest) -> None:
        if request.seq is not None:
            self.cache.release(request.seq)
            request.seq = None


__all__ = ["EngineRequest", "FINISHED_ABORT", "FINISHED_LENGTH", "Output", "Scheduler", "Step", "TokenSource"]
