"""The generation worker: one thread owns the models and the sessions; requests queue to it.

The HTTP side validates a request, applies the context policy and submits a :class:`Job`; the
worker plans how the job uses the sessions (extend, or a staging fork or rebuild), generates, and
reports back through the job's ``emit`` callback with :class:`Started`, :class:`Delta`,
:class:`Finished` or :class:`Failed` events. A job whose client went away is stopped at the next
token; the session then holds exactly the prompt and the tokens emitted so far.
"""

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import kernel_patch
from .protocol import APIError, GenerationRequest, Usage
from .sessions import STAGED, Plan, SessionPool

log = logging.getLogger("dflash.server")

# The warm-up's prompt: plain words any tokenizer encodes to a few dozen tokens.
WARM_UP_TEXT = "The quick brown fox jumps over the lazy dog. " * 6

LogprobEntry = Tuple[str, float, List[Tuple[str, float]]]


@dataclass
class Engine:
    """The served models and how they generate.

    Attributes:
        model: The target mlx-lm model.
        tokenizer: Its ``TokenizerWrapper``.
        drafter: A DFlash drafter bound to ``model`` (``None``: no DFlash).
        draft_model: A classic draft model (``None``: none).
        model_id: The name the server answers to.
        draft_id: The classic draft model's name, if any.
        max_context: The context limit (``None``: unlimited).
        block_size: DFlash block size (``None``: the drafter's).
        prefill_step_size: Prompt tokens per prefill forward.
    """

    model: nn.Module
    tokenizer: Any
    drafter: Optional[nn.Module] = None
    draft_model: Optional[nn.Module] = None
    model_id: str = "default_model"
    draft_id: Optional[str] = None
    max_context: Optional[int] = None
    block_size: Optional[int] = None
    prefill_step_size: int = 2048

    def new_cache(self):
        """An empty session cache: target planes (+ draft planes) (+ the drafter's context)."""
        from ..cache import make_prompt_cache

        cache = make_prompt_cache(
            self.model, drafter=self.drafter, max_context=self.max_context
        )
        if self.draft_model is not None:
            cache.extend(
                make_prompt_cache(self.draft_model, max_context=self.max_context)
            )
        return cache

    def warm_up(self) -> int:
        """Generate once, greedily, from a short fixed prompt on a fresh cache.

        Run before the first request (on the thread that will serve them, with the
        verify kernels installed), this pays the process's one-time costs: mlx's
        compilation of the kernels and the traced layers' first traces, which on an H200
        made a process's first DFlash generation take 4.9-5.7 s against 0.6 s for later
        ones (docs/benchmarks/h200-2026-12-04-s38 and -s39); a first 1,024-token request
        took 13.7-20.6 s without it and 0.65-0.70 s after it (-s40). No session sees the
        cache, and a run-time pacing choice is started again (these rounds compile as they
        go).

        Returns:
            Tokens generated.
        """
        from ..pacing import forget_pacing

        prompt = self.tokenizer.encode(WARM_UP_TEXT)
        block = self.block_size or getattr(
            getattr(self.drafter, "config", None), "block_size", 4
        )
        max_tokens = 2 * block + 1
        if self.max_context is not None:
            # Well inside the context limit, whatever it is.
            quarter = max(1, self.max_context // 4)
            prompt, max_tokens = prompt[:quarter], min(max_tokens, quarter)
        request = GenerationRequest(kind="text", max_tokens=max_tokens)
        generated = sum(1 for _ in self.generate(prompt, self.new_cache(), request))
        forget_pacing(self.model)
        return generated

    def __post_init__(self):
        # Tokens XTC never removes (as mlx_lm.server): computed once, before the worker runs.
        tokenizer = self.tokenizer
        self.xtc_special_tokens = list(tokenizer.encode("\n")) + sorted(
            tokenizer.eos_token_ids
        )

    def generate(
        self, prompt: Sequence[int], cache, request: GenerationRequest
    ) -> Iterator:
        """Stream ``GenerationResponse`` objects for ``prompt`` continuing ``cache`` in place.

        Args:
            prompt: The prompt tokens not yet in ``cache``.
            cache: The session cache.
            request: Sampling settings, penalties and ``max_tokens``.

        Returns:
            The generator of ``dflash.stream_generate``.
        """
        from mlx_lm.sample_utils import make_logits_processors

        from .. import make_sampler, stream_generate

        kwargs = {
            "max_tokens": request.max_tokens,
            "sampler": make_sampler(
                temp=request.temperature,
                top_p=request.top_p,
                min_p=request.min_p,
                top_k=request.top_k,
                xtc_probability=request.xtc_probability,
                xtc_threshold=request.xtc_threshold,
                xtc_special_tokens=self.xtc_special_tokens,
            ),
            "logits_processors": make_logits_processors(**request.penalties) or None,
            "prompt_cache": cache,
            "prefill_step_size": self.prefill_step_size,
        }
        if self.drafter is not None:
            kwargs.update(drafter=self.drafter, block_size=self.block_size)
        elif self.draft_model is not None:
            kwargs.update(
                draft_model=self.draft_model, num_draft_tokens=request.num_draft_tokens
            )
        return stream_generate(self.model, self.tokenizer, list(prompt), **kwargs)


# ------------------------------------------------------------------------------ events
@dataclass
class Started:
    """The prompt is in the session (after a rebuild, the staging session was swapped in).

    Attributes:
        prompt_tokens: Tokens of the retained prompt.
        cached_tokens: Of those, the ones reused from the session.
        epoch: The session's context epoch.
        plan: ``"extend"``, ``"fork"`` or ``"rebuild"``.
    """

    prompt_tokens: int
    cached_tokens: int
    epoch: int
    plan: str


@dataclass
class Delta:
    """A generated token: its new text (stop strings withheld) and, if asked for, its
    log-probability entry.

    Attributes:
        text: Text that is now safe to send (may be empty).
        tokens: The token ids generated since the last event.
        logprobs: ``(token text, logprob, alternatives)`` per token, when asked for.
    """

    text: str
    tokens: List[int] = field(default_factory=list)
    logprobs: List[LogprobEntry] = field(default_factory=list)


@dataclass
class Finished:
    """The completion ended (``stop`` or ``length``)."""

    finish_reason: str
    usage: Usage


@dataclass
class Failed:
    """The job failed; the error is what the client gets."""

    error: APIError


@dataclass
class Job:
    """One request for the worker.

    Attributes:
        tokens: The retained prompt (after the context policy).
        request: The validated request.
        dropped: What the policy left out of the request (oldest chat turns or middle raw
            tokens; 0: nothing).
        emit: Called from the worker thread with each event; must not block.
        cancelled: Set when the client went away; the worker stops at the next token.
    """

    tokens: List[int]
    request: GenerationRequest
    dropped: int
    emit: Callable[[Any], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class StopText:
    """Withholds text that could still turn into a stop string; cuts the text at one.

    Args:
        stops: The stop strings.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [stop for stop in stops if stop]
        self.held = ""

    def feed(self, text: str) -> Tuple[str, bool]:
        """Add generated text; returns ``(text safe to send, whether a stop string ended it)``."""
        buffer = self.held + text
        hits = [buffer.find(stop) for stop in self.stops]
        hits = [hit for hit in hits if hit >= 0]
        if hits:
            self.held = ""
            return buffer[: min(hits)], True
        keep = self._partial(buffer)
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def _partial(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def flush(self) -> str:
        """The withheld text, once generation ended without a stop string."""
        held, self.held = self.held, ""
        return held


# ------------------------------------------------------------------------------ worker
class Worker:
    """The generation thread and its bounded queue.

    Args:
        engine: The served models.
        queue_size: Jobs that may wait (beyond the one running) before new ones get 429.
        cache_size: Sessions kept (``--prompt-cache-size``).
        cache_bytes: Session bytes kept at most (``None``: no limit).
        warm_up: Run :meth:`Engine.warm_up` on the generation thread before the first
            job (jobs submitted meanwhile wait in the queue); a warm-up that fails
            kills the worker, as a failing generation would fail every request.
    """

    def __init__(
        self,
        engine: Engine,
        queue_size: int = 64,
        cache_size: int = 10,
        cache_bytes: Optional[int] = None,
        warm_up: bool = False,
    ):
        if queue_size < 1:
            raise ValueError(
                f"the queue must hold at least 1 request, got {queue_size}"
            )
        self.engine = engine
        self.warm_up = warm_up
        self.pool = SessionPool(engine.new_cache, cache_size, cache_bytes)
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=queue_size)
        self.failure: Optional[BaseException] = None
        self._job_seconds = 1.0
        self.busy = False
        self.current: Optional[Job] = None
        self.stats = {
            "requests": 0,
            "generated_tokens": 0,
            "cancelled": 0,
            "rebuilds": 0,
            "shifts": 0,
            "failed": 0,
            # Seconds the warm-up took (None: not run, or not finished yet).
            "warm_up_seconds": None,
        }
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="dflash-generation", daemon=True
        )

    def start(self) -> None:
        """Start the generation thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the running job; jobs still queued are failed with 503."""
        self._stopping.set()
        self._thread.join(timeout)
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _emit(
                    job,
                    Failed(
                        APIError(503, "the server is shutting down", "server_error")
                    ),
                )

    @property
    def healthy(self) -> bool:
        """Whether the generation thread is alive and accepting work."""
        return (
            self._thread.is_alive()
            and self.failure is None
            and not self._stopping.is_set()
        )

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one job's time, 1 to 60."""
        return int(min(60, max(1, math.ceil(self._job_seconds))))

    def submit(self, job: Job) -> None:
        """Queue a job.

        Raises:
            APIError: 503 when the worker is not running, 429 when the queue is full (both with
                ``Retry-After``).
        """
        retry = {"Retry-After": str(self.retry_after())}
        if not self.healthy:
            raise APIError(
                503,
                "the generation worker is not available",
                "server_error",
                code="unavailable",
                headers=retry,
            )
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise APIError(
                429,
                f"the server is busy: {self.queue.maxsize} requests are already waiting",
                "rate_limit_error",
                code="queue_full",
                headers=retry,
            )

    def _run(self) -> None:
        try:
            # The verify kernels stay installed while the worker runs: each request's
            # generation shares the patch, so its traced layers and bound matmuls are
            # built once, not at every request (where the defaults install any).
            with kernel_patch.verify_kernels(self.engine.model, self.engine.drafter):
                if self.warm_up:
                    self._warm_up()
                self._serve_queue()
        except (
            BaseException
        ) as error:  # noqa: B902 - the health check must see any death
            self.failure = error
            log.exception("the generation worker died")

    def _warm_up(self) -> None:
        started = time.perf_counter()
        self.busy = True  # /health shows the worker busy until it can take a job
        try:
            tokens = self.engine.warm_up()
        finally:
            self.busy = False
        seconds = time.perf_counter() - started
        self.stats["warm_up_seconds"] = round(seconds, 3)
        log.info("warm-up: %d tokens in %.2f s", tokens, seconds)

    def _serve_queue(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is None:
                continue
            started = time.perf_counter()
            self.busy, self.current = True, job
            try:
                self.run_job(job)
            finally:
                self.busy, self.current = False, None
            # A smoothed job time for Retry-After.
            self._job_seconds += 0.2 * (
                time.perf_counter() - started - self._job_seconds
            )

    def run_job(self, job: Job) -> None:
        """Serve one job in the calling thread (the worker's); never raises for a job failure."""
        self.stats["requests"] += 1
        if job.cancelled.is_set():
            self.stats["cancelled"] += 1
            return
        try:
            self._serve(job)
        except APIError as error:
            self.stats["failed"] += 1
            _emit(job, Failed(error))
        except Exception as error:  # a generation failure must not kill the worker
            self.stats["failed"] += 1
            log.exception("generation failed")
            _emit(
                job,
                Failed(
                    APIError(
                        500, f"generation failed: {_first_line(error)}", "server_error"
                    )
                ),
            )

    def _serve(self, job: Job) -> None:
        request = job.request
        plan = self.pool.plan(job.tokens, job.dropped)
        if request.seed is not None:
            mx.random.seed(request.seed)
        sequence = list(job.tokens)
        stop = StopText(request.stop)
        responses = self.engine.generate(
            job.tokens[plan.reuse :], plan.session.cache, request
        )
        started = False
        try:
            for response in responses:
                # The cache already holds every yielded token, even one nobody reads.
                sequence.append(response.token)
                if not started:
                    if job.cancelled.is_set():
                        # A staging session is not swapped in for a client that went away.
                        self.stats["cancelled"] += 1
                        return
                    self._publish(plan)
                    started = True
                    _emit(
                        job,
                        Started(
                            len(job.tokens), plan.reuse, plan.session.epoch, plan.kind
                        ),
                    )
                self.stats["generated_tokens"] += 1
                if self._stream_token(job, response, sequence, plan, stop):
                    return
                if job.cancelled.is_set():
                    self.stats["cancelled"] += 1
                    return
            raise RuntimeError("generation ended without a finish reason")
        finally:
            responses.close()
            if started or plan.kind not in STAGED:
                self.pool.settle(plan.session, sequence)

    def _publish(self, plan: Plan) -> None:
        """The prefill succeeded: swap a staging session in, or mark the live one used."""
        if plan.kind in STAGED:
            self.pool.install(plan)
            self.stats["rebuilds"] += 1
            self.stats["shifts"] += int(plan.shifted)
        else:
            self.pool.touch(plan.session)

    def _stream_token(
        self, job: Job, response, sequence: List[int], plan: Plan, stop: StopText
    ) -> bool:
        """Emit one token's text; returns whether the completion finished."""
        request = job.request
        text, stopped = stop.feed(response.text)
        finish = "stop" if stopped else response.finish_reason
        if finish is not None and not stopped:
            text += stop.flush()
        entries = (
            [self._logprob_entry(response, request.top_logprobs)]
            if request.logprobs
            else []
        )
        _emit(job, Delta(text, [response.token], entries))
        if finish is not None:
            completion = len(sequence) - len(job.tokens)
            usage = Usage(len(job.tokens), completion, plan.reuse)
            _emit(job, Finished(finish, usage))
            return True
        return False

    def _logprob_entry(self, response, top: int) -> LogprobEntry:
        logprobs = response.logprobs
        tokenizer = self.engine.tokenizer
        chosen = float(logprobs[response.token].item())
        alternatives = []
        if top > 0:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            values = logprobs[ids].tolist()
            alternatives = sorted(
                ((tokenizer.decode([i]), v) for i, v in zip(ids.tolist(), values)),
                key=lambda pair: -pair[1],
            )
        return tokenizer.decode([response.token]), chosen, alternatives


def _emit(job: Job, event: Any) -> None:
    try:
        job.emit(event)
    except Exception:  # the receiving side is gone (e.g. its event loop closed)
        job.cancelled.set()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
