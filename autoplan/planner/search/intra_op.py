r"""The intra-op pass: an ILP choosing one placement per op group and a ZeRO stage.

Formulation (Alpa, Zheng et al. 2022, sec. 4; meta-pytorch/autoparallel's layout). The
instance is plain arrays (:class:`IntraOpProblem`), built from cost tables by
:mod:`autoplan.planner.search.compose`; this module only solves and checks it.

Variables::

    x_{v,j} in {0,1}     op group v takes candidate placement j         (one-hot per v)
    zeta_z  in {0,1}     the stage's ZeRO stage is z in {0,1,2,3}          (one-hot)
    e_{uv,ij} in {0,1}   groups u, v joined by an edge take i and j        (edge pairs)
    w_{v,jz} in {0,1}    group v takes j while the ZeRO stage is z         (ZeRO pairs)
    y_{g,i}  in {0,1}    a Partial gradient reaches tensor g's producer choosing i
    h_k >= 0             exposed (not overlapped) time of a collective family k
    p_l >= 0             the largest of a family of memory terms l

Objective (seconds of one training step on the stage, plus lambda per byte)::

    min  sum_v c_v . x_v  +  sum_{uv} C_uv : e_uv  +  sum_v Z_v : w_v  +  sum_g r_g . y_g
         + sum_k omega_k h_k  +  lambda * Mem

with c_v the group's compute (micro-batches x (forward + backward [+ recomputed forward])),
C_uv the resharding its edges imply (forward and backward), Z_v what the parameters read by
v cost at ZeRO stage z (optimizer step), r_g one collective for the summed Partial
gradients of a tensor read by several groups.

Constraints, each family added by one method of :class:`IlpBuilder`:

* one choice:            sum_j x_{v,j} = 1,  sum_z zeta_z = 1          -> ``_add_choices``
* edge consistency:      sum_j e_{uv,ij} = x_{u,i},  sum_i e_{uv,ij} = x_{v,j}
                                                                        -> ``_add_edges``
* ZeRO pairing:          sum_z w_{v,jz} = x_{v,j},  sum_j w_{v,jz} = zeta_z
                                                                        -> ``_add_zero``
* Partial gradients:     y_{g,i} >= e_{uv,ij}  for every pair (i, j) of g's edges whose
                         gradient is Partial                            -> ``_add_partials``
* overlap (the Estimator's ``_exposed``, c = OVERLAP_COST):
                         h_k >= A_k - (1 - c) B_k,   h_k >= c A_k       -> ``_add_hinges``
  (A_k: a collective's time, e.g. the gradient all-reduce; B_k: the compute it overlaps)
* memory per device:     sum_v m_v . x_v + sum_v M_v : w_v + sum_l p_l <= budget,
                         p_l >= L_{l,r}  for each term r of family l    -> ``_add_memory``
  (m_v: activations kept x micro-batches in flight; M_v: parameters, gradients and
  optimizer states at ZeRO stage z; p_l: one recomputed layer's activations, or under
  ZeRO-3 one layer's gathered parameters)

Solved as a mixed-integer program through OR-Tools' linear-solver wrapper (CBC by default;
SCIP and HiGHS work too), one thread, so the answer is deterministic; its LP relaxation is
solved first (CLP), and where that optimum is integral it is the answer, without branch and
bound (:func:`_relaxation`).
:func:`brute_force` enumerates every assignment of a small instance and :func:`objective`
evaluates one — pure functions over the arrays, used to cross-check the solver
(tests/test_search.py). :func:`~autoplan.planner.search.explain.explain` prices each
alternative of a group with the rest of the solution fixed.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from autoplan.errors import InfeasibleError, OutOfTime

log = logging.getLogger(__name__)

ZERO_STAGES = 4


@dataclass
class Linear:
    """A linear expression over x (``node``: v -> coefficient per candidate) and w
    (``zpair``: v -> (K_v x 4) coefficients)."""

    node: dict[int, np.ndarray] = field(default_factory=dict)
    zpair: dict[int, np.ndarray] = field(default_factory=dict)

    def value(self, choice: list[int], z: int) -> float:
        out = sum(float(c[choice[v]]) for v, c in self.node.items())
        return out + sum(float(c[choice[v], z]) for v, c in self.zpair.items())


@dataclass
class Hinge:
    """weight * max(A - (1 - c) B, c A): the exposed part of a collective (time A)
    overlapped with compute (time B), plus c of the hidden part. ``weight`` is a positive
    integer (how often per step it happens: 1, or the number of micro-batches)."""

    a: Linear
    b: Linear
    c: float
    weight: float = 1.0

    def value(self, choice: list[int], z: int) -> float:
        a, b = self.a.value(choice, z), self.b.value(choice, z)
        return self.weight * max(a - (1 - self.c) * b, self.c * a)


@dataclass
class PartialGroup:
    """A tensor read by several groups: one collective for its summed Partial gradients.
    ``pairs``: (edge index, K_u x K_v bool mask of pairs that hand back a Partial)."""

    u: int
    cost: np.ndarray                       # (K_u,) seconds of the collective
    pairs: list[tuple[int, np.ndarray]]


@dataclass
class IntraOpProblem:
    """One ILP instance (module docstring); times in seconds, memory in bytes."""

    names: list[str]                       # per group (for messages and explain)
    node_cost: list[np.ndarray]
    node_mem: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]]
    zcost: dict[int, np.ndarray] = field(default_factory=dict)     # v -> (K_v, 4)
    zmem: dict[int, np.ndarray] = field(default_factory=dict)      # v -> (K_v, 4)
    partials: list[PartialGroup] = field(default_factory=list)
    hinges: list[Hinge] = field(default_factory=list)
    mem_max: list[list[Linear]] = field(default_factory=list)
    budget: float = math.inf
    mem_weight: float = 0.0                # lambda, seconds per byte
    zero_allowed: tuple[int, ...] = (0, 1, 2, 3)

    @property
    def sizes(self) -> list[int]:
        return [len(c) for c in self.node_cost]

    def describe(self) -> str:
        pairs = sum(int(np.isfinite(m).sum()) for _, _, m in self.edges)
        return (f"{len(self.node_cost)} groups, {sum(self.sizes)} placement variables, "
                f"{len(self.edges)} edges ({pairs} pair variables), "
                f"{sum(m.size for m in self.zcost.values())} ZeRO pairs")


@dataclass
class Solution:
    choice: list[int]                      # candidate per group
    zero: int
    objective: float                       # seconds (+ lambda * memory)
    memory: float                          # bytes per device
    seconds: float = 0.0                   # solve time
    status: str = "OPTIMAL"


# ---- pure evaluation -----------------------------------------------------------------------

def memory(problem: IntraOpProblem, choice: list[int], z: int) -> float:
    """Bytes per device of an assignment."""
    out = sum(float(m[choice[v]]) for v, m in enumerate(problem.node_mem))
    out += sum(float(m[choice[v], z]) for v, m in problem.zmem.items())
    out += sum(max((t.value(choice, z) for t in fam), default=0.0) for fam in problem.mem_max)
    return out


def objective(problem: IntraOpProblem, choice: list[int], z: int) -> dict[str, float]:
    """Objective terms of an assignment: compute, edges, zero, partials, hinges, memory
    and their ``total`` (inf when a chosen pair is impossible)."""
    compute = sum(float(c[choice[v]]) for v, c in enumerate(problem.node_cost))
    edges = sum(float(m[choice[u], choice[v]]) for u, v, m in problem.edges)
    zero = sum(float(c[choice[v], z]) for v, c in problem.zcost.items())
    partial = 0.0
    for g in problem.partials:
        if any(mask[choice[problem.edges[k][0]], choice[problem.edges[k][1]]]
               for k, mask in g.pairs):
            partial += float(g.cost[choice[g.u]])
    hinge = sum(h.value(choice, z) for h in problem.hinges)
    mem = memory(problem, choice, z)
    total = compute + edges + zero + partial + hinge + problem.mem_weight * mem
    return {"compute": compute, "edges": edges, "zero": zero, "partials": partial,
            "hinges": hinge, "memory": mem, "total": total}


def feasible(problem: IntraOpProblem, choice: list[int], z: int) -> bool:
    return z in problem.zero_allowed and memory(problem, choice, z) <= problem.budget * (1 + 1e-9)


def brute_force(problem: IntraOpProblem) -> Solution:
    """The optimum by enumeration (small instances only)."""
    best: Solution | None = None
    for z in problem.zero_allowed:
        for choice in itertools.product(*[range(k) for k in problem.sizes]):
            choice = list(choice)
            if not feasible(problem, choice, z):
                continue
            val = objective(problem, choice, z)["total"]
            if not math.isfinite(val):           # a pair of placements that cannot meet
                continue
            if best is None or val < best.objective - 1e-12:
                best = Solution(choice, z, val, memory(problem, choice, z))
    if best is None:
        raise InfeasibleError(_infeasible_message(problem))
    return best


# ---- the ILP ----------------------------------------------------------------------------

class IlpBuilder:
    """Builds the mixed-integer program of an :class:`IntraOpProblem` (module docstring)
    for OR-Tools' linear-solver wrapper; times in seconds, memory in GB.

    The model is assembled as plain lists -- columns (bounds, integrality), rows (bounds,
    variable indices, coefficients), objective coefficients -- and handed to the solver as
    one ``MPModelProto`` (``Solver.LoadModelFromProto``), not coefficient by coefficient
    through the wrapper (issue #18: a GPT's ILP has ~5,500 variables and ~10,000
    coefficients). Variables, rows and coefficients come in the order, and with the values,
    an incremental build through the wrapper gives them (checked against one, model for
    model and solution for solution, in tests/test_search_fast_paths.py)."""

    def __init__(self, problem: IntraOpProblem, backend: str = "CBC"):
        from ortools.linear_solver import pywraplp

        self.p = problem
        self.s = pywraplp.Solver.CreateSolver(backend)
        if self.s is None:
            raise RuntimeError(f"OR-Tools has no {backend} backend here")
        self.inf = self.s.infinity()
        self.obj: dict[int, float] = {}       # var -> objective coefficient
        self.parts: list = []                 # (var, cost, memory or None): _cost's terms
        self.mem: dict[int, float] = {}       # var -> GB per unit
        self.x: list[list] = []               # variable indices while building, then the
        self.zeta: list = []                  # solver's variables (build)
        self.e: list[dict[tuple[int, int], int]] = []
        self.w: dict[int, dict[tuple[int, int], int]] = {}
        self._lb: list[float] = []
        self._ub: list[float] = []
        self._int: list[bool] = []
        self._rows: list[tuple[float, float, list[int], list[float]]] = []
        self._vars: list = []
        self._weighted: tuple | None = None   # (columns with memory, their parts): reweight
        self.proto = None   # the MPModelProto loaded, as reweighted (the LP relaxation's)

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _add(d: dict, var, coef: float) -> None:
        if coef:
            d[var] = d.get(var, 0.0) + float(coef)

    def _var(self, lb: float, ub: float, integer: bool = False) -> int:
        self._lb.append(lb)
        self._ub.append(ub)
        self._int.append(integer)
        return len(self._lb) - 1

    def _cost(self, var, cost: float, mem: float | None = None) -> None:
        """Objective term of ``var``: ``cost``, plus lambda x ``mem`` where it has memory
        (kept apart so that :meth:`reweight` can set another lambda)."""
        self.parts.append((var, cost, mem))
        lam = self.p.mem_weight
        self._add(self.obj, var, cost if mem is None else cost + lam * mem)

    def reweight(self, mem_weight: float) -> None:
        """Set the objective for memory weight ``mem_weight`` (in the solver and in
        :attr:`proto`), the model otherwise as built: the coefficients a build at that
        weight gives. Only columns with a memory term change (not the many pair columns)."""
        if self._weighted is None:
            touched = dict.fromkeys(var for var, _, mem in self.parts if mem is not None)
            self._weighted = (list(touched), [p for p in self.parts if p[0] in touched])
        touched, parts = self._weighted
        objective = self.s.Objective()
        coefs: dict = {}
        for var, cost, mem in parts:
            self._add(coefs, var, cost if mem is None else cost + mem_weight * mem)
        columns = self.proto.variable
        for var in touched:
            value = coefs.get(var, 0.0)
            objective.SetCoefficient(self._vars[var], value)
            columns[var].objective_coefficient = value
        objective.SetMinimization()

    def _row(self, lb: float, ub: float, terms) -> None:
        """lb <= sum(coef * var) <= ub (a variable's repeated terms summed, in order)."""
        coefs: dict = {}
        for var, coef in terms:
            coefs[var] = coefs.get(var, 0.0) + float(coef)
        self._rows.append((lb, ub, list(coefs), list(coefs.values())))

    def build(self):
        from ortools.linear_solver import linear_solver_pb2

        self._add_choices()
        self._add_edges()
        self._add_zero()
        self._add_partials()
        self._add_hinges()
        self._add_memory()
        model = linear_solver_pb2.MPModelProto()
        obj = self.obj
        add_var = model.variable.add
        for i, (lb, ub, integer) in enumerate(zip(self._lb, self._ub, self._int)):
            add_var(lower_bound=lb, upper_bound=ub, is_integer=integer,
                    objective_coefficient=obj.get(i, 0.0))
        add_row = model.constraint.add
        for lb, ub, index, coefs in self._rows:
            row = add_row(lower_bound=lb, upper_bound=ub)
            row.var_index.extend(index)
            row.coefficient.extend(coefs)
        error = self.s.LoadModelFromProto(model)
        if error:
            raise RuntimeError(f"OR-Tools refused the intra-op ILP: {error}")
        self.proto = model
        self.s.Objective().SetMinimization()
        self._vars = self.s.variables()
        self.x = [[self._vars[i] for i in xs] for xs in self.x]
        self.zeta = [self._vars[i] for i in self.zeta]
        return self.s

    # ---- constraint families (module docstring) ------------------------------------------
    def _add_choices(self) -> None:
        p = self.p
        for v, cost in enumerate(p.node_cost):
            xs = [self._var(0.0, 1.0, True) for _ in range(len(cost))]
            self._row(1, 1, [(x, 1) for x in xs])
            self.x.append(xs)
            for j, xv in enumerate(xs):
                self._cost(xv, cost[j], p.node_mem[v][j])
                self._add(self.mem, xv, p.node_mem[v][j] / 1e9)
        self.zeta = [self._var(0.0, 1.0, True) for _ in range(ZERO_STAGES)]
        self._row(1, 1, [(z, 1) for z in self.zeta])
        for z in range(ZERO_STAGES):
            if z not in p.zero_allowed:
                self._row(0, 0, [(self.zeta[z], 1)])

    def _add_edges(self) -> None:
        p = self.p
        for u, v, cost in p.edges:
            ku, kv = cost.shape
            # the pair variables in row-major order, as a loop over i then j creates them
            ii, jj = np.nonzero(np.isfinite(cost))
            first = len(self._lb)
            count = len(ii)
            index = list(range(first, first + count))
            self._lb += [0.0] * count
            self._ub += [1.0] * count
            self._int += [False] * count
            values = cost[ii, jj].tolist()
            self.parts += zip(index, values, [None] * count)         # _cost, term by term
            self.obj.update((var, 0.0 + c) for var, c in zip(index, values) if c)
            pairs = dict(zip(zip(ii.tolist(), jj.tolist()), index))
            # sum_j e_ij = x_ui, then sum_i e_ij = x_vj (each variable once in its row)
            for i in range(ku):
                at = [index[k] for k in np.flatnonzero(ii == i).tolist()]
                self._rows.append((0, 0, [self.x[u][i]] + at, [-1.0] + [1.0] * len(at)))
            for j in range(kv):
                at = [index[k] for k in np.flatnonzero(jj == j).tolist()]
                self._rows.append((0, 0, [self.x[v][j]] + at, [-1.0] + [1.0] * len(at)))
            self.e.append(pairs)

    def _add_zero(self) -> None:
        p = self.p
        for v in sorted(set(p.zcost) | set(p.zmem)):
            k = len(p.node_cost[v])
            cost = p.zcost.get(v, np.zeros((k, ZERO_STAGES)))
            mem = p.zmem.get(v, np.zeros((k, ZERO_STAGES)))
            pairs = {}
            for j in range(k):
                for z in range(ZERO_STAGES):
                    var = self._var(0.0, 1.0)
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
        p = self.p
        rows_of: dict[int, dict[int, list[tuple[int, int]]]] = {}   # k -> a -> [(b, var)]
        for k in {k for g in p.partials for k, _ in g.pairs}:
            for (a, b), var in self.e[k].items():             # (in the pairs' order)
                rows_of.setdefault(k, {}).setdefault(a, []).append((b, var))
        for g in p.partials:
            for i in range(len(g.cost)):
                if not g.cost[i]:
                    continue
                y = self._var(0.0, 1.0)
                self._cost(y, g.cost[i])
                for k, mask in g.pairs:
                    for b, var in rows_of.get(k, {}).get(i, ()):
                        if mask[i, b]:
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
        for h in self.p.hinges:
            a = self._terms(h.a)
            if not a:
                continue
            b = self._terms(h.b)
            var = self._var(0.0, self.inf)
            # h >= A - (1 - c) B   and   h >= c A
            self._row(0, self.inf, [(var, 1)] + [(x, -c) for x, c in a]
                      + [(x, (1.0 - h.c) * c) for x, c in b])
            self._row(0, self.inf, [(var, 1)] + [(x, -h.c * c) for x, c in a])
            self._cost(var, h.weight)

    def _add_memory(self) -> None:
        p = self.p
        for fam in p.mem_max:
            var = self._var(0.0, self.inf)
            for lin in fam:
                terms = self._terms(lin, 1e-9)
                if terms:
                    self._row(0, self.inf, [(var, 1)] + [(x, -c) for x, c in terms])
            self._add(self.mem, var, 1.0)
            self._cost(var, 0.0, 1e9)
        if math.isfinite(p.budget) and self.mem:
            self._row(-self.inf, p.budget / 1e9, list(self.mem.items()))


def solve(problem: IntraOpProblem, *, time_limit_s: float = 60.0,
          backend: str = "CBC", explain: bool = True,
          relaxation_first: bool = True) -> Solution:
    """The optimum of ``problem`` (raises InfeasibleError with the binding memory if none;
    ``explain=False``: without it, skipping the second solve that finds that memory, for a
    caller that drops the message).

    x and zeta are integer; the pair variables e, w, y are continuous in [0, 1] — with x and
    zeta integral the consistency constraints force them integral too, which keeps the
    branch-and-bound small. ``relaxation_first``: the LP relaxation first, branch and bound
    only where its optimum is fractional (:func:`_relaxation`)."""
    t0 = time.perf_counter()
    builder = IlpBuilder(problem, backend)
    builder.build()
    return _run(builder, problem, time_limit_s, explain, t0, relaxation_first)


def solve_weights(problem: IntraOpProblem, mem_weights: list[float], *,
                  time_limit_s: Callable[[], float], backend: str = "CBC",
                  relaxation_first: bool = True) -> Iterator[Solution | None]:
    """:func:`solve` of ``problem`` at each memory weight in turn (None where infeasible),
    the ILP built once: the weights change only the objective's coefficients
    (:meth:`IlpBuilder.reweight`), and CBC solves each model from scratch, so each solution
    is the one a fresh build would give. ``time_limit_s()`` is asked before each solve."""
    builder = None
    for i, w in enumerate(mem_weights):
        t0 = time.perf_counter()
        at = replace(problem, mem_weight=w)
        if builder is None:
            builder = IlpBuilder(at, backend)
            builder.build()
        else:
            builder.p = at
            builder.reweight(w)
        try:
            yield _run(builder, at, time_limit_s(), False, t0, relaxation_first)
        except InfeasibleError:
            yield None


def _run(builder: IlpBuilder, problem: IntraOpProblem, time_limit_s: float, explain: bool,
         t0: float, relaxation_first: bool = True) -> Solution:
    """Solve ``builder``'s model as it stands: its LP relaxation (:func:`_relaxation`,
    unless ``relaxation_first`` is False), then, where that optimum is fractional, the MIP
    with ``builder``'s backend, the x the reduced costs rule out fixed at 0."""
    from ortools.linear_solver import pywraplp

    solver = builder.s
    t_build = time.perf_counter() - t0
    root, fix = _relaxation(builder, problem, time_limit_s) if relaxation_first else (None, [])
    if root is not None:
        name, (choice, z) = "OPTIMAL", root
    else:
        solver.SetTimeLimit(int(time_limit_s * 1000))
        solver.SetNumThreads(1)
        fixed = [solver.variable(i) for i in fix]
        for var in fixed:
            var.SetUb(0.0)
        try:
            status = solver.Solve()
            solved = status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
            if solved:                   # (read before the bounds change back)
                choice = [max(range(len(xs)), key=lambda j: xs[j].solution_value())
                          for xs in builder.x]
                z = max(range(ZERO_STAGES), key=lambda k: builder.zeta[k].solution_value())
        finally:                         # the model as built, for the next memory weight
            for var in fixed:
                var.SetUb(1.0)
        names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
                 pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}
        name = names.get(status, f"status {status}")
        if not solved:
            raise InfeasibleError(_infeasible_message(problem) if explain else
                                  "the intra-op ILP is infeasible")
    seconds = time.perf_counter() - t0
    log.info("intra-op ILP: %s; built in %.3f s, solved in %.3f s: %s%s",
             problem.describe(), t_build, seconds - t_build, name,
             " (integral LP relaxation)" if root is not None else
             f" ({len(fix)} placements fixed by reduced costs)")
    val = objective(problem, choice, z)
    return Solution(choice, z, val["total"], val["memory"], seconds, name)


#: how far from 0 or 1 an integer variable of the LP relaxation's optimum may lie and still
#: count as integral (CBC's default integer tolerance, ``CbcModel::CbcIntegerTolerance``)
INTEGER_TOLERANCE = 1e-6
#: relative margin of the reduced-cost test (:func:`_relaxation`) for the LP's tolerances
REDUCED_COST_MARGIN = 1e-6


def _relaxation(builder: IlpBuilder, problem: IntraOpProblem, time_limit_s: float
                ) -> tuple[tuple[list[int], int] | None, list[int]]:
    """The model's LP relaxation -- every variable continuous -- solved with CLP:
    ((choice, ZeRO stage), []) when its optimum is integral in every x and zeta; else
    (None, the x columns branch and bound may fix at 0); (None, []) when CLP finds no
    optimum (infeasible, numerical trouble); OutOfTime when it stops at the time limit.

    An integral optimum is the ILP's optimum: the relaxation's optimum z_LP bounds the
    ILP's from below, and an optimum integral in x and zeta is a feasible point of the ILP
    that attains it (the pair variables e, w, y and the hinges h are continuous in the ILP
    too). Branch and bound would stop at its root for the same reason, after CBC's
    preprocessing and cut rounds: on GPT-39B on 64 A100s the relaxation was integral in 35
    of the library's 36 solves, and CLP solved each in about a fifth of CBC's CPU time.

    Fractional: reduced-cost fixing. A column at 0 in the LP optimum with reduced cost d
    raises the objective of any solution setting it to 1 by at least d (LP duality), so
    where z_LP + d exceeds z_UB, the objective of a feasible assignment (the relaxation
    rounded: each group's largest x), no optimum of the ILP takes it, and fixing it at 0
    keeps every optimum (Wolsey, *Integer Programming* (1998), ch. 2 and sec. 7.3 on
    preprocessing; on the fractional GPT-39B solve, 143 of 278 columns, CBC's time 0.31 ->
    0.12 s). Among tied optima the one CLP or the fixed model's branch and bound returns
    may differ from CBC's on the whole model."""
    from ortools.linear_solver import linear_solver_pb2, pywraplp

    model = linear_solver_pb2.MPModelProto()
    model.CopyFrom(builder.proto)             # the model as loaded, objective as reweighted
    xs = [[v.index() for v in group] for group in builder.x]
    zs = [v.index() for v in builder.zeta]
    integer = [i for group in xs for i in group] + zs         # the model's integer columns
    for i in integer:
        model.variable[i].is_integer = False
    lp = pywraplp.Solver.CreateSolver("CLP")
    if lp is None or lp.LoadModelFromProto(model):
        return None, []
    lp.SetTimeLimit(int(time_limit_s * 1000))
    status = lp.Solve()
    if status in (pywraplp.Solver.FEASIBLE, pywraplp.Solver.NOT_SOLVED):   # time limit: CBC
        # would solve it at its root, blind to its own limit (a Mamba layer: minutes past 2 s)
        raise OutOfTime(f"the intra-op ILP's LP relaxation ({len(model.variable):,} "
                        f"variables) did not finish in {time_limit_s:.1f} s")
    if status != pywraplp.Solver.OPTIMAL:
        return None, []
    response = linear_solver_pb2.MPSolutionResponse()
    lp.FillSolutionResponseProto(response)
    values = response.variable_value
    choice = [max(range(len(group)), key=lambda j: values[group[j]]) for group in xs]
    z = max(range(ZERO_STAGES), key=lambda k: values[zs[k]])
    if all(abs(values[i] - round(values[i])) <= INTEGER_TOLERANCE for i in integer):
        return (choice, z), []
    if not feasible(problem, choice, z):
        return None, []
    upper = objective(problem, choice, z)["total"]
    if not math.isfinite(upper):
        return None, []
    lower = response.objective_value
    gap = upper - lower + REDUCED_COST_MARGIN * max(1.0, abs(upper))
    cost = response.reduced_cost
    return None, [i for group in xs for i in group
                  if values[i] <= INTEGER_TOLERANCE and cost[i] > gap]


def min_memory(problem: IntraOpProblem) -> Solution:
    """The assignment needing the least memory (what an infeasible message reports)."""
    relaxed = IntraOpProblem(problem.names, [np.zeros_like(c) for c in problem.node_cost],
                             problem.node_mem, [(u, v, np.where(np.isfinite(m), 0.0, m))
                                                for u, v, m in problem.edges],
                             {}, problem.zmem, [], [], problem.mem_max, math.inf, 1.0 / 1e9,
                             problem.zero_allowed)
    return solve(relaxed)


def _infeasible_message(problem: IntraOpProblem) -> str:
    if not math.isfinite(problem.budget):
        return "the intra-op ILP has no consistent assignment (no placement fits every op)"
    try:
        least = min_memory(problem)
    except InfeasibleError:
        return "the intra-op ILP has no consistent assignment"
    return (f"no placement fits in {problem.budget / 1e9:.2f} GB per device: the least "
            f"memory any placement needs is {least.memory / 1e9:.2f} GB (ZeRO-{least.zero}); "
            "more devices per stage, more pipeline stages, a smaller micro-batch or "
            "activation checkpointing would help")
