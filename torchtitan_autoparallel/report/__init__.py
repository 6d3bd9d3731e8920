"""Reading and checking a plan: the HTML report, plan diffs, TensorBoard figures.

Entry point: ``python -m torchtitan_autoparallel.report {html,diff} ...``
(``__main__.py``). Everything here reads a ``Plan`` (``planner/plan/plan.py``) and
never plans.
"""
