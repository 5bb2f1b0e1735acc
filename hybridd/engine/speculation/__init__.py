"""Speculative decoding: a drafter proposes up to k tokens per sequence, one verify
step of the target model scores them all (k + 1 rows per sequence, logits for every
row), and the longest prefix the target agrees with is kept, plus one token of the
target's own.

One concept per module: `drafter` (what a drafter is, the protocol every drafter
implements), `ngram` (prompt lookup, which needs no model), `draft_model` (a small model
with the target's tokenizer decodes the drafts, with a KV cache of its own), `eagle3` (an
EAGLE-3 head over the target's hidden states, with a KV cache of its own), `draft_runner`
(a drafter with a model in the graph generator: its KV arena, step buffers and graphs),
`eagle3_runner` (the EAGLE-3 head there), `graph_drafter` (the context generator's side
of them: drafts asked for over the control socket), `verification` (how the
target's rows accept a draft: exactly the target's distribution), `policy` (k per
sequence and speculation on or off per batch size, from measured acceptance and step
costs), `stats` (drafts proposed and accepted, per position), `speculator` (the three
together, as the scheduler uses them), `registry` (the drafters the settings name). The
scheduler builds verify steps; the runners sample their rows like any other.
"""
