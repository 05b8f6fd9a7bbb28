"""The one part of otel-rl built at install time: the bridge's OTLP decoder in C (`otel_rl.bridge._otlp`).

It is optional: without a C compiler the install goes on and the bridge decodes with the generated protobuf
messages instead (same spans, more CPU per span).  Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "otel_rl.bridge._otlp",
            ["otel_rl/bridge/_otlp.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
