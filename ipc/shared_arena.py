"""Shared arenas: one allocation, exported by the graph generator, mapped by the context generator.

An arena is one contiguous allocation viewed as named tensors (`ArenaLayout`). The
owner (`SharedArena.create`) allocates it and describes it in `manifest()`; the
importer (`SharedArena.open(manifest)`) maps the same bytes and derives identical
views. No tensor data ever travels through a socket.

- CPU: a POSIX shared memory segment (`ipc.posix_shm`); views by `torch.frombuffer`.
- CUDA: one raw `cupy.cuda.Memory` allocation (stable base pointer, outside torch's
  caching allocator) shared by a CUDA IPC memory handle; views by DLPack. cupy is
  imported only on this path.

Lifetime: `close()` (idempotent, and run by `weakref.finalize` on every exit path)
drops the arena's references and, for the owner, removes the segment's name. Memory
is unmapped when the last view dies, so a view kept elsewhere never dangles.
On the CPU the owner should call `unlink_name()` as soon as the importer confirms it
has mapped the arena (`ReadyAck`): from then on nothing can leak, even on SIGKILL.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from msgspec import Meta

from hybridd.log import get_logger
from hybridd.ipc import posix_shm
from hybridd.ipc.arena_layout import ArenaLayout, Region
from hybridd.protocol.codec import convert
from hybridd.protocol.envelope import Fields
from hybridd.protocol.errors import ErrorCode, ProtocolError

log = get_logger("hybridd.ipc.shared_arena")

KIND_SHM = "shm"
KIND_CUDA = "cuda"
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class _Manifest(Fields):
    """The wire form of `SharedArena.manifest()`, as the importer checks it."""

    kind: Literal["shm", "cuda"]
    nbytes: Annotated[int, Meta(ge=1)]
    device: Annotated[int, Meta(ge=-1)]
    owner_pid: Annotated[int, Meta(ge=1)]
    regions: dict[str, Any]  # checked by ArenaLayout.from_wire
    name: Annotated[str, Meta(min_length=1, max_length=255)] | None = None  # shm
    handle: Annotated[bytes, Meta(max_length=CUDA_IPC_HANDLE_BYTES)] | None = None  # cuda


class _ShmBacking:
    """A mapped POSIX shm segment; the owner also owns its name."""

    def __init__(self, name: str, buffer: mmap.mmap, *, owner: bool) -> None:
        self.name = name
        self.buffer: mmap.mmap | None = buffer
        self.owner = owner
        self.named = owner

    def view(self, region: Region) -> torch.Tensor:
        assert self.buffer is not None
        flat = torch.frombuffer(self.buffer, dtype=region.torch_dtype, count=region.numel, offset=region.offset)
        return flat.view(region.shape)

    def unlink_name(self) -> None:
        if self.named:
            posix_shm.unlink_segment(self.name)
            self.named = False

    def release(self) -> None:
        self.unlink_name()
        # No mmap.close(): live views export its buffer; it unmaps with the last of them.
        self.buffer = None


class _CudaIpcMapping:
    """An opened CUDA IPC handle; closed when the last view of it dies."""

    def __init__(self, ptr: int, device_index: int) -> None:
        self.ptr = ptr
        weakref.finalize(self, _close_ipc_handle, ptr, device_index)


def _close_ipc_handle(ptr: int, device_index: int) -> None:
    import cupy

    try:
        with cupy.cuda.Device(device_index):
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    except Exception as error:  # at interpreter exit the CUDA context may already be gone
        log.debug("closing CUDA IPC handle failed", error=str(error))


class _CudaBacking:
    def __init__(self, memory: Any, handle: bytes, device_index: int) -> None:
        self.memory = memory  # cupy.cuda.Memory (owner) or UnownedMemory (importer)
        self.handle = handle
        self.device_index = device_index

    @classmethod
    def allocate(cls, nbytes: int, device_index: int) -> _CudaBacking:
        import cupy

        with cupy.cuda.Device(device_index):
            memory = cupy.cuda.Memory(nbytes)
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
        return cls(memory, handle, device_index)

    @classmethod
    def import_handle(cls, handle: bytes, nbytes: int, device_index: int) -> _CudaBacking:
        import cupy

        with cupy.cuda.Device(device_index):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            memory = cupy.cuda.UnownedMemory(ptr, nbytes, _CudaIpcMapping(ptr, device_index), device_index)
        return cls(memory, handle, device_index)

    def view(self, region: Region) -> torch.Tensor:
        import cupy

        with cupy.cuda.Device(self.device_index):
            raw = cupy.ndarray(
                (region.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(self.memory, region.offset)
            )
            # Bytes first, dtype in torch: cupy has no bfloat16.
            return torch.from_dlpack(raw).view(region.torch_dtype).view(region.shape)

    def unlink_name(self) -> None:
        pass  # an IPC handle has no name to remove

    def release(self) -> None:
        self.memory = None


class SharedArena:
    """Named tensors over one shared allocation; see the module docstring."""

    def __init__(
        self, layout: ArenaLayout, device: torch.device, backing: _ShmBacking | _CudaBacking, *, owner: bool
    ) -> None:
        self.layout = layout
        self.device = device
        self.is_owner = owner
        self._backing = backing
        # Registered before the views exist, so that a failure below still unlinks.
        self._closer = weakref.finalize(self, backing.release)
        self.tensors: dict[str, torch.Tensor] = {region.name: backing.view(region) for region in layout}

    @classmethod
    def create(cls, layout: ArenaLayout, device: torch.device | str) -> SharedArena:
        """Allocate a new arena (the owner side), zero-filled."""
        device = torch.device(device)
        if device.type == "cpu":
            name = posix_shm.new_segment_name()
            backing: _ShmBacking | _CudaBacking = _ShmBacking(
                name, posix_shm.create_segment(name, layout.nbytes), owner=True
            )
        elif device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            backing = _CudaBacking.allocate(layout.nbytes, index)
        else:
            raise ValueError(f"shared arenas live on cpu or cuda, not {device}")
        arena = cls(layout, device, backing, owner=True)
        if device.type == "cuda":
            for tensor in arena.tensors.values():
                tensor.zero_()  # cudaMalloc does not clear; the shm segment starts zeroed
        log.debug("created shared arena", device=str(device), nbytes=layout.nbytes, regions=len(layout.regions))
        return arena

    @classmethod
    def open(cls, manifest: Mapping[str, Any]) -> SharedArena:
        """Map an arena from the owner's manifest (the importer side)."""
        checked = convert(manifest, _Manifest, "manifest")
        nbytes, device_index = checked.nbytes, checked.device
        layout = ArenaLayout.from_wire(checked.regions, "manifest.regions")
        if layout.nbytes != nbytes:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"manifest.nbytes: {nbytes} differs from the regions' total {layout.nbytes}",
                field="manifest.nbytes",
            )
        if checked.kind == KIND_SHM:
            name = checked.name
            if name is None or checked.handle is not None:
                raise ProtocolError(
                    ErrorCode.INVALID_REQUEST, "manifest.name: a shm arena has a name and no handle", field="manifest.name"
                )
            backing: _ShmBacking | _CudaBacking = _ShmBacking(name, posix_shm.open_segment(name, nbytes), owner=False)
            device = torch.device("cpu")
        else:
            handle = checked.handle
            if handle is None or checked.name is not None or len(handle) != CUDA_IPC_HANDLE_BYTES or device_index < 0:
                raise ProtocolError(
                    ErrorCode.INVALID_REQUEST,
                    f"manifest: a cuda arena needs a {CUDA_IPC_HANDLE_BYTES}-byte handle and a device index >= 0",
                    field="manifest.handle",
                )
            backing = _CudaBacking.import_handle(handle, nbytes, device_index)
            device = torch.device("cuda", device_index)
        return cls(layout, device, backing, owner=False)

    def manifest(self) -> dict[str, Any]:
        """Everything the importer needs, msgpack-ready."""
        manifest: dict[str, Any] = {
            "kind": KIND_SHM if self.device.type == "cpu" else KIND_CUDA,
            "nbytes": self.layout.nbytes,
            "device": -1 if self.device.index is None else self.device.index,
            "owner_pid": os.getpid(),
            "regions": self.layout.to_wire(),
        }
        if isinstance(self._backing, _ShmBacking):
            manifest["name"] = self._backing.name
        else:
            manifest["handle"] = self._backing.handle
        return manifest

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def unlink_name(self) -> None:
        """Owner: remove the segment's name once the importer has mapped it (CPU; no-op on CUDA)."""
        if self.is_owner:
            self._backing.unlink_name()

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def close(self) -> None:
        """Drop this arena's views and (owner) the segment's name; idempotent."""
        self.tensors = {}
        self._closer()

    def __enter__(self) -> SharedArena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "importer"
        return f"SharedArena({role}, {self.device}, {self.layout!r}{', closed' if self.closed else ''})"
