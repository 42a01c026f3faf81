"""The CompushareError tree.

    CompushareError
    ├── UsageError          the user's mistake: a bad flag, a bad path (clear message)
    ├── UnsupportedLibp2p   an installed libp2p other than the one net/libp2p_patches.py patches
    ├── ModelUnavailable    a model that is neither stored nor obtainable here
    │   └── PrivateModeUnsupported  ... or not in private mode: a projection it cannot encrypt
    ├── SwarmUnreachable    no bootstrap peer answered
    ├── RouteError          the DHT holds no chain of servers covering every block
    ├── RemoteError         a server answered with an error reply (code + message)
    │   ├── ServerBusy      ... the "busy" reply: its KV budget is full
    │   └── HopFailed       ... a server of the route failed (gone, too slow, error, wrong answer)
    │       └── HopUnavailable  ... it could not open a session
    └── PeerMisbehaved      a peer sent something malformed (costs it trust)
        └── FrameError      a frame that fails decoding or validation

Errors one module raises sit beside it, in this tree: net.dht.StoreRefused,
pipeline.server.session.Rejected, pipeline.server.private_pool.WorkerCrashed,
pipeline.private_wire.PrivateRemoteError, he.ckks.HEError, torrent.fetch.FetchError.
"Closed by us" (cancellation, shutdown) never raises one of these.
"""


class CompushareError(Exception):
    """Base of every error CompuShare raises on purpose."""


class UsageError(CompushareError):
    """Raised for a user's mistake: bad flag, missing file, bad config."""


class UnsupportedLibp2p(CompushareError):
    """Raised when the installed libp2p is not the version CompuShare's patches were written for."""


class ModelUnavailable(CompushareError):
    """Raised when a model is not stored locally and cannot be obtained here."""


class PrivateModeUnsupported(ModelUnavailable):
    """Raised when a model's layers hold projections private mode cannot encrypt."""


class SwarmUnreachable(CompushareError):
    """Raised when none of the bootstrap peers could be reached."""


class RouteError(CompushareError):
    """Raised when no chain of live servers covers every block of a model."""


class RemoteError(CompushareError):
    """Raised on the client side when a server replies with an error frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ServerBusy(RemoteError):
    """The server's KV budget cannot admit the session right now."""


class HopFailed(RemoteError):
    """One server of a route failed: the consumer routes around it (code "mismatch":
    a spot check caught it computing wrongly)."""

    def __init__(self, peer_id: str, code: str, message: str) -> None:
        super().__init__(code, message)
        self.peer_id = peer_id


# A HopFailed's `code` is a server's own error code (wire.py) or one of these, which
# this side found.
TIMEOUT = "timeout"  # no answer within the step's deadline
CONNECTION_LOST = "connection_lost"  # the connection went while waiting
CLOSED = "closed"  # the server closed the stream or the session
BAD_REPLY = "bad_reply"  # an answer that is not one to the request
UNREACHABLE = "unreachable"  # it could not be dialled
MISMATCH = "mismatch"  # a spot check caught it computing wrongly
FAILED = "failed"  # it failed and no planner could replace it
WRONG_FORMAT = "wrong_format"  # it computes in another weight format than the model's


class HopUnavailable(HopFailed):
    """Opening a session on one hop of a route failed."""


class PeerMisbehaved(CompushareError):
    """Raised when a peer sends something malformed or forged."""


class FrameError(PeerMisbehaved):
    """A frame that fails decoding or validation. `code` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
