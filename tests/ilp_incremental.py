"""The intra-op ILP built coefficient by coefficient through OR-Tools' wrapper: how
:class:`autoplan.planner.search.intra_op.IlpBuilder` built it before issue #18 (it now hands
the solver one model proto and adds the edge pairs with numpy), kept as the reference its
models and solutions are checked against (tests/test_search_fast_paths.py). The constraint
families are IlpBuilder's own; what differs is how variables and rows reach the solver and
the edge pairs' plain loop."""

from __future__ import annotations

import math

from autoplan.planner.search.intra_op import IlpBuilder


class IncrementalBuilder(IlpBuilder):
    """Every variable, row and coefficient set through the wrapper as it is made."""

    @property
    def proto(self):
        """The model as the solver holds it, exported (IlpBuilder keeps its own copy in
        step; the LP relaxation starts from it)."""
        from ortools.linear_solver import linear_solver_pb2

        model = linear_solver_pb2.MPModelProto()
        self.s.ExportModelToProto(model)
        return model

    @proto.setter
    def proto(self, value) -> None:         # (IlpBuilder's own copy: none to keep here)
        pass

    def _var(self, lb: float, ub: float, integer: bool = False):
        return self.s.Var(lb, ub, integer, "")

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

    def reweight(self, mem_weight: float) -> None:
        objective = self.s.Objective()
        coefs: dict = {}
        for var, cost, mem in self.parts:
            self._add(coefs, var, cost if mem is None else cost + mem_weight * mem)
        for var, _, _ in self.parts:
            objective.SetCoefficient(var, coefs.get(var, 0.0))
        objective.SetMinimization()

    def _add_edges(self) -> None:
        for u, v, cost in self.p.edges:
            pairs: dict = {}
            ku, kv = cost.shape
            rows = [[(self.x[u][i], -1)] for i in range(ku)]
            cols = [[(self.x[v][j], -1)] for j in range(kv)]
            for i in range(ku):
                for j in range(kv):
                    if not math.isfinite(cost[i, j]):
                        continue
                    var = self._var(0.0, 1.0)
                    pairs[(i, j)] = var
                    self._cost(var, cost[i, j])
                    rows[i].append((var, 1))
                    cols[j].append((var, 1))
            for terms in rows + cols:
                self._row(0, 0, terms)
            self.e.append(pairs)
