"""Run a solved plan on real process groups (gloo on CPU, NCCL on GPU).

Public entry points:

* ``build_executable(executable_plan, mesh, FullValues(...)) -> PlannedStep``: parameters placed as planned, ``step(tokens, labels) ->
  (loss, grads)`` running the joint graph with exactly the planned
  redistributions;
* ``plan_and_build(model, mesh, full_values, PlannerOptions(...))``: plan on every
  rank, solve on rank 0, check and broadcast (``planner/plan/agree.py``), then
  ``build_executable``;
* ``build_adamw`` / ``optimizer_step`` / ``clip_grad_norm``: the optimizer
  over DTensor parameters with global-norm clipping;
* ``audit(planned_step, plan, tokens, labels) -> (expected, executed)``;
* ``PlannedStep.compile`` / ``compile_local``: re-trace into a local-tensor
  graph (``compiled.py``) that later steps run instead of the interpreter;
  with ``PlannedStep.backend`` set (``[compile]``), a torch.compile backend
  builds that graph on its first run (``backend.py``).
"""

from torchtitan_autoparallel.execute.audit import audit, executed_collectives, expected_collectives
from torchtitan_autoparallel.execute.interpreter import PlanExecutionError, StepOutput
from torchtitan_autoparallel.execute.optim import build_adamw, clip_grad_norm, global_grad_norm, optimizer_step
from torchtitan_autoparallel.execute.pipeline import PlannedTraining, plan_and_build
from torchtitan_autoparallel.execute.step import FullValues, PlannedStep, build_executable

__all__ = [
    "PlanExecutionError",
    "PlannedStep",
    "PlannedTraining",
    "StepOutput",
    "audit",
    "build_adamw",
    "build_executable",
    "FullValues",
    "clip_grad_norm",
    "executed_collectives",
    "expected_collectives",
    "global_grad_norm",
    "optimizer_step",
    "plan_and_build",
]
