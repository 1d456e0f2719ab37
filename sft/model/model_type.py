"""The model types that take their own paths (MLA), and where a hub id is looked for (check_hub_model, which
sft/model/loading.py's resolve_model_path uses). Imports none of the options, which sft/model/loading.py does.
"""

from __future__ import annotations

from sft.errors import ModelNotFoundError
from sft.machine import launch

# Multi-head latent attention (DeepSeek-V2/V3): key and value head sizes differ, and Liger's fused loss has no patch
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def check_hub_model(repo_id: str, option: str) -> None:
    """The hub id is in the local cache, or the hub answers for it now (a 3-second connection test first)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # cached: transformers loads it (and checks for updates if online)
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{option} {repo_id}: not in the local Hugging Face cache ({cache}), and "
                                 f"HF_HUB_OFFLINE=1 forbids downloading it. Download it once where there is network "
                                 f"(`hf download {repo_id}`), or give a local directory.")
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    if not launch().hub_proxied:  # through a proxy, a direct connection test says nothing
        try:
            socket.create_connection((host, 443), timeout=3).close()
        except OSError as e:
            raise ModelNotFoundError(
                f"{option} {repo_id}: not in the local Hugging Face cache ({cache}) and {host} cannot be reached "
                f"({e.strerror or e}). Connect to the network, or work offline: give a local directory, or set "
                f"HF_HUB_OFFLINE=1 to use only the cache.") from None
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        model_info(repo_id, timeout=15)
    except GatedRepoError:
        raise ModelNotFoundError(f"{option} {repo_id}: the model is gated; accept its licence on {host} and log in "
                                 f"(`hf auth login`).") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{option} {repo_id}: no such model on {host} (or it is private: `hf auth login`). "
                                 f"Check the name, or give a local directory.") from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelNotFoundError(f"{option} {repo_id}: the hub did not answer ({e}). Retry, or set "
                                 f"HF_HUB_OFFLINE=1 to use only the local cache.") from None
