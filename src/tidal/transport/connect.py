"""Connecting to NATS: the credentials (a token file, or the pod's environment), a client that reconnects through an outage
and logs each connection event in one line, and the server's refusals (of the login, of a subject)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import nats
import nats.errors
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import ServiceUnavailableError

DEFAULT_INBOX_PREFIX = "_INBOX"  # nats-py's
T = TypeVar("T")

# the package's log lines carry one name, whichever of its modules writes them
log = logging.getLogger("tidal.transport")

TRANSIENT_ERRORS = (NatsTimeout, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError, ServiceUnavailableError)


class NatsUnavailableError(ConnectionError):
    """NATS cannot be reached, refused this client, or the connection to it was lost for good."""


class NatsPermissionError(PermissionError):
    """The server refused this client's user a publish or subscribe (a "Permissions Violation"): on a
    cluster each role logs in as its own user, with only the subjects that role needs."""


class NatsClient(nats.NATS):
    """A nats-py client that keeps the permission violations the server reported to it, in order: the
    server reports them asynchronously (to the error callback), not as the failing request's error."""

    def __init__(self) -> None:
        super().__init__()
        self.permission_violations: list[str] = []
        self.next_violation = asyncio.Event()  # set (and replaced) when the server reports one

    def note_violation(self, message: str) -> None:
        self.permission_violations.append(message)
        reported, self.next_violation = self.next_violation, asyncio.Event()
        reported.set()


def permission_violations(nc: nats.NATS) -> list[str]:
    """What the server refused ``nc`` so far; none for a client that connect_nats did not make."""
    return nc.permission_violations if isinstance(nc, NatsClient) else []


def role_credentials(token_file: str | Path | None) -> dict:
    """A role's NATS credentials: the token in `token_file` (`--nats-token-file`: the run directory's nats-token,
    which `tidal run` writes for its embedded server), else the environment's (credentials_from_env)."""
    if token_file is None:
        return credentials_from_env()
    token = Path(token_file).read_text().strip()
    if not token:
        raise ValueError(f"--nats-token-file {token_file}: the file is empty")
    return {"token": token}


def credentials_from_env() -> dict:
    """NATS credentials of a server outside the run (transport.nats_url) or of a cluster's pod, from the
    environment Kubernetes gives it from a Secret (NATS_USER / NATS_PASSWORD, NATS_TOKEN, NATS_CREDS); never
    from config. The embedded server's token is a file (role_credentials)."""
    env = os.environ
    if env.get("NATS_TOKEN"):
        return {"token": env["NATS_TOKEN"]}
    if env.get("NATS_USER"):
        return {"user": env["NATS_USER"], "password": env.get("NATS_PASSWORD", "")}
    if env.get("NATS_CREDS"):
        return {"user_credentials": env["NATS_CREDS"]}
    return {}


def inbox_prefix(credentials: dict) -> str:
    """Where the server sends this client's replies (publish acks, pulled messages, KV gets): a user's own
    ``_INBOX_<user>``, so the cluster's auth.conf can let each role subscribe to its own replies only;
    the shared ``_INBOX`` for a token or credentials-file login, whose user name the client does not know."""
    user = credentials.get("user")
    return f"_INBOX_{user}" if user else DEFAULT_INBOX_PREFIX


async def connect_nats(url: str, name: str, credentials: dict) -> NatsClient:
    """A client that reconnects through a short outage (a restarted nats-server) and logs each
    connection event in one line, not nats-py's tracebacks."""

    nc = NatsClient()
    connected = False  # until then a disconnect is a failed first attempt, which the connect itself reports
    refused = asyncio.Event()  # the server refused the credentials: retrying them will not help

    async def on_error(err: Exception) -> None:
        message = str(err) or type(err).__name__
        if "permissions violation" in message.lower():
            nc.note_violation(message.removeprefix("nats: "))
        if isinstance(err, nats.errors.AuthorizationError) or "authorization violation" in message.lower():
            refused.set()
        log.warning("NATS %s: %s", url, message)

    async def on_disconnected() -> None:
        if connected and not nc.is_closed:  # closed: by us, or the reconnects gave up (the next call raises)
            log.warning("lost the connection to NATS at %s; reconnecting", url)

    async def on_reconnected() -> None:
        log.info("reconnected to NATS at %s", url)

    connecting = asyncio.ensure_future(
        nc.connect(
            url,
            connect_timeout=5,
            reconnect_time_wait=1,
            max_reconnect_attempts=20,
            name=name,
            inbox_prefix=inbox_prefix(credentials),
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **credentials,
        )
    )
    waiting = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({connecting, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():  # refused: nats-py would try the same credentials max_reconnect_attempts times
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            raise NatsUnavailableError(f"NATS at {url} refused the connection: {_who(credentials)} (Authorization Violation)")
        connecting.result()
    except nats.errors.NoServersError:
        if refused.is_set():
            raise NatsUnavailableError(f"NATS at {url} refused the connection: {_who(credentials)} (Authorization Violation)") from None
        raise NatsUnavailableError(f"cannot reach NATS at {url} (transport.nats_url, or the run's embedded nats-server): is it running?") from None
    except nats.errors.Error as err:
        raise NatsUnavailableError(f"NATS at {url} refused the connection: {err}") from None
    finally:
        waiting.cancel()
    connected = True
    return nc


def _who(credentials: dict) -> str:
    if credentials.get("user"):
        return f"wrong password for user {credentials['user']} (NATS_USER / NATS_PASSWORD)"
    if credentials.get("token"):
        return "wrong token (--nats-token-file / NATS_TOKEN)"
    if credentials.get("user_credentials"):
        return f"credentials file {credentials['user_credentials']} not accepted (NATS_CREDS)"
    return "it requires credentials and the environment has none (NATS_USER / NATS_PASSWORD, NATS_TOKEN or NATS_CREDS)"


async def unless_denied(nc: nats.NATS, since: int, what: str, request: Awaitable[T]) -> T:
    """`request`'s result; a NatsPermissionError (raise_if_denied's, naming `what`) as soon as the server
    reports a permission violation to ``nc`` after the first ``since``: a request the server drops gets
    no reply, and waiting out its timeout would only delay the refusal."""
    if not isinstance(nc, NatsClient):
        return await request
    task = asyncio.ensure_future(request)
    try:
        while not task.done():
            if len(nc.permission_violations) > since:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise_if_denied(nc, since, what)
            violation = asyncio.ensure_future(nc.next_violation.wait())
            try:
                await asyncio.wait({task, violation}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                violation.cancel()
        return task.result()
    finally:
        task.cancel()  # the caller was cancelled meanwhile: so is its request (a no-op once it is done)


def raise_if_denied(nc: nats.NATS, since: int, what: str) -> None:
    """A NatsPermissionError if the server reported a permission violation to ``nc`` after the first ``since``."""
    new = permission_violations(nc)[since:]
    if new:
        user = getattr(nc, "options", {}).get("user") or "(token or anonymous)"
        raise NatsPermissionError(
            f"NATS refused {what} to user {user}: {new[-1]}. Each role logs in as its own user with only the subjects "
            "that role needs (auth.conf in manifests/base/nats.yaml): check the pod's NATS_USER / NATS_PASSWORD"
        )
