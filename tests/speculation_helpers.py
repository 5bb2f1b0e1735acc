"""Helpers of the speculative decoding tests: the engine core over a model in this
process with a chosen KV cache size (so that preemption can be forced), a drafter
that replays a known continuation with a set share of wrong tokens (so that a test
sees drafts accepted, cut short and rejected, whatever the model), the graph
generator's draft runner served in this process (`ServedDraftModel`), and structured
output's cases for speculating daemons."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable

import torch

from hybridd.engine.block_manager import BlockManager
from hybridd.engine.core import EngineCore
from hybridd.engine.in_process_runner import InProcessRunner
from hybridd.engine.scheduler import Scheduler
from hybridd.engine.speculation.draft_runner import DraftRunner, draft_model_runner
from hybridd.engine.speculation.eagle3 import MAX_PENDING_STATES
from hybridd.engine.speculation.eagle3_runner import eagle3_runner
from hybridd.engine.speculation.drafter import Draft, HiddenStateDrafter
from hybridd.engine.speculation.graph_drafter import GraphDrafter
from hybridd.engine.speculation.speculator import Speculator
from hybridd.model.kv_cache import KVCache, blocks_for
from hybridd.protocol import codec, control
from hybridd.protocol.messages import SamplingParams
from hybridd.runtime.buckets import BucketPlan
from hybridd.runtime.step_buffers import StepBuffers


def run_engine(model, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               speculator: Speculator | None = None, num_blocks: int = 256, block_size: int = 8, max_batch: int = 8,
               grammar=None):
    """Every prompt to its end through the engine core (with `params`, or `params[i]` for
    prompt i; under `grammar`, their structured output compiled, when given); returns
    (outputs per prompt, scheduler)."""
    kv = KVCache.allocate(model.config, num_blocks + 1, block_size, model.dtype, model.device)
    blocks = BlockManager(num_blocks, block_size, watermark=0.0)
    k = speculator.max_tokens if speculator is not None else 0
    scheduler = Scheduler(blocks, max_batch=max_batch, max_prefill_tokens=512, max_model_len=model.max_positions,
                          eos_token_ids=model.config.eos_token_ids, speculator=speculator,
                          max_verify_rows=max_batch * (k + 1))
    drafter = speculator.drafter if speculator is not None else None
    hidden_drafter = drafter if isinstance(drafter, HiddenStateDrafter) else None
    core = EngineCore(scheduler, InProcessRunner(model, kv, hidden_drafter=hidden_drafter), pipeline_depth=1)
    each = params if isinstance(params, list) else [params] * len(prompts)
    requests = [core.add(str(i), prompt, p, grammar=grammar)
                for i, (prompt, p) in enumerate(zip(prompts, each, strict=True))]
    while core.has_work:
        core.step()
    return [[list(seq.output_token_ids) for seq in request.seqs] for request in requests], scheduler


def sampled_tokens_by_position(model, prompt: list[int], speculator: Speculator | None, first_seed: int,
                               requests: int, n: int, tokens: int, structured=None, grammar=None) -> list[Counter]:
    """The tokens drawn at each output position by `requests` seeded requests (seeds from
    `first_seed`) of `n` sequences each, `tokens` tokens long, sampled at temperature 1
    (under `structured`, compiled as `grammar`, when given)."""
    params = [SamplingParams(max_tokens=tokens, temperature=1.0, top_p=0.98, seed=seed, n=n, ignore_eos=True,
                             structured=structured)
              for seed in range(first_seed, first_seed + requests)]
    outputs, _ = run_engine(model, [prompt] * requests, params, speculator, num_blocks=512, block_size=16,
                            max_batch=64, grammar=grammar)
    by_position = [Counter() for _ in range(tokens)]
    for request in outputs:
        for output in request:
            for position, token in enumerate(output):
                by_position[position][token] += 1
    return by_position


def repetitive_prompts(lengths: tuple[int, ...], seed: int = 1, vocab: int = 320) -> list[list[int]]:
    """Prompts that quote themselves (a passage, part of it, the passage again), as a
    prompt-grounded task does, so that prompt lookup finds drafts."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for length in lengths:
        passage = torch.randint(3, vocab, (length,), generator=g).tolist()
        prompts.append(passage + passage[: length // 2] + passage)
    return prompts


def keep_drafts(groups: list[list], drafts: list[list[Draft]], kept: int) -> None:
    """Each sequence of `groups` as after a verify step that kept the first `kept` tokens
    of its draft (`drafts[g][i]` for sequence i of group g) and then drew a token of its
    own (one the drafts rarely guess)."""
    for group, group_drafts in zip(groups, drafts, strict=True):
        for seq, draft in zip(group, group_drafts, strict=True):
            seq.output_token_ids += draft.tokens[:kept] + [(seq.token_ids[-1] + 7) % 4000 + 3]


def no_eager_step_once_captured(graph_runner, rounds: Callable[[], None], what: str) -> None:
    """`graph_runner`'s background capture run until every bucket but the decode ones is
    captured or disabled (within 300 s), then `rounds`: none of its steps runs eagerly, and
    no bucket was disabled (`what` names the steps in the failure)."""
    stats = graph_runner.stats
    graph_runner.start_background_capture()
    try:
        deadline = time.monotonic() + 300
        while not all(s.captured or s.disabled for (kind, _), s in stats.items() if kind != "decode"):
            assert time.monotonic() < deadline, [s.to_dict() for s in stats.values()]
            time.sleep(0.1)
        eager_runs = {key: s.eager_runs for key, s in stats.items()}
        rounds()
        assert {key: s.eager_runs for key, s in stats.items()} == eager_runs, f"a {what} step ran eagerly"
        assert all(s.disabled is None for s in stats.values()), [s.to_dict() for s in stats.values()]
    finally:
        graph_runner.stop_background_capture()


class ReplayDrafter:
    """Proposes the continuation a sequence is known to take (`continuations[i][j]` for
    sequence j of the prompt `prompts[i]`), with every `wrong_every`-th proposed token
    made wrong."""

    name = "replay"

    def __init__(self, prompts: list[list[int]], continuations: list[list[list[int]]], wrong_every: int = 3) -> None:
        self.known = {(tuple(p), j): c for p, cs in zip(prompts, continuations, strict=True) for j, c in enumerate(cs)}
        self.wrong_every = wrong_every
        self.proposed = 0

    def propose(self, seqs, max_tokens) -> list[Draft]:
        drafts = []
        for seq, count in zip(seqs, max_tokens, strict=True):
            known = self.known.get((tuple(seq.prompt_token_ids), seq.index), [])
            done = seq.num_output_tokens
            tokens = list(known[done:done + count])
            for j in range(len(tokens)):
                self.proposed += 1
                if self.proposed % self.wrong_every == 0:
                    tokens[j] = (tokens[j] + 1) % 300 + 3
            drafts.append(Draft(tokens))
        return drafts

    def release(self, request_id: str) -> None:
        pass


def build_tiny_draft(target, path, layers: int = 1, seed: int = 7, noise: float = 0.02):
    """A draft for the tiny transformers model `target` (built by `build_tiny_model`), made
    with transformers' own classes the same way: the target's vocabulary, embeddings,
    final norm and LM head and its first `layers` layers, every weight nudged by
    `noise` so that the draft agrees with the target often but not always."""
    import copy

    torch.manual_seed(seed)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    draft = type(target)(config).to(torch.float32)
    state = {name: value for name, value in target.state_dict().items()
             if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    draft.load_state_dict(state, strict=False)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn_like(p) * noise)
    draft.save_pretrained(path)
    return draft


# Structured output under speculation, through a daemon: each case's constraint, a prompt
# whose text the constrained output repeats (so prompt lookup finds drafts), and a check
# that the output is valid.
MOOD_SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["merry", "sad"]},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 99}},
               "required": ["mood", "age"], "additionalProperties": False}
LINE_REGEX = r"(KING|LAFEU):\n[A-Za-z ,]{1,40}[.!?]"
STRUCTURED_CASES = {
    "json_schema": ({"json": json.dumps(MOOD_SCHEMA)},
                    'JULIET:\n{"mood": "merry", "age": 14}\n\nROMEO:\n{"mood": "sad", "age": 16}\n\nJULIET:\n'),
    "regex": ({"regex": LINE_REGEX}, "KING:\nFind him, and bring him hither.\n\nLAFEU:\nI saw the man.\n\n"
                                     "KING:\nFind him, and bring him hither.\n\n"),
}


def valid_structured_output(case: str, text: str) -> bool:
    if case == "regex":
        return re.fullmatch(LINE_REGEX, text) is not None
    document = json.loads(text)
    return (set(document) == {"mood", "age"} and document["mood"] in ("merry", "sad")
            and type(document["age"]) is int and 0 <= document["age"] <= 99)


def structured_without_speculation(model, tokenizer, case: str, max_tokens: int = 48) -> list[int]:
    """The greedy output of `case` by the in-process engine without speculation."""
    from hybridd.engine.generate import generate
    from hybridd.engine.grammar import GrammarCompiler
    from hybridd.protocol.messages import StructuredOutput

    structured = StructuredOutput(**STRUCTURED_CASES[case][0])
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size, [tokenizer.eos_token_id])
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured)
        (seq,) = generate(model, [tokenizer.encode(STRUCTURED_CASES[case][1])], params, tokenizer=tokenizer,
                          grammar=compiler.compile(structured))[0]
    finally:
        compiler.close()
    return list(seq.output_token_ids)


def structured_through_daemon(client, tokenizer, case: str, max_tokens: int = 48) -> tuple[list[int], str, str]:
    """(tokens, text, finish reason) of `case`, greedy, from the daemon that `client` speaks to."""
    structured, prompt = STRUCTURED_CASES[case]
    final, _ = client.generate(prompt_token_ids=tokenizer.encode(prompt), stream=False,
                               sampling={"max_tokens": max_tokens, "temperature": 0.0, "structured": structured})
    assert final["type"] == "final", final
    choice = final["choices"][0]
    return choice["token_ids"], choice["text"], choice["finish_reason"]


def served_bucket_plan(max_batch: int) -> BucketPlan:
    """The buckets of a drafter served in this process: decode buckets up to `max_batch`
    sequences, a few prefill and mixed ones."""
    decode = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_batch] + [max_batch]
    return BucketPlan.create(decode, [16, 32, 64], max_prefill_seqs=2, mixed_tokens=64)


class ServedOverControlSocket:
    """A drafter's runner (`runner`) served in this process to the context generator's
    drafter over it: every message encoded and decoded as on the control socket
    (`messages`: the `Draft`s received)."""

    runner: DraftRunner

    def __init__(self) -> None:
        self.messages: list[control.Draft] = []

    def _notify(self, message: control.Draft) -> None:
        received = codec.CONTROL.decode(codec.encode(message))
        self.messages.append(received)
        assert self.runner.draft(received) is None  # no answer

    def _exchange(self, message: control.Draft) -> control.Drafted:
        received = codec.CONTROL.decode(codec.encode(message))
        self.messages.append(received)
        return codec.CONTROL.decode(codec.encode(self.runner.draft(received)))


class ServedDraftModel(ServedOverControlSocket):
    """The draft model as the graph generator serves it (`DraftRunner`: a graph runner of
    its own, eager on the CPU, over its KV arena and step buffers of `max_tokens` tokens)
    and the context generator's drafter over it (`drafter`), in this process."""

    def __init__(self, model, num_blocks: int, block_size: int, max_tokens: int = 64, max_batch: int = 8) -> None:
        """Decode buckets up to `max_batch` sequences; draft distributions for up to 16 draft
        tokens each (the in-process engine's verify steps are not held to max_batch rows)."""
        super().__init__()
        plan = served_bucket_plan(max_batch)
        vocab = model.config.vocab_size
        buffers = StepBuffers.allocate(max(max_tokens, plan.max_prefill_tokens), plan.max_rows,
                                       blocks_for(model.max_positions, block_size), vocab, model.device)
        kv = KVCache.allocate(model.config, num_blocks, block_size, model.dtype, model.device)
        probabilities = torch.zeros(16 * plan.max_batch, vocab, device=model.device)
        self.runner = draft_model_runner(model, kv, buffers, plan, probabilities, use_graphs=True,
                                         memory_budget_bytes=1 << 30, stream=None)
        self.runner.runner.capture_decode_graphs()
        self.drafter = GraphDrafter(self._exchange, self._notify, probabilities)


class ServedEagle3(ServedOverControlSocket):
    """An EAGLE-3 head as the graph generator serves it (`eagle3_runner`: a graph runner
    of its own over its KV arena and step buffers of `max_tokens` tokens, graphs captured
    on CUDA, eager on the CPU) and the context generator's drafter over it (`drafter`),
    in this process. `observe` names rows of a step's hidden states as a `Step` does."""

    def __init__(self, head, num_blocks: int, block_size: int, max_tokens: int = 64, max_batch: int = 8,
                 use_graphs: bool = True) -> None:
        super().__init__()
        plan = served_bucket_plan(max_batch)
        self.runner = eagle3_runner(head, head.allocate_kv(num_blocks, block_size), plan,
                                    max(max_tokens, plan.max_prefill_tokens), use_graphs=use_graphs,
                                    memory_budget_bytes=1 << 30, stream=None)
        self.runner.runner.capture_decode_graphs()
        self.drafter = GraphDrafter(self._exchange, self._notify, None, "eagle3",
                                    hidden_states_kept=MAX_PENDING_STATES)

    def observe(self, rows: list[control.HiddenRows], hidden: torch.Tensor,
                forks: list[control.Fork] | None = None) -> None:
        """A step whose hidden states are `hidden` [rows, 3 x hidden] names `rows` (and `forks`)."""
        step = control.Step(step=0, kind="prefill", n_real=1, n_tokens=len(hidden), hidden=rows, forks=forks or [])
        self.drafter.observed([r.request_id for r in rows] + [f.child for f in forks or []])
        self.runner.observe(codec.CONTROL.decode(codec.encode(step)), hidden)
