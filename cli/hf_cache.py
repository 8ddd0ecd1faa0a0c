"""Models named by their Hugging Face id (``ORG/NAME[@REVISION]``), found where mlx-lm finds them.

mlx-lm's ``load`` takes a path when it exists, else the id's snapshot in the Hugging Face cache
(``huggingface_hub.snapshot_download``, ``HF_HUB_CACHE`` or ``HF_HOME``/hub); so does dctms, through
the same library call, offline unless ``--download`` is given. A plan compiled from an id records
the id and the snapshot's commit hash (``CompileRequest.hub``), never the cache's absolute path, so
``dctms check`` finds the same snapshot on another machine.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from dctms.schema.errors import DctmsError

# What mlx-lm's _download fetches (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS): all a model folder needs.
ALLOW_PATTERNS = [
    "*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model",
    "*.txt", "*.jsonl", "*.jinja",
]  # fmt: skip
# A Hub repository id (huggingface_hub's own rule: letters, digits, "-", "_", "." between the
# slash), optionally with "@" and a branch, tag or commit.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")

# The commands that take a model, and the attributes of their arguments that name one.
MODEL_ARGUMENTS = {
    "compile": ("model", "draft"),
    "run": ("model", "draft_model"),
    "fit": ("model", "draft"),
    "check": ("model",),
    "bench": ("model", "draft_model"),
    "explain": ("model",),
}


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str  # the snapshot's commit hash
    path: Path  # the snapshot folder in this machine's cache


def hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when ``text`` has the form of a Hub id, else None."""
    m = HUB_ID.match(text)
    if m is None or ".." in text:
        return None
    return m["repo"], m["revision"]


def cache_dir() -> str:
    """The cache huggingface_hub searches (HF_HUB_CACHE, else HF_HOME/hub, as the library reads
    them when it is imported)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_model(text: str, download: bool = False) -> HubModel | None:
    """The cached snapshot a model argument names, or None when it is a path that exists or does
    not look like an id (the caller's own "not found" applies). A missing id is one line naming the
    cache searched and the commands that fetch it."""
    if Path(text).exists():
        return None  # a local path wins over an id, as in mlx-lm
    parsed = hub_id(text)
    if parsed is None:
        return None
    repo, revision = parsed
    return find_snapshot(repo, revision, download, f"{text}: no such folder, and")


def find_snapshot(repo: str, revision: str | None, download: bool, label: str) -> HubModel:
    """The snapshot of ``repo`` at ``revision`` (None: main) in the cache (fetched first with
    ``download``); a missing one is a DctmsError starting with ``label``."""
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = huggingface_hub.snapshot_download(
            repo, revision=revision, local_files_only=not download, allow_patterns=ALLOW_PATTERNS
        )
    except LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        raise DctmsError(
            f"{label} {repo}{at} is not in the Hugging Face cache {cache_dir()} (HF_HUB_CACHE); "
            f"fetch it with --download or `hf download {repo}"
            f"{' --revision ' + revision if revision else ''}`"
        ) from None
    except HFValidationError as err:
        raise DctmsError(f"{label} {repo} is not a Hugging Face id: {err}") from None
    except Exception as err:  # --download: the Hub's own errors (network, a gated repository)
        if not download:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DctmsError(f"{label} downloading {repo} failed: {first}") from None
    path = Path(folder)
    if not COMMIT.match(path.name):
        raise DctmsError(f"{label} the cache returned {path} for {repo}, not a snapshot folder")
    return HubModel(repo, path.name, path)


def add_download_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--download",
        action="store_true",
        help="fetch a model named by its Hugging Face id (ORG/NAME[@REVISION]) that is not in "
        "the local cache (otherwise nothing is downloaded)",
    )


def resolve_model_arguments(args: argparse.Namespace) -> dict[str, HubModel]:
    """Replace each model argument given as a Hub id with its snapshot folder; the ids found, by
    attribute (kept on ``args.hub``)."""
    found: dict[str, HubModel] = {}
    download = bool(getattr(args, "download", False))
    for name in MODEL_ARGUMENTS.get(getattr(args, "command", ""), ()):
        value = getattr(args, name, None)
        if not isinstance(value, str):
            continue
        hub = resolve_model(value, download)
        if hub is not None:
            setattr(args, name, str(hub.path))
            found[name] = hub
    args.hub = found
    return found


def with_hub(plan, hub: HubModel | None):
    """``plan`` recording the Hub id and snapshot commit it was compiled from (unchanged when the
    model was a folder or a config: those plans stay as they were)."""
    if hub is None or plan.compile is None:
        return plan
    import msgspec

    from dctms.schema.types import HubSource

    source = HubSource(repo_id=hub.repo_id, revision=hub.revision)
    return msgspec.structs.replace(plan, compile=msgspec.structs.replace(plan.compile, hub=source))
