"""KV transports: how a finished prefill's K/V reach the decode worker.

The prefill engine writes the prompt's K/V rows into a tensor the transport hands out (`alloc`),
`ship` turns that tensor into a small picklable reference that travels with the handoff through
the router, and the decode worker's `receive` turns the reference back into a tensor (read-only:
it is only copied into the decode engine's pool). `discard` frees what a dropped handoff holds.

- `InProcessTransport`: the tensor itself (workers in one process: tests, the local router).
- `SharedMemoryTransport`: a file in /dev/shm that the prefill engine writes straight into (no
  extra copy) and the decode worker maps and unlinks. One host only.
- `RayObjectStoreTransport`: `ray.put` of the rows; works across machines (Ray moves the object
  between nodes' stores). The prefill worker owns the object, so a dead prefill worker loses it
  and the router re-prefills the request.
"""

from __future__ import annotations

import os
import uuid
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

TRANSPORTS = ("auto", "shm", "ray")


class KVTransport(ABC):
    name: str

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where the prefill engine writes a handoff's K/V rows."""
        return torch.empty(shape, dtype=dtype)

    @abstractmethod
    def ship(self, kv: torch.Tensor) -> object:
        """A picklable reference to `kv` (an `alloc` tensor, fully written)."""

    @abstractmethod
    def receive(self, ref: object) -> torch.Tensor:
        """The K/V rows behind `ref`, on the decode side. Call at most once per reference."""

    def discard(self, ref: object) -> None:  # noqa: B027 - nothing to free by default
        """Free what `ref` holds when its handoff is dropped (aborted, or its worker died)."""


class InProcessTransport(KVTransport):
    name = "inproc"

    def ship(self, kv: torch.Tensor) -> torch.Tensor:
        return kv

    def receive(self, ref: torch.Tensor) -> torch.Tensor:
        return ref


@dataclass(frozen=True)
class ShmRef:
    path: str
    shape: tuple[int, ...]
    dtype: str


class SharedMemoryTransport(KVTransport):
    name = "shm"

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = directory
        self._paths: dict[int, str] = {}  # data_ptr of an alloc'd tensor -> its file

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        path = os.path.join(self.directory, f"tessera-kv-{uuid.uuid4().hex}")
        array = np.memmap(path, dtype=_numpy_dtype(dtype), mode="w+", shape=shape)
        tensor = torch.from_numpy(array)
        self._paths[tensor.data_ptr()] = path
        return tensor

    def ship(self, kv: torch.Tensor) -> ShmRef:
        path = self._paths.pop(kv.data_ptr())
        return ShmRef(path, tuple(kv.shape), str(kv.dtype).removeprefix("torch."))

    def receive(self, ref: ShmRef) -> torch.Tensor:
        array = np.memmap(ref.path, dtype=_numpy_dtype(getattr(torch, ref.dtype)), mode="r", shape=ref.shape)
        os.unlink(ref.path)  # the mapping stays valid; the file goes once it is unmapped
        with warnings.catch_warnings():  # read-only is what we want: it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array)

    def discard(self, ref: ShmRef) -> None:
        try:
            os.unlink(ref.path)
        except FileNotFoundError:
            pass


class RayObjectStoreTransport(KVTransport):
    name = "ray"

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.empty(shape, dtype=_numpy_dtype(dtype)))

    def ship(self, kv: torch.Tensor) -> list:
        import ray

        return [ray.put(kv.numpy())]  # in a list, so that Ray passes the reference, not the array

    def receive(self, ref: list) -> torch.Tensor:
        import ray

        array = ray.get(ref[0])  # zero-copy from the local object store: read-only
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array)

    def discard(self, ref: list) -> None:
        import ray

        ray.internal.free(ref)


def make_transport(name: str) -> KVTransport:
    if name == "inproc":
        return InProcessTransport()
    if name == "shm":
        return SharedMemoryTransport()
    if name == "ray":
        return RayObjectStoreTransport()
    raise ValueError(f"--kv-transport {name!r}: choose one of {', '.join(TRANSPORTS)}")


def _numpy_dtype(dtype: torch.dtype):
    if dtype == torch.bfloat16:
        raise ValueError("bfloat16 K/V cannot travel through numpy (shm / ray transports); run the workers with "
                         "--dtype float32 or float16, or --kv-transport inproc in one process")
    return torch.empty((), dtype=dtype).numpy().dtype
