"""Chat bodies with media parts, for the encode path's tests (media discovery, result matching)."""

import hashlib


def sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


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
