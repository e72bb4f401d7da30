"""Several engines behind one endpoint with Ray Serve (`strata-nb serve --ray --replicas N`): each replica is a
process with its own engine, queue and conversation cache, serving the same routes; Ray's proxy spreads the
requests. A conversation resumes from its kept state only when it lands on the replica that kept it."""
from __future__ import annotations

import os
import signal
import time

from ray import serve

from strata_nb.runtime.sampler import SamplerConfig
from strata_nb.serve.app import create_app
from strata_nb.serve.service import Service


class _Replica:
    """This process's Service (a class, so the app built in the replica finds the one its deployment set)."""

    service: Service | None = None


def _build_app():
    return create_app(lambda: _Replica.service)


@serve.deployment
@serve.ingress(_build_app)
class StrataReplica:
    def __init__(self, model: str, engine: dict, sampler: SamplerConfig, park_budget_bytes: int, max_queue: int,
                 model_name: str | None):
        from strata_nb.api import load

        _Replica.service = Service(load(model, **engine), sampler=sampler, park_budget_bytes=park_budget_bytes,
                                   max_queue=max_queue, model_id=model_name)

    def __del__(self):
        if _Replica.service is not None:
            _Replica.service.close()
            _Replica.service = None


def run_replicas(model: str, *, replicas: int, host: str, port: int, engine: dict, sampler: SamplerConfig,
                 park_budget_bytes: int, max_queue: int, model_name: str | None) -> None:
    """Start (or join, with RAY_ADDRESS) a Ray cluster and serve until interrupted. Without --threads each replica
    gets an equal share of this machine's cores."""
    import ray

    from strata_nb.api import Model
    from strata_nb.errors import StrataError

    if replicas < 1:
        raise StrataError(f"--replicas must be >= 1, got {replicas}")
    Model(model)  # the file checked here: a bad one is one line, not a replica's traceback
    cores = os.cpu_count() or 1
    if engine.get("threads") is None:
        engine = {**engine, "threads": max(1, cores // replicas)}
    def _stop(signum, frame):
        raise KeyboardInterrupt

    ray.init(include_dashboard=False, configure_logging=False)
    signal.signal(signal.SIGTERM, _stop)  # after ray.init, whose own handler aborts: shut down as Ctrl-C does
    try:
        serve.start(http_options={"host": host, "port": port})
        app = StrataReplica.options(num_replicas=replicas, ray_actor_options={"num_cpus": 0}).bind(
            os.path.abspath(model), engine, sampler, park_budget_bytes, max_queue, model_name)
        serve.run(app, blocking=False)
        print(f"serving {replicas} replicas at http://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
