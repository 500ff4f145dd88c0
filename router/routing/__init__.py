"""Routing: prompt keys, the prefix index, the ring, the load board, the policy and the Balancer that drives them. No I/O."""
