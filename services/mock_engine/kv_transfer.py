"""The engine stand-in's prefill/decode disaggregation: vLLM's `--kv-transfer-config` with the
NixlConnector, and the `kv_transfer_params` a request and an answer carry.

What vLLM's NixlConnector does, and what the stand-in does instead of moving real KV:

* **Prefill side.** A request whose `kv_transfer_params` has `do_remote_decode: true` (a proxy
  sends it with `max_tokens: 1`) is prefilled as any other; when it finishes by length, its
  blocks are *not* freed: they are held for the decode engine to read (until it does, or
  `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s, passes), and the answer's `kv_transfer_params`
  says where they are: `do_remote_prefill: true`, `do_remote_decode: false`,
  `remote_block_ids`, `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`,
  `tp_size`.
* **Decode side.** A request with `do_remote_prefill: true` and those `remote_*` fields reads
  the prompt's blocks it does not cache itself from the prefill engine, then runs with them
  computed: only the last prompt token is computed locally (vLLM recomputes it), so its time
  to first token is the transfer plus one short step. The blocks it received are cached and
  published (`BlockStored`) as soon as they arrive. Invalid parameters (vLLM: "Got invalid
  KVTransferParams") or a read that fails (the prefill engine unreachable, the blocks expired
  or not there) fall back to a local prefill, vLLM's default `kv_load_failure_policy`
  ("recompute").

Where vLLM's NIXL side channel is a ZMQ socket on `VLLM_NIXL_SIDE_CHANNEL_PORT` and the blocks
move by RDMA, the stand-in's side channel is its own HTTP port (`POST /kv_transfer/read`, a
stand-in route): `remote_host`/`remote_port` are the prefill engine's HTTP address. The read
answers the held prompt's token ids (the decode engine checks they are its prompt's: NIXL would
copy whatever the blocks hold) and frees the held blocks; the decode engine then waits the
transfer time, `blocks x bytes per block / bandwidth` (`--kv-transfer-bandwidth-gbps`,
`--kv-bytes-per-token`), divided by `--speedup-ratio` like every other duration.

The parsing here is pure; the read is `read_remote_blocks` (one HTTP call).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger("dynamo_lite.mock_engine")

# vLLM's KVTransferConfig fields (vllm/config/kv_transfer.py). The stand-in reads kv_connector,
# kv_role and engine_id; the others are accepted, as vLLM takes them, and change nothing here.
_KNOWN_FIELDS = frozenset({
    "kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank", "kv_parallel_size",
    "kv_ip", "kv_port", "kv_connector_extra_config", "kv_connector_module_path", "enable_permute_local_kv",
    "kv_load_failure_policy",
})
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("NixlConnector",)
# vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: how long a prefill engine holds blocks nobody reads.
DEFAULT_HOLD_SECS = 480.0
# Llama 3.1 8B in BF16 (the timing model's default engine): 32 layers x 8 KV heads x 128 dims x
# K and V x 2 bytes = 128 KiB of KV per token.
DEFAULT_KV_BYTES_PER_TOKEN = 131_072
# One 400 Gb/s RDMA NIC per GPU (H100 HGX nodes) at half its line rate: what a block-by-block
# NIXL read reaches, as an assumption to fit to one's own measurements.
DEFAULT_BANDWIDTH_GBPS = 200.0
# How long the decode side waits for the prefill engine's side channel before it prefills itself.
READ_TIMEOUT_SECS = 5.0
READ_PATH = "/kv_transfer/read"
# The params a prefill answer carries, in vLLM's NixlConnector order.
REMOTE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class KvTransferConfigError(ValueError):
    """`--kv-transfer-config` is not what the stand-in (or vLLM) accepts."""


@dataclass(frozen=True, slots=True)
class KvTransferConfig:
    """vLLM's `--kv-transfer-config` JSON, the fields the stand-in acts on."""

    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))  # vLLM's default: a new uuid4

    @classmethod
    def parse(cls, text: str) -> KvTransferConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KvTransferConfigError(f"--kv-transfer-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise KvTransferConfigError("--kv-transfer-config must be a JSON object")
        unknown = sorted(set(data) - _KNOWN_FIELDS)
        if unknown:
            raise KvTransferConfigError(f"--kv-transfer-config: unknown field(s) {', '.join(unknown)}")
        connector = data.get("kv_connector")
        if connector not in CONNECTORS:
            raise KvTransferConfigError(
                f"--kv-transfer-config: kv_connector {connector!r}: the stand-in plays {', '.join(CONNECTORS)} only")
        role = data.get("kv_role")
        if role not in KV_ROLES:
            raise KvTransferConfigError(f"--kv-transfer-config: kv_role {role!r}: one of {', '.join(KV_ROLES)}")
        policy = data.get("kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise KvTransferConfigError(
                f"--kv-transfer-config: kv_load_failure_policy {policy!r}: the stand-in recomputes (prefills "
                "locally) when a read fails, vLLM's default 'recompute'")
        engine_id = data.get("engine_id")
        if engine_id is None:
            return cls(connector, role)
        if not isinstance(engine_id, str) or not engine_id:
            raise KvTransferConfigError("--kv-transfer-config: engine_id must be a non-empty string")
        return cls(connector, role, engine_id)


@dataclass(frozen=True, slots=True)
class TransferModel:
    """How long reading blocks from a prefill engine takes."""

    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS  # gigabits per second
    hold_secs: float = DEFAULT_HOLD_SECS

    def bytes_per_block(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def seconds(self, blocks: int, block_size: int) -> float:
        return blocks * self.bytes_per_block(block_size) * 8 / (self.bandwidth_gbps * 1e9)

    def scaled(self, speedup: float) -> TransferModel:
        return TransferModel(self.kv_bytes_per_token, self.bandwidth_gbps * speedup, self.hold_secs / speedup)


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """A decode request's `kv_transfer_params`: where its prompt's blocks are."""

    block_ids: list[int]
    engine_id: str
    request_id: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{READ_PATH}"


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """A prefill request: the engine holds its blocks for a decode engine to read."""
    return bool(params and params.get("do_remote_decode"))


def remote_blocks(params: dict[str, Any] | None) -> RemoteBlocks | str | None:
    """A decode request's remote blocks; None when it asks no remote prefill (or names no
    blocks: a prompt shorter than a block moves nothing, as in vLLM); a string saying why the
    parameters are invalid otherwise (vLLM then logs a warning and prefills locally)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    block_ids = params.get("remote_block_ids")
    if not block_ids:
        return None
    missing = [name for name in REMOTE_FIELDS[1:] if params.get(name) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    if not isinstance(block_ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        return "remote_block_ids must be a list of integers"
    engine_id, request_id, host, port = (params[name] for name in REMOTE_FIELDS[1:])
    if not isinstance(engine_id, str) or not isinstance(request_id, str) or not isinstance(host, str):
        return "remote_engine_id, remote_request_id and remote_host must be strings"
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return "remote_port must be a TCP port"
    return RemoteBlocks(block_ids, engine_id, request_id, host, port)


def prefill_answer_params(block_ids: list[int], engine_id: str, request_id: str, host: str, port: int) -> dict[str, Any]:
    """The `kv_transfer_params` of a finished prefill request, as vLLM's NixlConnector returns
    them (`request_finished`)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


class ReadFailed(Exception):
    """The prefill engine's blocks cannot be read: the decode engine prefills itself."""


async def read_remote_blocks(client: httpx.AsyncClient, remote: RemoteBlocks, reader_engine_id: str) -> list[int]:
    """Ask the prefill engine for the held blocks of `remote` (and free them there): the token
    ids they hold. ReadFailed when it cannot be reached, does not hold them or answers oddly."""
    body = {"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id,
            "remote_block_ids": remote.block_ids, "engine_id": reader_engine_id}
    try:
        answer = await client.post(remote.url, json=body, timeout=READ_TIMEOUT_SECS)
    except httpx.HTTPError as exc:
        raise ReadFailed(f"{remote.url}: {type(exc).__name__}: {exc}") from None
    if answer.status_code != 200:
        raise ReadFailed(f"{remote.url}: {answer.status_code} {answer.text[:200]}")
    try:
        tokens = answer.json()["token_ids"]
    except (ValueError, KeyError, TypeError):
        raise ReadFailed(f"{remote.url}: an answer without token_ids") from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ReadFailed(f"{remote.url}: token_ids is not a list of integers")
    return tokens


__all__ = [
    "DEFAULT_BANDWIDTH_GBPS",
    "DEFAULT_HOLD_SECS",
    "DEFAULT_KV_BYTES_PER_TOKEN",
    "KV_ROLES",
    "READ_PATH",
    "KvTransferConfig",
    "KvTransferConfigError",
    "ReadFailed",
    "RemoteBlocks",
    "TransferModel",
    "prefill_answer_params",
    "read_remote_blocks",
    "remote_blocks",
    "wants_remote_decode",
]
