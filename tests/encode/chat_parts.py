"""Chat bodies with media parts, for the encode path's tests (media discovery, result matching)."""

from blake3 import blake3


def digest(s: str) -> str:
    """The proxy's content key of a text (a URL): BLAKE3 in hex."""
    return blake3(s.encode()).hexdigest()


def img(url, **extra):
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def body_with(*parts, system="You are helpful."):
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": list(parts)},
        ],
        "max_tokens": 8,
    }
