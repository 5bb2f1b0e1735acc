"""The context generator's side of a drafter that runs in the graph generator
(`draft_runner`): a `Drafter` whose `propose` is one `control.Draft` message and its
`control.Drafted` answer.

It sends each sequence's tokens once: a sequence's tokens only grow, so a message
carries those past what was sent before (with a new sequence's sampling parameters and
seed), and the finished sequences since the last message (many of them waiting are
told at once in a `Draft` that asks for nothing, which gets no answer: a sequence
finishes while a step is being launched, when no other answer may be awaited). Tokens
are sent at most
`MAX_TOKENS_PER_MESSAGE` to a message (long prompts take several, the last one asking
for the drafts), within the control channel's message size. The draft distributions of
sampled requests are read from the shared `probabilities` region, where the graph
generator wrote them before answering. An answer that says the draft failed leaves
every sequence of the message undrafted this time and sent whole the next.

A drafter that reads the model's hidden states (an EAGLE-3 head) keeps at most
`hidden_states_kept` of them per sequence; the step pipeline names each step's rows of
them to the graph generator (`hidden_states.step_rows`) and tells this side which
sequences the graph generator now keeps states for (`observed`), so that each is let go
there when it finishes, drafted for or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import torch

from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.drafter import NO_DRAFT, Draft
from hybridd.protocol import control

# Token ids (at most 5 bytes each in msgpack) per message: well within the control
# channel's MAX_MESSAGE_BYTES and its decoder's array length.
MAX_TOKENS_PER_MESSAGE = 1 << 17
# Finished sequences are told with the next draft; this many waiting are told at once.
MAX_RELEASED = 256


class GraphDrafter:
    def __init__(self, exchange: Callable[[control.Draft], control.Drafted], notify: Callable[[control.Draft], None],
                 probabilities: torch.Tensor | None, name: str = "draft_model", hidden_states_kept: int = 0) -> None:
        """`exchange` sends a `Draft` and returns its `Drafted`; `notify` sends one that
        asks for nothing (no answer comes); `probabilities` is the shared region [rows, V]
        of the draft distributions (None: the drafter has none); `hidden_states_kept`: see
        the module docstring (0: the drafter reads no hidden states)."""
        self.exchange = exchange
        self.notify = notify
        self.probabilities = probabilities
        self.name = name
        self.hidden_states_kept = hidden_states_kept
        self._sent: dict[str, int] = {}  # tokens of each sequence the graph generator has
        self._released: list[str] = []
        self._messages = 0

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[Draft]:
        drafts: list[Draft] = [NO_DRAFT] * len(seqs)
        asked = [i for i, count in enumerate(max_tokens) if count > 0]
        if not asked:
            return drafts
        entries = []
        for i in asked:
            seq = seqs[i]
            tokens = seq.token_ids
            first = self._sent.get(seq.request_id, 0)
            entry = control.DraftSequence(request_id=seq.request_id, first=first, tokens=tokens[first:],
                                          count=max_tokens[i], prompt_len=len(seq.prompt_token_ids))
            if first == 0:
                entry.params, entry.seed = seq.params, seq.seed
            entries.append(entry)
            self._sent[seq.request_id] = len(tokens)
        reply = self._send(self._uploaded(entries), entries)
        if reply is None:
            return drafts
        for i, tokens, row in zip(asked, reply.tokens, reply.rows, strict=True):
            probabilities = None if row < 0 or self.probabilities is None else \
                self.probabilities[row:row + len(tokens)].clone()
            drafts[i] = Draft(list(tokens), probabilities)
        return drafts

    def _uploaded(self, entries: list[control.DraftSequence]) -> list[control.DraftSequence]:
        """Cut the tokens of `entries` to what the last message takes; the entries (asking
        for no drafts) that carry the rest first, in order, each message within the limit."""
        total = sum(len(e.tokens) for e in entries)
        if total <= MAX_TOKENS_PER_MESSAGE:
            return []
        uploads = []
        for entry in entries:
            while total > MAX_TOKENS_PER_MESSAGE and len(entry.tokens) > 1:
                n = min(len(entry.tokens) - 1, total - MAX_TOKENS_PER_MESSAGE, MAX_TOKENS_PER_MESSAGE)
                uploads.append(control.DraftSequence(request_id=entry.request_id, first=entry.first,
                                                     tokens=entry.tokens[:n], count=0, prompt_len=entry.prompt_len,
                                                     params=entry.params, seed=entry.seed))
                entry.first, entry.tokens, entry.params, entry.seed = entry.first + n, entry.tokens[n:], None, 0
                total -= n
        return uploads

    def _send(self, uploads: list[control.DraftSequence],
              asking: list[control.DraftSequence]) -> control.Drafted | None:
        """Send `uploads` (tokens only) in messages within the limit, then `asking`; the
        last message's answer, or None when one failed."""
        messages: list[list[control.DraftSequence]] = []
        size = MAX_TOKENS_PER_MESSAGE
        for entry in uploads:
            if size + len(entry.tokens) > MAX_TOKENS_PER_MESSAGE:
                messages.append([])
                size = 0
            messages[-1].append(entry)
            size += len(entry.tokens)
        messages.append(asking)
        reply = None
        for sequences in messages:
            self._messages += 1
            reply = self.exchange(control.Draft(draft=self._messages, sequences=sequences, released=self._released))
            self._released = []
            if reply.failed:
                for entry in asking:
                    self._sent.pop(entry.request_id, None)
                return None
        return reply

    def observed(self, request_ids: Iterable[str]) -> None:
        """The graph generator now keeps hidden states of these sequences."""
        for request_id in request_ids:
            self._sent.setdefault(request_id, 0)

    def release(self, request_id: str) -> None:
        if self._sent.pop(request_id, None) is None:
            return
        self._released.append(request_id)
        if len(self._released) >= MAX_RELEASED:
            self._messages += 1
            self.notify(control.Draft(draft=self._messages, released=self._released))
            self._released = []
