"""Enumerate every plan: the test oracle for the other solvers.

Deliberately independent of the ILP's preprocessing: it only collapses tie
groups and pins (which shrink the enumeration) and scores every remaining plan
straight from the tables, in vectorised chunks.
"""

from __future__ import annotations

import math
import time

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve.base import Solution, memory_message
from torchtitan_autoparallel.planner.solve.presolve.collapse import tie_components

MAX_COMBINATIONS = 1_000_000
CHUNK = 65_536
BUDGET_RTOL = 1e-6


class BruteForceSolver:
    def __init__(self, name: str = "brute-force", max_combinations: int = MAX_COMBINATIONS) -> None:
        self.name = name
        self.max_combinations = max_combinations

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        start = time.perf_counter()
        units, domains = _units_and_domains(problem)
        total = math.prod(len(d) for d in domains)
        if total > self.max_combinations:
            raise ValueError(
                f"{self.name}: {total:.3g} plans to enumerate, more than the "
                f"{self.max_combinations:.0e} it accepts; use the 'ilp' solver instead"
            )
        best, best_energy = None, math.inf
        least_memory = math.inf  # over plans valid except for the budget
        for plans in _chunks(units, domains, total):
            energy = _energies(problem, plans)
            valid = np.isfinite(energy)
            if problem.memory_budget is not None and valid.any():
                used = _memory(problem, plans)
                least_memory = min(least_memory, float(used[valid].min()))
                # the same relative slack as Problem.is_feasible, so solvers agree
                valid &= used <= problem.memory_budget * (1 + BUDGET_RTOL)
            if valid.any():
                i = int(np.flatnonzero(valid)[np.argmin(energy[valid])])
                if energy[i] < best_energy:
                    best, best_energy = plans[i].copy(), float(energy[i])
        if best is None:
            if math.isfinite(least_memory):
                raise InfeasibleProblem(memory_message(problem.memory_budget, least_memory))
            raise InfeasibleProblem(f"{self.name}: no plan has finite energy")
        objective = problem.energy(best)
        seconds = time.perf_counter() - start
        return Solution(best, objective, objective, self.name, "optimal", seconds)


def _units_and_domains(problem: Problem) -> tuple[np.ndarray, list[np.ndarray]]:
    """Tie components choose together; a pin fixes its component's choice."""
    comp = tie_components(problem.num_nodes, problem.ties)
    k = problem.num_strategies
    reps = np.unique(comp)
    domains = {int(r): np.arange(k[r]) for r in reps}
    for v, s in problem.pins.items():
        d = domains[int(comp[v])]
        domains[int(comp[v])] = d[d == s]
    units = np.searchsorted(reps, comp)  # node -> position of its component
    return units, [domains[int(r)] for r in reps]


def _chunks(units: np.ndarray, domains: list[np.ndarray], total: int):
    """Yield (chunk, num_nodes) plans in mixed-radix order."""
    sizes = np.array([len(d) for d in domains], dtype=np.int64)
    for lo in range(0, total, CHUNK):
        idx = np.arange(lo, min(lo + CHUNK, total), dtype=np.int64)
        choice = np.empty((len(idx), len(domains)), dtype=np.int64)
        for j in range(len(domains) - 1, -1, -1):
            choice[:, j] = domains[j][idx % sizes[j]]
            idx //= sizes[j]
        yield choice[:, units]


def _energies(problem: Problem, plans: np.ndarray) -> np.ndarray:
    total = np.zeros(len(plans))
    for v in range(problem.num_nodes):
        total += problem.unary[v][plans[:, v]]
    for e, (u, v) in enumerate(problem.edges):
        total += problem.pairwise[e][plans[:, u], plans[:, v]]
    return total


def _memory(problem: Problem, plans: np.ndarray) -> np.ndarray:
    used = np.zeros(len(plans))
    for v, m in enumerate(problem.memory):
        if m is not None:
            used += m[plans[:, v]]
    return used
