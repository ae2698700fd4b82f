"""Build hook for the one C extension; everything else is declared in setup.cfg.

``arena._stream`` (streaming copies into slot memory) is optional: where it cannot be compiled
the install still succeeds and shmloader copies with ``torch.stack`` as before
(``arena.stream.AVAILABLE`` is then False).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("arena._stream", ["arena/_stream.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
