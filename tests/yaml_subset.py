"""A strict subset of YAML, read without PyYAML (not a dependency): block mappings and
sequences, plain and quoted scalars, JSON-style flow collections, ``|`` literal blocks,
comments, ``---``. Anything outside the subset is an error, so a file that passes is valid
YAML that means what the tests read. Used for docs/deploy/*.yaml and docs/monitoring/*.yaml.
"""

from __future__ import annotations

import json
import re


class YamlError(ValueError):
    pass


def load_all(text: str) -> list:
    docs, current = [], []
    for line in text.split("\n"):
        if line.rstrip() == "---":
            docs.append(current)
            current = []
        else:
            current.append(line)
    docs.append(current)
    out = []
    for lines in docs:
        parser = _Parser(lines)
        if parser.lines:
            out.append(parser.parse())
    return out


_KEY = re.compile(r"^([A-Za-z0-9_.\-/]+):(?: (.*))?$")


class _Parser:
    def __init__(self, raw: list[str]) -> None:
        self.raw = raw
        self.lines = []  # (indent, text, line number) of content lines
        for n, line in enumerate(raw):
            if "\t" in line:
                raise YamlError(f"line {n + 1}: tab")
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            self.lines.append((len(line) - len(line.lstrip(" ")), line.strip(), n))
        self.i = 0

    def parse(self):
        value = self.block(self.lines[0][0])
        if self.i != len(self.lines):
            raise YamlError(f"line {self.lines[self.i][2] + 1}: unexpected indentation")
        return value

    def block(self, indent: int):
        _, text, _ = self.lines[self.i]
        return self.sequence(indent) if text.startswith("- ") or text == "-" else self.mapping(indent)

    def mapping(self, indent: int) -> dict:
        out: dict = {}
        while self.i < len(self.lines):
            ind, text, n = self.lines[self.i]
            if ind < indent:
                break
            if ind > indent:
                raise YamlError(f"line {n + 1}: unexpected indentation")
            if text.startswith("- "):
                break
            m = _KEY.match(text)
            if not m:
                raise YamlError(f"line {n + 1}: expected 'key: value', got {text!r}")
            key, rest = m.group(1), m.group(2)
            if key in out:
                raise YamlError(f"line {n + 1}: duplicate key {key!r}")
            self.i += 1
            out[key] = self.value_after(rest, ind, n)
        return out

    def value_after(self, rest, ind: int, n: int):
        if rest is None or _strip_comment(rest) == "":
            if self.i < len(self.lines):
                nind, ntext, _ = self.lines[self.i]
                if nind > ind or (nind == ind and ntext.startswith("- ")):
                    return self.block(nind)
            return None
        if rest.strip() == "|":
            return self.literal(ind, n)
        return scalar(rest, n)

    def literal(self, ind: int, n: int) -> str:
        # Raw lines after the key's line that are indented more than the key (or blank).
        start = n + 1
        body, block_indent = [], None
        j = start
        while j < len(self.raw):
            line = self.raw[j]
            if line.strip():
                lead = len(line) - len(line.lstrip(" "))
                if lead <= ind:
                    break
                block_indent = lead if block_indent is None else block_indent
                if lead < block_indent:
                    raise YamlError(f"line {j + 1}: literal block dedented")
                body.append(line[block_indent:])
            else:
                body.append("")
            j += 1
        while self.i < len(self.lines) and self.lines[self.i][2] < j:
            self.i += 1
        while body and body[-1] == "":
            body.pop()
        return "\n".join(body) + "\n"

    def sequence(self, indent: int) -> list:
        out = []
        while self.i < len(self.lines):
            ind, text, n = self.lines[self.i]
            if ind < indent or not (text.startswith("- ") or text == "-"):
                if ind > indent:
                    raise YamlError(f"line {n + 1}: unexpected indentation")
                break
            if ind > indent:
                raise YamlError(f"line {n + 1}: unexpected indentation")
            item = text[2:] if text != "-" else ""
            if item and _KEY.match(item) and not item.startswith(("'", '"', "[", "{")):
                # "- key: value": a mapping whose keys sit at the item's column.
                col = ind + 2
                self.lines[self.i] = (col, item, n)
                out.append(self.mapping(col))
            else:
                self.i += 1
                out.append(self.value_after(item or None, ind, n))
        return out


def _strip_comment(text: str) -> str:
    if text.lstrip().startswith(("'", '"')):
        return text.strip()
    return re.split(r"\s+#", text, maxsplit=1)[0].strip()


def scalar(text: str, n: int):
    text = _strip_comment(text)
    if text.startswith('"') or text.startswith("[") or text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise YamlError(f"line {n + 1}: {exc}") from None
    if text.startswith("'"):
        if not text.endswith("'") or len(text) < 2:
            raise YamlError(f"line {n + 1}: unterminated quote")
        inner = text[1:-1]
        if re.search(r"(?<!')'(?!')", inner):
            raise YamlError(f"line {n + 1}: stray quote")
        return inner.replace("''", "'")
    if text in ("true", "false"):
        return text == "true"
    if text in ("null", "~"):
        return None
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"-?\d+\.\d+", text):
        return float(text)
    if ": " in text or text.endswith(":") or " #" in text or text[0] in "-?:,[]{}#&*!|>'\"%@`":
        raise YamlError(f"line {n + 1}: quote this scalar: {text!r}")
    return text
