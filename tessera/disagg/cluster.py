"""Starting the workers (Ray actors, or in-process for tests) and the router in front of them.

`tessera serve --prefill-workers P --decode-workers D` or `--data-parallel N` calls
`create_router`. Ray is started locally (`ray.init()`) unless `--ray-address` names a cluster
to join (`ray start --head` on one machine, `ray start --address=HEAD:6379` on the others), so
the same command spans machines. Each worker asks Ray for `worker_cpus` CPUs and runs torch with
as many threads; Ray restarts a worker that dies (up to `max_restarts` times), and the router
puts it back in service once it answers again.

KV transport: `auto` picks shared memory when Ray runs locally (every worker on this host) and
Ray's object store when joining a cluster; the router refuses `shm` if workers span hosts.
"""

from __future__ import annotations

import dataclasses
import logging

from tessera.config import EngineConfig
from tessera.disagg.handles import LocalWorkerHandle, RayWorkerHandle, WorkerHandle
from tessera.disagg.router import DisaggRouter
from tessera.disagg.transport import TRANSPORTS

logger = logging.getLogger("tessera.disagg")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    prefill_workers: int = 0
    decode_workers: int = 0
    data_parallel: int = 1
    ray_address: str | None = None
    kv_transport: str = "auto"
    worker_cpus: float = 1.0
    max_restarts: int = 4
    use_ray: bool = True

    def __post_init__(self) -> None:
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("--prefill-workers and --decode-workers must be >= 0")
        if bool(self.prefill_workers) != bool(self.decode_workers):
            raise ValueError("disaggregation needs both --prefill-workers >= 1 and --decode-workers >= 1")
        if self.data_parallel < 1:
            raise ValueError(f"--data-parallel must be >= 1, got {self.data_parallel}")
        if self.prefill_workers and self.data_parallel > 1:
            raise ValueError("--data-parallel replicates colocated workers; with --prefill-workers/--decode-workers "
                             "scale the pools instead (e.g. --decode-workers 4)")
        if self.kv_transport not in TRANSPORTS + ("inproc",):
            raise ValueError(f"--kv-transport {self.kv_transport!r}: choose one of {', '.join(TRANSPORTS)}")
        if self.worker_cpus <= 0:
            raise ValueError(f"--worker-cpus must be > 0, got {self.worker_cpus}")

    @property
    def enabled(self) -> bool:
        """Whether requests go through workers at all (else the single in-process engine)."""
        return bool(self.prefill_workers) or self.data_parallel > 1

    def transport(self) -> str:
        if not self.use_ray:
            return "inproc"
        if self.kv_transport != "auto":
            return self.kv_transport
        return "ray" if self.ray_address else "shm"


def create_router(config: EngineConfig, cluster: ClusterConfig, observer=None) -> DisaggRouter:
    """Start the workers (model loads run in parallel, one per worker) and return the router."""
    from tessera.model.download import resolve_model_path
    from tessera.model.tokenizer import Tokenizer
    from tessera.model.weights import load_model_files

    path = resolve_model_path(config.model)
    mc = load_model_files(path).config
    tokenizer = Tokenizer(path, mc)
    threads = config.num_threads or max(1, int(cluster.worker_cpus))
    worker_config = dataclasses.replace(config, model=str(path), num_threads=threads)
    transport = cluster.transport()
    roles = (["prefill"] * cluster.prefill_workers + ["decode"] * cluster.decode_workers
             if cluster.prefill_workers else ["replica"] * cluster.data_parallel)
    handles = _start_workers(roles, worker_config, cluster, transport, threads)
    by_role = {r: [h for h in handles if h.role == r] for r in ("prefill", "decode", "replica")}
    serving = len(by_role["decode"]) or len(by_role["replica"])
    max_model_len = config.resolve_max_model_len(mc)
    return DisaggRouter(prefill=by_role["prefill"], decode=by_role["decode"], replicas=by_role["replica"],
                        tokenizer=tokenizer, model_config=mc, max_model_len=max_model_len,
                        block_size=config.block_size, max_num_seqs=config.max_num_seqs * serving,
                        observer=observer, require_one_host=transport == "shm")


def _start_workers(roles: list[str], config: EngineConfig, cluster: ClusterConfig, transport: str,
                   threads: int) -> list[WorkerHandle]:
    if not cluster.use_ray:
        return [LocalWorkerHandle(role, config, transport) for role in roles]
    try:
        import ray
    except ImportError:
        raise ValueError("--prefill-workers/--decode-workers/--data-parallel run workers on Ray, which is not "
                         "installed: pip install 'tessera[disagg]'") from None
    from tessera.disagg.worker import EngineWorker

    if not ray.is_initialized():
        ray.init(address=cluster.ray_address, include_dashboard=False, ignore_reinit_error=True,
                 log_to_driver=True)
    actor_class = ray.remote(EngineWorker).options(
        num_cpus=cluster.worker_cpus, max_restarts=cluster.max_restarts, max_concurrency=8,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}},
    )
    handles = [RayWorkerHandle(role, actor_class.remote(config, transport)) for role in roles]
    ray.get([h.actor.ping.remote() for h in handles])  # every model loaded (or its error raised)
    logger.info("workers up: %s (KV transport %s)", ", ".join(h.name for h in handles), transport)
    return handles
