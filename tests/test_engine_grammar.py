"""Structured output in the engine: the allowed-token bitmask the sampler applies, the
grammar compiler (llguidance) with its errors, time bound and cache, and generation under
a constraint through the engine core with the embedded model."""

from __future__ import annotations

import json
import random
import re
import string

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.grammar import GrammarCompiler, StructuredOutputError, TokenMasks, choice_regex
from hybridd.engine.sampler import Sampler, SamplingTensors
from hybridd.engine.sequence import Sequence
from hybridd.engine.token_bitmask import BITS, allow_all, allowed_tokens
from hybridd.protocol.messages import SamplingParams, StructuredOutput

VOCAB = 320
SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["merry", "sad"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["mood", "age"], "additionalProperties": False}


def _bitmask(allowed: list[set[int] | None]) -> torch.Tensor:
    mask = allow_all(len(allowed), VOCAB)
    for row, tokens in enumerate(allowed):
        if tokens is not None:
            mask[row] = 0
            for token in tokens:
                mask[row, token // BITS] |= torch.tensor(1 << (token % BITS), dtype=torch.int64).to(torch.int32)
    return mask


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0), SamplingParams(temperature=1.5), SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
    SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5),
], ids=["greedy", "random", "top_k_top_p", "penalised"])
def test_each_row_draws_only_what_its_bitmask_allows_and_a_free_row_draws_as_without(params):
    generator = torch.Generator().manual_seed(7)
    allowed = [{3}, {0, 31, 32, 319}, set(range(100, 300, 7)), None]
    rows = len(allowed)
    sampler = Sampler(compile=False)
    for trial in range(20):
        logits = torch.randn(rows, VOCAB, generator=generator) * 4
        history = [[1, 2, 3]] * rows
        tensors = SamplingTensors.build([params] * rows, [trial] * rows, [trial] * rows, VOCAB, "cpu", history,
                                        history)
        tokens, logprobs = sampler.sample(logits, tensors, with_logprobs=True, allowed=_bitmask(allowed))
        free, _ = sampler.sample(logits, tensors)
        for row, tokens_allowed in enumerate(allowed):
            if tokens_allowed is not None:
                assert int(tokens[row]) in tokens_allowed
                # The logprobs are the constrained distribution's: only allowed tokens have mass.
                assert set(logprobs.top_ids[row][logprobs.top_values[row] > float("-inf")].tolist()) <= tokens_allowed
        assert int(tokens[-1]) == int(free[-1])


@pytest.mark.gpu
def test_the_fused_gpu_sampler_draws_only_allowed_tokens():
    generator = torch.Generator().manual_seed(3)
    allowed = [{5}, set(range(0, VOCAB, 3)), None]
    sampler = Sampler(compile=True)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8)):
        logits = (torch.randn(3, VOCAB, generator=generator) * 4).cuda()
        tensors = SamplingTensors.build([params] * 3, [1] * 3, [1] * 3, VOCAB, "cuda")
        tokens, _ = sampler.sample(logits, tensors, with_logprobs=True, allowed=_bitmask(allowed).cuda())
        assert int(tokens[0]) == 5 and int(tokens[1]) % 3 == 0
        assert int(tokens[2]) == int(sampler.sample(logits, tensors)[0][2])


def test_bitmask_bits_are_tokens_in_order_and_a_row_of_minus_one_allows_all():
    mask = _bitmask([{0, 33, 319}, None])
    bits = allowed_tokens(mask, VOCAB)
    assert bits[0].nonzero().flatten().tolist() == [0, 33, 319] and bool(bits[1].all())


@pytest.fixture(scope="module")
def tokenizer():
    from hybridd.model import load_tokenizer

    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=4)


def _text_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _follows(compiler: GrammarCompiler, structured: StructuredOutput, tokens: list[int]) -> bool:
    """Whether the masks let `tokens` then EOS through, one token at a time."""
    seq = Sequence("s", [1])
    seq.grammar = compiler.compile(structured).new_matcher()
    masks = TokenMasks(compiler.vocab_size, 1)
    for token in [*tokens, compiler.tokenizer.eos_token]:
        if not bool(allowed_tokens(masks.fill([seq]), compiler.vocab_size)[0, token]):
            return False
        seq.append_token(token)
    return seq.grammar_ended


def test_a_verify_steps_masks_follow_each_draft_and_leave_its_matcher_where_it_was(compiler, tokenizer):
    """Row j of a constrained sequence allows what its grammar allows after its draft's
    first j tokens; an unconstrained sequence's rows allow every token."""
    structured = StructuredOutput(json=json.dumps(SCHEMA))
    draft = _text_tokens(tokenizer, '{"mood": "sad"')
    seq, free, undrafted = Sequence("s", [1]), Sequence("f", [1]), Sequence("u", [1])
    seq.grammar = compiler.compile(structured).new_matcher()
    undrafted.grammar = compiler.compile(structured).new_matcher()
    assert seq.grammar.validate_tokens(draft) == len(draft)
    masks = TokenMasks(compiler.vocab_size, 16)
    before = masks.fill([seq]).clone()
    rows = masks.fill_verify([free, seq, undrafted], [[5, 6], draft, []]).clone()
    assert rows.shape[0] == 3 + len(draft) + 1 + 1 and bool((rows[:3] == -1).all())
    assert torch.equal(rows[-1], before[0])  # a sequence without a draft: its grammar's next tokens
    assert torch.equal(masks.fill([seq]), before)  # the matcher is where it was
    follower = compiler.compile(structured).new_matcher()
    for j in range(len(draft) + 1):
        expected = Sequence("e", [1])
        expected.grammar = follower
        assert torch.equal(rows[3 + j], masks.fill([expected])[0]), j
        if j < len(draft):
            follower.consume_token(draft[j])
    assert not torch.equal(rows[3], rows[3 + len(draft)])


@pytest.mark.parametrize("structured, good, bad", [
    (StructuredOutput(json=json.dumps(SCHEMA)), '{"mood": "sad", "age": 7}', '{"mood": "glad", "age": 7}'),
    (StructuredOutput(json_object=True), '{"any": [1, 2]}', '[1, 2]'),
    (StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"), "123-ab", "12-abc"),
    (StructuredOutput(choice=["yes", "no (really)", "a.b*c"]), "no (really)", "maybe"),
    (StructuredOutput(grammar='start: "ay" | "nay" NUMBER\n%import common.NUMBER'), "nay42", "yea"),
    (StructuredOutput(grammar='root ::= "ay" | "nay"'), "nay", "nah"),
], ids=["json", "json_object", "regex", "choice", "lark", "gbnf"])
def test_the_masks_follow_each_kind_of_constraint_to_its_end(compiler, tokenizer, structured, good, bad):
    assert _follows(compiler, structured, _text_tokens(tokenizer, good))
    assert not _follows(compiler, structured, _text_tokens(tokenizer, bad))


@pytest.mark.parametrize("structured, field", [
    (StructuredOutput(json="{not json"), "sampling.structured.json"),
    (StructuredOutput(json='{"type": "object", "properties": {"a": {"type": "nonsense"}}}'), "sampling.structured.json"),
    (StructuredOutput(json="[1, 2]"), "sampling.structured.json"),
    (StructuredOutput(regex="(unclosed"), "sampling.structured.regex"),
    (StructuredOutput(grammar="start: undefined_rule"), "sampling.structured.grammar"),
], ids=["not-json", "bad-type", "not-a-schema", "bad-regex", "bad-grammar"])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(compiler, structured, field):
    with pytest.raises(StructuredOutputError) as info:
        compiler.compile(structured)
    assert info.value.field == field and str(info.value).startswith(field + ": ")


def test_compiled_constraints_are_cached_least_recently_used_and_compiling_is_bounded(compiler, tokenizer):
    first = compiler.compile(StructuredOutput(regex="a+"))
    assert compiler.compile(StructuredOutput(regex="a+")) is first
    for regex in ("b+", "c+", "d+", "e+"):  # the cache holds 4
        compiler.compile(StructuredOutput(regex=regex))
    assert compiler.compile(StructuredOutput(regex="a+")) is not first and len(compiler) == 4
    # 256 choices of 1,000 random letters: about 80 ms to compile on an idle CPU.
    letters = random.Random(0)
    choices = ["".join(letters.choice(string.ascii_letters) for _ in range(1000)) for _ in range(256)]
    slow = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], timeout_s=1e-3)
    try:
        with pytest.raises(StructuredOutputError, match="structured_compile_timeout_s") as info:
            slow.compile(StructuredOutput(choice=choices))
        assert info.value.field == "sampling.structured.choice"
    finally:
        slow.close()


def test_choice_regex_escapes_every_punctuation_character():
    assert choice_regex(["a.b", "(c)|d"]) == r"(a\.b|\(c\)\|d)"


@pytest.fixture(scope="module")
def model():
    from hybridd.model import load_model

    return load_model(EMBEDDED_MODEL, device="cpu", dtype=torch.float32)


def test_generation_under_a_schema_gives_valid_documents_for_every_seed_and_fork(model, tokenizer, compiler):
    from hybridd.engine.generate import generate

    structured = StructuredOutput(json=json.dumps(SCHEMA))
    prompt = tokenizer.encode("ROMEO:\nHow old art thou, and how dost thou feel?\n\nJULIET:\n")
    for seed in (1, 2):
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=seed, n=3, structured=structured)
        for seq in generate(model, [prompt], params, tokenizer=tokenizer, grammar=compiler.compile(structured))[0]:
            assert seq.finish_reason == "stop", seq.output_text
            document = json.loads(seq.output_text)
            assert set(document) == {"mood", "age"} and document["mood"] in ("merry", "sad")
            assert type(document["age"]) is int and 0 <= document["age"] <= 99


def test_a_constraint_ends_the_sequence_even_when_eos_is_ignored(model, tokenizer, compiler):
    from hybridd.engine.generate import generate

    structured = StructuredOutput(regex=r"[0-9]{2}")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, structured=structured)
    seq = generate(model, [tokenizer.encode("ROMEO:\nCount!\n\nJULIET:\n")], params, tokenizer=tokenizer,
                   grammar=compiler.compile(structured))[0][0]
    assert re.fullmatch(r"[0-9]{2}", seq.output_text) and seq.finish_reason == "stop"
