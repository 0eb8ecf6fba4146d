"""Secret files: the gateway's token file and its TLS key, held to one rule by the gateway
(gateway/access.py, at every re-read) and by the supervisor (before it starts the gateway).

A secret file must be a regular file owned by the daemon's user or root, and neither writable by
its group nor open to other users at all (0600, 0640, 0400, 0440): a file someone else can change
can grant access, and one everybody can read has leaked. Only the standard library.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

MIN_TOKEN_CHARS = 16


def file_signature(path: Path) -> tuple | None:
    """What changes when the file is replaced, rewritten, chmodded or chowned (ctime); None when
    it cannot be looked at."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size


class SecretFileError(ValueError):
    """The token file (or the TLS key) cannot be used: why, and which file."""


def read_tokens(path: Path) -> list[bytes]:
    """The SHA-256 digests of the tokens in ``path``; SecretFileError says what is wrong."""
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            _check_owner_and_mode(path, info)
            text = file.read(1024 * 1024 + 1)
    except OSError as exc:
        raise SecretFileError(f"token_file {path}: {exc.strerror or exc}") from None
    if len(text) > 1024 * 1024:
        raise SecretFileError(f"token_file {path}: larger than 1 MiB")
    digests = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        if len(line) < MIN_TOKEN_CHARS or not all(0x21 <= byte < 0x7F for byte in line):
            raise SecretFileError(f"token_file {path}, line {number}: a token is at least "
                                 f"{MIN_TOKEN_CHARS} printable ASCII characters without spaces "
                                 "(modelwarden token FILE makes one)")
        digests.append(hashlib.sha256(line).digest())
    if not digests:
        raise SecretFileError(f"token_file {path} holds no token (modelwarden token FILE adds one)")
    return digests


def _check_owner_and_mode(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise SecretFileError(f"token_file {path} is not a regular file")
    if info.st_uid not in (os.geteuid(), 0):
        raise SecretFileError(f"token_file {path} is owned by uid {info.st_uid}: it must belong to "
                             "the daemon's user or root, or whoever owns it can grant access")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o027:
        raise SecretFileError(f"token_file {path} has mode {mode:04o}: other users may read it or "
                             "its group may change it; chmod 600 (or 640)")


def check_tls(cert: Path, key: Path, client_ca: Path | None = None) -> None:
    """The certificate chain and its key load and belong together; the key is kept private; the
    client CA, if any, loads."""
    import ssl

    try:
        with open(key, "rb") as file:
            info = os.fstat(file.fileno())
    except OSError as exc:
        raise SecretFileError(f"tls_key {key}: {exc.strerror or exc}") from None
    try:
        _check_owner_and_mode(key, info)
    except SecretFileError as exc:
        raise SecretFileError(str(exc).replace("token_file", "tls_key", 1)) from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError is one: a bad PEM, or a key of another certificate
        raise SecretFileError(f"tls_cert {cert} with tls_key {key}: {exc.strerror or exc}") from None
    if client_ca is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=client_ca)
        except OSError as exc:
            raise SecretFileError(f"tls_client_ca {client_ca}: {exc.strerror or exc}") from None
