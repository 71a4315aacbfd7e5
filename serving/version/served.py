"""One served model version: its name and version, its runner, batcher and batching settings,
and its life (``serving.version.life``: LOADING, WARMING, READY, DRAINING, RETIRED, FAILED): load,
warm up, ready, drain, close. ``ServedModel`` is the only writer of its state machine; everyone
else reads ``state``, ``reason`` and ``condition()``.

The lifespan makes one ``ServedModel`` per model it serves (today one: ``Settings.served_name``,
version 1) and keeps them in ``ServerState.models``; the routes look a model up there by name.
Everything that belongs to one model lives here, so that several models (and versions) are
several of these, not more fields on the server's state.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving.batching.batcher import Batcher, BatchSettings
from serving.errors import InvalidInputError, NotFoundError, NotReadyError
from serving.generation.engine import Generator
from serving.metrics.series import Metrics, ModelMetrics
from serving.settings.config import ConfigError, Settings
from serving.settings.lengths import served_max_length
from serving.supervisor import supervise
from serving.version.admitted import Admitted
from serving.version.collector import freeze_heap
from serving.version.condition import Condition, condition_of
from serving.version.length_check import LengthPlan, plan_length_padding
from serving.version.life import Life, Phase, VersionState
from serving.version.runner import ModelRunner, RunnerFactory, pipeline_depth, release_bundle
from serving.version.scale_state import LimitSources, ScaleState, ScaleStatus
from serving.version.shape_log import ShapeLog
from serving.version.stage_stats import log_memory, poll_stats
from serving.version.stop_budget import StopBudget, drain_batcher
from shards.errors import one_line
from shards.pipeline.health import Health
from shards.signature import ModelSignature

log = logging.getLogger("shardserve")
# While loading, how often /readyz's account of what the load waits for is refreshed.
WAITS_PERIOD_S = 1.0


@dataclass(eq=False)
class ServedModel:
    name: str
    settings: Settings
    # The server's registry; this version's own series are ``metrics`` (labels model, version).
    server_metrics: Metrics
    version: str = "1"  # as the protocols' paths and messages carry it
    runner: ModelRunner | None = None
    batcher: Batcher | None = None  # set once the model is warm: from then on it is ready
    # A generating model's (a keras_hub CausalLM preset) in place of a batcher: its scheduler
    # over its replicas and its tokenizer, set once warm.
    generator: Generator | None = None
    length_plan: LengthPlan | None = None  # the length padding in force, or why none (warm-up)
    scaling: ScaleStatus | None = None  # its replica bounds, target and why (once READY)
    # Its batching limits as each source wants them (start-up, the operator, the replicas that
    # serve, a switch's widening): ``serving.elastic.limits`` combines and applies them.
    limits: LimitSources = field(default_factory=LimitSources, repr=False)
    # Called with this version once its batcher is set, before it is READY and takes requests
    # (the reconciler widens its queue there while what it replaces drains), or None.
    before_ready: Callable[[ServedModel], None] | None = field(default=None, repr=False)
    # What serving.elastic keeps of this version (held by a switch, a fixed count, its scaler).
    scale_state: ScaleState = field(default_factory=ScaleState, repr=False)
    _jobs: list[asyncio.Task[None]] = field(default_factory=list, repr=False)
    shapes: ShapeLog = field(default_factory=ShapeLog, repr=False)  # what the stages ran
    admitted: Admitted = field(default_factory=Admitted, repr=False)
    metrics: ModelMetrics = field(init=False, repr=False)
    _life: Life = field(init=False, repr=False)
    # While loading: what the load waits for (resources Ray has not granted yet), for /readyz.
    _load_waits: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = self.server_metrics.for_model(self.name, self.version)
        self._life = Life(f"model {self.name!r} version {self.version}")
        self.metrics.bind_state(lambda: self._life.state, tuple(VersionState))

    # ---- its state (``serving.version.life``), read-only outside this module

    @property
    def state(self) -> VersionState:
        return self._life.state

    @property
    def reason(self) -> str | None:
        """FAILED: why it failed; DRAINING: why it refuses new requests; else None."""
        return self._life.reason

    @property
    def waiting(self) -> str | None:
        """While LOADING: what its load waits for (resources Ray has not granted yet)."""
        return self._load_waits

    @property
    def phase(self) -> Phase:
        """Where it stands for a request (``serving.version.life.Life.phase``): loading, ready,
        stopping or failed; every view of "is it serving" derives from it."""
        return self._life.phase

    @property
    def takes_requests(self) -> bool:
        """May it take a request: READY, whatever its replicas' condition (the reconciler
        routes, labels, scales and keeps it; its condition answers or refuses each request)."""
        return self._life.phase == "ready"

    @property
    def available(self) -> bool:
        """Is it counted as available: READY and a replica serves, or will within a request's
        deadline (readiness, V2 ready, gRPC health, TF Serving's AVAILABLE, the routing pick)."""
        return self.not_ready_reason() is None

    def condition(self) -> Condition:
        """How a READY version serves now: healthy, recovering or degraded, from its replicas and
        its batcher (``serving.version.condition``)."""
        return condition_of(self.health(), self.batcher, self.settings.request_timeout_ms)

    async def until_ready(self) -> None:
        await self._life.until(VersionState.READY)

    async def until_loaded(self) -> None:
        """Until its runner is made or its load failed (or it stopped meanwhile)."""
        await self._life.until(*(s for s in VersionState if s is not VersionState.LOADING))

    @property
    def metric_labels(self) -> dict[str, str]:
        """The labels that tell this version's series from another's."""
        return {"model": self.name, "version": self.version}

    @property
    def queue_factor(self) -> int:
        """What its queue rows are multiplied by now (a switch of its model under way)."""
        return self.limits.factor

    @property
    def queue_widened(self) -> tuple[int, int] | None:
        """Its own queue rows and the rows it holds while a switch widens them, or None."""
        factor, batcher = self.limits.factor, self.batcher
        rows = batcher.settings.max_queue_rows if batcher is not None else 0
        return None if factor == 1 or batcher is None else (rows // factor, rows)

    @property
    def batch_settings(self) -> BatchSettings | None:
        """The batching settings in force (an admin PUT changes them), once loaded."""
        return self.batcher.settings if self.batcher is not None else None

    @property
    def signature(self) -> ModelSignature:
        if self.generator is not None:
            return self.generator.signature
        if self.runner is None:
            raise NotReadyError("model is still loading; its signature is not known yet")
        return self.runner.signature

    def length_padding_parameters(self) -> dict[str, Any] | None:
        """The length padding in force, or why none, for the V2 metadata; ``None`` before
        warm-up has planned it or for a model with no input of unknown length."""
        return self.length_plan.parameters() if self.length_plan is not None else None

    def scaling_parameters(self) -> dict[str, Any] | None:
        return self.scaling.parameters() if self.scaling is not None else None

    def health(self) -> Health | None:
        """Its replicas' health, once its runner is made."""
        return self.runner.health() if self.runner is not None else None

    def not_ready_reason(self) -> str | None:
        """Why it would refuse a request now (its replicas' condition included), or ``None``."""
        refusal = self._life.refusal()
        return self.condition().unavailable if refusal is None else refusal

    def require_batcher(self) -> Batcher:
        """The batcher, or the 503 that says why this model cannot take a request now (its
        phase's refusal, ``not_ready_reason``'s, with how to wait for a load)."""
        phase = self._life.phase
        if phase == "failed":
            raise self._refused()
        if self.generator is not None:
            raise InvalidInputError(
                f"model {self.name!r} version {self.version} generates text: POST "
                f"/v2/models/{self.name}/generate; predict and infer are not served for a "
                "keras_hub CausalLM preset"
            )
        if self.batcher is None or phase == "loading":
            waiting = f" ({self._load_waits})" if self._load_waits else ""
            raise NotReadyError(
                f"model is still loading{waiting}; retry when GET /readyz answers 200"
            )
        if phase == "stopping":
            raise self._refused()
        if self.batcher.failure is not None:
            raise NotReadyError(self.batcher.failure)
        return self.batcher

    def _refused(self) -> NotReadyError:
        """The 503 of a phase that refuses (failed, stopping), saying why."""
        refusal = self._life.refusal()
        assert refusal is not None  # asked only where its phase refuses
        return NotReadyError(refusal)

    def require_generator(self) -> Generator:
        """The generator, or why this version takes no generate request now: 503 while it
        loads or stops, 404 for a version that does not generate."""
        phase = self._life.phase
        if phase == "failed":
            raise self._refused()
        if self.generator is None:
            if self.batcher is not None:  # no generate route for it: 404, as a route
                raise NotFoundError(
                    f"model {self.name!r} version {self.version} does not generate text (it "
                    "is not a keras_hub CausalLM preset): no generate route; use predict or "
                    "infer"
                )
            raise NotReadyError("model is still loading; retry when GET /readyz answers 200")
        if phase == "loading":
            raise NotReadyError("model is still loading; retry when GET /readyz answers 200")
        if phase == "stopping":
            raise self._refused()
        return self.generator

    # ---- life: start (load, warm up, ready) ... drain, close

    def start(self, factory: RunnerFactory, on_failure: Callable[[str], None] | None) -> None:
        """Load in the background (so /healthz and /readyz answer meanwhile) and poll the
        stages' stats from now until ``stop_jobs``; each job under ``supervise``: a loop that
        raises starts again, a load that raises past its own handling fails the version."""
        where = f"model {self.name!r} version {self.version}'s"

        def failed(reason: str) -> None:
            if self._life.fail(reason) and on_failure is not None:  # else it said why already
                on_failure(reason)

        metrics = self.server_metrics
        self._jobs = [
            supervise(
                "load",
                lambda: self.load(factory, on_failure),
                metrics,
                what=f"{where} load",
                restart=False,
                on_failure=failed,
            ),
            supervise("stats_poll", lambda: poll_stats(self), metrics, what=f"{where} stats poll"),
        ]

    async def wait_load(self) -> None:
        """Until the load ``start`` began has ended: ready, failed, or cancelled."""
        if self._jobs:
            await asyncio.wait(self._jobs[:1])

    async def load(self, factory: RunnerFactory, on_failure: Callable[[str], None] | None) -> None:
        """Load, start the batcher and warm up within ``load_timeout_s``; meanwhile keep
        ``waiting`` saying what the load waits for. Any failure, the timeout included, is the
        version's FAILED reason (for ``/readyz``) and ``on_failure``: never a silent hang."""
        timeout_s = self.settings.load_timeout_s
        what = f"model {self.name!r} version {self.version}'s look at what its load waits for"
        watcher = supervise("load_waits", self._watch_waits, self.server_metrics, what=what)
        started: list[Batcher] = []
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                await self._load(factory, started)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                # The last look of the watcher: the cancelled load has removed its placement
                # groups since, in the same step of the loop, so the watcher has not looked again.
                reason = _timed_out(timeout_s, self._load_waits)
                log.error("model failed to load: %s", reason)
            else:
                reason = describe_error(exc)
                log.exception("model failed to load")
            self._life.fail(reason)
            if on_failure is not None:
                on_failure(reason)
        finally:
            watcher.cancel()
            self._load_waits = None
            if self.batcher is None:  # failed or cancelled: its loop must not outlive the load
                for batcher in started:
                    await batcher.stop(drain=False)

    async def _load(self, factory: RunnerFactory, started: list[Batcher]) -> None:
        made = await factory(self.settings)
        if isinstance(made, Generator):
            await self._load_generator(made)
            return
        runner = made
        self.runner = runner
        # A replica set's own background tasks (a replica's recovery) count here too.
        task_errors = getattr(runner, "task_errors", None)
        if isinstance(task_errors, list):
            task_errors.append(self.server_metrics.background_error)
        self._life.advance(VersionState.WARMING)
        metrics = self.metrics
        batcher = Batcher(
            runner.run_batch,
            batch_settings(self.settings, runner),
            on_batch=metrics.observe_batch,
            on_reject=metrics.reject,
            on_error=self.server_metrics.background_error,
        )
        self.limits.start = batcher.settings
        await batcher.start()
        started.append(batcher)
        metrics.bind_gauges(
            lambda: batcher.queued_rows,
            lambda: batcher.inflight_batches,
            lambda: batcher.effective_wait_ms,
            held_rows=lambda: batcher.held_rows,
        )
        metrics.bind_health(runner.health)
        await self.warm_up(runner, served_length(self.settings, runner.signature))
        # Before any request is queued: the batcher keys its queues by the padding in force.
        self.length_plan = await plan_length_padding(runner, self.settings)
        batcher.set_length_padding(self.length_plan.padding)
        await log_memory(self, runner)
        self.batcher = batcher
        if self.before_ready is not None:
            self.before_ready(self)
        if self.settings.gc_freeze:
            freeze_heap(self.settings.gc_first_threshold)
        self._life.advance(VersionState.READY)
        log.info(
            "ready: serving %r version %s (%d stage(s))", self.name, self.version, runner.num_stages
        )

    async def _load_generator(self, generator: Generator) -> None:
        """A generating version: its scheduler starts and generates one token, then READY."""
        self._life.advance(VersionState.WARMING)
        try:
            generator.set_observer(self.metrics.generation())
            self.metrics.bind_generation(*generator.gauges())
            generator.start()
            await generator.warm_up()
        except BaseException:
            await generator.close("the model failed to load")
            raise
        self.generator = generator
        self._life.advance(VersionState.READY)
        info = generator.info
        log.info(
            "ready: generating with %r version %s (%s, %d stage(s) x %d replica(s), %d KV slots "
            "of %d positions each, %s)",
            self.name, self.version, info.model_family, info.stages, generator.replicas,
            info.kv_slots, info.max_length,
            "text and token ids" if generator.tokenizer is not None else "token ids only",
        )  # fmt: skip

    @staticmethod
    async def warm_up(runner: ModelRunner, length: int = 1) -> None:
        """One batch end to end, so the first user request does not pay for connection set-up;
        a dimension the model leaves unknown at ``length`` (``max_sequence_length``), the
        longest a request may bring."""
        inputs = {
            spec.name: np.zeros((1, *(d or length for d in spec.shape)), dtype=spec.np_dtype)
            for spec in runner.signature.inputs
        }
        try:
            await runner.run_batch(inputs)
        except Exception as exc:
            if all(d is not None for spec in runner.signature.inputs for d in spec.shape):
                raise
            # A model whose positions stop short of the length (a fixed position embedding).
            raise RuntimeError(
                f"the warm-up batch at max_sequence_length={length} failed "
                f"({describe_error(exc)}); a model that takes shorter inputs needs "
                "--max-sequence-length at most its longest"
            ) from exc

    async def _watch_waits(self) -> None:
        """Ask Ray what this process's placement groups wait for, every ``WAITS_PERIOD_S``.

        ``shards.cluster`` (it imports Ray) is looked up, not imported: the real runner imports
        it while it loads, and a server on another runner (the tests' fakes) has no Ray to ask."""
        while True:
            await asyncio.sleep(WAITS_PERIOD_S)
            runtime = sys.modules.get("shards.cluster")
            if runtime is None:
                continue
            try:
                waiting = await asyncio.to_thread(runtime.pending_placement)
            except Exception:  # a GCS hiccup must not end the load; the next look may work
                log.debug("could not read the pending placement groups", exc_info=True)
                continue
            self._load_waits = waiting

    def stop_accepting(self, reason: str) -> None:
        """Refuse new requests (503 with ``reason``) from now on: DRAINING (a version that
        drains already keeps its first reason, a failed one its failure); those held are
        answered."""
        self._life.refuse(reason)

    async def stop_jobs(self, timeout_s: float) -> None:
        """End the load (if it still runs) and the stats poll, waiting at most ``timeout_s``."""
        for job in self._jobs:
            job.cancel()
        if self._jobs:
            await asyncio.wait(self._jobs, timeout=timeout_s)

    async def drain(self, budget: StopBudget) -> None:
        """Answer what the batcher holds until the budget's drain mark, then fail the rest
        (``serving.version.stop_budget``): first the requests it admitted before it began to
        refuse, some of which may not have queued their rows yet."""
        await self.admitted.wait_idle(budget.drain_left())
        if self.batcher is not None:
            await drain_batcher(self.batcher, budget)

    async def retire(
        self, reason: str, *, failure: str | None = None, keep_draining: bool = False
    ) -> None:
        """Refuse new requests (503 with ``reason``), answer each one it admitted within its own
        deadline (up to ``request_timeout_ms`` from now; ``stop_timeout_s`` bounds a SIGTERM
        only), end its jobs and actors: every retire (switch, promotion, unload) goes this way.
        It ends RETIRED, or FAILED with ``failure`` (a switch turned back: the index says why);
        with ``keep_draining`` it stays DRAINING until ``end_retire`` says how it ended."""
        self.stop_accepting(reason)
        budget = StopBudget.retire(self.settings.request_timeout_ms / 1000.0)
        await self.stop_jobs(budget.answer_left())
        await self.drain(budget)
        await self.close(budget.left())
        if not keep_draining:
            self.end_retire(failure)

    def end_retire(self, failure: str | None = None) -> None:
        """A retired version is RETIRED, or FAILED with ``failure`` (its reason in the index)."""
        if failure is not None:
            self._life.fail(failure)
        elif self._life.state is not VersionState.RETIRED:
            self._life.move(VersionState.RETIRED)

    async def close(self, timeout_s: float) -> None:
        """Release the runner (its actors) within ``timeout_s``, and the mark that kept its
        cached bundle from a prune."""
        if self.generator is not None:
            try:
                await asyncio.wait_for(self.generator.close(), timeout_s)
            except Exception:
                log.warning("closing the generator failed", exc_info=True)
        if self.runner is None:
            return
        try:
            await asyncio.wait_for(self.runner.close(), timeout_s)
        except Exception:  # a dead Ray must not keep the process from exiting
            log.warning("closing the model runner failed", exc_info=True)
        finally:
            release_bundle(self.runner)


def served_length(settings: Settings, signature: ModelSignature) -> int:
    """The longest length ``signature``'s model is served up to (``served_max_length``);
    ``ConfigError`` naming both numbers where ``--max-sequence-length`` is over the model's
    own bound (a bundle partitioned elsewhere reaches the server without the resolver's check
    only through a runner that skips it)."""
    requested, bound = settings.max_sequence_length, signature.max_length
    if requested is not None and bound is not None and requested > bound:
        raise ConfigError(
            f"max_sequence_length={requested} is over {bound}, the longest input model "
            f"{signature.name!r} takes; serve it with --max-sequence-length at most {bound}, "
            f"or leave the flag out to serve up to {bound}"
        )
    return served_max_length(requested, signature)


def batch_settings(settings: Settings, runner: ModelRunner) -> BatchSettings:
    """The batcher's start-up settings: the server's, fitted to the runner's stages."""
    stages = pipeline_depth(runner)
    replicas = runner.replicas
    return BatchSettings(
        max_batch_size=settings.max_batch_size,
        batch_timeout_ms=settings.batch_timeout_ms,
        max_inflight_batches=settings.inflight_batches(stages, replicas),
        max_queue_rows=settings.queue_rows(stages, replicas),
        allowed_batch_sizes=settings.padded_sizes(),
        slo_p99_ms=settings.slo_p99_ms,
        pipeline_depth=stages * replicas,
        pipeline_stages=stages,
        fill_while_busy=settings.fill_while_busy,
        # CPU stages take any batch size with one trace: padding would only add rows.
        pad_batches=settings.allowed_batch_sizes is not None or runner.on_gpu,
    )


def describe_error(exc: BaseException) -> str:
    """One line for clients: the root cause of a remote (Ray) error, never its traceback."""
    cause = getattr(exc, "cause", None)
    return one_line(cause if isinstance(cause, BaseException) else exc)


def _timed_out(timeout_s: float, waiting: str | None) -> str:
    message = f"the model did not load within load_timeout_s={timeout_s:g} s"
    if waiting:
        return f"{message} ({waiting}); free or add those resources, or raise load_timeout_s"
    return f"{message}; the server log says how far it got; raise load_timeout_s if it needs longer"
