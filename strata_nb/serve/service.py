"""What one server process serves: a loaded engine, its conversation runner, the engine thread and the counters."""
from __future__ import annotations

from strata_nb.runtime.sampler import SamplerConfig
from strata_nb.serve.conversations import Runner
from strata_nb.serve.metrics import Metrics
from strata_nb.serve.scheduler import Scheduler


class Service:
    """engine: a loaded api.Engine (warmed up here, before the first request). sampler: the defaults a request's
    own fields override. park_budget_bytes: host RAM for kept conversation states."""

    def __init__(self, engine, *, sampler: SamplerConfig | None = None, park_budget_bytes: int = 2 * 10**9,
                 max_queue: int = 16, model_id: str | None = None):
        self.engine = engine
        self.model = engine.model
        self.model_id = model_id or engine.path.stem
        self.n_ctx = engine.n_ctx
        self.recurrent = engine.spec.recurrent
        self.sampler = sampler or SamplerConfig()
        self.sampler.validate()
        engine.warm_up()
        self.metrics = Metrics()
        self.runner = Runner(engine, park_budget_bytes)
        self.scheduler = Scheduler(self.runner, self.metrics, max_queue)

    def metrics_text(self) -> str:
        return self.metrics.render(self.scheduler.queued, self.scheduler.running, self.runner)

    def close(self) -> None:
        self.scheduler.close()
        self.engine.close()
