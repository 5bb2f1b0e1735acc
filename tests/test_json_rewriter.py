"""The JSON rewriter that gives a streamed tool call's arguments json.dumps' form: fed
one character at a time, cut anywhere, or whole, it writes what json.dumps writes of
the parsed value, and text that is not JSON passes as written."""

from __future__ import annotations

import json

import pytest

from hybridd.gateway.json_rewriter import JsonRewriter

DOCUMENTS = [
    '{\n"city" :\n"Mantua" ,"days"\n:\n2 }',
    '{"a":[1,2.50,-0,1e2,true,false,null,{},[]],"b":{"c":"d"}}',
    '{"say": "\\"Hi\\" \\/ \\\\ \\u00e9\\u00E9 caf\u00e9 \\n\\t\\b\\f\\r \\u0001 \\ud83d\\ude00 \U0001f600"}',
    '  [ "x" , { } , 12345678901234567890 ]  ',
]


def rewritten(pieces: list[str]) -> str:
    rewriter = JsonRewriter()
    return "".join(rewriter.feed(piece) for piece in pieces) + rewriter.finish()


@pytest.mark.parametrize("document", DOCUMENTS)
def test_any_cut_writes_what_json_dumps_writes(document):
    expected = json.dumps(json.loads(document), ensure_ascii=False)
    assert rewritten([document]) == expected
    assert rewritten(list(document)) == expected
    for cut in range(len(document) + 1):
        assert rewritten([document[:cut], document[cut:]]) == expected, cut


def test_what_is_not_json_passes_and_stays_encodable():
    assert rewritten(['{"a": \\ud800 x}']) == '{"a": \\ud800x}'  # tokens as written, spacing dropped
    lone = rewritten(['{"a": "\\ud83d', 'x", "b": "\\ude00"}'])
    assert lone == '{"a": "\\ud83dx", "b": "\\ude00"}' and lone.encode()
    assert rewritten(['{"a": "\\q"}']) == '{"a": "\\q"}'
    assert rewritten(['{"a": 1.']) == '{"a": 1.'  # cut short: the held token as written
