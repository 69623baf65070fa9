from epd_proxy.bench.exchange import parse_sse


def ev(text):
    return ('data: {"id":"x","choices":[{"index":0,"delta":{"content":%s},"finish_reason":null}]}\n\n'
            % __import__("json").dumps(text, ensure_ascii=False)).encode()


def test_events_split_across_pieces_and_utf8():
    role = b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    body = role + ev(" caf\u00e9") + ev("\U0001f680") + b"data: [DONE]\n\n"
    # Cut inside a multi-byte character and inside the "\n\n".
    cut1 = body.index("\u00e9".encode()) + 1
    cut2 = body.index(b"\n\n", cut1) + 1
    pieces = [(1.0, body[:cut1]), (2.0, body[cut1:cut2]), (3.0, body[cut2:])]
    events, done, error = parse_sse(pieces)
    assert done and error is None
    assert [t for _, t in events] == [" caf\u00e9", "\U0001f680"]
    assert [t for t, _ in events] == [3.0, 3.0]


def test_event_time_is_the_piece_that_completes_it():
    pieces = [(1.0, ev("a")), (2.0, ev("b")[:10]), (2.5, ev("b")[10:] + ev("c")), (4.0, b"data: [DONE]\n\n")]
    events, done, error = parse_sse(pieces)
    assert events == [(1.0, "a"), (2.5, "b"), (2.5, "c")]
    assert done


def test_in_band_error_and_truncation():
    err = b'data: {"error": {"message": "boom", "code": 502}}\n\n'
    events, done, error = parse_sse([(1.0, ev("a") + err + b"data: [DONE]\n\n")])
    assert error and "boom" in error and done
    events, done, error = parse_sse([(1.0, ev("a") + b"data: {\"choi")])
    assert not done and error == "stream ended inside an event"


def test_completions_text_field():
    body = b'data: {"choices":[{"index":0,"text":" hi"}]}\n\ndata: [DONE]\n\n'
    events, done, _ = parse_sse([(0.5, body)])
    assert events == [(0.5, " hi")] and done


def test_named_events_of_messages_and_responses():
    from epd_proxy.bench.exchange import parse_named_sse

    msg = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":3}}}\n\n'
           b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
           b'"delta":{"type":"text_delta","text":" caf\xc3\xa9"}}\n\n'
           b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
           b'"delta":{"type":"text_delta","text":"!"}}\n\n'
           b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    cut = msg.index(b"caf") + 4  # inside the multi-byte character
    events, done, error = parse_named_sse([(1.0, msg[:cut]), (2.0, msg[cut:])], "messages")
    assert [t for _, t in events] == [" caf\u00e9", "!"] and done and error is None
    events, done, error = parse_named_sse([(1.0, msg[:msg.index(b"event: message_stop")])], "messages")
    assert not done
    resp = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi",'
            b'"sequence_number":1}\n\n'
            b'event: error\ndata: {"type":"error","code":"502","message":"boom","sequence_number":2}\n\n')
    events, done, error = parse_named_sse([(0.5, resp)], "responses")
    assert events == [(0.5, "hi")] and not done and "boom" in error
