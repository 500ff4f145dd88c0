"""The one part of the build pyproject.toml cannot declare: the optional C inner loops of a
routing decision (router/routing/_hotloop.c, loaded by router/routing/hotloop.py) and of the
headers of each proxied request (router/fleet/_wire.c, loaded by router/fleet/upstream.py).
``optional``: without a C compiler the install goes on without them and the router runs its
Python loops, which give the same answers. ``-ffp-contract=off``: no fused multiply-add, which rounds once
where Python rounds twice (GCC fuses by default where the target has FMA: aarch64, or x86 with
-march=haswell), so the costs stay bit-identical to the Python loop's."""
import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-ffp-contract=off"]
setup(ext_modules=[Extension("router.routing._hotloop", ["router/routing/_hotloop.c"], optional=True,
                             extra_compile_args=FLAGS),
                   Extension("router.fleet._wire", ["router/fleet/_wire.c"], optional=True)])
