"""Control messages between the two worker processes (same framing as client messages).

The graph generator (static domain) and the context generator (dynamic domain) talk
over one ZeroMQ PAIR socket. The graph generator opens with `Ready` (arena manifests,
event handles, capacities); the context generator answers `ReadyAck` once it has
mapped every arena (the owner may then drop the arenas' names). In steady state the
context generator sends `Step` and the graph generator answers `Launched` as soon as
the step is enqueued on the GPU; it sends `Stats` when they change. A request that
arrives while no step is in flight is announced with `Expect`, so that the graph
generator is awake when its `Step` comes. With a draft model (speculative_drafter
draft_model) the context generator asks for draft tokens with `Draft` and the graph
generator, which runs the draft model, answers `Drafted`; with an EAGLE-3 head
(speculative_drafter eagle3) the same, and each `Step` also names the rows of the
model's hidden states the head keeps (`HiddenRows`). These messages carry no `id`: the
channel is point-to-point and `step` numbers order the pipeline.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from hybridd.protocol.envelope import Count, Fields, Message
from hybridd.protocol.limits import MAX_TOKEN_ID, UNPACK_MAX_BIN_LEN
from hybridd.protocol.messages import SamplingParams

StepKind = Literal["prefill", "decode"]
Positive = Annotated[int, Meta(ge=1)]


class Ready(Message, tag="ready", kw_only=True):
    """Graph generator → context generator, once: what it allocated and what it can run.

    `arenas` maps an arena name to its `SharedArena.manifest()`; `events` maps an event
    name to its interprocess handle (b"" on the CPU).
    """

    arenas: dict[str, dict[str, Any]]
    events: dict[str, Annotated[bytes, Meta(max_length=UNPACK_MAX_BIN_LEN)]] = {}
    model: str
    vocab_size: Annotated[int, Meta(ge=1, le=MAX_TOKEN_ID)]
    eos_token_ids: list[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]]
    max_model_len: Positive
    num_kv_blocks: Positive
    block_size: Positive
    max_batch: Positive
    decode_buckets: Annotated[list[Positive], Meta(min_length=1)]
    prefill_buckets: list[Positive]
    max_prefill_seqs: Positive = 1
    # How the weights are quantized (`hybridd.quantization.Quantization.facts()` and
    # its `description`); empty where they are not.
    quantization: dict[str, str] = {}
    pid: Count = 0  # the graph generator's pid, so the peer can notice its death


class ReadyAck(Message, tag="ready_ack"):
    """Context generator → graph generator: every arena in `Ready` is mapped."""


class HiddenRows(Fields):
    """Rows of a step whose hidden states an EAGLE-3 head in the graph generator keeps:
    the rows from `row` on, one per token of `tokens`, are those of sequence `request_id`
    at positions `start`, `start + 1`, ...; a token of -1 is the sequence's own there,
    not yet on the context generator's host (its drafts bring it)."""

    request_id: str
    start: Count
    row: Count
    tokens: list[Annotated[int, Meta(ge=-1, le=MAX_TOKEN_ID)]]


class Fork(Fields):
    """Sequence `child` shares the tokens of `parent` so far (a fork of its prompt)."""

    parent: str
    child: str


class Step(Message, tag="step"):
    """Context generator → graph generator: run step `step` on the inputs now in the arena.

    `n_real` sequences and `n_tokens` tokens are real; the graph generator's runner picks
    the captured bucket and pads the rest. With an EAGLE-3 head, `hidden` names the rows
    of the step's hidden states the head keeps and `forks` the sequences forked after it.
    """

    step: Count
    kind: StepKind
    n_real: Count
    n_tokens: Count
    hidden: list[HiddenRows] = []
    forks: list[Fork] = []


class Expect(Message, tag="expect"):
    """Context generator → graph generator: a request arrived while no step was in flight,
    so a `Step` follows once it is admitted. The graph generator polls its socket until
    then, for at most its `step_wake_poll_s`, instead of sleeping: the `Step` finds its
    threads awake rather than paying for their wake-up on the way to the first token."""


class Launched(Message, tag="launched"):
    """Graph generator → context generator: step `step` is enqueued (its tokens are sampled
    after `logits_ready`)."""

    step: Count


class Stats(Message, tag="stats"):
    """Graph generator → context generator: its runner's counters, for `status` replies."""

    stats: dict[str, Any]


class Shutdown(Message, tag="shutdown"):
    """Context generator → graph generator: exit now."""


TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]


class DraftSequence(Fields):
    """One sequence of a `Draft`: its tokens from index `first` on (those the graph
    generator has not been sent: a sequence's tokens only grow), and how many draft
    tokens it wants (0: its tokens only); with its first tokens, its prompt's length,
    sampling parameters and seed (its drafts are sampled as the target samples)."""

    request_id: str
    first: Count
    tokens: list[TokenId]
    count: Count
    prompt_len: Count = 0
    params: SamplingParams | None = None
    seed: Count = 0


class Draft(Message, tag="draft"):
    """Context generator → graph generator: draft tokens for `sequences`; `released`
    sequences have finished (their draft state can go). Answered with `Drafted`, unless
    `sequences` is empty."""

    draft: Count
    sequences: list[DraftSequence] = []
    released: list[str] = []


class Drafted(Message, tag="drafted"):
    """Graph generator → context generator: each sequence's draft tokens, in the order
    of the `Draft`, and for a sampled request the first of its rows in the shared
    draft `probabilities` region (one per token; -1: none). `failed`: no drafts this
    time, and the graph generator forgot the request's sequences (send them whole)."""

    draft: Count
    tokens: list[list[TokenId]] = []
    rows: list[int] = []
    failed: bool = False


ControlMessage = Ready | ReadyAck | Expect | Step | Launched | Stats | Shutdown | Draft | Drafted
