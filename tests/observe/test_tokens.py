"""The tokens an answer reports (tokens.py): prompt, completion and cached, from the usage
object alone, whatever the answer's size."""

from epd_proxy.observe.tokens import NO_TOKENS, usage_of


def test_usage_of_a_whole_answer_and_of_the_last_stream_events():
    assert usage_of(b'{"id":"x","usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}') == (7, 3, None)
    tail = (b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
            b'"prompt_tokens_details":{"cached_tokens":4}}}\n\ndata: [DONE]\n\n')
    assert usage_of(tail) == (5, 2, 4)
    assert usage_of(b'data: {"choices":[{"delta":{}}],"usage":null}\n\ndata: [DONE]\n\n') == NO_TOKENS
    assert usage_of(b"") == NO_TOKENS and usage_of(None) == NO_TOKENS
    assert usage_of(b'data: {"usage":{"prompt_tok') == NO_TOKENS  # cut: unknown, not an error


def test_other_shapes_are_read_whole():
    # A deeper object than vLLM writes: the slice does not decode, the document does.
    deep = (b'{"usage":{"prompt_tokens":2,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":1,'
            b'"x":{"y":1}}}}')
    assert usage_of(deep) == (2, 1, 1)
    assert usage_of(b'{"usage":{"prompt_tokens":"many"}}') == NO_TOKENS
    # The answer's text cannot fool it: a quote in a string is escaped.
    text = b'{"choices":[{"message":{"content":"\\"usage\\":{\\"prompt_tokens\\":9}"}}],"usage":{"prompt_tokens":1,' \
           b'"completion_tokens":1}}'
    assert usage_of(text) == (1, 1, None)
