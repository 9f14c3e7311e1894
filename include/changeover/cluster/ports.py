"""Free ports on loopback, picked at run time, and a clear refusal for a busy one."""

from __future__ import annotations

import socket

from changeover.errors import ChangeoverError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def require_free(host: str, port: int, what: str) -> int:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ChangeoverError(
                f"port {port} on {host} for {what}",
                f"it is already in use ({exc.strerror})",
                "stop whatever holds it, or leave the port unset so Changeover picks a free one",
            ) from None
    return port
