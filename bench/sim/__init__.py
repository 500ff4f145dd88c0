"""The fleet simulator: simulated replicas and the router's own Balancer in virtual time (``prefixlb sim``)."""
