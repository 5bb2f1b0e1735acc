"""Detokenizer and stop criteria with a real byte-level BPE tokenizer trained here,
and the scheduler streaming text through them."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hybridd.engine.block_manager import BlockManager
from hybridd.engine.detokenizer import IncrementalDetokenizer
from hybridd.protocol.messages import SamplingParams
from hybridd.engine.scheduler import Scheduler
from hybridd.engine.sequence import Sequence
from hybridd.engine.stop_criteria import StopCriteria

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Answer: 42. END of answer. The end.",
    "héllo wörld, naïve café — 日本語のテキスト 😀🎉 emoji",
    "def f(x):\n    return x * 2\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def stream(tokenizer, text: str, prompt: str = "Q: ") -> tuple[list[int], list[str]]:
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return ids, [detok.add(ids[: i + 1]) for i in range(len(ids))]


@pytest.mark.parametrize("text", CORPUS + ["日本語😀 split bytes: 🎉🎉 ünïcödé"])
def test_incremental_text_equals_full_decode(tokenizer, text):
    ids, chunks = stream(tokenizer, text)
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)


def test_multibyte_characters_split_across_tokens_are_held_back(tokenizer):
    text = "😀🎉 日本"
    ids, chunks = stream(tokenizer, text)
    # The tiny vocabulary cannot hold these characters whole: some tokens are partial bytes.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    assert "" in chunks  # a token that completed no character emitted nothing
    assert "".join(chunks) == text


def test_flush_releases_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("😀")
    partial = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi"))
    assert detok.add(partial[:1]) == ""
    assert detok.flush(partial[:1]).endswith("\ufffd")


def test_special_tokens_are_skipped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    output = [tokenizer.eos_token_id]
    assert detok.add(output) == ""
    output.append(tokenizer.encode("hello")[0])
    assert detok.add(output) != ""


def drive(tokenizer, text: str, params: SamplingParams, eos=(), max_model_len=10_000, extra_ids=()):
    """Feed `text`'s tokens (then `extra_ids`) through detokenizer and stop criteria."""
    prompt = tokenizer.encode("Q: ")
    seq = Sequence("r", prompt, params)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    stop = StopCriteria(params, eos, max_model_len)
    chunks, result = [], None
    for t in [*tokenizer.encode(text), *extra_ids]:
        seq.append_token(t)
        result = stop.check(t, detok.add(seq.output_token_ids), seq.num_output_tokens, len(seq))
        chunks.append(result.text)
        if result.finish_reason:
            break
    return seq, chunks, result, stop


def test_stop_string_spanning_tokens_truncates_and_never_leaks(tokenizer):
    text = "Answer: 42. END of answer."
    assert not any("END of" in tokenizer.decode([t]) for t in tokenizer.encode(text))  # spans tokens
    seq, chunks, result, stop = drive(tokenizer, text, SamplingParams(max_tokens=100, stop=["END of"]))
    assert (result.finish_reason, result.stop_reason) == ("stop", "END of")
    assert "".join(chunks) == "Answer: 42. "
    assert all("E" not in c for c in chunks)  # no part of the stop string was ever streamed
    assert len(seq.output_token_ids) < len(tokenizer.encode(text))


def test_held_back_prefix_is_released_when_it_does_not_match(tokenizer):
    text = "hello world, the quick brown fox"
    seq, chunks, result, stop = drive(tokenizer, text, SamplingParams(max_tokens=100, stop=["world!", "fox jumps"]))
    assert result.finish_reason is None
    # "world" and " fox" were held back while they could still start a stop string
    assert "".join(chunks) == "hello world, the quick brown "
    assert stop.held == "fox"


def test_held_text_released_when_finishing_by_length(tokenizer):
    text = "hello world"
    n = len(tokenizer.encode(text))
    seq, chunks, result, stop = drive(tokenizer, text, SamplingParams(max_tokens=n, stop=["world peace"]))
    assert result.finish_reason == "length"
    assert "".join(chunks) == "hello world"


def test_eos_stops_without_its_text_unless_ignored(tokenizer):
    eos = tokenizer.eos_token_id
    seq, chunks, result, _ = drive(tokenizer, "the end", SamplingParams(max_tokens=50), eos=[eos], extra_ids=[eos])
    assert (result.finish_reason, result.stop_reason) == ("stop", eos)
    assert "".join(chunks) == "the end"
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    seq, chunks, result, _ = drive(tokenizer, "the end", params, eos=[eos], extra_ids=[eos])
    assert result.finish_reason is None and seq.output_token_ids[-1] == eos


def test_stop_token_ids(tokenizer):
    stop_id = tokenizer.encode(".")[0]
    seq, chunks, result, _ = drive(tokenizer, "lazy dog. more", SamplingParams(max_tokens=50, stop_token_ids=[stop_id]))
    assert (result.finish_reason, result.stop_reason) == ("stop", stop_id)
    assert "".join(chunks) == "lazy dog"


def test_max_tokens_and_max_model_len(tokenizer):
    _, chunks, result, _ = drive(tokenizer, "the quick brown fox jumps", SamplingParams(max_tokens=2))
    assert result.finish_reason == "length" and len(chunks) == 2
    prompt_len = len(tokenizer.encode("Q: "))
    params = SamplingParams(max_tokens=99)
    seq, _, result, _ = drive(tokenizer, "the quick brown fox jumps", params, max_model_len=prompt_len + 3)
    assert result.finish_reason == "length" and len(seq) == prompt_len + 3


def test_stop_string_with_multibyte_text(tokenizer):
    params = SamplingParams(max_tokens=100, stop=["日本"])
    seq, chunks, result, _ = drive(tokenizer, "naïve café — 日本語のテキスト", params)
    assert result.finish_reason == "stop"
    assert "".join(chunks) == "naïve café — "
    assert all("\ufffd" not in c for c in chunks)


def test_scheduler_streams_text_and_stops_on_string(tokenizer):
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, 4, 64, 256, eos_token_ids=[tokenizer.eos_token_id], tokenizer=tokenizer)
    answer = tokenizer.encode("Answer: 42. END of answer.")
    seq = Sequence("s", tokenizer.encode("Q: "), SamplingParams(max_tokens=100, stop=["END"]))
    sched.add(seq)
    streamed = []
    for token in answer:
        batch = sched.schedule()
        finished = sched.postprocess(batch, [token])
        streamed.append(seq.new_text)
        if finished:
            break
    assert finished == [seq] and seq.finish_reason == "stop" and seq.stop_reason == "END"
    assert "".join(streamed) == seq.output_text == "Answer: 42. "
    assert bm.num_free == 32


def test_the_stream_path_gives_the_window_paths_chunks(tokenizer):
    """A fast tokenizer detokenizes through `tokenizers`' DecodeStream; token by token it
    gives the chunks the two-decode window gives (the path other tokenizers take)."""
    for text in CORPUS + ["日本語😀 split bytes: 🎉🎉 ünïcödé"]:
        prompt = tokenizer.encode("Q: ")
        stream_path = IncrementalDetokenizer(tokenizer, prompt)
        window_path = IncrementalDetokenizer(tokenizer, prompt)
        assert stream_path._stream is not None
        window_path._stream = None
        output: list[int] = []
        for token in tokenizer.encode(text):
            output.append(token)
            assert stream_path.add(output) == window_path.add(output), (text, len(output))


def test_the_embedded_models_tokenizer_streams_what_the_window_gives():
    from hybridd.config import EMBEDDED_MODEL
    from hybridd.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    text = (EMBEDDED_MODEL / "validation.txt").read_text()[:3000]
    ids = tokenizer.encode(text)
    stream_path, window_path = IncrementalDetokenizer(tokenizer, ids[:8]), IncrementalDetokenizer(tokenizer, ids[:8])
    assert stream_path._stream is not None
    window_path._stream = None
    output: list[int] = []
    for token in ids[8:]:
        output.append(token)
        assert stream_path.add(output) == window_path.add(output)
    assert stream_path.flush(output) == window_path.flush(output) == ""
