"""CUDA arenas and interprocess events between real processes (GPU machine only)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
cupy = pytest.importorskip("cupy")

import zmq  # noqa: E402

from hybridd.ipc.arena_layout import ArenaLayout  # noqa: E402
from hybridd.ipc.channel import Channel, bind_ipc_endpoint  # noqa: E402
from hybridd.ipc.events import InterprocessEvent  # noqa: E402
from hybridd.ipc.shared_arena import SharedArena  # noqa: E402
from hybridd.protocol import codec
from hybridd.protocol.control import Ready, ReadyAck, Stats, Step  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")
TIMEOUT_MS = 120_000


def _layout() -> ArenaLayout:
    return ArenaLayout({"kv_cache": ((2, 2, 8, 16, 2, 64), "bfloat16"), "token_ids": ((32,), "int64")})


def _recv(channel: Channel):
    message = channel.recv(TIMEOUT_MS)
    assert message is not None, "peer did not answer"
    return message


def _importer(endpoint: str) -> None:
    """Maps the owner's arena, waits on its event on the GPU, reads and writes."""
    with Channel(zmq.PAIR, decoder=codec.CONTROL) as channel:
        channel.connect(endpoint)
        ready = _recv(channel)
        manifest = ready.arenas["io"]
        torch.cuda.set_device(manifest["device"])
        arena = SharedArena.open(manifest)
        inputs_ready = InterprocessEvent.from_handle(ready.events["inputs_ready"], torch.device("cuda", manifest["device"]))
        channel.send(ReadyAck())
        step = _recv(channel)  # sent only after the owner enqueued its record
        assert isinstance(step, Step)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            inputs_ready.wait(stream)  # GPU-side ordering, no host sync on the owner's work
            total = arena["token_ids"].sum()
            arena["kv_cache"][1].fill_(3.0)
        stream.synchronize()
        channel.send(Stats(stats={"total": int(total.item())}))
        arena.close()
        channel.close(linger_ms=10_000)


def test_cuda_arena_and_event_across_processes(tmp_path):
    device = torch.device("cuda", 0)
    arena = SharedArena.create(_layout(), device)
    manifest = arena.manifest()
    assert manifest["kind"] == "cuda" and len(manifest["handle"]) == 64
    assert arena["kv_cache"].is_cuda and arena["kv_cache"].dtype == torch.bfloat16
    assert arena["kv_cache"].data_ptr() % 256 == 0
    event = InterprocessEvent.create(device)
    assert event.is_cuda and len(event.ipc_handle()) == 64

    path = tmp_path / "ctl.sock"
    channel = bind_ipc_endpoint(path, socket_type=zmq.PAIR, decoder=codec.CONTROL)
    child = SPAWN.Process(target=_importer, args=(f"ipc://{path}",))
    child.start()
    try:
        channel.send(
            Ready(
                arenas={"io": manifest},
                events={"inputs_ready": event.ipc_handle()},
                model="test",
                vocab_size=32,
                eos_token_ids=[0],
                max_model_len=128,
                num_kv_blocks=8,
                block_size=16,
                max_batch=4,
                decode_buckets=[1, 2, 4],
                prefill_buckets=[],
            )
        )
        assert isinstance(_recv(channel), ReadyAck)
        torch.cuda._sleep(200_000_000)  # keep the GPU busy so that the peer really has to wait
        arena["token_ids"].copy_(torch.arange(32, device=device))
        event.record()
        channel.send(Step(step=0, kind="decode", n_real=1, n_tokens=1))
        assert _recv(channel).stats == {"total": sum(range(32))}
        child.join(60)
        assert child.exitcode == 0
        torch.cuda.synchronize()
        assert arena["kv_cache"][1].float().eq(3.0).all() and arena["kv_cache"][0].eq(0).all()
    finally:
        if child.is_alive():
            child.kill()
        channel.close()
        arena.close()


def test_cuda_arena_views_are_zero_initialised_and_typed():
    arena = SharedArena.create(_layout(), "cuda")
    assert all(t.eq(0).all() for t in arena.tensors.values())
    assert arena["token_ids"].dtype == torch.int64 and arena["token_ids"].device.type == "cuda"
    arena.unlink_name()  # no-op on CUDA
    arena.close()
