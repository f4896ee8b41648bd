"""NATS JetStream: the WORK and ROLLOUTS streams and the run's KV bucket.

connect: credentials, connecting, the server's refusals; streams: the run's streams and KV bucket;
client: the `Transport` client, `session` / `run_in_session` for one job on a connection, and `RunNats`, a
launcher's one-off operations on a run's streams and KV bucket."""

from tidal.transport.client import (  # noqa: F401
    OUTAGE_SECONDS,
    MessageTooLargeError,
    RunNats,
    Transport,
    group_msg_id,
    keep_in_progress,
    run_in_session,
    session,
)
from tidal.transport.connect import (  # noqa: F401
    TRANSIENT_ERRORS,
    NatsClient,
    NatsPermissionError,
    NatsUnavailableError,
    connect_nats,
    credentials_from_env,
    inbox_prefix,
    permission_violations,
    raise_if_denied,
    role_credentials,
)
from tidal.transport.streams import STREAM_CONFIG_DIFFERS, TRAINER_CONSUMER, WORKERS_CONSUMER, delete_run, stream_config, stream_names  # noqa: F401
