"""Every name CompuShare puts on the wire, in one place: stream protocol ids, the gossip
topic, DHT record namespaces and provider-key prefixes, and the error codes peers
send each other. protocol.md documents each; tests/unit/test_wire_names.py checks
that it documents exactly these. Constants only: no imports, the lowest layer.
"""

# Stream protocols (versioned: a new version is a new id).
INFER = "/compushare/infer/1.5.0"
TRAIN = "/compushare/train/1.0.0"
PRIVATE = "/compushare/private/2.1.0"
PRIVATE_V2_0 = "/compushare/private/2.0.0"  # still answered: its consumers send no `wait`, get no `busy`
PIECES = "/compushare/pieces/1.0.0"
KARMA = "/compushare/karma/1.0.0"
VIEW = "/compushare/view/1.0.0"
DILOCO = "/compushare/diloco/1.0.0"
PROTOCOLS = (INFER, TRAIN, PRIVATE, PIECES, KARMA, VIEW, DILOCO)

# GossipSub: one topic per model, AD_TOPIC_PREFIX + the model id (protocol revision 22).
# The version is part of the topic: AD_TOPIC_V1, the one topic of every ad up to
# revision 20, is neither joined nor published on; a peer subscribed to it is told apart.
AD_TOPIC_PREFIX = "/compushare/ads/2/"
AD_TOPIC_V1 = "/compushare/ads/1"

# DHT records: keys /<namespace>/...; provider keys: sha256(prefix + ...).
SERVER_RECORDS = "csserver"  # /csserver/<model_id>/<peer_id>
KARMA_RECORDS = "cskarma"  # /cskarma/<peer_id>
RUN_RECORDS = "csrun"  # /csrun/<run_id>: a training run's signed record (diloco/run.py)
MODEL_KEY = "compushare/model/v1/"  # + model_id
BLOCK_KEY = "compushare/block/v1/"  # + model_id + "/" + block
SEED_KEY = "compushare/seed/v1/"  # + model_id
REPORTS_KEY = "compushare/reports/v1/"  # + peer_id
RUN_KEY = "compushare/run/v1/"  # + run_id: the run's participants
ROUND_KEY = "compushare/round/v1/"  # + run_id + "/" + round: who is ready to average that round
PROVIDER_KEYS = (MODEL_KEY, BLOCK_KEY, SEED_KEY, REPORTS_KEY, RUN_KEY, ROUND_KEY)

# Error codes of any framed stream: the frame and the tensors in it.
BAD_FRAME = "bad_frame"
FRAME_TOO_LARGE = "frame_too_large"
BAD_TENSOR = "bad_tensor"
BAD_DTYPE = "bad_dtype"
BAD_SHAPE = "bad_shape"
NON_FINITE = "non_finite"
FRAME_ERRORS = (BAD_FRAME, FRAME_TOO_LARGE, BAD_TENSOR, BAD_DTYPE, BAD_SHAPE, NON_FINITE)

# Error codes of /compushare/infer ({"type": "error", "code": ...} replies).
BUSY = "busy"
UNKNOWN_SESSION = "unknown_session"
OUT_OF_ORDER = "out_of_order"
SESSION_EXISTS = "session_exists"
BAD_REQUEST = "bad_request"
WRONG_MODEL = "wrong_model"
BAD_SPAN = "bad_span"
TOO_LONG = "too_long"
INTERNAL = "internal"
RATE_LIMITED = "rate_limited"
BAD_RECEIPT = "bad_receipt"
NO_INPUT = "no_input"  # a step from_upstream whose push did not come within its wait
INFER_ERRORS = (BAD_REQUEST, UNKNOWN_SESSION, OUT_OF_ORDER, SESSION_EXISTS, WRONG_MODEL, BAD_SPAN, TOO_LONG,
                BUSY, RATE_LIMITED, BAD_RECEIPT, NO_INPUT, INTERNAL)

# Error codes about LoRA adapters (/compushare/infer's open, /compushare/train's requests).
BAD_ADAPTER = "bad_adapter"  # malformed, not fitting the model or span, or not hashing to its digest
UNKNOWN_ADAPTER = "unknown_adapter"  # named by a digest this server does not hold: send the tensors
ADAPTER_ERRORS = (BAD_ADAPTER, UNKNOWN_ADAPTER)
# Error codes of /compushare/train (the frame codes too).
TRAIN_ERRORS = (BAD_REQUEST, UNKNOWN_SESSION, SESSION_EXISTS, WRONG_MODEL, BAD_SPAN, TOO_LONG, BUSY, RATE_LIMITED,
                BAD_ADAPTER, UNKNOWN_ADAPTER, BAD_RECEIPT, INTERNAL)

# Error codes of /compushare/private: session errors end the stream, request errors do not.
MALFORMED = "malformed"
BAD_PARAMS = "bad_params"
NOT_SERVED = "not_served"  # the model or span (a session error), or a layer outside it (a request error)
BAD_KEYS = "bad_keys"
BAD_CIPHERTEXT = "bad_ciphertext"
WORKER_CRASHED = "worker_crashed"
IDLE = "idle"  # 2.1.0: the session heard nothing within what its consumer announced (it ends)
PRIVATE_ERRORS = (MALFORMED, BAD_PARAMS, NOT_SERVED, BAD_KEYS, BAD_CIPHERTEXT, WORKER_CRASHED, IDLE)

# Codes of /compushare/pieces: a seeder's `error` (then it closes) and `reject` (one request).
UNKNOWN_MODEL = "unknown_model"
BAD_MESSAGE = "bad_message"
NOT_HELD = "not_held"
TOO_MANY_REQUESTS = "too_many_requests"
PIECES_ERRORS = (UNKNOWN_MODEL, BUSY, BAD_MESSAGE, BAD_FRAME, FRAME_TOO_LARGE)
PIECES_REJECTS = (NOT_HELD, TOO_MANY_REQUESTS)

# Error codes of /compushare/diloco ({"type": "error", "code": ...}; the frame codes too).
UNKNOWN_RUN = "unknown_run"  # not a run this peer takes part in
WRONG_ROUND = "wrong_round"  # another round, or another base (outer weights) than the receiver's
NOT_LEADER = "not_leader"  # a join sent to a peer that does not lead the round (with "leader": the one it knows)
WRONG_GROUP = "wrong_group"  # a part for another group, index or size than the owner's
EXCLUDED = "excluded"  # a peer against whom a verified failure report is held
TOO_LATE = "too_late"  # the owner's deadline passed, its part already averaged
DILOCO_ERRORS = (BAD_REQUEST, UNKNOWN_RUN, WRONG_ROUND, NOT_LEADER, WRONG_GROUP, EXCLUDED, TOO_LATE)
