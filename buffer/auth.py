"""CURVE keys and client roles for the buffer service.

Keys come from key files (made by `python -m buffer keygen DIR`, paths in `CurveConfig`) or from
environment variables, which win over files. A key never comes from the config file itself and is
never logged or put in an error message.

Roles: the authorized clients' public keys live in one folder per role under
`authorized_clients_dir` (`worker/`, `learner/`, `admin/`); a client may call only its role's
operations (`ROLE_OPS`), anything else is answered `forbidden` and changes nothing. A key outside
every role folder is refused at start.
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

# What each role may call (admin: everything, `recover` included).
ROLE_OPS: dict[str, frozenset[str] | None] = {
    "worker": frozenset({"acquire_permits", "release_permit", "filter_group", "push_groups", "stats", "health"}),
    "learner": frozenset({"pull_batch", "ack", "nack", "set_version", "set_eta", "stats", "health", "snapshot"}),
    "admin": None,
}


def check_private_dir(directory: str | Path) -> None:
    """A folder only this user may enter (a Unix socket's or the run keys'): it exists, is no
    symlink, is owned by this user and has mode 0700 (no group or other bits)."""
    import stat

    directory = Path(directory)
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"folder {str(directory)!r} does not exist") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(f"folder {str(directory)!r} must be a directory of this user with mode 0700 (it is "
                         f"{'a directory' if stat.S_ISDIR(st.st_mode) else 'no directory'} of uid {st.st_uid}, mode "
                         f"{stat.S_IMODE(st.st_mode):o}): other local users could reach what it holds; chmod 700 it")


def role_allows(role: str, op: str) -> bool:
    allowed = ROLE_OPS[role]
    return allowed is None or op in allowed


def keygen(directory: str | Path, roles: tuple[str, ...] = tuple(ROLE_OPS), name: str | None = None
           ) -> dict[str, Path]:
    """Write the server key pair (unless DIR holds one) and a client key pair per role, named after
    the role (or `name`, for one role), with its public key in `authorized_clients/<role>/`.
    Secret files are mode 0600. Returns the file paths (never the keys)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    unknown = [r for r in roles if r not in ROLE_OPS]
    if unknown or (name is not None and len(roles) != 1):
        raise ValueError(f"roles must be some of {sorted(ROLE_OPS)} (a name needs exactly one role), got {roles}")
    paths = {}
    if not (directory / "server.key_secret").is_file():
        _pair(directory, "server")
    paths["server_public_key_file"] = directory / "server.key"
    paths["server_secret_key_file"] = directory / "server.key_secret"
    authorized = directory / "authorized_clients"
    for role in roles:
        public, secret = _pair(directory, name or role)
        (authorized / role).mkdir(parents=True, exist_ok=True)
        (authorized / role / public.name).write_bytes(public.read_bytes())
        paths[f"{role}_client_public_key_file"] = public
        paths[f"{role}_client_secret_key_file"] = secret
    paths["authorized_clients_dir"] = authorized
    return paths


def _pair(directory: Path, name: str) -> tuple[Path, Path]:
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_roles(directory: str | Path) -> dict[bytes, str]:
    """Each authorized public key (Z85) and its role, from `directory/<role>/*.key`. A key file
    outside every role folder, or a folder that is no role, is an error naming it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"CURVE authorized_clients_dir {str(directory)!r} does not exist")
    roles: dict[bytes, str] = {}
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and entry.name in ROLE_OPS:
            roles.update({key: entry.name for key in zmq.auth.load_certificates(str(entry))})
        elif entry.is_dir() or entry.suffix == ".key":
            raise ValueError(f"CURVE authorized_clients_dir: {str(entry)!r} is in no role folder; every client key "
                             f"belongs to one of {sorted(ROLE_OPS)} (authorized_clients/<role>/NAME.key: "
                             f"`etarl buffer keygen DIR --role ROLE` makes one)")
    return roles


class _RoleKeys:
    """A ZAP credentials provider: a client is admitted if its key has a role."""

    def __init__(self, roles: dict[bytes, str]):
        self.roles = roles

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.roles


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
    the clients whose keys have a role. Returns (the authenticator thread or None, {Z85 public key:
    role} or None when any client that knows the server key is admitted)."""
    socket.curve_secretkey = _key(ENV_SERVER_SECRET, cfg.server_secret_key_file, True, "server secret")
    socket.curve_publickey = _key(ENV_SERVER_PUBLIC, cfg.server_public_key_file or cfg.server_secret_key_file,
                                  False, "server public")
    socket.curve_server = True
    if cfg.authorized_clients_dir is None:
        return None, None
    from zmq.auth.thread import ThreadAuthenticator

    roles = load_roles(cfg.authorized_clients_dir)
    auth = ThreadAuthenticator(socket.context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_RoleKeys(roles))
    return auth, roles


def configure_client(socket: zmq.Socket, cfg: CurveConfig) -> None:
    socket.curve_secretkey = _key(ENV_CLIENT_SECRET, cfg.client_secret_key_file, True, "client secret")
    socket.curve_publickey = _key(ENV_CLIENT_PUBLIC, cfg.client_public_key_file or cfg.client_secret_key_file,
                                  False, "client public")
    socket.curve_serverkey = _key(ENV_SERVER_PUBLIC, cfg.server_public_key_file, False, "server public")
