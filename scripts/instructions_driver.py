"""Send N requests over C keep-alive connections to a proxy and check each answer is 200:
chat (MODE stream or nonstream), or the same prompt streamed through /v1/messages or
/v1/responses (MODE messages, responses).

Used by instructions.sh: a plain asyncio client, so that what is counted is the proxy's work,
not the client's."""

import asyncio
import json
import os
import sys

# Tokens per answer (EPD_TOKENS): two counts at different lengths split the cost into its
# per-event and per-request parts.
TOKENS = int(os.environ.get("EPD_TOKENS", "64"))


async def worker(port: int, k: int, count: int, mode: str) -> None:
    words = ("the quick brown fox jumps over lazy dog while cluster serves prefill decode " * 8).split()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for i in range(count):
        text = " ".join(words[(k + i) % 7:][:90])
        if mode == "responses":
            path, doc = b"/v1/responses", {"model": "sim-model", "max_output_tokens": TOKENS, "stream": True,
                                           "store": False, "input": text}
        else:
            path = b"/v1/messages" if mode == "messages" else b"/v1/chat/completions"
            doc = {"model": "sim-model", "max_tokens": TOKENS, "stream": mode != "nonstream",
                   "messages": [{"role": "user", "content": text}]}
        body = json.dumps(doc).encode()
        writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path
                     + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise SystemExit(f"unexpected answer: {status!r}")
        headers = {}
        while (line := await reader.readline()) != b"\r\n":
            name, value = line.split(b":", 1)
            headers[name.strip().lower()] = value.strip()
        if b"content-length" in headers:
            await reader.readexactly(int(headers[b"content-length"]))
        else:
            while (size := int((await reader.readline()).strip(), 16)) != 0:
                await reader.readexactly(size + 2)
            await reader.readline()
    writer.close()


async def main() -> None:
    port, n, conc, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    await asyncio.gather(*(worker(port, k, n // conc, mode) for k in range(conc)))


if __name__ == "__main__":
    asyncio.run(main())
