# C types for supervisor/routing/identity.py when Cython compiles it (pure-Python mode): the
# intake asks who sent each message the C way.

cpdef object of_property(object raw, object transport)
