"""The routing policies, one module each, and the registry they join (see ``base.py``).

=================  ===========================================================================
``cache_aware``    the least predicted TTFT minus a locality bonus (the default; cost model in
                   ``router/routing/policy.py``)
``least_load``     the least pending work; the cache is ignored
``consistent_hash``  the key's ring owner, or the next on the ring under the bounded load
``round_robin``    each worker in turn
=================  ===========================================================================

Importing the package imports every module in it, so a module that registers a policy is all
a new policy needs.
"""
import importlib
import pkgutil

from router.routing.policies.base import (Policy, choose, decision_for, get_policy, policy_names, register,
                                          under_limit, unregister)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["Policy", "choose", "decision_for", "get_policy", "policy_names", "register", "under_limit",
           "unregister"]
