"""Models named by their Hugging Face id (`Org/Name`): found in the local Hugging Face cache, or
downloaded into it where the network allows.

The cache is the one huggingface_hub and vLLM use (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
~/.cache/huggingface/hub), read when a model is resolved; `HF_HUB_OFFLINE=1` keeps to it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Org/Name, as the Hub spells repository ids.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What serving needs: configuration, tokenizer, chat template and safetensors weights.
SERVING_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubModelError(ValueError):
    """A model id that resolves to no usable directory; the message says what to do."""


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not name.startswith((".", "~"))


def hub_cache_dir(environ=os.environ) -> Path:
    if environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(environ.get("HF_HUB_CACHE") or environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = environ.get("HF_HOME") or str(Path(environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline(environ=os.environ) -> bool:
    return environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def _pass_a_directory(repo_id: str) -> str:
    return (f"download it where the network allows (`hf download {repo_id}`) or pass its directory:"
            " --model /path/to/model (a folder with config.json)")


def resolve_hub_model(repo_id: str) -> Path:
    """The directory of `repo_id`'s snapshot (main) in the Hugging Face cache, downloaded first if absent
    and the network is allowed; HubModelError saying why not otherwise."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        found = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
        if (found / "config.json").is_file():
            return found
    except (OSError, ValueError):
        pass  # not cached (or only partly): download it, if allowed
    if hub_offline():
        raise HubModelError(f"model {repo_id!r} is not a directory here and not in the Hugging Face cache ({cache});"
                            f" HF_HUB_OFFLINE is set, so it is not downloaded: {_pass_a_directory(repo_id)}")
    try:
        found = Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=SERVING_FILES))
        if not any(found.glob("*.safetensors")):  # weights only as PyTorch pickles
            found = Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=[*SERVING_FILES, "*.bin"]))
    except Exception as exc:  # network, authorisation, unknown repository: all said in one line
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise HubModelError(f"model {repo_id!r} is not a directory here and could not be downloaded from the"
                            f" Hugging Face Hub ({type(exc).__name__}: {reason}); {_pass_a_directory(repo_id)}"
                            ) from None
    if not (found / "config.json").is_file():
        raise HubModelError(f"model {repo_id!r} from the Hugging Face Hub has no config.json ({found}); pass a"
                            " directory holding a transformers model instead")
    return found
