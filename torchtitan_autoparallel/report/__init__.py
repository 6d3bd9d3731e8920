"""Reading and checking a plan: the HTML report, plan diffs, TensorBoard figures.

Entry point: ``python -m torchtitan_autoparallel.report {html,diff,text} ...``
(``__main__.py``). Everything here reads a ``Plan`` (``planner/plan/plan.py``) and
never plans; ``executed.py`` also reads the executor's step graph, or traces it
on fake tensors for a plan-only run.
"""
