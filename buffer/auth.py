"""CURVE keys for the buffer service.

Keys come from key files (made by `python -m buffer keygen DIR`, paths in `CurveConfig`) or from
environment variables, which win over files. A key never comes from the config file itself and is
never logged or put in an error message.
"""
from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth

from buffer.config import CurveConfig

ENV_SERVER_PUBLIC = "ETARL_BUFFER_SERVER_PUBLIC_KEY"
ENV_SERVER_SECRET = "ETARL_BUFFER_SERVER_SECRET_KEY"
ENV_CLIENT_PUBLIC = "ETARL_BUFFER_CLIENT_PUBLIC_KEY"
ENV_CLIENT_SECRET = "ETARL_BUFFER_CLIENT_SECRET_KEY"


def keygen(directory: str | Path) -> dict[str, Path]:
    """Write a server and a client key pair (secret files mode 0600) and an `authorized_clients/`
    folder holding the client's public key. Returns the file paths (never the keys)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    authorized = directory / "authorized_clients"
    authorized.mkdir(exist_ok=True)
    paths = {}
    for name in ("server", "client"):
        public, secret = zmq.auth.create_certificates(str(directory), name)
        os.chmod(secret, 0o600)
        paths[f"{name}_public_key_file"] = Path(public)
        paths[f"{name}_secret_key_file"] = Path(secret)
    client_public = paths["client_public_key_file"]
    (authorized / client_public.name).write_bytes(client_public.read_bytes())
    paths["authorized_clients_dir"] = authorized
    return paths


def _key(env_name: str, path: Path | None, secret: bool, what: str) -> bytes:
    value = os.environ.get(env_name)
    if value:
        key = value.strip().encode()
    elif path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"CURVE {what} key file {str(path)!r} does not exist")
        public, secret_key = zmq.auth.load_certificate(str(path))
        key = secret_key if secret else public
        if key is None:
            raise ValueError(f"CURVE key file {str(path)!r} holds no {what} secret key")
    else:
        raise ValueError(f"CURVE is enabled but no {what} key is configured (set {env_name} or the key file)")
    if len(key) != 40:
        raise ValueError(f"CURVE {what} key from {env_name if value else str(path)!r} is not a 40-character Z85 key")
    return key


def configure_server(socket: zmq.Socket, cfg: CurveConfig):
    """Make `socket` a CURVE server. With `authorized_clients_dir`, a ZAP authenticator admits only
    those clients; returns the authenticator thread (stop it when closing), else None."""
    socket.curve_secretkey = _key(ENV_SERVER_SECRET, cfg.server_secret_key_file, True, "server secret")
    socket.curve_publickey = _key(ENV_SERVER_PUBLIC, cfg.server_public_key_file or cfg.server_secret_key_file,
                                  False, "server public")
    socket.curve_server = True
    if cfg.authorized_clients_dir is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    if not Path(cfg.authorized_clients_dir).is_dir():
        raise FileNotFoundError(f"CURVE authorized_clients_dir {str(cfg.authorized_clients_dir)!r} does not exist")
    auth = ThreadAuthenticator(socket.context)
    auth.start()
    auth.configure_curve(domain="*", location=str(cfg.authorized_clients_dir))
    return auth


def configure_client(socket: zmq.Socket, cfg: CurveConfig) -> None:
    socket.curve_secretkey = _key(ENV_CLIENT_SECRET, cfg.client_secret_key_file, True, "client secret")
    socket.curve_publickey = _key(ENV_CLIENT_PUBLIC, cfg.client_public_key_file or cfg.client_secret_key_file,
                                  False, "client public")
    socket.curve_serverkey = _key(ENV_SERVER_PUBLIC, cfg.server_public_key_file, False, "server public")
