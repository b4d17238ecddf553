"""Exceptions raised by nemo_safe.

Every error says what happened, which ranks / paths were involved and what to
do, because the user usually reads it in one of hundreds of job log files.
"""

from __future__ import annotations


class NemoSafeError(RuntimeError):
    """Base class of every error nemo_safe raises."""


class ConfigurationError(NemoSafeError, ValueError):
    """Bad input or an inconsistent launcher / trainer configuration."""


class UnsafeBarrierPath(NemoSafeError):
    """Something other than a plain directory sits where the barrier directory belongs."""


class BarrierTimeout(NemoSafeError, TimeoutError):
    """A barrier did not complete within its timeout (missing ranks, or rank 0 never finished)."""


class RankZeroAbsent(NemoSafeError):
    """Rank 0 never showed up within the grace and not every other rank is present either:
    the ranks probably do not share the barrier's directory. Callers that can do without
    the barrier (NeMo's exp_manager) carry on as upstream does."""


class RankZeroFailed(NemoSafeError):
    """Rank 0's work inside a barrier raised; re-raised on every other rank.

    ``remote_type`` and ``remote_message`` carry rank 0's exception type name and text.
    """

    def __init__(self, message: str, remote_type: str = "", remote_message: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message


class LeaderFailed(NemoSafeError):
    """The process that did a shared job (a dataset download) for the others failed;
    raised in every process that was waiting for it, with the leader's message."""

    def __init__(self, message: str, remote_type: str = "", remote_message: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message


class LeaderDeposed(NemoSafeError):
    """Raised inside a shared job whose process was stalled so long that another process
    took the job over; the stalled one stops before publishing anything and waits instead."""


class WaitTimeout(NemoSafeError, TimeoutError):
    """A process waited longer than its timeout for another process's shared job."""


class DownloadIncomplete(NemoSafeError, OSError):
    """A download ended before all announced bytes arrived; nothing was published.

    Callers written against upstream torchvision keep working, because this is a subclass of
    what upstream raises, or of what its callers catch, in the same situation:

    * a ``RuntimeError``: MNIST's mirror loop (``except (RuntimeError, URLError)``) goes on to the
      next mirror, as it does on upstream's ``RuntimeError("File not found or corrupted.")``;
    * an ``OSError``: ``download_url`` retries an ``https`` URL over ``http``
      (``except (URLError, OSError)``) and callers such as SBU's ``except OSError`` skip the file;
    * when reading the body raised (a connection reset, an ``http.client.IncompleteRead``, an
      ``ssl.SSLError``), :func:`download_incomplete` raises a subclass that is *also* that exception's
      type (``DownloadIncomplete[ConnectionResetError]``), with its ``errno`` and attributes, so
      ``except ConnectionResetError`` still catches it.

    When the server just closed the connection early (upstream raises nothing there:
    ``http.client`` returns a short body, and torchvision keeps the truncated file when it has no
    md5), it is a plain ``DownloadIncomplete``.
    """

    #: The type of the exception that broke the download off, if one did.
    cause_type: type[BaseException] | None = None

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (_rebuild_download_incomplete, (self.cause_type, str(self)))


_typed: dict[type[BaseException], type[DownloadIncomplete]] = {}


def _download_incomplete_class(cause_type: type[BaseException] | None) -> type[DownloadIncomplete]:
    if cause_type is None or issubclass(DownloadIncomplete, cause_type):
        return DownloadIncomplete
    cls = _typed.get(cause_type)
    if cls is None:
        try:
            cls = type(
                f"DownloadIncomplete[{cause_type.__name__}]",
                (DownloadIncomplete, cause_type),
                {"__module__": __name__, "cause_type": cause_type},
            )
        except TypeError:  # a type that cannot be combined (layout conflict): the plain one still is an OSError
            cls = DownloadIncomplete
        _typed[cause_type] = cls
    return cls


def download_incomplete(message: str, cause: BaseException | None = None) -> DownloadIncomplete:
    """A :class:`DownloadIncomplete` with ``message`` that is also of ``cause``'s type (see there)."""
    cls = _download_incomplete_class(type(cause) if cause is not None else None)
    try:
        error = cls(message)
    except Exception:
        cls, error = DownloadIncomplete, DownloadIncomplete(message)
    if cause is not None and cls is not DownloadIncomplete:
        for key, value in getattr(cause, "__dict__", {}).items():  # IncompleteRead.partial, SSLError.reason, ...
            if not key.startswith("__"):
                setattr(error, key, value)
    if isinstance(cause, OSError):
        error.errno = cause.errno  # strerror stays None, so str() is the message
    return error


def _rebuild_download_incomplete(cause_type: type[BaseException] | None, message: str) -> DownloadIncomplete:
    return _download_incomplete_class(cause_type)(message)


class UnsafeArchivePath(NemoSafeError, OSError):
    """An archive member, or a symlink already in the destination, would have an extraction
    write outside the destination folder. Nothing was written there. An ``OSError`` like the
    errors of upstream's extraction, so callers catching those still do."""


class ChecksumMismatch(NemoSafeError):
    """Downloaded bytes do not have the expected md5; nothing was published.

    A ``RuntimeError``, as upstream's ``RuntimeError("File not found or corrupted.")`` from
    ``download_url``'s integrity check, so MNIST's mirror loop goes on to the next mirror."""
