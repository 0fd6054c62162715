"""Handles the router holds on workers: the same async calls on a Ray actor or an in-process
EngineWorker. A call on a worker that is gone raises `WorkerDiedError`, whatever the backend."""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod

from tessera.config import EngineConfig
from tessera.disagg.worker import EngineWorker, WorkerEvent, WorkerInfo, WorkerLoad
from tessera.engine.handoff import SequenceHandoff
from tessera.sampling import SamplingParams

_names = itertools.count()


class WorkerDiedError(RuntimeError):
    """The worker process (or actor) is gone; its requests must be served elsewhere."""


class WorkerHandle(ABC):
    def __init__(self, role: str) -> None:
        self.role = role  # "prefill", "decode" or "replica"
        self.name = f"{role}-{next(_names)}"

    @abstractmethod
    async def _run(self, method: str, *args):
        """Call the worker's `method`; raise WorkerDiedError if the worker is gone."""

    async def info(self) -> WorkerInfo:
        return await self._run("info")

    async def ping(self) -> bool:
        return await self._run("ping")

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, handoff: bool) -> None:
        await self._run("add", request_id, prompt_ids, params, handoff)

    async def import_handoff(self, handoff: SequenceHandoff, kv_ref: object) -> float:
        return await self._run("import_handoff", handoff, kv_ref)

    async def discard(self, kv_ref: object) -> None:
        await self._run("discard", kv_ref)

    async def abort(self, request_ids: list[str]) -> None:
        await self._run("abort", request_ids)

    async def poll(self, timeout_s: float) -> tuple[list[WorkerEvent], WorkerLoad]:
        return await self._run("poll", timeout_s)

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass


class LocalWorkerHandle(WorkerHandle):
    """An EngineWorker in this process; `kill()` and `restart()` stand in for a crash and for
    Ray's restart of the actor (tests of the router's failover without Ray)."""

    def __init__(self, role: str, config: EngineConfig, transport: str = "inproc") -> None:
        super().__init__(role)
        self.config, self.transport = config, transport
        self.worker: EngineWorker | None = EngineWorker(config, transport)

    def kill(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.shutdown()

    def restart(self) -> None:
        self.kill()
        self.worker = EngineWorker(self.config, self.transport)

    async def _run(self, method: str, *args):
        worker = self.worker
        if worker is None:
            raise WorkerDiedError(f"worker {self.name} is gone")
        try:
            result = await asyncio.to_thread(getattr(worker, method), *args)
        except Exception:
            if self.worker is not worker:
                raise WorkerDiedError(f"worker {self.name} is gone") from None
            raise
        if self.worker is not worker:  # killed while the call ran: its answer never arrives
            raise WorkerDiedError(f"worker {self.name} is gone")
        return result

    def shutdown(self) -> None:
        self.kill()


class RayWorkerHandle(WorkerHandle):
    def __init__(self, role: str, actor) -> None:
        super().__init__(role)
        self.actor = actor

    async def _run(self, method: str, *args):
        import ray

        try:
            return await getattr(self.actor, method).remote(*args)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise WorkerDiedError(f"worker {self.name} is gone: {exc}") from exc

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
