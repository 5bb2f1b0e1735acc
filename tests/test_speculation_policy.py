"""The parts of speculation that need no model: prompt lookup's proposals, the policy's
choices from measured acceptance and step costs, and the counters."""

from __future__ import annotations

from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.ngram import NgramDrafter
from hybridd.engine.speculation.policy import SpeculationPolicy, size_class
from hybridd.engine.speculation.stats import SpeculationStats
from hybridd.engine.speculation.verification import accepted_tokens


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    drafter = NgramDrafter(1, 3)
    seq = Sequence("a", [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    # "1 2 3" occurs three times before the end; the latest is followed by 4 5 1 2 3.
    assert drafter.propose([seq], [4])[0].tokens == [4, 5, 1, 2]
    seq.output_token_ids += [8]  # no earlier 8: no draft
    assert drafter.propose([seq], [4])[0].tokens == []
    assert drafter.propose([seq], [0])[0].tokens == []
    drafter.release("a")
    assert drafter._indexes == {}


def test_prompt_lookup_continues_a_loop_past_the_sequence_end():
    seq = Sequence("b", [5, 6, 5, 6, 5])
    assert NgramDrafter(1, 2).propose([seq], [5])[0].tokens == [6, 5, 6, 5, 6]


def test_acceptance_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert accepted_tokens([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]
    assert accepted_tokens([4], [2, 3]) == [2]
    assert accepted_tokens([], [2]) == [2]


def test_draft_length_follows_measured_acceptance():
    policy = SpeculationPolicy(8, smoothing=0.5, min_keep=0.25, initial_acceptance=0.6)
    assert policy.draft_length("s") == 2  # 0.6**2 >= 0.25 > 0.6**3
    for _ in range(10):
        policy.observe_draft("s", 4, 4)
    assert policy.draft_length("s") == 8
    for _ in range(10):
        policy.observe_draft("s", 4, 0)
    assert policy.draft_length("s") == 1  # never less than one: acceptance must stay measurable
    policy.release("s")
    assert policy.acceptance("s") == 0.6
    assert SpeculationPolicy(8, min_keep=0.0).draft_length("s") == 8  # every draft token worth scoring


def test_speculation_is_chosen_per_batch_size_where_it_measured_cheaper_and_probed_again():
    policy = SpeculationPolicy(4, probe_interval=8, probe_steps=2)
    policy.scheduled(1)
    policy.scheduled(32)
    assert policy.speculates(1)  # not measured yet: tried first
    policy.observe_step(1, True, 5.0, 1)  # a first step (compiling) is not counted
    assert policy.speculates(1)
    policy.observe_step(1, True, 0.010, 3)  # 3.3 ms per token speculating
    assert not policy.speculates(1)  # plain not measured yet: tried next
    for size, spec, seconds, tokens in ((1, False, 0.005, 1),  # 5 ms per token plain
                                        (32, True, 0.040, 32),  # 32 streams: 1.25 ms per token speculating
                                        (32, False, 0.020, 32)):  # 0.6 ms per token plain
        policy.observe_step(size, spec, 9.0, 1)
        policy.observe_step(size, spec, seconds, tokens)
    assert policy.speculates(1) == policy.speculates(1)  # asking again is no step

    def steps(size: int) -> list[bool]:
        choices = []
        for _ in range(16):
            choices.append(policy.speculates(size))
            policy.scheduled(size)
        return choices

    choices_1, choices_32 = steps(1), steps(32)
    # Each size its cheaper mode, the other probed two steps in a row every eight.
    assert sum(choices_1) == 12 and sum(choices_32) == 4
    assert choices_32.count(True) == 4 and any(a and b for a, b in zip(choices_32, choices_32[1:]))
    assert size_class(3) == size_class(4) == 4 and size_class(5) == 8
    assert SpeculationPolicy(4, adaptive=False).speculates(32)


def test_counters_per_position():
    stats = SpeculationStats(4)
    stats.count(4, 2)
    stats.count(3, 3)
    stats.count(2, 0)
    assert stats.accepted_per_position == [2, 2, 1, 0]
    assert stats.to_dict()["acceptance_rate"] == round(5 / 9, 4)
    assert stats.mean_acceptance_length == 1 + 5 / 3
