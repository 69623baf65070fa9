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


def test_messages_and_responses_usage():
    # Anthropic: input_tokens leave out the cached tokens; the prompt is their sum.
    assert usage_of(b'{"type":"message","usage":{"input_tokens":8,"output_tokens":6,'
                    b'"cache_read_input_tokens":32}}') == (40, 6, 32)
    assert usage_of(b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
                    b'"usage":{"input_tokens":5,"output_tokens":6}}\n\nevent: message_stop\n'
                    b'data: {"type":"message_stop"}\n\n') == (5, 6, None)
    # Responses: input_tokens is the whole prompt; its details hold the cached count (two nested
    # objects: read whole, and in a stream from the response.completed event's response).
    usage = (b'{"input_tokens":40,"input_tokens_details":{"cached_tokens":32,"input_tokens_per_turn":[40]},'
             b'"output_tokens":6,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":46}')
    assert usage_of(b'{"id":"resp_1","object":"response","usage":' + usage + b'}') == (40, 6, 32)
    event = (b'event: response.completed\ndata: {"response":{"id":"resp_1","usage":' + usage
             + b',"user":null},"sequence_number":9,"type":"response.completed"}\n\n')
    assert usage_of(event) == (40, 6, 32)


def test_object_end_balances_braces():
    from epd_proxy.observe.tokens import object_end

    doc = b'x{"a":{"b":[1,{"c":2}]},"d":{}}tail'
    assert doc[1:object_end(doc, 1)] == b'{"a":{"b":[1,{"c":2}]},"d":{}}'
    assert object_end(b'{"a":{"b":1}', 0) == -1  # cut
    assert object_end(b"{}", 0) == 2
