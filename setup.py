"""The one part of the build pyproject.toml cannot declare: the optional C inner loops of a
routing decision (router/routing/_hotloop.c, loaded by router/routing/hotloop.py), of the
headers of each proxied request (router/fleet/_wire.c, loaded by router/fleet/upstream.py) and of
the fleet simulator (bench/sim/_simloop.c, loaded by bench/sim/simloop.py). ``optional``: without
a C compiler the install goes on without them and the router and the simulator run their Python
loops, which give the same results. ``-ffp-contract=off``: no fused multiply-add, which rounds
once where Python rounds twice (GCC fuses by default where the target has FMA: aarch64, or x86
with -march=haswell), so the floats stay bit-identical to the Python loops'."""
import os
import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-ffp-contract=off"]
EXTENSIONS = [Extension("router.routing._hotloop", ["router/routing/_hotloop.c"], optional=True,
                        extra_compile_args=FLAGS),
              Extension("router.fleet._wire", ["router/fleet/_wire.c"], optional=True)]
if os.path.exists("bench/sim/_simloop.c"):  # the router's image is built without bench/
    EXTENSIONS.append(Extension("bench.sim._simloop", ["bench/sim/_simloop.c"], optional=True,
                                extra_compile_args=FLAGS))
setup(ext_modules=EXTENSIONS)
