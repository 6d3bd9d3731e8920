"""Exact solvers: the local-polytope ILP (``model``) on HiGHS (``ilp``) or on CBC
through PuLP (``cbc``); the LP relaxation as a bound and the optimality certificate
(``lp_bound``); reduced-cost fixing (``fixing``) and LP rounding (``rounding``)."""
