"""The intra-op ILP built coefficient by coefficient through OR-Tools' wrapper: the builder
:class:`autoplan.planner.search.intra_op.IlpBuilder` replaced in issue #18 (which now hands
the solver one model proto), kept as the reference its models and solutions are checked
against (tests/test_search_fast_paths.py)."""

from __future__ import annotations

import math

import numpy as np

from autoplan.planner.search.intra_op import ZERO_STAGES, IntraOpProblem, Linear


class IncrementalBuilder:
    """Builds the mixed-integer program of an :class:`IntraOpProblem` (module docstring)
    through OR-Tools' linear-solver wrapper, coefficient by coefficient; times in seconds,
    memory in GB."""

    def __init__(self, problem: IntraOpProblem, backend: str = "CBC"):
        from ortools.linear_solver import pywraplp

        self.p = problem
        self.s = pywraplp.Solver.CreateSolver(backend)
        if self.s is None:
            raise RuntimeError(f"OR-Tools has no {backend} backend here")
        self.inf = self.s.infinity()
        self.obj: dict = {}                   # var -> objective coefficient
        self.parts: list = []                 # (var, cost, memory or None): _cost's terms
        self.mem: dict = {}                   # var -> GB per unit
        self.x: list[list] = []
        self.zeta: list = []
        self.e: list[dict[tuple[int, int], object]] = []
        self.w: dict[int, dict[tuple[int, int], object]] = {}

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _add(d: dict, var, coef: float) -> None:
        if coef:
            d[var] = d.get(var, 0.0) + float(coef)

    def _cost(self, var, cost: float, mem: float | None = None) -> None:
        """Objective term of ``var``: ``cost``, plus lambda x ``mem`` where it has memory
        (kept apart so that :meth:`reweight` can set another lambda)."""
        self.parts.append((var, cost, mem))
        lam = self.p.mem_weight
        self._add(self.obj, var, cost if mem is None else cost + lam * mem)

    def reweight(self, mem_weight: float) -> None:
        """Set the objective for memory weight ``mem_weight``, the model otherwise as
        built: the same coefficients a build at that weight gives."""
        objective = self.s.Objective()
        coefs: dict = {}
        for var, cost, mem in self.parts:
            self._add(coefs, var, cost if mem is None else cost + mem_weight * mem)
        for var, _, _ in self.parts:
            objective.SetCoefficient(var, coefs.get(var, 0.0))
        objective.SetMinimization()

    def _row(self, lb: float, ub: float, terms) -> None:
        """lb <= sum(coef * var) <= ub (a variable's repeated terms summed, in order)."""
        ct = self.s.Constraint(lb, ub)
        coefs: dict = {}
        for var, coef in terms:
            coefs[var] = coefs.get(var, 0.0) + float(coef)
        for var, coef in coefs.items():
            ct.SetCoefficient(var, coef)

    def build(self):
        self._add_choices()
        self._add_edges()
        self._add_zero()
        self._add_partials()
        self._add_hinges()
        self._add_memory()
        objective = self.s.Objective()
        for var, coef in self.obj.items():
            objective.SetCoefficient(var, coef)
        objective.SetMinimization()
        return self.s

    # ---- constraint families (module docstring) ------------------------------------------
    def _add_choices(self) -> None:
        p, s = self.p, self.s
        for v, cost in enumerate(p.node_cost):
            xs = [s.BoolVar(f"x[{v},{j}]") for j in range(len(cost))]
            self._row(1, 1, [(x, 1) for x in xs])
            self.x.append(xs)
            for j, xv in enumerate(xs):
                self._cost(xv, cost[j], p.node_mem[v][j])
                self._add(self.mem, xv, p.node_mem[v][j] / 1e9)
        self.zeta = [s.BoolVar(f"zero{z}") for z in range(ZERO_STAGES)]
        self._row(1, 1, [(z, 1) for z in self.zeta])
        for z in range(ZERO_STAGES):
            if z not in p.zero_allowed:
                self._row(0, 0, [(self.zeta[z], 1)])

    def _add_edges(self) -> None:
        p, s = self.p, self.s
        for k, (u, v, cost) in enumerate(p.edges):
            pairs: dict[tuple[int, int], object] = {}
            ku, kv = cost.shape
            rows = [[(self.x[u][i], -1)] for i in range(ku)]
            cols = [[(self.x[v][j], -1)] for j in range(kv)]
            for i in range(ku):
                for j in range(kv):
                    if not math.isfinite(cost[i, j]):
                        continue
                    var = s.NumVar(0.0, 1.0, f"e{k}[{i},{j}]")
                    pairs[(i, j)] = var
                    self._cost(var, cost[i, j])
                    rows[i].append((var, 1))
                    cols[j].append((var, 1))
            for terms in rows + cols:
                self._row(0, 0, terms)
            self.e.append(pairs)

    def _add_zero(self) -> None:
        p, s = self.p, self.s
        for v in sorted(set(p.zcost) | set(p.zmem)):
            k = len(p.node_cost[v])
            cost = p.zcost.get(v, np.zeros((k, ZERO_STAGES)))
            mem = p.zmem.get(v, np.zeros((k, ZERO_STAGES)))
            pairs = {}
            for j in range(k):
                for z in range(ZERO_STAGES):
                    var = s.NumVar(0.0, 1.0, f"w[{v},{j},{z}]")
                    pairs[(j, z)] = var
                    self._cost(var, cost[j, z], mem[j, z])
                    self._add(self.mem, var, mem[j, z] / 1e9)
            for j in range(k):
                self._row(0, 0, [(pairs[(j, z)], 1) for z in range(ZERO_STAGES)]
                          + [(self.x[v][j], -1)])
            for z in range(ZERO_STAGES):
                self._row(0, 0, [(pairs[(j, z)], 1) for j in range(k)] + [(self.zeta[z], -1)])
            self.w[v] = pairs

    def _add_partials(self) -> None:
        p, s = self.p, self.s
        for g_i, g in enumerate(p.partials):
            for i in range(len(g.cost)):
                if not g.cost[i]:
                    continue
                y = s.NumVar(0.0, 1.0, f"y{g_i}[{i}]")
                self._cost(y, g.cost[i])
                for k, mask in g.pairs:
                    for (a, b), var in self.e[k].items():
                        if a == i and mask[a, b]:
                            self._row(0, self.inf, [(y, 1), (var, -1)])      # y >= e

    def _terms(self, lin: Linear, scale: float = 1.0) -> list:
        terms = []
        for v, coef in lin.node.items():
            terms += [(self.x[v][j], float(coef[j]) * scale) for j in range(len(coef))
                      if coef[j]]
        for v, coef in lin.zpair.items():
            if v in self.w:
                terms += [(var, float(coef[j, z]) * scale) for (j, z), var in self.w[v].items()
                          if coef[j, z]]
        return terms

    def _add_hinges(self) -> None:
        for k, h in enumerate(self.p.hinges):
            a = self._terms(h.a)
            if not a:
                continue
            b = self._terms(h.b)
            var = self.s.NumVar(0.0, self.inf, f"h{k}")
            # h >= A - (1 - c) B   and   h >= c A
            self._row(0, self.inf, [(var, 1)] + [(x, -c) for x, c in a]
                      + [(x, (1.0 - h.c) * c) for x, c in b])
            self._row(0, self.inf, [(var, 1)] + [(x, -h.c * c) for x, c in a])
            self._cost(var, h.weight)

    def _add_memory(self) -> None:
        p, s = self.p, self.s
        for k, fam in enumerate(p.mem_max):
            var = s.NumVar(0.0, self.inf, f"peak{k}")
            for lin in fam:
                terms = self._terms(lin, 1e-9)
                if terms:
                    self._row(0, self.inf, [(var, 1)] + [(x, -c) for x, c in terms])
            self._add(self.mem, var, 1.0)
            self._cost(var, 0.0, 1e9)
        if math.isfinite(p.budget) and self.mem:
            self._row(-self.inf, p.budget / 1e9, list(self.mem.items()))

