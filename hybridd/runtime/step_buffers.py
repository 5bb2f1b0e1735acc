"""The static step buffers: fixed-address input and output tensors that every graph reads
and writes, sized for the largest bucket.

The context generator writes a step (`write`): its real rows, and every row past them
as padding (slot -1, so padded rows write nothing to the KV cache), so a graph of any
bucket reads a padded step without a padding kernel of its own; graphs then see the new
contents at the same addresses. In the two-process runtime these tensors live in a
shared arena.

All integer inputs live in one packed int32 region (`step_inputs`), so a step's
inputs, padding included, reach the device in a single host-to-device copy from a
pinned mirror; per-buffer copies were seven small transfers on the critical path of
every step, and padding on the device seven more kernels before every graph.

With a drafter that reads the model's hidden states (EAGLE-3), `aux_hidden` [max_tokens,
3 x hidden] holds every row's residual stream in the drafter's layers, written by the
step's forward (inside its graph) and copied, the rows each `Step` names, by the head
beside it in the graph generator before the next step's forward.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridd.model.kv_cache import blocks_for
from hybridd.model.step_inputs import HostStepInputs, StepInputs


def geometry(max_prefill_tokens: int, max_batch: int, max_model_len: int, block_size: int) -> tuple[int, int]:
    """(max_tokens, max_blocks_per_seq) of the step buffers, as both processes derive them.

    A step carries at most `max_prefill_tokens` tokens (decode rows and prompt chunks
    together; a longer prompt, or the recompute of a preempted sequence, is prefilled in
    chunks over several steps), or one token for each of up to `max_batch` streams; only
    the block tables span a whole `max_model_len`."""
    return max(max_prefill_tokens, max_batch), blocks_for(max_model_len, block_size)


def input_fields(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of each int32 input inside the packed `step_inputs` region, in order."""
    return {
        "input_ids": (max_tokens,),
        "positions": (max_tokens,),
        "slot_mapping": (max_tokens,),
        "seq_lens": (max_seqs,),
        "query_start_loc": (max_seqs + 1,),
        "logits_indices": (max_seqs,),
        "block_tables": (max_seqs, max_blocks_per_seq),
    }


def buffer_layout(
    max_tokens: int, max_seqs: int, max_blocks_per_seq: int, vocab_size: int,
    aux_hidden: tuple[int, torch.dtype] | None = None,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every static buffer region; the one definition of their
    geometry. `aux_hidden`: the width and dtype of the hidden states a drafter reads."""
    fields = input_fields(max_tokens, max_seqs, max_blocks_per_seq)
    packed = sum(_numel(shape) for shape in fields.values())
    layout = {
        "step_inputs": ((packed,), torch.int32),
        "logits": ((max_seqs, vocab_size), torch.float32),
    }
    if aux_hidden is not None:
        layout["aux_hidden"] = ((max_tokens, aux_hidden[0]), aux_hidden[1])
    return layout


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _split(packed: torch.Tensor, fields: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    views, offset = {}, 0
    for name, shape in fields.items():
        n = _numel(shape)
        views[name] = packed[offset : offset + n].view(shape)
        offset += n
    return views


class StepBuffers:
    def __init__(self, tensors: dict[str, torch.Tensor], max_tokens: int, max_blocks_per_seq: int):
        """`tensors`: the regions of `buffer_layout` (`step_inputs`, `logits`)."""
        self.tensors = tensors
        self.packed = tensors["step_inputs"]
        self.logits = tensors["logits"]
        self.aux_hidden: torch.Tensor | None = tensors.get("aux_hidden")
        self.max_tokens = max_tokens
        self.max_seqs = self.logits.shape[0]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.fields = input_fields(max_tokens, self.max_seqs, max_blocks_per_seq)
        for name, view in _split(self.packed, self.fields).items():
            setattr(self, name, view)
        # Two pinned host mirrors, alternated, each with the event of its last copy and
        # the (tokens, seqs) rows its last step filled; made on the first write, since the
        # graph generator never writes.
        self._mirrors: list[torch.Tensor] = []
        self._mirror_views: list[dict[str, np.ndarray]] = []
        self._mirror_done: list[torch.cuda.Event | None] = [None, None]
        self._mirror_rows: list[tuple[int, int]] = []
        self._next_mirror = 0

    @classmethod
    def allocate(
        cls, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device | str,
        aux_hidden: tuple[int, torch.dtype] | None = None,
    ) -> StepBuffers:
        layout = buffer_layout(max_tokens, max_seqs, max_blocks_per_seq, vocab_size, aux_hidden)
        tensors = {n: torch.zeros(shape, dtype=dt, device=device) for n, (shape, dt) in layout.items()}
        return cls(tensors, max_tokens, max_blocks_per_seq)

    def view(self, is_prefill: bool, num_tokens: int, num_seqs: int) -> StepInputs:
        """The bucket-shaped window of the buffers that a graph of this shape reads."""
        return StepInputs(
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            logits_indices=self.logits_indices[:num_seqs],
            is_prefill=is_prefill,
        )

    def write(self, step: HostStepInputs | StepInputs) -> None:
        """A host-side step's real rows (numpy arrays, or tensors on the CPU), and padding
        in every row past them, in one host-to-device copy of the packed inputs (on the
        current stream)."""
        rows = step.logits_indices.shape[0]
        if step.num_tokens > self.max_tokens or max(step.num_seqs, rows) > self.max_seqs:
            raise ValueError(
                f"step of {step.num_tokens} tokens / {step.num_seqs} seqs / {rows} logits rows exceeds the step "
                f"buffers ({self.max_tokens} tokens / {self.max_seqs} seqs and rows)"
            )
        width = step.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block tables are {width} wide; the buffer holds {self.max_blocks_per_seq}")
        if not self._mirrors:
            pin = self.packed.device.type == "cuda"
            self._mirrors = [torch.zeros(self.packed.shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
            # Filled through numpy views: a slice assignment there costs a fraction of a
            # torch operation's dispatch, and a step's inputs are a dozen small ones.
            self._mirror_views = [{n: v.numpy() for n, v in _split(m, self.fields).items()} for m in self._mirrors]
            for host in self._mirror_views:
                _pad(host, 0, self.max_tokens, 0, self.max_seqs)
            self._mirror_rows = [(0, 0), (0, 0)]
        index = self._next_mirror
        self._next_mirror ^= 1
        if self._mirror_done[index] is not None:
            self._mirror_done[index].synchronize()  # its previous copy has been read
        host = self._mirror_views[index]
        # Rows that this mirror's previous step filled and this one does not go back to padding.
        filled_tokens, filled_seqs = self._mirror_rows[index]
        _pad(host, step.num_tokens, filled_tokens, step.num_seqs, filled_seqs)
        self._mirror_rows[index] = (step.num_tokens, max(step.num_seqs, rows))
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "logits_indices"):
            values = np.asarray(getattr(step, name))
            host[name][: values.shape[0]] = values
        # Padded sequences start (and end) where the real tokens end.
        host["query_start_loc"][step.num_seqs + 1 :] = step.num_tokens
        table = host["block_tables"][: step.num_seqs]
        table[:, width:] = 0
        table[:, :width] = np.asarray(step.block_tables)
        self.packed.copy_(self._mirrors[index], non_blocking=True)
        if self.packed.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self._mirror_done[index] = done


def _pad(host: dict[str, np.ndarray], tokens_from: int, tokens_to: int, seqs_from: int, seqs_to: int) -> None:
    """Rows [tokens_from, tokens_to) and sequences [seqs_from, seqs_to) of a host mirror as
    padding: slot -1 (no KV write) at position 0; padded sequences have length 1 over
    block 0 (a harmless read), padded logits rows read token 0. Their `query_start_loc`
    is set by `write`, from its step."""
    if tokens_to > tokens_from:
        host["input_ids"][tokens_from:tokens_to] = 0
        host["positions"][tokens_from:tokens_to] = 0
        host["slot_mapping"][tokens_from:tokens_to] = -1
    if seqs_to > seqs_from:
        host["seq_lens"][seqs_from:seqs_to] = 1
        host["logits_indices"][seqs_from:seqs_to] = 0
        host["block_tables"][seqs_from:seqs_to] = 0
