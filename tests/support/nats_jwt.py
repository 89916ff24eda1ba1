"""A NATS decentralized-JWT set-up made in the test, as `nsc` would make it: an operator, a system
account, an account with JetStream, and a user of that account whose credentials file (user JWT
and NKey seed) the replicas read with `--nats-creds`. The keys are NKeys (the `nkeys` package,
which nats-py needs to sign with a credentials file); the JWTs are signed with them, in the
format nats-server checks (`alg: ed25519-nkey`, `jti` the SHA-512/256 of the claims).

`Trust.server_config` is the nats-server configuration block that trusts the operator and
preloads both accounts (`resolver: MEMORY`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

nkeys = pytest.importorskip("nkeys", reason="nkeys (nats-py[nkeys]) signs with --nats-creds")

UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
             "conn": -1, "leaf": -1}
JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True)
class Identity:
    seed: str
    public: str

    @classmethod
    def create(cls, prefix: int) -> Identity:
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        return cls(seed.decode(), nkeys.from_seed(bytearray(seed)).public_key.decode())

    def sign_jwt(self, subject: str, name: str, nats: dict[str, Any]) -> str:
        header = _b64url(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
        claims: dict[str, Any] = {"jti": "", "iat": int(time.time()), "iss": self.public, "name": name,
                                  "sub": subject, "nats": nats}
        digest = hashlib.new("sha512_256", json.dumps(claims).encode()).digest()
        claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
        payload = _b64url(json.dumps(claims).encode())
        signature = nkeys.from_seed(bytearray(self.seed.encode())).sign(f"{header}.{payload}".encode())
        return f"{header}.{payload}.{_b64url(signature)}"


@dataclass(frozen=True)
class Trust:
    operator_jwt: str
    system: tuple[str, str]  # public key, JWT
    account: tuple[str, str]
    account_identity: Identity

    @classmethod
    def create(cls) -> Trust:
        operator = Identity.create(nkeys.PREFIX_BYTE_OPERATOR)
        system = Identity.create(nkeys.PREFIX_BYTE_ACCOUNT)
        account = Identity.create(nkeys.PREFIX_BYTE_ACCOUNT)
        return cls(
            operator.sign_jwt(operator.public, "test-operator", {"type": "operator", "version": 2}),
            (system.public, operator.sign_jwt(system.public, "SYS", {"type": "account", "version": 2,
                                                                      "limits": UNLIMITED})),
            (account.public, operator.sign_jwt(account.public, "fleet", {
                "type": "account", "version": 2, "limits": {**UNLIMITED, **JETSTREAM}})),
            account,
        )

    def server_config(self) -> str:
        (system, system_jwt), (account, account_jwt) = self.system, self.account
        return (f'operator: "{self.operator_jwt}"\nsystem_account: {system}\nresolver: MEMORY\n'
                f'resolver_preload: {{ {system}: "{system_jwt}", {account}: "{account_jwt}" }}\n')

    def user_creds(self, path: Path, name: str = "replica", signer: Identity | None = None) -> Path:
        """A credentials file for a new user of the account (signed by `signer`: another
        account's key makes one the server refuses)."""
        user = Identity.create(nkeys.PREFIX_BYTE_USER)
        user_jwt = (signer or self.account_identity).sign_jwt(user.public, name, {
            "type": "user", "version": 2, "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})
        path.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                        f"-----BEGIN USER NKEY SEED-----\n{user.seed}\n------END USER NKEY SEED------\n")
        path.chmod(0o600)
        return path
