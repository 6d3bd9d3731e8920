"""The approximate solver (``solver``): the problem as a pairwise MRF (``mrf``),
TRW-S for a plan and a lower bound (``trws``), local search to polish the plan
(``local_search``, with the compiled loops of ``kernels``)."""
