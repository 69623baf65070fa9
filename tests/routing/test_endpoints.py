"""The endpoint → pool rule (pure)."""

import pytest

from epd_proxy.routing.endpoints import ROUTED, least_loaded_first, roles_for


def test_tokenizer_endpoints_go_to_prefill_or_decode_by_load():
    for path in ("/tokenize", "/detokenize", "/v1/messages/count_tokens", "/tokenizer_info"):
        assert roles_for(path) == ("decode", "prefill")
        assert least_loaded_first(path)


def test_model_endpoints_prefer_the_decode_pool():
    for path in ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                 "/v2/rerank", "/v1/audio/transcriptions", "/v1/audio/translations", "/generative_scoring"):
        assert roles_for(path)[0] == "decode"
        assert "encode" not in roles_for(path)
        assert not least_loaded_first(path)


def test_version_may_come_from_any_instance():
    assert roles_for("/version") == ("decode", "prefill", "encode")
    assert ROUTED["/version"].method == "GET"


def test_generation_and_unknown_paths_are_not_routed_here():
    for path in ("/v1/chat/completions", "/v1/completions", "/nope"):
        with pytest.raises(KeyError):
            roles_for(path)
