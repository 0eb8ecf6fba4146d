# C types for client/client.py when Cython compiles it (pure-Python mode): the client's round
# trip holds its session typed (``session: Session``), so the session's steps are C calls.

from modelwarden.client.session cimport Session

cpdef _send(object connection, list messages, double timeout)
