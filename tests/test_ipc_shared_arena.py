"""Shared arenas between real processes on POSIX shared memory, including SIGKILLs.

The processes talk the way the workers do: a PAIR channel carrying `Ready` (with the
arena manifest) and `ReadyAck`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import zmq

from hybridd.ipc import posix_shm
from hybridd.ipc.arena_layout import ALIGNMENT, ArenaLayout
from hybridd.ipc.channel import Channel, bind_ipc_endpoint
from hybridd.ipc.shared_arena import SharedArena
from hybridd.protocol import codec
from hybridd.protocol.control import Ready, ReadyAck, Stats, Step
from hybridd.protocol.errors import ProtocolError

SPAWN = multiprocessing.get_context("spawn")
TIMEOUT_MS = 60_000


def _layout() -> ArenaLayout:
    return ArenaLayout(
        {
            "kv_cache": ((2, 2, 4, 4, 2, 8), "bfloat16"),  # [layers, 2, blocks, block_size, kv_heads, head_dim]
            "token_ids": ((8,), "int64"),
            "slot_mapping": ((8,), "int32"),
            "logits": ((4, 32), "float32"),
        }
    )


def _ready(arena: SharedArena) -> Ready:
    return Ready(
        arenas={"io": arena.manifest()},
        events={},
        model="test",
        vocab_size=32,
        eos_token_ids=[0],
        max_model_len=64,
        num_kv_blocks=4,
        block_size=4,
        max_batch=4,
        decode_buckets=[1, 2, 4],
        prefill_buckets=[8],
    )


def _recv(channel: Channel):
    message = channel.recv(TIMEOUT_MS)
    assert message is not None, "peer did not answer"
    return message


def _segment_exists(name: str) -> bool:
    return (posix_shm.SHM_DIR / name).exists()


# ---------------------------------------------------------------- child processes


def _importer_child(endpoint: str, ack: bool) -> None:
    """Maps the arena from `Ready`, reports what it sees, writes its own results."""
    with Channel(zmq.PAIR, decoder=codec.CONTROL) as channel:
        channel.connect(endpoint)
        ready = _recv(channel)
        arena = SharedArena.open(ready.arenas["io"])
        if ack:
            channel.send(ReadyAck())
        channel.send(Stats(stats={"token_ids": arena["token_ids"].tolist()}))
        arena["logits"].fill_(1.5)
        arena["kv_cache"][1, 0, 3] = 2.0
        channel.send(Stats(stats={"wrote": True}))
        while True:  # each Step: report the inputs as they are now
            step = _recv(channel)
            if not isinstance(step, Step):
                break
            channel.send(Stats(stats={"token_ids": arena["token_ids"].tolist()}))
        arena.close()


def _owner_child(endpoint: str, unlink_on_ack: bool, exit_after_ready: bool) -> None:
    """Creates the arena, announces it, and (optionally) drops its name on ReadyAck."""
    arena = SharedArena.create(_layout(), "cpu")
    arena["token_ids"].copy_(torch.arange(8) * 10)
    arena["kv_cache"].fill_(0.25)
    with Channel(zmq.PAIR, decoder=codec.CONTROL) as channel:
        channel.connect(endpoint)
        channel.send(_ready(arena))
        if exit_after_ready:
            channel.close(linger_ms=10_000)  # let Ready reach the parent
            return  # no arena.close(): the finalizer must clean up at exit
        message = _recv(channel)
        if unlink_on_ack and isinstance(message, ReadyAck):
            arena.unlink_name()
        channel.send(Stats(stats={"unlinked": unlink_on_ack}))
        time.sleep(120)  # until SIGKILLed


def _start(target, *args) -> multiprocessing.Process:
    process = SPAWN.Process(target=target, args=args, daemon=True)
    process.start()
    return process


def _kill(process: multiprocessing.Process) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    assert process.exitcode == -signal.SIGKILL


@pytest.fixture
def control(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("arena")) / "ctl.sock"
    with bind_ipc_endpoint(path, socket_type=zmq.PAIR, decoder=codec.CONTROL) as channel:
        yield channel, f"ipc://{path}"


# ---------------------------------------------------------------- tests


def test_child_importer_and_parent_owner_see_each_others_writes(control):
    channel, endpoint = control
    arena = SharedArena.create(_layout(), "cpu")
    name = arena.manifest()["name"]
    arena["token_ids"].copy_(torch.arange(8))
    child = _start(_importer_child, endpoint, True)
    try:
        channel.send(_ready(arena))
        assert isinstance(_recv(channel), ReadyAck)
        arena.unlink_name()
        assert not _segment_exists(name), "the name goes as soon as the importer has mapped it"

        assert _recv(channel).stats == {"token_ids": list(range(8))}
        assert _recv(channel).stats == {"wrote": True}
        assert torch.equal(arena["logits"], torch.full((4, 32), 1.5))
        assert arena["kv_cache"].dtype == torch.bfloat16
        assert arena["kv_cache"][1, 0, 3].eq(2.0).all() and arena["kv_cache"][0].eq(0).all()

        arena["token_ids"][0] = 99  # the importer sees writes made after it mapped
        channel.send(Step(step=0, kind="decode", n_real=1, n_tokens=1))
        assert _recv(channel).stats == {"token_ids": [99, *range(1, 8)]}
        channel.send(ReadyAck())  # anything but a Step ends the child
        child.join(30)
        assert child.exitcode == 0
    finally:
        arena.close()
        if child.is_alive():
            _kill(child)
    assert not _segment_exists(name)


def test_owner_exit_without_close_leaves_no_segment(control):
    channel, endpoint = control
    child = _start(_owner_child, endpoint, False, True)
    name = _recv(channel).arenas["io"]["name"]
    child.join(30)
    assert child.exitcode == 0
    assert not _segment_exists(name)


def test_owner_sigkilled_before_ack_is_reaped_and_views_stay_valid(control):
    channel, endpoint = control
    child = _start(_owner_child, endpoint, True, False)
    manifest = _recv(channel).arenas["io"]
    imported = SharedArena.open(manifest)
    _kill(child)
    assert _segment_exists(manifest["name"]), "SIGKILL before the ack leaves the segment"
    assert not posix_shm.pid_alive(child.pid)

    assert manifest["name"] in posix_shm.reap_stale_segments()
    assert not _segment_exists(manifest["name"])
    assert imported["token_ids"].tolist() == [i * 10 for i in range(8)]
    imported["logits"].fill_(3.0)  # the mapping outlives both the owner and the name
    assert imported["logits"].sum().item() == 3.0 * 4 * 32
    imported.close()


def test_owner_sigkilled_after_ack_leaves_nothing(control):
    channel, endpoint = control
    child = _start(_owner_child, endpoint, True, False)
    manifest = _recv(channel).arenas["io"]
    imported = SharedArena.open(manifest)
    channel.send(ReadyAck())
    assert _recv(channel).stats == {"unlinked": True}
    _kill(child)
    assert not _segment_exists(manifest["name"])
    assert imported["kv_cache"].float().mean().item() == 0.25
    imported.close()


def test_importer_sigkilled_leaves_nothing_after_owner_close(control):
    channel, endpoint = control
    arena = SharedArena.create(_layout(), "cpu")
    name = arena.manifest()["name"]
    child = _start(_importer_child, endpoint, False)
    channel.send(_ready(arena))
    assert _recv(channel).stats == {"token_ids": [0] * 8}  # mapped, never acked
    _kill(child)
    assert _segment_exists(name)
    arena["token_ids"].fill_(5)  # the owner is unaffected
    arena.close()
    arena.close()  # idempotent
    assert arena.closed and arena.tensors == {}
    assert not _segment_exists(name)


def test_reap_spares_live_owners_and_removes_dead_ones():
    with SharedArena.create(_layout(), "cpu") as live:
        dead = SPAWN.Process(target=time.sleep, args=(0,))
        dead.start()
        dead.join(30)
        orphan = f"{posix_shm.SEGMENT_PREFIX}{dead.pid}-abc123"
        posix_shm.create_segment(orphan, 4096).close()
        reaped = posix_shm.reap_stale_segments()
        assert orphan in reaped and live.manifest()["name"] not in reaped
        assert _segment_exists(live.manifest()["name"]) and not _segment_exists(orphan)


def test_views_survive_close_of_the_arena():
    arena = SharedArena.create(_layout(), "cpu")
    logits = arena["logits"]
    arena.close()
    logits.fill_(2.0)  # the mapping lives as long as a view does
    assert logits.sum().item() == 2.0 * 4 * 32


def test_layout_aligns_every_region():
    layout = _layout()
    assert [r.offset % ALIGNMENT for r in layout] == [0, 0, 0, 0]
    assert layout.regions["token_ids"].offset == 2 * 2 * 4 * 4 * 2 * 8 * 2
    assert layout.nbytes % ALIGNMENT == 0
    assert ArenaLayout.from_wire(layout.to_wire()) == layout


@pytest.mark.parametrize(
    "spec",
    [{}, {"x": ((4,), "complex64")}, {"x": ((0, 4), "float32")}, {"x": ((), "float32")}],
    ids=["empty", "dtype", "zero-dim", "scalar"],
)
def test_layout_rejects_bad_regions(spec):
    with pytest.raises(ValueError):
        ArenaLayout(spec)


def test_open_validates_the_manifest():
    with SharedArena.create(_layout(), "cpu") as arena:
        manifest = arena.manifest()
        moved = manifest | {"regions": manifest["regions"] | {"logits": manifest["regions"]["logits"] | {"offset": 8}}}
        with pytest.raises(ProtocolError) as info:
            SharedArena.open(moved)
        assert info.value.field == "manifest.regions.logits.offset"
        with pytest.raises(ProtocolError) as info:
            SharedArena.open(manifest | {"nbytes": manifest["nbytes"] + 256})
        assert info.value.field == "manifest.nbytes"
        with pytest.raises(ProtocolError) as info:
            SharedArena.open(manifest | {"kind": "rdma"})
        assert info.value.field == "manifest.kind"
        with pytest.raises(ProtocolError) as info:
            SharedArena.open(manifest | {"extra": 1})
        assert info.value.field == "manifest.extra"
        with pytest.raises(FileNotFoundError):
            SharedArena.open(manifest | {"name": "hybridd-1-000000"})
