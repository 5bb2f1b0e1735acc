"""The bench's speculative decoding parts.

`speculation` (the daemon, at the client through the SDK): a prompt-grounded task (a
passage, then its beginning again, to continue) greedy, with and without speculation
in the same daemon (`speculative=False` per request, the requests interleaved), at 1
and 4 concurrent streams: tokens/s at the client, and the daemon's mean acceptance
length (tokens a verified sequence gains per step) from its status counters. With the
embedded model the passages are Shakespeare from its validation text; with random
weights, random token ids repeated the same way.

`speculation_steps` (in this process, random weights of the preset's shape, the graph
runner's decode graphs): (a) a verify step's time for k = 1..8 draft tokens at batch
1, 4, 16 against the one-row decode step of that batch; (b) time per output token at
batch 1 with `ReplayDrafter`, a bench-only drafter that replays the model's recorded
greedy continuation with each token right with a set probability (0, 50, 80, 100 %),
against decoding without speculation; (c) the EAGLE-3 head's own draft work per verify
step (`measure_head_drafts`): a random head of the target's shape (`make_eagle3_head`)
loaded by the product's loader and served by `eagle3_runner` as the graph generator
serves it, at batch 1, 4, 16 and k = 1..8; and beside each replay figure the time per
token with that head's cost added (`s_per_token_with_head`, derived).

    python -m hybridd.bench --out /tmp/spec --device cpu --model hybridd/assets/tiny-shakespeare \
        --parts checkpoint,speculation                                # the embedded model
    python -m hybridd.bench --out $OUT/spec --preset llama2-7b --parts checkpoint,speculation,speculation_steps
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from hybridd.bench.timing import ratio
from hybridd.engine.in_process_runner import LandedSteps

# Per-token acceptance of the replay drafter; at k = 4, 0.75 gives a mean acceptance length of 3.05
# (EAGLE-3's reported figure for Llama-3.1-8B on MT-bench is about 3).
ACCEPTANCES = (0.0, 0.5, 0.75, 0.8, 1.0)
VERIFY_KS = tuple(range(1, 9))
VERIFY_BATCHES = (1, 4, 16)


# ----------------------------------------------------------------------------- the daemon


def grounded_prompts(model: Path, vocab: int, count: int, seed: int = 3) -> list[str | list[int]]:
    """Prompts that hold the text to continue: a passage, then its beginning again."""
    validation = model / "validation.txt"
    if validation.exists():
        text = validation.read_text()
        starts = random.Random(seed).sample(range(0, len(text) - 1200, 97), count)
        return [text[s:s + 700] + "\n\n" + text[s:s + 150] for s in starts]
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        passage = [rng.randrange(3, vocab) for _ in range(200)]
        prompts.append(passage + passage[:40])
    return prompts


def measure_speculation(endpoint: str, model: Path, vocab: int, tokens: int, reps: int,
                        concurrency: tuple[int, ...] = (1, 4)) -> dict:
    """Tokens/s at the client with and without speculation, interleaved, per concurrency."""
    from hybridd.client import Client

    prompts = grounded_prompts(model, vocab, reps * max(concurrency))
    clients = [Client(endpoint, timeout=600.0) for _ in range(max(concurrency))]
    out: dict[str, Any] = {"tokens_per_request": tokens, "prompts": len(prompts)}
    try:
        for client in clients:  # warm-ups, both ways
            for speculative in (True, False):
                client.generate(prompts[0], max_tokens=8, temperature=0.0, ignore_eos=True, speculative=speculative)
        for streams in concurrency:
            rates: dict[bool, list[float]] = {True: [], False: []}
            accepted = []
            for rep in range(reps):
                for speculative in ((True, False) if rep % 2 == 0 else (False, True)):
                    batch = prompts[rep * streams:(rep + 1) * streams]
                    before = clients[0].status().get("speculation", {})
                    seconds = _run_streams(clients[:streams], batch, tokens, speculative)
                    after = clients[0].status().get("speculation", {})
                    rates[speculative].append(streams * tokens / seconds)
                    if speculative:
                        drafts = after.get("drafts", 0) - before.get("drafts", 0)
                        gained = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
                        accepted.append((drafts, gained))
            drafts = sum(d for d, _ in accepted)
            on, off = statistics.median(rates[True]), statistics.median(rates[False])
            out[f"streams_{streams}"] = {
                "tokens_per_s_speculative": on, "tokens_per_s_plain": off, "speedup": ratio(on, off),
                "mean_acceptance_length": 1 + sum(g for _, g in accepted) / drafts if drafts else None,
                "verified_drafts": drafts, "samples_tokens_per_s": {"speculative": rates[True], "plain": rates[False]},
            }
        out["status"] = clients[0].status().get("speculation", {})
    finally:
        for client in clients:
            client.close()
    return out


def _run_streams(clients, prompts, tokens: int, speculative: bool) -> float:
    """Seconds for len(clients) concurrent greedy generations of `tokens` tokens (a thread each)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(client, prompt) -> None:
        client.generate(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True, speculative=speculative)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(clients)) as pool:
        for future in [pool.submit(one, *pair) for pair in zip(clients, prompts, strict=True)]:
            future.result()
    return time.perf_counter() - start


# Fractions of the copied continuation replaced by random tokens (`chain_prompt`). With k = 4
# and the policy's per-sequence draft length, 0.2 gives about 3 tokens a verify step.
CORRUPTIONS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)


def chain_prompt(rng: random.Random, perm: list[int], corruption: float, tokens: int, prefix: int = 32) -> list[int]:
    """A batch-1 prompt for a predictable target (token t followed by perm[t]) that prompt
    lookup drafts at a set acceptance: a random prefix, the target's own continuation from
    a start token x0 (x0, perm[x0], ...; `tokens` + 8 long, no repeat, no id below 3), a
    fraction `corruption` of its positions replaced by other random tokens, then x0 again.
    The target continues with perm[x0], ..., which the drafter finds wherever the copy is intact."""
    vocab = len(perm)
    while True:
        chain = [rng.randrange(3, vocab)]
        while len(chain) < tokens + 9 and perm[chain[-1]] >= 3 and perm[chain[-1]] not in chain:
            chain.append(perm[chain[-1]])
        if len(chain) == tokens + 9:
            break
    copy = chain[:-1]
    for i in rng.sample(range(len(copy)), round(corruption * len(copy))):
        copy[i] = 3 + (copy[i] - 3 + rng.randrange(1, vocab - 3)) % (vocab - 3)  # another id, >= 3
    return [rng.randrange(3, vocab) for _ in range(prefix)] + copy + chain[:1]


# ----------------------------------------------------------------------------- in this process


class ReplayDrafter:
    """Bench only: proposes a sequence's recorded continuation, each token right with
    probability `acceptance` (a wrong one otherwise), from a fixed random stream."""

    name = "replay"

    def __init__(self, recorded: dict[tuple[int, ...], list[int]], acceptance: float, vocab: int,
                 seed: int = 0) -> None:
        self.recorded = recorded
        self.acceptance = acceptance
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, seqs, max_tokens):
        from hybridd.engine.speculation.drafter import Draft

        drafts = []
        for seq, count in zip(seqs, max_tokens, strict=True):
            known = self.recorded.get(tuple(seq.prompt_token_ids), [])
            done = seq.num_output_tokens
            tokens = []
            for token in known[done:done + count]:
                right = self.rng.random() < self.acceptance
                tokens.append(token if right else (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
            drafts.append(Draft(tokens))
        return drafts

    def release(self, request_id: str) -> None:
        pass


class GraphStepRunner(LandedSteps):
    """Bench only: the engine core's runner over the graph runner in this process (its
    decode graphs replayed for decode and verify steps), sampling as the in-process runner does."""

    def __init__(self, runner, buffers, sampler, vocab: int) -> None:
        super().__init__(sampler, buffers.logits.device)
        self.runner, self.buffers = runner, buffers

    def launch(self, batch):
        import torch

        self.buffers.write(batch.inputs)
        self.runner.run(batch.is_prefill, batch.num_tokens, batch.num_rows)
        if self.buffers.logits.is_cuda:
            # The step ran on the runner's serving stream: the logits are read, and the next
            # step's inputs written, on this one (unordered, a step read inputs half written).
            torch.cuda.synchronize()
        return self.sample(batch, self.buffers.logits[:batch.num_rows])


def build_runtime(model_dir: Path, device: str, max_rows: int, max_model_len: int, block_size: int = 16):
    """The model, its KV cache, step buffers and a graph runner whose decode buckets go
    up to `max_rows` rows (every verify step of the measured shapes has a graph)."""
    import torch

    from hybridd.model import KVCache, load_model
    from hybridd.runtime.buckets import BucketPlan
    from hybridd.runtime.graph_runner import GraphRunner
    from hybridd.runtime.step_buffers import StepBuffers, geometry

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(model_dir, dtype=dtype, device=device)
    decode = sorted({1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 20, 24, 28, 32, 36} | set(range(48, max_rows + 1, 16))
                    | {max_rows})
    plan = BucketPlan.create([b for b in decode if b <= max_rows], [16, 64, 256, 512], max_prefill_seqs=8)
    num_blocks = 16 * (max_model_len // block_size + 1)
    kv = KVCache.allocate(model.config, num_blocks + 1, block_size, dtype, device)
    max_tokens, per_seq = geometry(plan.max_prefill_tokens, plan.max_batch, max_model_len, block_size)
    buffers = StepBuffers.allocate(max_tokens, plan.max_rows, per_seq, model.config.vocab_size, device)
    runner = GraphRunner(model, kv, buffers, plan, use_graphs=device == "cuda")
    runner.capture_decode_graphs()
    return model, kv, buffers, runner, num_blocks


def time_steps(runner, buffers, rows_per_seq: int, batch: int, context: int, block_size: int, reps: int) -> float:
    """Median seconds of one step of `batch` sequences, each `rows_per_seq` decode rows
    at the positions after `context` tokens (a verify step when rows_per_seq > 1)."""
    import torch

    from hybridd.model.step_inputs import HostStepInputs

    blocks_per_seq = (context + rows_per_seq) // block_size + 1
    tokens, positions, tables = [], [], []
    for s in range(batch):
        table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        for j in range(rows_per_seq):
            tokens.append(5 + j)
            positions.append(context + j)
            tables.append(table)
    step = HostStepInputs.decode(tokens, positions, tables, block_size, table_width=buffers.max_blocks_per_seq)
    cuda = buffers.logits.is_cuda
    times = []
    for i in range(reps + 3):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        buffers.write(step)
        runner.run(False, len(tokens), len(tokens))
        if cuda:
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_verify_steps(runner, buffers, context: int = 512, reps: int = 20, ks: tuple[int, ...] = VERIFY_KS) -> dict:
    out: dict[str, Any] = {"context_tokens": context}
    for batch in VERIFY_BATCHES:
        one_row = time_steps(runner, buffers, 1, batch, context, 16, reps)
        row: dict[str, Any] = {"decode_step_s": one_row}
        for k in ks:
            if batch * (k + 1) > buffers.max_seqs:
                continue
            seconds = time_steps(runner, buffers, k + 1, batch, context, 16, reps)
            row[f"k{k}"] = {"step_s": seconds, "over_decode": ratio(seconds, one_row)}
        out[f"batch_{batch}"] = row
    return out


def make_predictable(model) -> None:
    """Bench only: hybridd's model given the predictable checkpoint's weights in place
    (`make_predictable_weights`: token t followed by perm(t) by a wide margin)."""
    from hybridd.bench.random_checkpoint import make_predictable_weights

    make_predictable_weights(model.embed_tokens.weight, model.lm_head.weight, model.norm.weight,
                             [w for layer in model.layers for w in (layer.o_proj.weight, layer.down_proj.weight)])


def measure_replay(model, kv, buffers, runner, num_blocks: int, tokens: int, k: int, batch: int = 1) -> dict:
    """Seconds per output token at each acceptance, and without speculation."""
    import torch

    from hybridd.engine.block_manager import BlockManager
    from hybridd.engine.core import EngineCore
    from hybridd.engine.sampler import Sampler
    from hybridd.engine.scheduler import Scheduler
    from hybridd.engine.speculation.policy import SpeculationPolicy
    from hybridd.engine.speculation.speculator import Speculator
    from hybridd.protocol.messages import SamplingParams

    vocab = model.config.vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    sampler = Sampler(compile=buffers.logits.is_cuda)

    def run(speculator) -> tuple[float, list[list[int]]]:
        blocks = BlockManager(num_blocks, 16, watermark=0.0)
        scheduler = Scheduler(blocks, max_batch=batch, max_prefill_tokens=512, max_model_len=1024,
                              block_table_width=buffers.max_blocks_per_seq, speculator=speculator,
                              max_verify_rows=buffers.max_seqs)
        core = EngineCore(scheduler, GraphStepRunner(runner, buffers, sampler, vocab), pipeline_depth=1)
        requests = [core.add(str(i), p, params) for i, p in enumerate(prompts)]
        core.step()  # the prefill, untimed
        if buffers.logits.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        while core.has_work:
            core.step()
        seconds = time.perf_counter() - start
        return seconds, [list(r.seqs[0].output_token_ids) for r in requests]

    run(None)  # warm-up
    plain_s, recorded = run(None)
    out: dict[str, Any] = {"batch": batch, "k": k, "tokens": tokens,
                           "plain_s_per_token": plain_s / (tokens - 1)}
    table = {tuple(p): r for p, r in zip(prompts, recorded, strict=True)}
    for acceptance in ACCEPTANCES:
        speculator = Speculator(ReplayDrafter(table, acceptance, vocab), k,
                                SpeculationPolicy(k, adaptive=False, initial_acceptance=1.0, min_keep=0.0))
        seconds, outputs = run(speculator)
        stats = speculator.stats
        out[f"acceptance_{int(acceptance * 100)}"] = {
            "s_per_token": seconds / (tokens - 1), "over_plain": ratio(seconds, plain_s),
            "same_tokens": outputs == recorded, "mean_acceptance_length": stats.mean_acceptance_length,
            "measured_acceptance": stats.acceptance_rate,
        }
    return out


def build_head_runner(head_dir: Path, model, target_runner, max_model_len: int, num_blocks: int,
                      catch_up_tokens: int, block_size: int = 16):
    """The EAGLE-3 head in `head_dir` as the graph generator serves it: loaded by the
    product's loader on the model's device and in its dtype (embedding with the model's),
    its KV arena of `num_blocks` blocks, `eagle3_runner` over the daemon's default buckets
    (max_batch 32) on the target's serving stream, graphs on CUDA: the decode buckets
    captured as before ready, then the background thread's prefill and mixed buckets up to
    the one that holds `catch_up_tokens` (the largest catch-up timed), waited for (up to a
    minute) and the thread stopped before any timing, so that the timed drafts replay
    graphs as a warm daemon's do (the larger buckets, the prompts' catch-up, untimed, may
    run eagerly)."""
    from hybridd.engine.speculation.eagle3_runner import eagle3_runner
    from hybridd.model.eagle3 import load_eagle3_head
    from hybridd.runtime.buckets import DEFAULT_DECODE_BUCKETS, DEFAULT_PREFILL_BUCKETS, BucketPlan
    from hybridd.runtime.step_buffers import geometry

    head = load_eagle3_head(head_dir, model.config, None, model.embed_tokens, max_model_len,
                            dtype=model.dtype, device=model.device)
    plan = BucketPlan.create(DEFAULT_DECODE_BUCKETS, DEFAULT_PREFILL_BUCKETS, 8, mixed_tokens=256)
    max_tokens, _ = geometry(plan.max_prefill_tokens, plan.max_batch, max_model_len, block_size)
    cuda = model.device.type == "cuda"
    draft = eagle3_runner(head, head.allocate_kv(num_blocks, block_size), plan, max_tokens, use_graphs=cuda,
                          memory_budget_bytes=1 << 30, stream=target_runner.stream)
    draft.capture()
    if cuda:
        draft.start_background_capture()
        limit = min((b for b in plan.prefill if b >= catch_up_tokens), default=plan.prefill[-1])
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and not all(
                    b["captured"] or b["disabled"] for b in draft.runner.snapshot()["buckets"]
                    if b["kind"] != "decode" and b["size"] <= limit):
                time.sleep(0.1)
        finally:
            draft.stop_background_capture()
    return head, draft


def time_head_drafts(draft, vocab: int, k: int, batch: int, context: int, reps: int, states, warm: int = 3) -> dict:
    """Median seconds of the head's work for one verify step of `batch` sequences drafting
    `k` tokens each, driven by the control messages the graph generator gets: the verify
    step's rows of the target's states kept (`observe`: the last token and the k drafts),
    then a `Draft` of each sequence's new tokens (every draft kept and one more: the
    longest catch-up a step of k leaves, k + 1 rows), answered by the head's catch-up
    forward and its k - 1 chained single-token steps. The sequences start from a prompt
    of `context` tokens whose states were kept as a prefill's (and drafted once, untimed);
    `states` [rows, 3 x hidden] stand for the target's hidden states (random)."""
    import torch

    from hybridd.protocol import control
    from hybridd.protocol.messages import SamplingParams

    rng = random.Random(1000 * batch + k)
    params = SamplingParams(max_tokens=context + (warm + reps + 2) * (k + 1), temperature=0.0, ignore_eos=True)
    ids = [f"head-b{batch}-k{k}-{s}" for s in range(batch)]
    sent: dict[str, control.DraftSequence] = {}
    lengths: dict[str, int] = {}
    for rid in ids:
        prompt = [rng.randrange(3, vocab) for _ in range(context)]
        draft.observe(control.Step(step=0, kind="prefill", n_real=1, n_tokens=context,
                                   hidden=[control.HiddenRows(request_id=rid, start=0, row=0, tokens=prompt)]),
                      states)
        sent[rid] = control.DraftSequence(request_id=rid, first=0, tokens=[*prompt, rng.randrange(3, vocab)], count=k,
                                          prompt_len=context, params=params, seed=0)
        lengths[rid] = context + 1
    cuda = states.is_cuda
    verify: control.Step | None = None
    times, eager = [], 0
    if cuda:
        # The graph generator's serving thread drafts with the serving stream as its own, so
        # that the head's sampling is ordered with its forwards: this thread does too.
        caller = torch.cuda.current_stream()
        torch.cuda.set_stream(draft.runner.stream)
    for i in range(warm + reps + 1):  # the first: the prompts' catch-up
        before = _eager_runs(draft)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if verify is not None:
            draft.observe(verify, states)
        reply = draft.draft(control.Draft(draft=i, sequences=list(sent.values())))
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if reply is None or reply.failed or [len(t) for t in reply.tokens] != [k] * batch:
            raise RuntimeError(f"the EAGLE-3 head drafted {reply and reply.tokens} for {batch} x {k} tokens")
        if i > warm:
            times.append(seconds)
            eager += _eager_runs(draft) - before
        rows = []
        for s, (rid, tokens) in enumerate(zip(ids, reply.tokens, strict=True)):
            n = lengths[rid]
            last = sent[rid].tokens[-1]
            rows.append(control.HiddenRows(request_id=rid, start=n - 1, row=s * (k + 1), tokens=[last, *tokens]))
            sent[rid] = control.DraftSequence(request_id=rid, first=n, tokens=[*tokens, rng.randrange(3, vocab)],
                                              count=k)
            lengths[rid] = n + k + 1
        verify = control.Step(step=i + 1, kind="decode", n_real=batch, n_tokens=batch * (k + 1), hidden=rows)
    draft.draft(control.Draft(draft=warm + reps + 1, released=ids))
    if cuda:
        torch.cuda.set_stream(caller)
    return {"head_draft_s": statistics.median(times), "catch_up_rows": k + 1, "eager_forwards": eager}


def _eager_runs(draft) -> int:
    return sum(b["eager_runs"] for b in draft.runner.snapshot()["buckets"])


def measure_head_drafts(head_dir: Path, model, target_runner, context: int, reps: int,
                        ks: tuple[int, ...] = VERIFY_KS, batches: tuple[int, ...] = VERIFY_BATCHES,
                        warm: int = 3) -> dict:
    """The EAGLE-3 head's draft work per verify step (`time_head_drafts`, after `warm`
    untimed ones) per batch and k."""
    import torch

    longest = context + (warm + reps + 2) * (max(ks) + 1)
    blocks = max(batches) * (longest // 16 + 2)
    head, draft = build_head_runner(head_dir, model, target_runner, model.config.max_model_len, blocks,
                                    max(batches) * (max(ks) + 1))
    spec = head.spec
    states = torch.randn((max(context, max(batches) * (max(ks) + 1)), 3 * spec.target_hidden_size),
                         dtype=head.dtype, device=head.device)
    out: dict[str, Any] = {
        "head": {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
                 "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
                 "draft_vocab_size": spec.draft_vocab_size, "vocab_size": spec.vocab_size,
                 "dtype": str(head.dtype).removeprefix("torch."), "graphs": draft.runner.use_graphs},
        "context_tokens": context,
    }
    for batch in batches:
        out[f"batch_{batch}"] = {f"k{k}": time_head_drafts(draft, spec.vocab_size, k, batch, context, reps, states,
                                                            warm) for k in ks}
    return out


def add_head_cost(replay: dict, head: dict) -> None:
    """Beside each replay figure, the time per token had its drafts cost the head's work:
    derived from two measurements of this run, s_per_token + head_draft_s(k, batch 1) /
    mean acceptance length (each verify step gains that many tokens, and costs one draft)."""
    k = replay["k"]
    head_s = head.get(f"batch_{replay['batch']}", {}).get(f"k{k}", {}).get("head_draft_s")
    if head_s is None:
        return
    replay["with_head"] = (f"derived: s_per_token + eagle3_head.batch_{replay['batch']}.k{k}.head_draft_s "
                           f"({head_s:.6g} s) / mean_acceptance_length, both measured in this run")
    for acceptance in ACCEPTANCES:
        row = replay[f"acceptance_{int(acceptance * 100)}"]
        length = row["mean_acceptance_length"]
        if length:
            row["s_per_token_with_head"] = row["s_per_token"] + head_s / length
            row["over_plain_with_head"] = ratio(row["s_per_token_with_head"], replay["plain_s_per_token"])


def measure_speculation_steps(model: Path, device: str, tokens: int, k: int = 4, reps: int = 20,
                              quick: bool = False, head_dir: Path | None = None) -> dict:
    """The in-process part: verify-step times, time per token with the replay drafter, the
    EAGLE-3 head's draft work (a random head of the model's shape written to `head_dir`,
    default beside the model: `<model>-eagle3-random`) and the replay figures with it
    (`quick`: k = 1, 2, 4, 8 at a 128-token context, for the CPU)."""
    import gc

    import torch

    from hybridd.bench.random_checkpoint import make_eagle3_head

    max_rows = max(VERIFY_BATCHES) * (max(VERIFY_KS) + 1)
    model_obj, kv, buffers, runner, num_blocks = build_runtime(model, device, max_rows, 1024)
    make_predictable(model_obj)
    try:
        steps = (measure_verify_steps(runner, buffers, 128, reps, (1, 2, 4, 8)) if quick
                 else measure_verify_steps(runner, buffers, reps=reps))
        replay = measure_replay(model_obj, kv, buffers, runner, num_blocks, tokens, k)
        try:
            head_dir = make_eagle3_head(head_dir or model.parent / f"{model.name}-eagle3-random", model, device=device)
            head = (measure_head_drafts(head_dir, model_obj, runner, 128, reps, (1, 2, 4, 8), warm=1) if quick
                    else measure_head_drafts(head_dir, model_obj, runner, 512, reps))
        except Exception as exc:  # the figures above stand without the head's
            head = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        add_head_cost(replay, head)
        return {"verify_steps": steps, "replay": replay, "eagle3_head": head}
    finally:
        del model_obj, kv, buffers, runner
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
