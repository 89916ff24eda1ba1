"""Files a running service reads again without a restart: its TLS certificate (`dynamo_lite.web.tls`)
and its API key files (`KeyFiles`), on SIGHUP and when one of them changes (checked every
`POLL_SECS`). A set of files that cannot be used is logged and the previous one stays in force:
a rotation half done never locks clients out or stops the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from typing import Final, Protocol

from .auth import ApiKeys, read_key_file

logger = logging.getLogger("dynamo_lite.reloading")

POLL_SECS: Final = 2.0

Stamp = tuple[tuple[int, int], ...]


class Reloadable(Protocol):
    def reload(self) -> bool: ...

    def reload_if_changed(self) -> None: ...


def file_stamp(paths: Sequence[str]) -> Stamp:
    """What changes when a file is replaced: (mtime in ns, size) of each, (0, 0) if missing."""
    stamps = []
    for path in paths:
        try:
            status = os.stat(path)
        except OSError:
            stamps.append((0, 0))
        else:
            stamps.append((status.st_mtime_ns, status.st_size))
    return tuple(stamps)


async def watch(reloadables: Sequence[Reloadable], poll_secs: float = POLL_SECS) -> None:
    """Reload each on SIGHUP, and each whose files changed every `poll_secs`, until cancelled."""
    loop = asyncio.get_running_loop()

    def reload_all() -> None:
        for reloadable in reloadables:
            reloadable.reload()

    loop.add_signal_handler(signal.SIGHUP, reload_all)
    try:
        while True:
            await asyncio.sleep(poll_secs)
            for reloadable in reloadables:
                reloadable.reload_if_changed()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


def read_keys(write_keys: Sequence[str], read_keys: Sequence[str], write_file: str | None,
              read_file: str | None) -> tuple[list[str], list[str]]:
    """(full keys, read-only keys): those given inline, then those the files hold now;
    ValueError naming a file that cannot be read."""
    write, read = list(write_keys), list(read_keys)
    for keys, path in ((write, write_file), (read, read_file)):
        if path:
            try:
                keys.extend(read_key_file(path))
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the key file {path}: {exc}") from None
    return write, read


class KeyFiles:
    """The keys of `--api-key-file` / `--read-api-key-file`, with those given inline, read into
    `api_keys` again when the files change: a key rotation without a restart."""

    def __init__(self, api_keys: ApiKeys, write_keys: Sequence[str], read_keys: Sequence[str],
                 write_file: str | None, read_file: str | None) -> None:
        self.api_keys = api_keys
        self.inline = (list(write_keys), list(read_keys))
        self.files = (write_file, read_file)
        self.paths = [path for path in self.files if path]
        self._stamp = file_stamp(self.paths)
        self.reloads = 0
        self.failed_reloads = 0

    def reload(self) -> bool:
        self._stamp = file_stamp(self.paths)
        try:
            write, read = read_keys(*self.inline, *self.files)
            self.api_keys.replace(tuple(key.encode() for key in write), tuple(key.encode() for key in read))
        except ValueError as exc:
            self.failed_reloads += 1
            logger.error("API key files %s not reloaded, the previous keys stay in force: %s",
                         ", ".join(self.paths), exc)
            return False
        self.reloads += 1
        logger.info("API keys reloaded from %s: %d full, %d read-only", ", ".join(self.paths), len(write), len(read))
        return True

    def reload_if_changed(self) -> None:
        if self.paths and file_stamp(self.paths) != self._stamp:
            self.reload()


__all__ = ["POLL_SECS", "KeyFiles", "Reloadable", "file_stamp", "read_keys", "watch"]
