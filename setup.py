"""Build of statestore_async and its Cython extensions.

Every ``_ext/<name>.pyx`` becomes the extension module ``statestore_async._native.<name>``;
each one has a pure-Python twin in ``statestore_async/_ref/<name>.py`` (see docs/ARCHITECTURE.md).

Environment switches:
  STATESTORE_DEBUG=1   build with line tracing, bounds checks and -O0 -g (for debugging and coverage)
  STATESTORE_ANNOTATE=1  also write Cython's HTML annotation next to each .pyx
"""
import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("STATESTORE_DEBUG", "") not in ("", "0")
ANNOTATE = os.environ.get("STATESTORE_ANNOTATE", "") not in ("", "0")


def _extensions():
    exts = []
    for pyx in sorted(glob.glob(os.path.join("_ext", "*.pyx"))):
        name = os.path.splitext(os.path.basename(pyx))[0]
        macros = [("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1")] if DEBUG else []
        args = ["-O0", "-g"] if DEBUG else ["-O3"]
        exts.append(
            Extension(
                f"statestore_async._native.{name}",
                [pyx],
                define_macros=macros,
                extra_compile_args=args,
            )
        )
    return exts


class build_ext(_build_ext):
    """Cythonizes ``_ext/*.pyx`` on demand, with release or debug directives."""

    def finalize_options(self):
        try:
            from Cython.Build import cythonize
        except ImportError:  # pragma: no cover - exercised only on a broken setup
            sys.stderr.write(
                "\nstatestore_async needs Cython to build its extensions (_ext/*.pyx).\n"
                "Install it first:  pip install -r requirements/build.txt\n"
                "then:              pip install --no-build-isolation -e .\n\n"
            )
            raise SystemExit(1) from None
        directives = {
            "language_level": "3",
            "boundscheck": DEBUG,
            "wraparound": DEBUG,
            "initializedcheck": DEBUG,
            "cdivision": True,
            "embedsignature": True,
        }
        if DEBUG:
            directives["linetrace"] = True
        self.distribution.ext_modules = cythonize(
            self.distribution.ext_modules,
            compiler_directives=directives,
            annotate=ANNOTATE,
            # a module's .pxd (``statestore_async/_native/table.pxd``) is found by its package name
            include_path=[HERE],
            force=DEBUG,
            quiet=True,
        )
        super().finalize_options()


setup(ext_modules=_extensions(), cmdclass={"build_ext": build_ext})
