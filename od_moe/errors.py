"""The exceptions od-moe raises on purpose: user mistakes, and expert reads that fail while generating.

A `UserError` carries a message that says what went wrong and what to do; the CLI prints it on one line
and exits with code 2, the server turns it into an HTTP 4xx. An `ExpertReadError` fails the one request
whose expert could not be read (the CLI prints it on one line, the server answers 500 and /health shows
it); the engine, its caches and the next request are unaffected. A `RankLost` says another rank of a
pipeline is gone (`distributed/heartbeat.py`): nothing can be generated until every rank is started again (the
CLI prints one line and exits with 1, the server answers 503 and /health says "error"). A `StartFailed` says
`od-moe serve` could not get ready (loading, warming up or building its batch raised): the CLI prints one
line and exits with 1. Programming errors stay ordinary exceptions.
"""


class UserError(ValueError):
    """Bad input from the user: a missing path, a model with no MoE layer, an impossible capacity..."""


class ExpertReadError(OSError):
    """An expert's bytes could not be read from the model's files (a file shrank, vanished or the disk
    failed): the request that needed it fails; nothing was installed from the failed read."""


class RankLost(RuntimeError):
    """Another rank of a pipeline is gone (its process ended or stopped answering, or its machine went
    away): this rank cannot compute its share of a pass any more; every rank must be started again."""


class StartFailed(RuntimeError):
    """The server could not get ready: its model failed to load or warm up, or its batch to build (not a
    user's mistake, which stays a `UserError`); the message names the error it wraps."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.__cause__ = cause  # as `raise ... from cause` would: the error it wraps, shown under it
