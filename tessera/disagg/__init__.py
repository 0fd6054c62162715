"""Prefill/decode disaggregation and data-parallel replicas, with workers as Ray actors.

- worker.py: EngineWorker, one LLMEngine behind a thread-safe API (the Ray actor's class).
- transport.py: how a prefill's K/V reach a decode worker (shared memory, Ray object store).
- routing.py: prefix- and load-aware choice of worker.
- router.py: DisaggRouter, the server's engine: dispatch, streaming, handoffs, failover.
- handles.py: the router's async calls on a Ray actor or an in-process worker.
- cluster.py / args.py / serve.py: starting it all from `tessera serve` flags.
- sim.py: a cluster simulator driven by measured step and transfer costs (benchmarks/disagg.py).

The engine side of a handoff (export after the first token, import into another pool) lives in
tessera.engine.handoff and LLMEngine.
"""
