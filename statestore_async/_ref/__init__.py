"""Pure-Python references of the compiled modules in ``_ext/``: same functions, same bytes.

They define the behaviour; tests check the compiled twins against them on random inputs.
"""
