"""The simulator's /tokenize, /detokenize and /v1/embeddings: vLLM's shapes, its own tokenizer."""

import base64
import struct

import msgspec

from epd_proxy.sim import SimConfig
from epd_proxy.sim.tokens import VOCAB, prompt_tokens
from epd_proxy.sim.utility import EMBEDDING_DIM, detokenize, embeddings, tokenize

CONFIG = SimConfig()


def _call(fn, body, *args):
    status, raw = fn(msgspec.json.encode(body), CONFIG, *args)
    return status, msgspec.json.decode(raw)


def test_tokenize_counts_as_generation_does_and_detokenize_reads_it_back():
    body = {"model": "sim-model", "prompt": "the quick brown fox"}
    status, out = _call(tokenize, body)
    assert status == 200 and set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) == prompt_tokens(body) == 4
    assert out["max_model_len"] == CONFIG.max_model_len and out["token_strs"] is None
    status, back = _call(detokenize, {"tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": "the quick brown fox"}


def test_tokenize_chat_and_token_strs():
    body = {"messages": [{"role": "user", "content": "hi there"}], "return_token_strs": True}
    status, out = _call(tokenize, body)
    assert status == 200 and out["count"] == prompt_tokens(body) == 3
    assert out["token_strs"] == ["<|user|>", "hi", "there"]


def test_detokenize_output_tokens_and_unknown_ids():
    assert _call(detokenize, {"tokens": [0, 1]}) == (200, {"prompt": VOCAB[0] + VOCAB[1]})
    status, out = _call(detokenize, {"tokens": [12345]})
    assert status == 400 and out["error"]["param"] == "tokens"


def test_unknown_model_is_vllms_404():
    status, out = _call(tokenize, {"model": "other", "prompt": "x"})
    assert status == 404 and out["error"]["type"] == "NotFoundError"


def test_embeddings_shape_and_formats():
    status, out = _call(embeddings, {"model": "sim-model", "input": ["a b", "c"]}, "r1")
    assert status == 200 and out["object"] == "list" and out["id"] == "embd-r1" and out["model"] == "sim-model"
    assert [d["index"] for d in out["data"]] == [0, 1] and out["data"][0]["object"] == "embedding"
    vector = out["data"][0]["embedding"]
    assert len(vector) == EMBEDDING_DIM and abs(sum(v * v for v in vector) - 1) < 1e-9
    assert out["usage"] == {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0,
                            "prompt_tokens_details": None}
    _, packed = _call(embeddings, {"input": "a b", "encoding_format": "base64"}, "r2")
    floats = struct.unpack(f"<{EMBEDDING_DIM}f", base64.b64decode(packed["data"][0]["embedding"]))
    assert all(abs(a - b) < 1e-6 for a, b in zip(floats, vector))
    assert _call(embeddings, {"input": 5}, "r3")[0] == 400


def test_a_long_lived_simulator_reads_back_what_it_tokenized_lately(monkeypatch):
    from epd_proxy.sim import utility

    monkeypatch.setattr(utility, "_MAX_KNOWN", 8)
    monkeypatch.setattr(utility, "_words", {})
    for i in range(4):  # more words than it keeps
        assert _call(tokenize, {"model": "sim-model", "prompt": f"filler{i}a filler{i}b filler{i}c"})[0] == 200
    status, out = _call(tokenize, {"model": "sim-model", "prompt": "the quick brown fox"})
    assert _call(detokenize, {"tokens": out["tokens"]}) == (200, {"prompt": "the quick brown fox"})


def test_a_generation_prompt_asked_by_name_is_the_assistant_header_a_continued_message_starts_with():
    """vLLM renders a chat /tokenize with its generation prompt, the header a final assistant
    message continued (``continue_final_message``) starts with: the difference of the two is
    the continued text's tokens (what stream migration counts an answer so far by)."""
    conversation = [{"role": "user", "content": "hi there"}]
    _, plain = _call(tokenize, {"messages": conversation, "return_token_strs": True})
    _, asked = _call(tokenize, {"messages": conversation, "add_generation_prompt": True, "return_token_strs": True})
    _, continued = _call(tokenize, {"messages": conversation + [{"role": "assistant", "content": " the model"}],
                                    "add_generation_prompt": False, "continue_final_message": True})
    assert plain["count"] == prompt_tokens({"messages": conversation}) == 3  # what generation renders
    assert asked["token_strs"] == ["<|user|>", "hi", "there", "<|assistant|>"]
    assert continued["tokens"][:asked["count"]] == asked["tokens"] and continued["count"] - asked["count"] == 2
