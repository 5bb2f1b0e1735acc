"""Control messages between the two worker processes (same framing as client messages).

The graph generator (static domain) and the context generator (dynamic domain) talk
over one ZeroMQ PAIR socket. The graph generator opens with `Ready` (arena manifests,
event handles, capacities); the context generator answers `ReadyAck` once it has
mapped every arena (the owner may then drop the arenas' names). In steady state the
context generator sends `Step` and the graph generator answers `Launched` as soon as
the step is enqueued on the GPU. These messages carry no `id`: the channel is
point-to-point and `step` numbers order the pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from hybridd.protocol.envelope import envelope as _envelope
from hybridd.protocol.envelope import check_version, message_type
from hybridd.protocol.envelope import open_envelope as _open
from hybridd.protocol.limits import MAX_TOKEN_ID, UNPACK_MAX_BIN_LEN

StepKind = Literal["prefill", "decode"]
STEP_KINDS: frozenset[str] = frozenset({"prefill", "decode"})


@dataclass(slots=True, kw_only=True)
class Ready:
    """Graph generator → context generator, once: what it allocated and what it can run.

    `arenas` maps an arena name to its `SharedArena.manifest()`; `events` maps an event
    name to its interprocess handle (b"" on the CPU).
    """

    TYPE: ClassVar[str] = "ready"

    arenas: dict[str, dict[str, Any]]
    events: dict[str, bytes] = field(default_factory=dict)
    model: str
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_batch: int
    decode_buckets: list[int]
    prefill_buckets: list[int]
    max_prefill_seqs: int = 1
    pid: int = 0  # the graph generator's pid, so the peer can notice its death

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {
            "pid": self.pid,
            "max_prefill_seqs": self.max_prefill_seqs,
            "arenas": self.arenas,
            "events": self.events,
            "model": self.model,
            "vocab_size": self.vocab_size,
            "eos_token_ids": self.eos_token_ids,
            "max_model_len": self.max_model_len,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "max_batch": self.max_batch,
            "decode_buckets": self.decode_buckets,
            "prefill_buckets": self.prefill_buckets,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Ready:
        r = _open(data)
        arenas_reader = r.nested("arenas")
        arenas = {name: dict(arenas_reader.mapping(name)) for name in arenas_reader.keys()}
        events_reader = r.nested_optional("events")
        events = (
            {}
            if events_reader is None
            else {name: events_reader.binary(name, max_len=UNPACK_MAX_BIN_LEN) for name in events_reader.keys()}
        )
        message = cls(
            arenas=arenas,
            events=events,
            model=r.string("model"),
            vocab_size=r.integer("vocab_size", lo=1, hi=MAX_TOKEN_ID),
            eos_token_ids=r.integer_list("eos_token_ids", lo=0, hi=MAX_TOKEN_ID),
            max_model_len=r.integer("max_model_len", lo=1),
            num_kv_blocks=r.integer("num_kv_blocks", lo=1),
            block_size=r.integer("block_size", lo=1),
            max_batch=r.integer("max_batch", lo=1),
            decode_buckets=r.integer_list("decode_buckets", min_items=1, lo=1),
            prefill_buckets=r.integer_list("prefill_buckets", lo=1),
            max_prefill_seqs=r.integer("max_prefill_seqs", lo=1),
            pid=r.integer("pid", lo=0),
        )
        r.finish()
        return message


@dataclass(slots=True, kw_only=True)
class ReadyAck:
    """Context generator → graph generator: every arena in `Ready` is mapped."""

    TYPE: ClassVar[str] = "ready_ack"

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ReadyAck:
        _open(data).finish()
        return cls()


@dataclass(slots=True, kw_only=True)
class Step:
    """Context generator → graph generator: run step `step` on the inputs now in the arena.

    `bucket` is the captured shape to use (batch size for decode, token count for
    prefill); `n_real` sequences and `n_tokens` tokens of it are real, the rest padding.
    """

    TYPE: ClassVar[str] = "step"

    step: int
    kind: StepKind
    bucket: int
    n_real: int
    n_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {
            "step": self.step,
            "kind": self.kind,
            "bucket": self.bucket,
            "n_real": self.n_real,
            "n_tokens": self.n_tokens,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Step:
        r = _open(data)
        message = cls(
            step=r.integer("step", lo=0),
            kind=r.string("kind", choices=STEP_KINDS),
            bucket=r.integer("bucket", lo=1),
            n_real=r.integer("n_real", lo=0),
            n_tokens=r.integer("n_tokens", lo=0),
        )
        r.finish()
        return message


@dataclass(slots=True, kw_only=True)
class Launched:
    """Graph generator → context generator: step `step` is enqueued (`graph`: replayed, else eager)."""

    TYPE: ClassVar[str] = "launched"

    step: int
    graph: bool

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {"step": self.step, "graph": self.graph}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Launched:
        r = _open(data)
        message = cls(step=r.integer("step", lo=0), graph=r.boolean("graph"))
        r.finish()
        return message


@dataclass(slots=True, kw_only=True)
class StatsRequest:
    TYPE: ClassVar[str] = "stats_request"

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StatsRequest:
        _open(data).finish()
        return cls()


@dataclass(slots=True, kw_only=True)
class Stats:
    TYPE: ClassVar[str] = "stats"

    stats: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {"stats": self.stats}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Stats:
        r = _open(data)
        message = cls(stats=dict(r.mapping("stats")))
        r.finish()
        return message


@dataclass(slots=True, kw_only=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Shutdown:
        _open(data).finish()
        return cls()


ControlMessage = Ready | ReadyAck | Step | Launched | StatsRequest | Stats | Shutdown
CONTROL_TYPES: dict[str, type[ControlMessage]] = {
    cls.TYPE: cls for cls in (Ready, ReadyAck, Step, Launched, StatsRequest, Stats, Shutdown)
}


def control_from_wire(data: Mapping[str, Any]) -> ControlMessage:
    check_version(data)
    return CONTROL_TYPES[message_type(data, CONTROL_TYPES)].from_wire(data)
