"""prefixlb."""
