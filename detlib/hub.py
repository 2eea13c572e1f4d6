"""The Hugging Face Hub for weights folders: a Hub repo id wherever weights are read (`--weights`,
`--evaluate_only`, `--init_from`), and `--push_to_hub` of a run's best/ (with its model card, `detlib.evaluation.model_card`).

Everything goes through huggingface_hub, so its cache (HF_HOME / HF_HUB_CACHE), its token (HF_TOKEN, `hf auth
login`) and its offline mode (HF_HUB_OFFLINE=1: only what is cached) are respected.

The rule, where a string may be a path or a repo id: a path that exists is local; `hf://NAME` is always the Hub;
otherwise `owner/name` (optionally `@revision`) is a repo id, unless its first folder exists locally
(`outputs/typo`): then it is a local path, and as it does not exist the error says that the folder hid the repo id
and that `hf://owner/name` asks for the Hub (`local_weights`; a bare `owner/name` never silently means a folder
that is not there, nor the Hub when a local folder of that name is there).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys

logger = logging.getLogger(__name__)

HUB_PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# The files of a weights folder a Hub download fetches (not whatever else a repo holds).
WEIGHTS_PATTERNS = ["*.safetensors", "*.json", "README.md", "*.bin", "*.pt", "*.pth"]
# A name ending so is a file's path, never a repo id.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json")


def offline() -> bool:
    """huggingface_hub's offline switch, read now (its own constant is read once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_repo(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `text` names a Hub repo rather than a local path (see the module
    docstring), else None."""
    if not isinstance(text, str) or os.path.exists(text):
        return None
    forced = text.startswith(HUB_PREFIX)
    name = text[len(HUB_PREFIX):] if forced else text
    if not forced and (not _REPO_ID.match(name) or os.path.isdir(name.split("/")[0]) or name.endswith(WEIGHT_SUFFIXES)):
        return None
    repo, _, revision = name.partition("@")
    return repo, revision or None


@functools.lru_cache(maxsize=None)
def download(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot folder of a Hub model repo's weights files (huggingface_hub's cache; offline: only
    what is cached).

    Raises:
        FileNotFoundError: one line saying why it could not be had (offline and not cached, no such repo, no
            network, ...), naming the repo.
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{repo_id} looks like a Hub repo id, and reading one needs huggingface_hub "
                                "(pip install huggingface_hub)") from None
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=WEIGHTS_PATTERNS,
                                 local_files_only=offline())
    except Exception as e:  # huggingface_hub's errors (and requests' / httpx's beneath them) have no common base
        reason = _first_line(e)
        if offline():
            reason = f"HF_HUB_OFFLINE is set and it is not in the Hub cache ({reason})"
        raise FileNotFoundError(f"no local file or folder {where}, and as a Hub repo it could not be fetched: "
                                f"{reason}") from None
    logger.info("Hub repo %s: %s", where, path)
    return path


def local_weights(path: str) -> str:
    """`path` itself, or for a Hub repo id (`hub_repo`) its downloaded snapshot folder.

    Raises:
        FileNotFoundError: one line, when a repo cannot be had, or when `path` is missing and reads as a repo id
            but a local folder of its first part hides it (`outputs/typo` with ./outputs there): it says so, and
            how to ask for the Hub (`hf://`), and whether the Hub cache holds the repo.
    """
    repo = hub_repo(path)
    if repo:
        return download(*repo)
    if isinstance(path, str) and not os.path.exists(path) and _REPO_ID.match(path) and not path.endswith(WEIGHT_SUFFIXES):
        first = path.split("/")[0]
        repo_id, _, revision = path.partition("@")
        cached = " (the Hub cache holds it)" if _cached(repo_id, revision or None) else ""
        raise FileNotFoundError(f"no local file or folder {path}: ./{first} is a local folder, so {path} is read as a path "
                                f"in it, not as the Hub repo id {path}; for the Hub write {HUB_PREFIX}{path}{cached}")
    return path


def _cached(repo_id: str, revision: str | None) -> bool:
    """Whether huggingface_hub's cache holds a snapshot of the repo (nothing is downloaded)."""
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, revision=revision, allow_patterns=WEIGHTS_PATTERNS, local_files_only=True)
    except Exception:  # not cached, not installed, a malformed id: no
        return False
    return True


def _first_line(e: Exception) -> str:
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


# ---- pushing a weights folder


def check_push(repo_id: str, private: bool = False) -> str | None:
    """Everything `push_folder` will need, checked before a run trains: huggingface_hub installed, not offline, a
    token, the Hub reachable with it, the repo created (or there) and writable. Returns None when all holds, else
    one line saying what is wrong and what to do."""
    flag = f"--push_to_hub {repo_id}"
    try:
        from huggingface_hub import HfApi, get_token
    except ImportError:
        return f"{flag} needs huggingface_hub: pip install huggingface_hub"
    if offline():
        return f"{flag}: HF_HUB_OFFLINE is set, and uploading needs the network (unset it, or drop --push_to_hub)"
    token = get_token()
    if not token:
        return f"{flag}: no Hugging Face token: log in (hf auth login) or set HF_TOKEN to a token with write access"
    api = HfApi()
    try:
        user = api.whoami(token=token)
    except Exception as e:
        return f"{flag}: the Hub at {api.endpoint} cannot be reached with this token ({_first_line(e)})"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, token=token, repo_type="model")
    except Exception as e:
        return f"{flag}: cannot create or write the repo as {user.get('name', '?')} ({_first_line(e)})"
    return None


def add_hub_flags(group) -> None:
    """--push_to_hub and --hub_private on an argparse group (`check_push` at start, `push_best` at the end)."""
    group.add_argument("--push_to_hub", metavar="REPO_ID", help="at the end, upload best/ (weights, model card, score "
                       "thresholds) to this Hugging Face Hub model repo (owner/name; created when missing); the token "
                       "and the network are checked at start (default: none, no upload)")
    group.add_argument("--hub_private", action="store_true", help="--push_to_hub creates the repo private")


def push_folder(folder: str, repo_id: str, private: bool = False, message: str | None = None) -> str:
    """Upload a weights folder (its model card, README.md, included) to the Hub model repo `repo_id` (created
    when missing). Returns the repo's URL. Raises RuntimeError (one line) when the upload fails."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                                 commit_message=message or f"detlib: {os.path.basename(folder.rstrip('/'))}/")
    except Exception as e:
        raise RuntimeError(f"uploading {folder} to {repo_id} failed ({_first_line(e)})") from None
    return getattr(info, "repo_url", None) or f"{api.endpoint}/{repo_id}"


def push_best(output_dir: str, repo_id: str, private: bool, script: str) -> None:
    """--push_to_hub at the end of a run: upload best/ (last/ when no evaluation made one); a failure is one line and
    exit 1, the folder kept for a manual upload."""
    folder = os.path.join(output_dir, "best")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        folder = os.path.join(output_dir, "last")
        logger.warning("--push_to_hub: no best/ (no evaluation improved on the first): uploading last/")
    try:
        url = push_folder(folder, repo_id, private, message=f"detlib {script}: {os.path.basename(folder)}/")
    except RuntimeError as e:
        logger.error("%s", e, extra={"console": False})
        print(f"error: --push_to_hub: {e}; the weights are in {folder}: upload them with "
              f"`hf upload {repo_id} {folder}`", file=sys.stderr, flush=True)
        raise SystemExit(1)
    logger.info("--push_to_hub: uploaded %s to %s", folder, url)
