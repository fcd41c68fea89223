"""The one compiled part: the fused CPU passes of the corrected layers (layers/_fused_cpu.c).

Metadata lives in pyproject.toml. The extension is optional: without a C compiler (or OpenMP)
the install still succeeds and the layers run their plain-torch passes instead
(``affdiv.layers._fused.available()`` tells which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "affdiv.layers._fused_cpu",
            sources=["layers/_fused_cpu.c"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
