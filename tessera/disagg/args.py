"""`tessera serve` flags of the worker cluster (prefill/decode disaggregation, replicas, Ray)."""

from __future__ import annotations

import argparse

from tessera.disagg.cluster import ClusterConfig
from tessera.disagg.transport import TRANSPORTS


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers (Ray): prefill/decode disaggregation and data-parallel replicas")
    g.add_argument("--prefill-workers", type=int, default=0,
                   help="workers that compute prompts and hand their KV cache to a decode worker (with --decode-workers)")
    g.add_argument("--decode-workers", type=int, default=0, help="workers that stream the tokens after the first")
    g.add_argument("--data-parallel", type=int, default=1,
                   help="colocated replicas behind one router, chosen by prefix cache and load")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. HEAD:6379, after `ray start --head`); default: start Ray locally")
    g.add_argument("--kv-transport", choices=list(TRANSPORTS), default="auto",
                   help="how KV blocks move: shm (shared memory, one host), ray (object store, any host); "
                        "auto: shm for a local Ray, ray with --ray-address")
    g.add_argument("--worker-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per worker (torch threads: the same, rounded down, at least 1)")


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                         data_parallel=args.data_parallel, ray_address=args.ray_address,
                         kv_transport=args.kv_transport, worker_cpus=args.worker_cpus)
