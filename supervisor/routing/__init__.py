"""The request path: a client's request from the frontend to a worker and back.

``router`` (accept, queue, hand to a worker, answer), ``service`` (one model's request state:
queue, pending batches, holds, wants), ``requests`` (a request while the supervisor holds it),
``batching`` (which requests share a forward pass), ``limits`` (memory bounds), ``buffers`` (the
registry of client shared-memory buffers), ``bufferserver`` (the daemon's end of buffers.sock),
``connections`` (the descriptor account), ``identity`` (who a peer is), ``quotas`` (what one
identity may hold).
"""
