# C declarations for shared/sockets.py when Cython compiles it (its pure-Python mode: the .py
# file is the one implementation; this file only gives its names C types).
#
# libzmq is called through pointers to the very functions pyzmq's extension calls (found with
# dlsym on pyzmq's own loaded module: mw_bind_libzmq): one libzmq in the process, no zmq.h at
# build time, no link to a library whose name a wheel's repair step renames.

cimport cython
from cpython.buffer cimport (PyBUF_SIMPLE, Py_buffer, PyBuffer_FillInfo, PyBuffer_Release,
                             PyObject_CheckBuffer, PyObject_GetBuffer)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcpy, strlen

cdef extern from *:
    """
    #include <dlfcn.h>
    /* libzmq's zmq_msg_t as zmq.h (4.x) lays it out on this ABI: 64 opaque bytes, pointer-aligned. */
    typedef struct { unsigned char _[64] __attribute__((aligned(sizeof(void *)))); } mw_msg_t;
    typedef const char *mw_cstr;
    #include <poll.h>
    #include <errno.h>
    typedef struct pollfd mw_pollfd;
    /* One item of the Poller: a zmq socket's handle (NULL for a plain descriptor), whether it is
       quiet, whether it must be asked for ZMQ_EVENTS at the next poll, whether it is ready. */
    typedef struct { void *socket; unsigned char quiet, check, ready; } mw_item_t;
    static int (*mw_zmq_msg_init)(mw_msg_t *);
    static int (*mw_zmq_msg_init_size)(mw_msg_t *, size_t);
    static int (*mw_zmq_msg_send)(mw_msg_t *, void *, int);
    static int (*mw_zmq_msg_recv)(mw_msg_t *, void *, int);
    static int (*mw_zmq_msg_close)(mw_msg_t *);
    static int (*mw_zmq_msg_copy)(mw_msg_t *, mw_msg_t *);
    static int (*mw_zmq_msg_move)(mw_msg_t *, mw_msg_t *);
    static void *(*mw_zmq_msg_data)(mw_msg_t *);
    static size_t (*mw_zmq_msg_size)(mw_msg_t *);
    static int (*mw_zmq_msg_more)(mw_msg_t *);
    static const char *(*mw_zmq_msg_gets)(mw_msg_t *, const char *);
    static int (*mw_zmq_errno)(void);
    static int (*mw_zmq_getsockopt)(void *, int, void *, size_t *);

    /* The functions of the libzmq that the already-loaded module at `path` (pyzmq's extension)
       uses: dlsym on its handle searches it and then the libraries it loaded. 0, or -1 if one
       is missing. */
    static int mw_bind_libzmq(const char *path) {
        void *module = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
        if (module == NULL) return -1;
    #define MW_BIND(name) *(void **)(&mw_##name) = dlsym(module, #name); if (!mw_##name) goto missing;
        MW_BIND(zmq_msg_init) MW_BIND(zmq_msg_init_size) MW_BIND(zmq_msg_send)
        MW_BIND(zmq_msg_recv) MW_BIND(zmq_msg_close) MW_BIND(zmq_msg_copy) MW_BIND(zmq_msg_move)
        MW_BIND(zmq_msg_data)
        MW_BIND(zmq_msg_size) MW_BIND(zmq_msg_more) MW_BIND(zmq_msg_gets) MW_BIND(zmq_errno)
        MW_BIND(zmq_getsockopt)
    #undef MW_BIND
        dlclose(module);  /* pyzmq keeps it loaded: this only drops our reference */
        return 0;
    missing:
        dlclose(module);
        return -1;
    }

    /* 1 if the zmq socket has a message to read, 0 if not, -1 (errno) on an error: ZMQ_EVENTS
       (15), which first processes the commands the socket's descriptor signalled. */
    static int mw_readable(void *socket) {
        int events = 0;
        size_t size = sizeof(events);
        if (mw_zmq_getsockopt(socket, 15, &events, &size) < 0) return -1;
        return (events & 1 /* ZMQ_POLLIN */) != 0;
    }

    /* The socket's ZMQ_FD (14): readable when libzmq has commands for it; -1 on an error. */
    static int mw_socket_fd(void *socket) {
        int fd = -1;
        size_t size = sizeof(fd);
        if (mw_zmq_getsockopt(socket, 14, &fd, &size) < 0) return -1;
        return fd;
    }

    /* pyzmq's Socket keeps its libzmq handle and its closed flag behind two attributes of its
       Cython base class, both getset descriptors: `underlying` (a property) and `_closed` (a
       public field). Read through their C getters, they skip zmq.Socket's attribute lookup,
       which passes through the __getattr__ hook of its sockopt sugar on every read. */
    static PyTypeObject *mw_socket_type;
    static PyGetSetDef *mw_underlying, *mw_closed;

    static PyGetSetDef *mw_getset_of(PyTypeObject *type, const char *name) {
        PyObject *descr = PyDict_GetItemString(type->tp_dict, name);  /* borrowed */
        if (descr == NULL || !PyObject_TypeCheck(descr, &PyGetSetDescr_Type)) return NULL;
        PyGetSetDef *def = ((PyGetSetDescrObject *)descr)->d_getset;
        return def->get != NULL ? def : NULL;
    }

    /* 0 once both getters are found on `type` (pyzmq's Cython Socket), -1 if either is not. */
    static int mw_bind_socket_type(PyObject *type) {
        if (!PyType_Check(type)) return -1;
        mw_underlying = mw_getset_of((PyTypeObject *)type, "underlying");
        mw_closed = mw_getset_of((PyTypeObject *)type, "_closed");
        if (mw_underlying == NULL || mw_closed == NULL) return -1;
        Py_INCREF(type);
        mw_socket_type = (PyTypeObject *)type;
        return 0;
    }

    /* The attribute `def` names, read on `socket` (an instance of mw_socket_type): a new
       reference, or NULL with an exception set. */
    static PyObject *mw_read(PyObject *socket, PyGetSetDef *def) {
        return def->get(socket, def->closure);
    }
    """
    ctypedef struct mw_msg_t:
        pass
    ctypedef const char *mw_cstr
    ctypedef struct mw_pollfd:
        int fd
        short events
        short revents
    ctypedef struct mw_item_t:
        void *socket
        unsigned char quiet, check, ready
    int mw_poll "poll"(mw_pollfd *, unsigned long, int) nogil
    int errno
    int mw_readable(void *socket)
    int mw_socket_fd(void *socket)
    int zmq_msg_init "mw_zmq_msg_init"(mw_msg_t *)
    int zmq_msg_init_size "mw_zmq_msg_init_size"(mw_msg_t *, size_t)
    int zmq_msg_send "mw_zmq_msg_send"(mw_msg_t *, void *, int)
    int zmq_msg_recv "mw_zmq_msg_recv"(mw_msg_t *, void *, int)
    int zmq_msg_close "mw_zmq_msg_close"(mw_msg_t *)
    int zmq_msg_copy "mw_zmq_msg_copy"(mw_msg_t *, mw_msg_t *)
    int zmq_msg_move "mw_zmq_msg_move"(mw_msg_t *, mw_msg_t *)
    void *zmq_msg_data "mw_zmq_msg_data"(mw_msg_t *)
    size_t zmq_msg_size "mw_zmq_msg_size"(mw_msg_t *)
    int zmq_msg_more "mw_zmq_msg_more"(mw_msg_t *)
    mw_cstr zmq_msg_gets "mw_zmq_msg_gets"(mw_msg_t *, const char *)
    int zmq_errno "mw_zmq_errno"()
    int mw_bind_libzmq(const char *path)
    ctypedef struct PyGetSetDef:
        pass
    PyGetSetDef *mw_underlying
    PyGetSetDef *mw_closed
    int mw_bind_socket_type(object type)
    bint mw_is_socket "PyObject_TypeCheck"(object obj, void *type)
    void *mw_socket_type
    object mw_read(object socket, PyGetSetDef *definition)


cdef class Poller:
    cdef public list items, quiet
    cdef public set writing, muted
    cdef public bint stale
    cdef Py_ssize_t capacity
    cdef long long rounds
    cdef mw_item_t *c_items
    cdef mw_pollfd *c_fds

    @cython.locals(count=cython.int, index=cython.int, found=cython.int, rc=cython.int,
                   wait=cython.int, code=cython.int, every=cython.bint, expired=cython.bint,
                   deadline=cython.double, readable=cython.int, found_before=cython.int)
    cdef list _poll_c(self, int timeout)
    @cython.locals(readable=cython.int, code=cython.int)
    cdef int _readable(self, void *socket) except -2
    @cython.locals(count=cython.Py_ssize_t, index=cython.Py_ssize_t, fd=cython.int,
                   handle=cython.p_void)
    cdef int _fill(self) except -1


cdef class Part:
    cdef mw_msg_t msg
    cdef Py_ssize_t size
    cdef bint writable


cdef int _SNDMORE, _NOBLOCK, _POLLIN, _POLLOUT, _POLLIN_FD, _POLLOUT_FD, _EAGAIN, _EINTR
cdef object _FRAME
cdef object _SOCKET
cdef long long QUIET_CHECK_EVERY
cdef Py_ssize_t _COPY_BELOW

cpdef send_parts(object socket, list parts)
cpdef object recv_message(object socket, int flags=*)
cpdef object recv_routed(object socket, object prop)
cdef object _handle(object socket)
cdef object _recv_c(object socket, int flags, object prop, bint writable)
cdef bint _send_c(object socket, list parts, int first_flags) except -1
cdef int _sent_now(mw_msg_t *msg, void *handle, int flags) except -1
