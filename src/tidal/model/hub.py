"""A hub id in model.name_or_path (`org/name`) on a machine that cannot reach the hub.

huggingface_hub retries every file it asks the hub for (five times, backing off): with no route to
the hub, a model already in the local cache takes minutes to load in each process of a run, and one
that is not there fails only after those minutes, in the middle of a traceback. The launcher asks
once, within seconds: unreachable and cached, the whole run loads from the cache (offline mode, which
its processes inherit); unreachable and not cached, one line says so before anything starts.
"""

from __future__ import annotations

import logging
import os
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

REACH_TIMEOUT_SECONDS = 5.0


def looks_like_hub_id(name_or_path: str) -> bool:
    """`org/name` or `name` that is not a directory here (a local path that is missing is reported as such elsewhere)."""
    from tidal.model.loading import is_missing_local_path

    return not Path(name_or_path).expanduser().exists() and not is_missing_local_path(name_or_path)


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def unreachable_reason(url: str, timeout: float = REACH_TIMEOUT_SECONDS) -> str | None:
    """None when `url` answers at all (any HTTP status, through a proxy if the environment names one);
    else why not, in a few words."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except urllib.error.URLError as err:
        return str(err.reason)
    except (OSError, ValueError) as err:  # a timeout; an endpoint that is no URL
        return str(err) or type(err).__name__


def is_cached(repo_id: str) -> bool:
    """The model's config.json is in the local hub cache (HF_HOME / HF_HUB_CACHE)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id: transformers says so when it loads
        return False


def go_offline() -> None:
    """Offline mode for this process (huggingface_hub reads its constant on each request) and for
    every process it starts (they read the variable at import)."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def check_hub_model(name_or_path: str | None, key: str = "model.name_or_path") -> None:
    """Before a run loads `name_or_path`: nothing to do for a directory or with the hub reachable.
    Otherwise (the hub out of reach, or HF_HUB_OFFLINE set) the cached copy is used, offline from here
    on, or a ModelLoadError says the model cannot be had here."""
    from huggingface_hub import constants

    from tidal.model.loading import ModelLoadError

    if name_or_path is None or not looks_like_hub_id(name_or_path):
        return
    if constants.HF_HUB_OFFLINE:  # huggingface_hub takes TRANSFORMERS_OFFLINE for it too: name the one set
        why = f"{'HF_HUB_OFFLINE' if os.environ.get('HF_HUB_OFFLINE') else 'TRANSFORMERS_OFFLINE'} is set"
    else:
        endpoint = hub_endpoint()
        reason = unreachable_reason(endpoint)
        if reason is None:
            return
        why = f"{endpoint} cannot be reached from this machine ({reason})"
    if is_cached(name_or_path):
        if not constants.HF_HUB_OFFLINE:
            log.warning("%s: %s %s loads from the local cache (HF_HUB_OFFLINE=1 for this run)", why, key, name_or_path)
            go_offline()
        return
    raise ModelLoadError(
        f"{key} {name_or_path!r} is a hub id, {why} and the model is not in the local cache ({constants.HF_HUB_CACHE}): "
        f"download it where the hub can be reached (`hf download {name_or_path}`) and copy the cache here (HF_HOME), or give a local directory"
    )
