# Included by _ext/table.pyx (one compiled module, one C file): the checks of arguments from Python, with the
# messages of statestore_async._ref.table.
# --- argument checks (the messages of _ref.table) ------------------------------------
cdef object key_error(Py_ssize_t n, Py_ssize_t min_key):
    return KeyFormatError(f"a store key starts with its {min_key}-byte key group, got {n} bytes")


cdef bytes _key_arg(object key):
    if type(key) is bytes:
        return <bytes>key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")


cdef bytes _length(bytes b):
    if <size_t>PyBytes_GET_SIZE(b) > MAX_LEN:
        raise InterfaceError(f"a key or value of {PyBytes_GET_SIZE(b)} bytes is too long")
    return b


cdef bytes _check_key(object key, Py_ssize_t min_key):
    if type(key) is not bytes:
        if isinstance(key, (bytearray, memoryview)):
            key = bytes(key)
        else:
            raise KeyFormatError(f"keys are bytes, got {type(key).__name__}")
    if PyBytes_GET_SIZE(key) < min_key:
        raise key_error(PyBytes_GET_SIZE(key), min_key)
    return <bytes>key


cdef bytes _check_value(object value):
    if type(value) is not bytes:
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        raise InterfaceError(f"values are bytes, got {type(value).__name__}")
    return <bytes>value


cdef object _value_arg(object value):
    if value is None:
        return None
    return _length(_check_value(value))


cdef tuple _pair(object item):
    try:
        k, v = item
    except (TypeError, ValueError):
        raise InterfaceError(f"pairs are (key, value) tuples, got {item!r:.80}") from None
    return (k, v)


cdef inline const uint8_t* _bp(bytes b) noexcept:
    return <const uint8_t*>PyBytes_AS_STRING(b)


cdef object _after_prefix(bytes prefix):
    """The first key after every key starting with ``prefix`` (None: there is none)."""
    cdef bytes p = prefix.rstrip(b"\xff")
    cdef Py_ssize_t n = PyBytes_GET_SIZE(p)
    if n == 0:
        return None
    return p[:n - 1] + bytes((p[n - 1] + 1,))
