"""Where downloaded task files come from when there is no internet: a local cache.

OSWorld's setup controller caches each download as `<cache_dir>/<uuid5(URL, url)>_<basename(path)>`; a file
already there is used as is. guijax looks up, in order:
  1. that OSWorld cache name in each cache directory,
  2. the URL's basename in each cache directory (a hand-filled cache),
  3. `file://` URLs, and URLs with no scheme as paths relative to `base_dir` (the task file's folder),
  4. http(s) only when `allow_network` is set.
"""
from __future__ import annotations

import os
import pathlib
import urllib.parse
import urllib.request
import uuid
from typing import Sequence


class CacheMiss(FileNotFoundError):
    """The URL is not in the local cache and may not be fetched; the message names the URL and where it looked."""


def osworld_cache_name(url: str, path: str) -> str:
    return f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{os.path.basename(path)}"


def locate(url: str, path: str = "", cache_dirs: Sequence[str | os.PathLike] = (),
           base_dir: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The local file that stands for `url`, or None."""
    parsed = urllib.parse.urlparse(url)
    basename = os.path.basename(parsed.path)
    for d in cache_dirs:
        d = pathlib.Path(d)
        for name in ([osworld_cache_name(url, path)] if path else []) + ([basename] if basename else []):
            if (d / name).is_file():
                return d / name
    if parsed.scheme == "file":
        p = pathlib.Path(urllib.request.url2pathname(parsed.path))
        return p if p.is_file() else None
    if not parsed.scheme and base_dir is not None:
        p = pathlib.Path(base_dir) / url
        return p if p.is_file() else None
    return None


def fetch_bytes(url: str, path: str = "", cache_dirs: Sequence[str | os.PathLike] = (),
                base_dir: str | os.PathLike | None = None, allow_network: bool = False,
                timeout_s: float = 300.0) -> bytes:
    if not url:
        raise ValueError("download: empty URL")
    local = locate(url, path, cache_dirs, base_dir)
    if local is not None:
        return local.read_bytes()
    scheme = urllib.parse.urlparse(url).scheme
    if scheme in ("http", "https") and allow_network:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (scheme checked)
            return r.read()
    where = [str(d) for d in cache_dirs] + ([str(base_dir)] if base_dir else [])
    raise CacheMiss(f"{url!r} is not in the local cache (looked in {where}"
                    f"{'' if not path else f' for {osworld_cache_name(url, path)}'}) and network downloads are off")
