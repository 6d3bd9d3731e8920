"""The problem with compute/communication overlap priced: the savings model (``model``,
its terms in ``terms``), the overlap-exact presolve (``presolve``, with its dominance
test in ``dominance``), the theta sweep over plain solves (``lagrange``) and the
overlap ILP (``solver``)."""
