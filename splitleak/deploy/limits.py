"""``splitleak serve``'s defaults (its --max-* flags): the server-side maxima of what a hello may ask.

They cover the study's settings (32-token documents, capture batches of 16 with as many mixup probe rows;
the latent mode's 48 decoys) with room to spare. A session holds at most one frame of MAX_FRAME_MIB and one
forward's graph of at most MAX_FRAME_TOKENS rows x tokens, whose logits (rows x tokens x the vocabulary, and
their gradient) are what costs memory in a plain split; the server's memory is bounded by MAX_CONCURRENT x
(model + that), whatever a client asks (measured in benchmarks/RESULTS.md, "Memory of `serve` under hostile
clients"). Plain numbers without imports: the CLI reads them for ``serve --help`` without loading torch."""

MAX_ROWS = 64  # rows of one frame, mixup's probe rows included (capture_batch x wire.transport.PROBE_FACTOR)
MAX_TOKENS = 256  # tokens of one row (doc_len; in the latent mode doc_len + decoys)
MAX_FRAME_TOKENS = 2048  # rows x tokens of one frame (the study's 32 x 32 is 1024)
MAX_FRAME_MIB = 64  # bytes of one frame (the WebSocket cap is this plus the envelope)
MAX_CONCURRENT = 4  # sessions at once, each with its own model copy
HELLO_SECONDS = 10.0  # the first message (the hello) must arrive this soon after the connection opens
# Before the handshake (splitleak.deploy.gate; ours): connections in their TLS and WebSocket opening handshakes
# at once, from one address, and the whole handshake's deadline (over loopback it takes milliseconds, over a
# slow link well under a second). The threads waiting on peers are at most MAX_PENDING.
MAX_PENDING = 64
MAX_PENDING_PER_ADDRESS = 8
HANDSHAKE_SECONDS = 10.0
