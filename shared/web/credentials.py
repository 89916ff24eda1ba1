"""What a client of the services presents: an API key and its TLS settings.

One value passed through every layer that calls the services (the clients, `KvRouter`, the
simulator, the endpoint picker, a service's `--peers` recovery), so that adding a setting does
not mean adding a parameter to each. The names follow httpx: `verify` (True: the system's CAs;
a path to a CA bundle; an `ssl.SSLContext`; False: no check) and `cert` (a client certificate
for mutual TLS: a PEM path holding certificate and key, or a (certfile, keyfile) pair).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from .auth import key_list

API_KEY_ENV = "DYNAMO_LITE_API_KEY"

Verify = Union[ssl.SSLContext, str, bool]
Cert = Union[str, tuple[str, str], None]


def api_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The key a client sends by default: `DYNAMO_LITE_API_KEY`, the first of its keys when it
    lists several (a service being rotated takes all of them; a client sends one)."""
    keys = key_list((os.environ if environ is None else environ).get(API_KEY_ENV, ""))
    return keys[0] if keys else None


@dataclass(frozen=True)
class ClientCredentials:
    """An API key (None: send none) and the TLS settings of https:// calls."""

    api_key: str | None = None
    verify: Verify = True
    cert: Cert = None

    @classmethod
    def from_env(cls, verify: Verify = True, cert: Cert = None) -> ClientCredentials:
        """The environment's key (`DYNAMO_LITE_API_KEY`, see `api_key_from_env`) with these TLS settings."""
        return cls(api_key_from_env(), verify, cert)

    def headers(self) -> dict[str, str]:
        """The `Authorization` header to send (none without a key)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def ssl_context(self) -> ssl.SSLContext | bool:
        """`verify` and `cert` as one `ssl.SSLContext` (what httpx 0.28 takes), or False."""
        verify = self.verify
        if verify is False:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif isinstance(verify, ssl.SSLContext):
            context = verify
        elif isinstance(verify, str):
            context = ssl.create_default_context(cafile=verify)
        else:
            context = ssl.create_default_context()
        if self.cert is not None:
            certfile, keyfile = (self.cert, None) if isinstance(self.cert, str) else self.cert
            context.load_cert_chain(certfile, keyfile)
        return context

    def httpx_options(self) -> dict[str, Any]:
        """Keyword arguments of `httpx.AsyncClient` / `httpx.Client`."""
        options: dict[str, Any] = {"headers": self.headers()}
        if self.verify is not True or self.cert is not None:
            options["verify"] = self.ssl_context()
        return options


def client_credentials(api_key: str | None, verify: Verify, cert: Cert) -> ClientCredentials:
    """The clients' `api_key=` default: the environment's key (see `api_key_from_env`); pass
    `api_key=""` to send none."""
    return ClientCredentials(api_key_from_env() if api_key is None else (api_key or None), verify, cert)


__all__ = ["API_KEY_ENV", "ClientCredentials", "api_key_from_env", "client_credentials"]
