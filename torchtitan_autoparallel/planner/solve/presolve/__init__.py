"""Exact presolve, run before every solver: ``pipeline`` (collapse ties, then reduce,
then expand the plan back), ``collapse`` (one node per tie group), ``reduce`` (dead-end
elimination, chains, leaves), ``kernels`` (their compiled loops)."""
