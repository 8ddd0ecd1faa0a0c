"""Generated hostile and malformed requests for `dctms serve` (issue 35's loopback fuzzer).

``cases(seed, count, ctx)`` yields deterministic ``Case`` records: the raw bytes of one HTTP/1.1
request (``Connection: close``) and the statuses it may get. Families (about their share of a run):
``valid`` (10 %: a real completion or chat, max_tokens 1, streamed or not: must be 200), ``fields``
(30 %: one or two fields of a valid body set to an odd value, removed, or added), ``json`` (14 %:
bodies that are not the JSON they claim: truncated, other top-level types, deep nesting, NaN, huge
numbers, bad UTF-8, other encodings), ``headers`` (16 %: Host, Authorization, Content-Type,
Content-Length, Transfer-Encoding and odd header lines), ``lines`` (10 %: methods, targets and
versions), ``unicode`` (10 %: lone and paired surrogates, NUL, noncharacters, BOMs, combining marks
in prompts, messages, roles and keys), ``sizes`` (10 %: prompts and max_tokens around the plans'
bounds and far past them, token ids at the vocabulary's edges, bodies over the size limit).
Every request's head is complete (a blank line), and a body is never shorter than declared, so no
case waits for a deadline: each must be answered at once.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

REFUSALS = frozenset({400, 401, 403, 404, 405, 413, 415, 431})
ANY = REFUSALS | {200}


@dataclass(frozen=True)
class Context:
    key: str
    port: int
    models: dict[str, tuple[int, int, int]]  # name -> (N, M, vocabulary)
    chat_models: tuple[str, ...]  # those whose chat goes through a template
    max_body: int


@dataclass
class Case:
    id: int
    family: str
    data: bytes
    allowed: frozenset[int] = ANY
    method: str = "POST"
    notes: list[str] = field(default_factory=list)


ODD = [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 0.5, -0.0, 1e308, "", " ",
       "x", "1", "null", "\u00e9", [], {}, [[]], [1, 2], {"a": 1}, [None], "\x00",
       "a" * 300]  # fmt: skip
UNICODE = ["\\ud800", "\\udfff", "a\\udc00b", "\\ud83d\\ude00", "\\ud83d", "\\ude00\\ud83d",
           "\\u0000", "\\uffff", "\\ufffe", "\\ufeff", "e\\u0301\\u0301\\u0301", "\\u202e",
           "\\udbff\\udfff", "\\u00e9\\u4e2d\\u0438", "\\\\ud800", "\\u0085\\u2028\\u2029"]  # fmt: skip
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/status", "/metrics",
         "/v1/embeddings", "/", "/v1", "/v1/", "/v1/completions/", "/V1/COMPLETIONS",
         "/v1/completions?x=1", "/v1/../status", "/v1/%63ompletions", "/%00", "/v1/completions%00",
         "/" + "a" * 3000, "//v1//completions", "/v1/completions#frag",
         "/v1/models/alpha"]  # fmt: skip
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "HEAD", "get", "PoSt",
           "BREW", "M-SEARCH"]  # fmt: skip
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
                 "application/json;charset=latin-1", "text/plain", "text/plain; charset=utf-8",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
                 "application/jsonp", "json", "", "application/json, text/plain", "*/*",
                 "application/ld+json", "text/json", ";application/json"]  # fmt: skip


def cases(seed: int, count: int, ctx: Context) -> Iterator[Case]:
    rng = random.Random(seed)
    families = [("valid", 10, _valid), ("fields", 30, _fields), ("json", 14, _json_bodies),
                ("headers", 16, _headers), ("lines", 10, _lines), ("unicode", 10, _unicode),
                ("sizes", 10, _sizes)]  # fmt: skip
    weights = [w for _, w, _ in families]
    for i in range(count):
        name, _, make = rng.choices(families, weights)[0]
        case = make(rng, ctx)
        case.id, case.family = i, name
        yield case


def _case(data: bytes, allowed=ANY, method: str = "POST", note: str = "") -> Case:
    return Case(0, "", data, frozenset(allowed), method, [note] if note else [])


def request(ctx: Context, method: str, path: str, body: bytes = b"", headers: dict | None = None,
            version: str = "HTTP/1.1") -> bytes:
    """A request with the right key, a loopback Host and a JSON body type unless ``headers``
    says otherwise (a None value drops that header)."""
    fields = {"Host": f"127.0.0.1:{ctx.port}", "Authorization": f"Bearer {ctx.key}",
              "Connection": "close"}  # fmt: skip
    if method.upper() in ("POST", "PUT", "PATCH") or body:
        fields["Content-Type"] = "application/json"
        fields["Content-Length"] = str(len(body))
    fields.update(headers or {})
    head = "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v is not None)
    return f"{method} {path} {version}\r\n{head}\r\n".encode("utf-8", "surrogateescape") + body


def _valid_body(rng: random.Random, ctx: Context, chat: bool | None = None) -> tuple[str, dict]:
    model = rng.choice(sorted(ctx.models))
    chat = rng.random() < 0.5 if chat is None else chat
    text = rng.choice(["hi", "the memory is known", "é中и", "a b c", "1 + 1 =", "\n\t"])
    body: dict = {"model": model, "max_tokens": 1}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": "s"})  # within beta's N
    else:
        body["prompt"] = text if rng.random() < 0.8 else [104, 105]
    if rng.random() < 0.4:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        body["temperature"] = 0
    if rng.random() < 0.2:
        body["return_token_ids"] = True
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _dump(body) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


def _valid(rng: random.Random, ctx: Context) -> Case:
    path, body = _valid_body(rng, ctx)
    return _case(request(ctx, "POST", path, _dump(body)), {200})


def _fields(rng: random.Random, ctx: Context) -> Case:
    path, body = _valid_body(rng, ctx)
    names = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
             "stream_options", "temperature", "top_p", "n", "best_of", "stop", "logprobs",
             "echo", "suffix", "presence_penalty", "frequency_penalty", "logit_bias", "tools",
             "return_token_ids", "user", "seed", "response_format", "unknown_field"]  # fmt: skip
    for _ in range(rng.choice([1, 1, 2])):
        name = rng.choice(names)
        roll = rng.random()
        messages = body.get("messages")
        has_message = isinstance(messages, list) and messages and isinstance(messages[0], dict)
        if roll < 0.15:
            body.pop(name, None)
        elif roll < 0.3 and has_message:
            body["messages"][0][rng.choice(["role", "content", "name", "extra"])] = rng.choice(ODD)
        elif roll < 0.4 and has_message:
            body["messages"][0]["content"] = [rng.choice(
                [{"type": "text", "text": rng.choice(ODD)}, {"type": "image_url"}, "text",
                 {"type": rng.choice(ODD)}, {}])]  # fmt: skip
        else:
            body[name] = rng.choice(ODD)
    return _case(request(ctx, "POST", path, _dump(body)))


def _json_bodies(rng: random.Random, ctx: Context) -> Case:
    path, body = _valid_body(rng, ctx)
    raw = _dump(body)
    roll = rng.randrange(12)
    if roll == 0:
        data = raw[: rng.randrange(len(raw))]
    elif roll == 1:
        data = _dump(rng.choice([[], [body], "text", 1, None, True, 1.5]))
    elif roll == 2:
        depth = rng.choice([10, 63, 64, 65, 200, 999, 1000, 5000, 60_000, 100_000])
        data = b"[" * depth + b"]" * depth
    elif roll == 3:
        depth = rng.choice([30, 63, 64, 65, 300, 3000])  # + 1 for the body: 64 levels pass
        nested = b'{"a": ' * depth + b"1" + b"}" * depth
        data = raw[:-1] + b', "deep": ' + nested + b"}"
        if depth <= 63:
            return _case(request(ctx, "POST", path, data), ANY)
    elif roll == 4:
        data = raw.replace(b'"max_tokens": 1', b'"max_tokens": ' + rng.choice(
            [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"1" * 5000, b"0x10", b"01", b"1.0",
             b"+1", b".5", b"1_000"]))  # fmt: skip
    elif roll == 5:
        data = raw[:-1] + b', "model": "' + rng.choice(sorted(ctx.models)).encode() + b'"}'
    elif roll == 6:
        data = raw[:10] + bytes([rng.choice([0x80, 0xC0, 0xFF, 0xED, 0xF8])]) + raw[10:]
    elif roll == 7:
        data = json.dumps(body).encode(rng.choice(["utf-16", "utf-32", "utf-16-le"]))
    elif roll == 8:
        data = b"\xef\xbb\xbf" + raw
    elif roll == 9:
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    elif roll == 10:
        data = rng.choice([b"", b" ", b"null", b"{}", b"{", b"}", b'{"model": }', b"\x00" * 8,
                           b"{'model': 'alpha'}", b'{"model": "alpha",}'])  # fmt: skip
    else:
        data = raw + b" " * rng.randrange(1, 50) + rng.choice([b"", b"x", b"{}", b"\x00"])
    return _case(request(ctx, "POST", path, data), REFUSALS | ({200} if roll in (5, 11) else set()))


def _headers(rng: random.Random, ctx: Context) -> Case:
    path, body = _valid_body(rng, ctx)
    raw = _dump(body)
    roll = rng.randrange(9)
    allowed: set[int] = set(REFUSALS)
    if roll == 0:
        host = rng.choice(["attacker.example", f"attacker.example:{ctx.port}", "localhost.evil",
                           "127.0.0.2", "[::2]", "", "127.0.0.1:abc", "[::1", "::1", " ",
                           "localhost:1:2", "LOCALHOST", f"[::1]:{ctx.port}", "proxy.example",
                           "proxy.example.evil", "127.0.0.1\t", "local\u00e9host",
                           "xn--lcalhost-ywa"])  # fmt: skip
        headers = {"Host": host}
        if host.strip().lower() in ("localhost", f"[::1]:{ctx.port}", "proxy.example", "127.0.0.1"):
            allowed.add(200)  # (surrounding white space is no part of a header's value)
    elif roll == 1:
        auth = rng.choice([None, "", "Bearer", "Bearer ", f"Bearer {ctx.key} x", f"Token {ctx.key}",
                           f"Bearer  {ctx.key}", f"BEARER {ctx.key}", ctx.key, f"Bearer {ctx.key[:-1]}",
                           f"Bearer {ctx.key}\u00e9", "Basic YTpi", "Bearer " + "k" * 5000])  # fmt: skip
        headers = {"Authorization": auth}
        if auth in (f"Bearer  {ctx.key}", f"BEARER {ctx.key}"):
            allowed.add(200)
    elif roll == 2:
        ctype = rng.choice(CONTENT_TYPES)
        headers = {"Content-Type": ctype}
        if ctype.split(";")[0].strip().lower() == "application/json":
            allowed.add(200)
    elif roll == 3:
        length = rng.choice(["-1", "abc", "1e3", " 5", "0x10", "", "9" * 30,
                             f"{len(raw)}, {len(raw)}", "+5"])  # fmt: skip
        headers = {"Content-Length": length}
        if length == f"{len(raw)}, {len(raw)}":
            allowed.add(200)  # a list of one value repeated: HTTP allows it
    elif roll == 4:  # chunked: well-formed (may be served) or broken
        headers = {"Content-Length": None, "Transfer-Encoding": rng.choice(
            ["chunked", "chunked", "gzip, chunked", "identity", "chunked, chunked"])}  # fmt: skip
        pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        if rng.random() < 0.5:
            chunked = rng.choice([b"zz\r\n" + raw + b"\r\n0\r\n\r\n",
                                  b"%x\r\n%s\r\n0\r\n\r\n" % (len(raw) - 3, raw),
                                  b"-1\r\n\r\n", b"0\r\n\r\n"])  # fmt: skip
        elif headers["Transfer-Encoding"] == "chunked":
            allowed.add(200)
        return _case(request(ctx, "POST", path, b"", headers) + chunked, allowed)
    elif roll == 5:  # an odd extra header line
        line = rng.choice(["X-A: \x00", "X A: b", ": empty-name", "X-Fold: a\r\n folded",
                           "X-Long: " + "y" * 20_000, "X-\u00e9: v", "X-B: \u00e9\u00e9",
                           "Expect: 100-continue", "Expect: weird", "Upgrade: websocket\r\n"
                           "Connection: upgrade", "X-C:" + "\t" * 10, "Content-Type: text/plain",
                           "Host: attacker.example", "Authorization: Bearer nope"])  # fmt: skip
        data = request(ctx, "POST", path, raw)
        head, _, rest = data.partition(b"\r\n\r\n")
        data = head + b"\r\n" + line.encode("utf-8") + b"\r\n\r\n" + rest
        if line.startswith(("Expect:", "X-C:", "X-B:", "Upgrade", "X-Fold")):
            allowed.add(200)
        return _case(data, allowed)
    elif roll == 6:  # many headers
        headers = {f"X-{i}": "v" * rng.randrange(1, 40) for i in range(rng.choice([50, 200, 2000]))}
        allowed.add(200)
    elif roll == 7:
        headers = {"Content-Length": str(len(raw) - rng.randrange(1, 5))}  # fewer bytes than sent
    else:
        headers = {"Content-Type": None, "Authorization": None}
    return _case(request(ctx, "POST", path, raw, headers), allowed)


def _lines(rng: random.Random, ctx: Context) -> Case:
    method = rng.choice(METHODS)
    target = rng.choice(PATHS + ["*", f"http://127.0.0.1:{ctx.port}/v1/models",
                                 "http://attacker.example/v1/models", "v1/models", ""])  # fmt: skip
    version = rng.choice(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "http/1.1",
                                             "HTTP/1.1 ", "HTTP/9.9", ""])  # fmt: skip
    _, body = _valid_body(rng, ctx, chat=False)
    raw = _dump(body) if method.upper() in ("POST", "PUT", "PATCH") else b""
    data = request(ctx, method, target, raw, version=version)
    if rng.random() < 0.1:
        data = data.replace(b"\r\n", b"\n")
    return _case(data, ANY)


def _unicode(rng: random.Random, ctx: Context) -> Case:
    path, body = _valid_body(rng, ctx)
    text = "".join(rng.choice(UNICODE) for _ in range(rng.randrange(1, 4)))
    where = rng.choice(["value", "value", "role", "key", "model"])
    raw = _dump(body)
    marker = "@@@"
    if where == "value":
        if "messages" in body:
            body["messages"][-1]["content"] = marker
        else:
            body["prompt"] = marker
    elif where == "role" and "messages" in body:
        body["messages"][-1]["role"] = marker
    elif where == "key":
        body[marker] = 1
    else:
        body["model"] = marker
    raw = _dump(body).replace(marker.encode(), text.encode())
    return _case(request(ctx, "POST", path, raw), ANY)


def _sizes(rng: random.Random, ctx: Context) -> Case:
    path, body = _valid_body(rng, ctx, chat=False)
    n, m, vocab = ctx.models[body["model"]]
    roll = rng.randrange(6)
    if roll == 0:
        body["prompt"] = "x" * rng.choice([1, n - 1, n, n + 1, 10 * n, 100_000])
    elif roll == 1:
        body["max_tokens"] = rng.choice([1, m, m + 1, 2**31, 2**63, 10**400])
    elif roll == 2:
        body["prompt"] = [rng.choice([0, 1, vocab - 1, vocab, -1, 2**31, 2**63, 10**30])
                          for _ in range(rng.choice([1, 2, n, n + 1]))]  # fmt: skip
    elif roll == 3:
        body["prompt"] = [1] * rng.choice([n, n + 1, 5000, 100_000])
    elif roll == 4:  # over the size limit: declared, with only a little of it sent
        data = request(ctx, "POST", path, b"", {"Content-Length": str(ctx.max_body + 1)})
        return _case(data + b'{"model": ', {413})
    else:
        body = {"model": body["model"], "max_tokens": 1,
                "messages": [{"role": "user", "content": "y"}] * rng.choice([1, 2, 1000, 20_000])}
        path = "/v1/chat/completions"
    return _case(request(ctx, "POST", path, _dump(body)), ANY)
