"""Which ``LMCACHE_*`` environment variables are LMCache configuration keys.

LMCache reads ``LMCACHE_<KEY>`` for each key of its configuration; other ``LMCACHE_*``
variables are switches of its code (``LMCACHE_USE_EXPERIMENTAL``, ``LMCACHE_LOG_LEVEL``,
``LMCACHE_TRACK_USAGE``, ...) or belong to its other configuration classes
(``LMCACHE_EC_*``, ``LMCACHE_COORDINATOR_*``, ...). kvmesh reads the first kind (a key it
does not know is warned about, naming the closest known key) and leaves the second alone.
"""

from __future__ import annotations

from kvmesh.config_lmcache import SHARED, is_lmcache_key
from kvmesh.config_lmcache_keys import RUNTIME_ENV, RUNTIME_ENV_PREFIXES

# LMCache's RESP connector falls back to LMCACHE_RESP_USERNAME / _PASSWORD / _HOST / _PORT;
# kvmesh reads RESP credentials from extra_config only (username / password).
_RESP = "resp_"


def not_config(key: str) -> bool:
    """Whether ``LMCACHE_<KEY>`` (``key`` lower-cased) is not a configuration key."""
    if is_lmcache_key(key) or key in SHARED:
        return False
    return key in RUNTIME_ENV or key.startswith(RUNTIME_ENV_PREFIXES) or key.startswith(_RESP)
