"""Generated bad input for every command (issue 11's fuzz suite): plans, configs, weights headers,
options. ``cases(seed, count, fixtures)`` yields deterministic ``Case`` records; ``fuzz_worker``
runs them.

Families (about the share of a run): ``plan_bytes`` (35 %: a plan file damaged byte-wise: cut,
flipped, spliced, emptied, nested, not UTF-8), ``plan_fields`` (35 %: one field of a valid plan set
to an extreme value, removed, or a key added, then re-stamped as a deliberate edit would be, so the
verifier and the runner are what is tested), ``options`` (22 %: odd numbers, sizes and paths for
each command's options), ``configs`` (4 %: a config.json field of the compile/fit model set to an
extreme value), ``headers`` (4 %: the safetensors header lying about offsets, dtypes, shapes, or one
tensor in two shards).
"""

from __future__ import annotations

import base64
import copy
import json
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

# Exit statuses a command may end with on generated input (2 = refused); anything else, a signal
# or a traceback is a failure.
ALLOWED = {
    "validate": {0, 2},
    "show": {0, 2},
    "dot": {0, 2},
    "trace": {0, 2},
    "diff": {0, 1, 2},
    "compile": {0, 1, 2},
    "fit": {0, 1, 2},
    "run": {0, 2, 3},
    "bench": {2},
    "roofline": {0, 2},
    "pool": {0, 1, 2},
    "convert-gguf": {0, 2},
    "pack": {0, 2},
}

INTS = [0, -1, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32, 2**53, 2**53 + 1, 2**63, 10**12, -(2**31), 10**400]
FLOATS = [0.0, -0.0, 1e-300, 1e308, -1e308, 0.5, 1.5]
TEXTS = ["", " ", "x", "0", "-1", "1e3", "nan", "inf", "-inf", "null", "\u00e9", "a\nb"]
ODD_VALUES: list = INTS + FLOATS + TEXTS + [None, True, False, [], {}, [[]], {"a": 1}, [1, 2, 3]]

NUMBERS = ["0", "-1", "1", "2", "3", "17", "2147483648", "4294967296", "1000000000000",
           "9" * 400, "-9" * 200, "1e3", "0x10", "nan", "inf", "", " ", "1.5", "\udcff"]  # fmt: skip
SIZES = ["0", "-1", "1", "16GiB", "1e999", "9" * 400, "1.5KiB", "64MiB", "x", "", "16 GiB",
         "0.0000001", "2%", "-2%", "1000000000000%", "9" * 400 + "%", "nan%"]  # fmt: skip
TOKEN_LISTS = ["1", "1,2,3", "", ",", "-1", "1,x", "999999999999", "9" * 400, "1,,2",
               ",".join(["5"] * 40), "63", "64", "1 2"]  # fmt: skip
PROMPTS = ["hello", "", "\udcff\udcfe", "\x00", "é" * 50]


@dataclass
class Case:
    id: int
    family: str
    command: str
    argv: list[str]  # "{d}" is the case's folder, "{f}" the shared fixtures folder
    files: dict[str, str] = field(default_factory=dict)  # name in {d} -> base64 content
    outputs: list[str] = field(default_factory=list)  # names in {d} the command may write

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def cases(seed: int, count: int, fixtures: dict[str, bytes]) -> Iterator[Case]:
    """``count`` cases; ``fixtures``: the bytes of ``small.plan`` (hand-built, one phase),
    ``tiny.plan`` (compiled from ``{f}/model``), ``config.json`` and ``model.safetensors`` of it."""
    rng = random.Random(seed)
    small = json.loads(fixtures["small.plan"])
    tiny = json.loads(fixtures["tiny.plan"])
    config = json.loads(fixtures["config.json"])
    makers = (
        [(_plan_bytes, 35), (_plan_fields, 35), (_options, 22), (_configs, 4), (_headers, 4)]
    )
    families = [m for m, w in makers for _ in range(w)]
    for i in range(count):
        maker = families[rng.randrange(len(families))]
        yield maker(i, rng, fixtures, small, tiny, config)


# ------------------------------------------------------------------------------------ plans


def _plan_command(rng: random.Random, runnable: bool) -> tuple[str, list[str], list[str]]:
    """A command reading {d}/p.plan: (command, argv, outputs)."""
    choices = ["validate", "show", "dot", "trace", "diff", "roofline", "pool"]
    choices += ["run", "run"] if runnable else []
    command = rng.choice(choices)
    plan = "{d}/p.plan"
    if command == "validate":
        return command, ["validate", plan], []
    if command == "show":
        return command, ["show", plan] + (["--json"] if rng.random() < 0.5 else []), []
    if command == "dot":
        view = rng.choice(["lifetimes", "buffers", "graph"])
        return command, ["dot", plan, "--view", view, "-o", "{d}/out.dot"], ["out.dot"]
    if command == "trace":
        return command, ["trace", plan, "-o", "{d}/out.json"], ["out.json"]
    if command == "roofline":
        return command, ["roofline", plan] + (["--json"] if rng.random() < 0.5 else []), []
    if command == "pool":
        return command, ["pool", "--memory", "1GiB", plan, "{f}/tiny.plan"], []
    if command == "diff":
        other = "{f}/tiny.plan" if runnable else "{f}/small.plan"
        return command, ["diff", other, plan, "--format", rng.choice(["text", "json"])], []
    return command, ["run", plan, "--model", "{f}/model", "--tokens", "1,2,3", "--max-tokens",
                     "2", "--report", "{d}/r.json"], ["r.json"]  # fmt: skip


def _plan_bytes(i, rng, fixtures, small, tiny, config) -> Case:
    runnable = rng.random() < 0.04
    data = bytearray(fixtures["tiny.plan" if runnable else "small.plan"])
    how = rng.choice(["cut", "flip", "splice", "empty", "nest", "utf8", "dup_line", "drop_line"])
    if how == "cut":
        data = data[: rng.randrange(len(data))]
    elif how == "flip":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif how == "splice":
        at = rng.randrange(len(data))
        data[at:at] = rng.choice([b"{", b"]", b",", b'"', b"\x00", b"1e999", b"-", b"\\u00"])
    elif how == "empty":
        data = bytearray(rng.choice([b"", b"   \n", b"null", b"[]", b"{}", b'"plan"', b"1"]))
    elif how == "nest":
        depth = rng.choice([100, 1000, 100000])
        data = bytearray(b"[" * depth + b"]" * depth)
    elif how == "utf8":
        at = rng.randrange(len(data))
        data[at:at] = b"\xff\xfe\xc3"
    else:
        lines = bytes(data).split(b"\n")
        k = rng.randrange(len(lines))
        if how == "dup_line":
            lines.insert(k, lines[k])
        else:
            del lines[k]
        data = bytearray(b"\n".join(lines))
    command, argv, outputs = _plan_command(rng, runnable)
    return Case(i, "plan_bytes", command, argv, {"p.plan": _b64(bytes(data))}, outputs)


def _paths(value, prefix=()) -> Iterator[tuple]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for k, v in enumerate(value[:40]):  # long lists: a sample of their first elements
            yield from _paths(v, prefix + (k,))


def _plan_fields(i, rng, fixtures, small, tiny, config) -> Case:
    from hardening import restamp

    runnable = rng.random() < 0.06
    document = copy.deepcopy(tiny if runnable else small)
    paths = [p for p in _paths(document) if p and p != ("digest",)]
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        path = rng.choice(paths)
        parent = document
        try:
            for key in path[:-1]:
                parent = parent[key]
            last = path[-1]
            how = rng.random()
            if how < 0.75:
                parent[last] = copy.deepcopy(rng.choice(ODD_VALUES))
            elif how < 0.85 and isinstance(parent, dict):
                del parent[last]
            elif isinstance(parent, dict):
                parent["unexpected"] = 1
            elif isinstance(parent, list) and len(parent) > 1:
                j = rng.randrange(len(parent))
                parent[last], parent[j] = parent[j], parent[last]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed the path
    command, argv, outputs = _plan_command(rng, runnable)
    data = restamp(document) if isinstance(document, dict) else json.dumps(document).encode()
    return Case(i, "plan_fields", command, argv, {"p.plan": _b64(data)}, outputs)


# ------------------------------------------------------------------------------------ options


def _path_option(
    rng: random.Random, name: str, source: str = "{d}/p.plan"
) -> tuple[str, list[str], dict[str, str]]:
    """An output path of one of the odd kinds: (argument, outputs allowed, files to create);
    ``source``: an input of the command."""
    kind = rng.choice(["new", "missing_dir", "dir", "under_file", "empty", "proc", "input",
                       "existing"])  # fmt: skip
    if kind == "new":
        return f"{{d}}/{name}", [name], {}
    if kind == "existing":
        return f"{{d}}/{name}", [name], {name: _b64(b"an earlier output\n")}
    if kind == "missing_dir":
        return f"{{d}}/nowhere/{name}", [], {}
    if kind == "dir":
        return "{d}", [], {}
    if kind == "under_file":
        return f"{{d}}/afile/{name}", [], {"afile": _b64(b"x")}
    if kind == "empty":
        return "", [], {}
    if kind == "proc":
        return f"/proc/{name}", [], {}
    return source, [], {}  # an input of the command


def _options(i, rng, fixtures, small, tiny, config) -> Case:
    command = rng.choice(["compile", "compile", "fit", "run", "run", "dot", "trace", "diff",
                          "bench", "show", "validate", "roofline", "pool", "convert-gguf",
                          "pack"])  # fmt: skip
    files = {"p.plan": _b64(fixtures["tiny.plan"])}
    outputs: list[str] = []
    num = lambda: rng.choice(NUMBERS)  # noqa: E731
    if command == "compile":
        argv = ["compile", "{f}/model", "-N", rng.choice(NUMBERS[:6] + ["8"] * 6), "-M",
                rng.choice(NUMBERS[:6] + ["4"] * 6), "-q"]  # fmt: skip
        extra = rng.choice([["--prefill-chunk", num()], ["--alignment", num()], ["--batch", num()],
                            ["--memory", rng.choice(SIZES)], ["--sync-every", num()],
                            ["--dtype", rng.choice(["float32", "int8", ""])], []])  # fmt: skip
        out, outputs, made = _path_option(rng, "out.plan", "{f}/model/config.json")
        files.update(made)
        argv += extra + ["-o", out]
    elif command == "fit":
        argv = ["fit", "{f}/model", "--memory", rng.choice(SIZES), rng.choice(["-M", "-N"]),
                rng.choice(NUMBERS[:5] + ["4"]), "-q"]  # fmt: skip
        if rng.random() < 0.3:
            argv += ["--alignment", num()]
        if rng.random() < 0.4:
            out, outputs, made = _path_option(
                rng, "fit.plan", rng.choice(["{f}/model/config.json", "{f}/model/model.safetensors"])
            )
            files.update(made)
            argv += ["-o", out]
    elif command == "run":
        source = (["--tokens", rng.choice(TOKEN_LISTS)] if rng.random() < 0.7
                  else ["--prompt", rng.choice(PROMPTS)])  # fmt: skip
        argv = ["run", "{d}/p.plan", "--model", rng.choice(["{f}/model", "{d}", "{d}/none"]),
                *source, "--max-tokens", rng.choice(NUMBERS[:8] + ["2"] * 4)]  # fmt: skip
        if rng.random() < 0.5:
            out, outputs, made = _path_option(rng, "r.json")
            files.update(made)
            argv += ["--report", out]
    elif command == "dot":
        out, outputs, made = _path_option(rng, rng.choice(["o.dot", "o.gv", "o.txt"]))
        files.update(made)
        argv = ["dot", "{d}/p.plan", "--view", rng.choice(["lifetimes", "buffers", "graph"]),
                "--phase", rng.choice(["decode", "prefill", "x", ""]), "--layers",
                rng.choice(["0", "0-1", "5-2", "x", "9" * 30, "-1", ""]), "-o", out]  # fmt: skip
    elif command == "trace":
        out, outputs, made = _path_option(rng, "t.json")
        files.update(made)
        argv = ["trace", "{d}/p.plan", "-o", out]
        if rng.random() < 0.5:
            argv += ["--phase", rng.choice(["decode", "prefill", "nope", ""])]
    elif command == "diff":
        argv = ["diff", "{f}/tiny.plan", "{d}/p.plan"]
        for _ in range(rng.randint(0, 2)):
            argv += [rng.choice(["--fail-above", "--budget"]), rng.choice(SIZES)]
    elif command == "bench":
        argv = ["bench", "{d}/p.plan", "--model", "{f}/model", "-q", "--no-plot", "--reps",
                rng.choice(["0", "-1", "9" * 30, "x"]), "--warmup", num(), "--resamples",
                num(), "--out", "{d}/bench"]  # fmt: skip
    elif command == "roofline":
        argv = ["roofline", "{d}/p.plan", "--prompt-tokens", num()]
        if rng.random() < 0.4:
            argv += ["--compare-bench", rng.choice(["{d}/none.json", "{d}", "{d}/p.plan", ""])]
        if rng.random() < 0.3:
            argv += ["--profile", rng.choice(["apple-m1", "cpu-x86-2core", "x"])]
    elif command == "pool":
        argv = ["pool", "--memory", rng.choice(SIZES), "{d}/p.plan",
                rng.choice(["{f}/tiny.plan", "a={d}/p.plan", "=", "x=", "{d}/none"])]  # fmt: skip
        if rng.random() < 0.3:
            argv.append("--concurrent")
    elif command == "convert-gguf":
        data = rng.choice([b"", b"GGUF", b"GGUF" + bytes(rng.randrange(256) for _ in range(64)),
                           b"not a gguf file at all", fixtures["model.safetensors"][:200]])  # fmt: skip
        files["m.gguf"] = _b64(data)
        out, outputs, made = _path_option(rng, "out", "{d}/m.gguf")
        files.update(made)
        argv = ["convert-gguf", "{d}/m.gguf", out, "-q"]
    elif command == "pack":
        rows = ["id,start,end,size", "a,0,3,64", "b,2,5,32", "c,4,6,128"]
        k = rng.randrange(1, len(rows))
        rows[k] = rng.choice(["x,1", "a,0,3,64", "d,5,2,8", "e,0,1,-4", "f,0,1," + "9" * 400,
                              "g,0,1,1e9", "", ",,,", "h,0,1,64,3", "i,0,1,64,0"])  # fmt: skip
        files["p.csv"] = _b64("\n".join(rows).encode())
        out, outputs, made = _path_option(rng, "o.csv", "{d}/p.csv")
        files.update(made)
        argv = ["pack", "{d}/p.csv", "--seconds", rng.choice(["0", "0.01", "-1", "nan", "1e9"]),
                "--alignment", rng.choice(["1", "0", "64", "3", "9" * 30]), "-o", out]  # fmt: skip
    elif command == "show":
        argv = ["show", rng.choice(["{d}/p.plan", "{d}", "{d}/none", "", "/proc/self/mem",
                                    "/dev/null"])]  # fmt: skip
    else:
        argv = ["validate", *rng.sample(["{d}/p.plan", "{d}", "{d}/none", "", "/dev/null"],
                                       rng.randint(1, 3))]  # fmt: skip
    return Case(i, "options", command, argv, files, outputs)


# ------------------------------------------------------------------------------------ models


CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta", "model_type",
               "head_dim", "max_position_embeddings", "tie_word_embeddings", "torch_dtype",
               "quantization", "rope_scaling"]  # fmt: skip
QUANTS = [{"bits": 0, "group_size": 64}, {"bits": "x", "group_size": 64}, {"bits": 4},
          {"group_size": 64}, {"bits": 4, "group_size": 0}, {"bits": 4, "group_size": 7},
          {"bits": 2**40, "group_size": 64}, {"bits": 4, "group_size": 32, "mode": 5}, []]  # fmt: skip


def _configs(i, rng, fixtures, small, tiny, config) -> Case:
    cfg = copy.deepcopy(config)
    for _ in range(rng.choice([1, 1, 2])):
        key = rng.choice(CONFIG_KEYS)
        if key == "quantization" and rng.random() < 0.7:
            cfg[key] = copy.deepcopy(rng.choice(QUANTS))
        elif rng.random() < 0.1:
            cfg.pop(key, None)
        else:
            cfg[key] = copy.deepcopy(rng.choice(ODD_VALUES))
    if rng.random() < 0.05:
        text = "[" * 5000 + "]" * 5000
        data = ('{"model_type": "qwen2", "x": ' + text + "}").encode()
    elif rng.random() < 0.04:  # a number past Python's 4,300-digit int conversion limit
        cfg[rng.choice(CONFIG_KEYS)] = "HUGE"
        data = json.dumps(cfg).replace('"HUGE"', "9" * 5000).encode()
    else:
        data = json.dumps(cfg).encode()
    command = rng.choice(["compile", "compile", "compile", "fit"])
    if command == "compile":
        argv = ["compile", "{d}/m", "-N", "8", "-M", "4", "-q", "-o", "{d}/out.plan"]
    else:
        argv = ["fit", "{d}/m", "--memory", "1GiB", "-M", "4", "-q"]
    files = {"m/config.json": _b64(data)}
    return Case(i, "configs", command, argv, files, ["out.plan"])


def _headers(i, rng, fixtures, small, tiny, config) -> Case:
    weights = fixtures["model.safetensors"]
    (n,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + n])
    body = weights[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    how = rng.choice(["offsets", "offsets", "dtype", "shape", "length", "truncate", "two_shards",
                      "not_dict", "meta"])  # fmt: skip
    files: dict[str, bytes] = {}
    if how == "offsets":
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[end, start], [start, end + 10**6], [0, 2**64],
                                            [-1, end], [start, start], [start, "x"],
                                            [start], [len(body), len(body) + 4]])  # fmt: skip
    elif how == "dtype":
        entry["dtype"] = rng.choice(["F8", "", 5, None, "F64", "I4"])
    elif how == "shape":
        entry["shape"] = rng.choice([[-1], [2**40, 2**40], [], [0], "x", [1.5], [10**12]])
    elif how == "not_dict":
        header[name] = rng.choice([1, "x", None, []])
    elif how == "meta":
        header["__metadata__"] = rng.choice([1, {"format": 5}, None])
    head = json.dumps(header).encode()
    if rng.random() < 0.05:  # a number past Python's 4,300-digit int conversion limit
        head = head.replace(b'"data_offsets": [', b'"data_offsets": [' + b"9" * 5000 + b", ", 1)
    length = len(head)
    if how == "length":
        length = rng.choice([0, 7, length + 100, 2**40, 2**64 - 1])
    data = struct.pack("<Q", length) + head + body
    if how == "truncate":
        data = data[: rng.randrange(8, len(data))]
    files["model.safetensors"] = data
    if how == "two_shards":
        files = {"model-00001-of-00002.safetensors": weights,
                 "model-00002-of-00002.safetensors": weights}  # fmt: skip
    files["config.json"] = fixtures["config.json"]
    encoded = {f"m/{k}": _b64(v) for k, v in files.items()}
    encoded["p.plan"] = _b64(fixtures["tiny.plan"])
    if rng.random() < 0.5:
        argv = ["compile", "{d}/m", "-N", "8", "-M", "4", "-q", "-o", "{d}/out.plan"]
        command = "compile"
    else:
        argv = ["run", "{d}/p.plan", "--model", "{d}/m", "--tokens", "1,2", "--max-tokens", "2"]
        command = "run"
    return Case(i, "headers", command, argv, encoded, ["out.plan"])
