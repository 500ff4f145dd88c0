"""The one part of the build pyproject.toml cannot declare: the optional C inner loops of a
routing decision (router/routing/_hotloop.c, loaded by router/routing/hotloop.py). ``optional``:
without a C compiler the install goes on without them and the router runs its Python loops,
which make the same decisions."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("router.routing._hotloop", ["router/routing/_hotloop.c"], optional=True)])
