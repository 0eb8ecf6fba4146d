# C types for shared/mpack.py when Cython compiles it (pure-Python mode: the .py is the one
# implementation; this file only says which names are C integers, which classes are extension
# types and which functions are called the C way).

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.string cimport memcpy

cdef Py_ssize_t _CACHED_BELOW, _CACHE_SLOTS
cdef list _cached_raw, _cached_text


cdef class _Reader:
    cdef bytes data
    cdef Py_ssize_t end, pos, max_str, max_bin, max_len
    cdef bint strict
    cdef int max_depth

    @cython.locals(start=cython.Py_ssize_t)
    cdef Py_ssize_t take(self, Py_ssize_t count) except -1

    cdef unsigned long long uint(self, int width) except? 0xFFFFFFFFFFFFFFFF

    @cython.locals(start=cython.Py_ssize_t, code=cython.int, value=cython.longlong)
    cdef object read(self, int depth)

    @cython.locals(start=cython.Py_ssize_t, index=cython.Py_ssize_t, slot=cython.Py_ssize_t,
                   data=bytes, raw=bytes, text=str)
    cdef str text(self, Py_ssize_t size)

    cdef str decode(self, Py_ssize_t start, Py_ssize_t size)

    @cython.locals(start=cython.Py_ssize_t)
    cdef bytes binary(self, Py_ssize_t size)

    @cython.locals(items=list, _=cython.Py_ssize_t)
    cdef list array(self, Py_ssize_t size, int depth)

    @cython.locals(result=dict, _=cython.Py_ssize_t, entries=cython.Py_ssize_t)
    cdef dict map(self, Py_ssize_t size, int depth)


@cython.locals(reader=_Reader, size=cython.Py_ssize_t, code=cython.int, start=cython.Py_ssize_t)
cpdef object value_span(object data, object key)

@cython.locals(reader=_Reader)
cpdef object read_at(bytes data, Py_ssize_t start, Py_ssize_t end, Py_ssize_t max_str)

@cython.locals(code=cython.int)
cpdef object uint_at(bytes data, Py_ssize_t start, Py_ssize_t end)

@cython.locals(index=cython.Py_ssize_t, value=cython.ulonglong)
cdef inline unsigned long long _read_be(bytes data, Py_ssize_t start, Py_ssize_t width) except? 0xFFFFFFFFFFFFFFFF

@cython.locals(end=cython.Py_ssize_t, code=cython.int, size=cython.Py_ssize_t)
cpdef Py_ssize_t value_end(bytes data, Py_ssize_t start, Py_ssize_t limit) except? -2

@cython.locals(reader=_Reader)
cpdef object unpack(object data, bint strict, Py_ssize_t max_str, Py_ssize_t max_bin,
                    Py_ssize_t max_len)

@cython.locals(out=_Writer)
cpdef bytes pack(object value)

cdef list _FIXINTS
cdef bint COMPILED
@cython.locals(buf=cython.uchar[9])
cpdef bytes pack_uint(object value)
@cython.locals(buf=cython.uchar[18], size=cython.Py_ssize_t, middle=cython.Py_ssize_t,
               first_end=cython.Py_ssize_t, end=cython.Py_ssize_t, out=bytes, data=cython.p_char)
cpdef bytes pack_two_after(bytes prefix, object first, bytes key, object second)
@cython.locals(out=_Writer, index=cython.Py_ssize_t, array=list, value=cython.ulonglong)
cpdef bytes pack_uint_arrays(bytes prefix, tuple keys, tuple arrays)
cpdef bytes pack_keyed(bytes prefix, tuple keys, tuple values)
@cython.locals(width=cython.Py_ssize_t, end=cython.Py_ssize_t, index=cython.Py_ssize_t)
cdef Py_ssize_t put_uint(unsigned char *data, Py_ssize_t pos, unsigned long long value) noexcept

cdef Py_ssize_t _FIRST_BYTES
cdef int _MAX_DEPTH


cdef class _Writer:
    cdef unsigned char *data
    cdef Py_ssize_t size, capacity
    cdef unsigned char first[256]
    cdef bytearray out

    cdef int byte(self, int value) except -1
    cdef int raw(self, bytes value) except -1
    cdef int chars(self, const char *text, Py_ssize_t size) except -1
    @cython.locals(index=cython.Py_ssize_t)
    cdef int be(self, unsigned long long value, Py_ssize_t width) except -1
    @cython.locals(capacity=cython.Py_ssize_t, data=cython.p_uchar)
    cdef int grow(self, Py_ssize_t more) except -1
    cdef int uint(self, unsigned long long value) except -1
    cdef bytes result(self)


@cython.locals(kind=type)
cdef int _write(_Writer out, object value, int depth) except -1
cdef int _write_map(_Writer out, dict value, int depth) except -1
cdef int _write_array(_Writer out, object value, int depth) except -1
cdef int _write_int(_Writer out, object value) except -1

@cython.locals(data=bytes, size=cython.Py_ssize_t, text=cython.p_const_char)
cdef int _write_text(_Writer out, str value) except -1

@cython.locals(data=bytes, size=cython.Py_ssize_t)
cdef int _write_binary(_Writer out, object value) except -1

cdef int _write_length(_Writer out, Py_ssize_t size, int code8, str what) except -1
cdef int _write_size(_Writer out, Py_ssize_t size, int fix, int code16) except -1
