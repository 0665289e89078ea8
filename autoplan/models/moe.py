"""Mixture-of-experts layers with static shapes: capacity-based token dispatch.

A mixture-of-experts (MoE) feed-forward layer sends each token to ``k`` of ``E`` experts
chosen by a router (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et al.
2024). The usual implementation loops over the experts a batch happens to hit and gathers
their tokens with ``nonzero`` — shapes that depend on the routing, which a meta-device trace
cannot follow.

Here every expert processes a fixed number of token slots, its *capacity*
(GShard, Lepikhin et al. 2020, sec. 2.2; Switch sec. 2.2):

    C = ceil(capacity_factor · k · T / E)        T tokens, k experts per token, E experts

Token-expert pairs are numbered within their expert in token order (a cumulative sum over a
one-hot of the choices); a pair whose number is below ``C`` is copied into its expert's slot
(an ``index_put`` of static shape), the experts run as two batched matmuls over an
``(E, C, h)`` buffer, and each token sums its experts' outputs weighted by the router. Pairs
beyond the capacity are dropped (their weight is zeroed), as in GShard and Switch; with
``capacity_factor >= E / k`` nothing can be dropped and the result equals the dropless
loop's.

So the layer traces on the meta device with exact shapes and its FLOPs are those of the
work it does: ``E · C`` token slots per expert matmul, i.e. ``capacity_factor · k · T``
tokens' worth — the *active* parameters' FLOPs (6 · N_active · T per step, Kaplan et al.
2020's rule applied to the parameters a token uses) times the capacity factor. Routing
balance: on the meta device there are no values; a balanced router fills every expert to
``k T / E``, which is what ``capacity_factor = 1`` prices. An imbalance factor ``f`` (the
most loaded expert gets ``f`` times the mean) is priced as ``capacity_factor = f``.

The same function serves the built-in MoE GPT family (:class:`MoE`) and every Hugging Face
MoE architecture whose experts module uses transformers' experts interface (Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...): :func:`register_hf_experts` registers it there as
the ``"autoplan_capacity"`` experts implementation, so a model built with
``experts_implementation="autoplan_capacity"`` traces and runs through it with its own
weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

HF_IMPLEMENTATION = "autoplan_capacity"
#: Attribute of a transformers experts module holding its expert-parallel process group
#: (set by the engine, :func:`set_ep_group`; absent: no expert parallelism).
EP_GROUP_ATTR = "autoplan_ep_group"


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Token slots per expert: ``ceil(capacity_factor · k · T / E)``, at least 1 and at most
    ``T`` (an expert never gets a token twice)."""
    return max(1, min(tokens, math.ceil(capacity_factor * top_k * tokens / experts)))


def dispatch_slots(top_k_index: torch.Tensor, experts: int, cap: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of every (token, choice) pair in the flattened ``(E · C + 1)`` buffer, and whether
    it was kept. ``top_k_index`` is ``(T, k)``; pairs are ranked within their expert in
    token order; a dropped pair goes to the spare last slot."""
    ids = top_k_index.reshape(-1)                                   # (S,)  S = T k
    onehot = F.one_hot(ids, experts)                                # (S, E)
    rank = ((onehot.cumsum(0) - 1) * onehot).sum(-1)                # (S,) position in expert
    kept = rank < cap
    slot = torch.where(kept, ids * cap + rank, torch.full_like(ids, experts * cap))
    return slot, kept


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool
            ) -> torch.Tensor:
    """Batched per-expert linear: x (E, C, in), w (E, out, in) or (E, in, out) if
    ``transposed``, b (E, out)."""
    y = torch.bmm(x, w if transposed else w.transpose(1, 2))
    return y if b is None else y + b.unsqueeze(1)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (differentiable), anything else unchanged."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of ``x`` along dim 0 over ``group`` in equal splits (differentiable: its
    backward is the same all-to-all of the gradient)."""
    return _AllToAll.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` in equal splits as a blocking c10d call, forward and backward
    (as :class:`autoplan.models.context_parallel._GatherAlong` does for the all-gather: the
    functional collectives' asynchronous tensors crashed gloo runs now and then)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def capacity_forward(hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, *, experts: int, capacity_factor: float,
                     up: torch.Tensor, down: torch.Tensor, apply_gate,
                     up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                     transposed: bool = False, post=None, ep_group=None) -> torch.Tensor:
    """The experts' output ``(T, h)`` for ``hidden`` ``(T, h)`` routed to ``top_k_index``
    with ``top_k_weights`` (both ``(T, k)``): see the module docstring.

    Expert parallelism (``ep_group`` of ``ep`` ranks, GShard sec. 2.2; Megatron-LM and
    torchtitan fold it into data parallelism): ``up``/``down`` hold this rank's ``E / ep``
    experts; the ``(E, C, h)`` buffer of this rank's tokens is exchanged by an all-to-all
    (expert block ``j`` to rank ``j``), the local experts run on the ``ep · C`` slots every
    rank sent them, and a second all-to-all brings the outputs home (*dispatch* and
    *combine*: each moves ``k · C_f · T · h`` elements per rank and direction, the same
    again in backward). The expert weights may be DTensors sharded ``Shard(0)`` over the
    expert-parallel mesh (the engine's, :mod:`engine.expert_parallel`): their local shards
    are used."""
    up, down, up_bias, down_bias = map(_local, (up, down, up_bias, down_bias))
    tokens, h = hidden.shape
    k = top_k_index.shape[-1]
    cap = capacity(tokens, experts, k, capacity_factor)
    slot, kept = dispatch_slots(top_k_index, experts, cap)
    pairs = hidden.repeat_interleave(k, dim=0)                      # (S, h)
    buf = hidden.new_zeros(experts * cap + 1, h).index_put((slot,), pairs)
    x = buf[:-1].view(experts, cap, h)
    if ep_group is not None:
        ep = ep_group.size()
        local = experts // ep
        x = _exchange(x, ep_group).view(ep, local, cap, h).transpose(0, 1).reshape(
            local, ep * cap, h)
    y = _linear(apply_gate(_linear(x, up, up_bias, transposed)), down, down_bias, transposed)
    if post is not None:
        y = post(y)
    if ep_group is not None:
        y = _exchange(y.view(local, ep, cap, h).transpose(0, 1).reshape(experts, cap, h),
                      ep_group)
    out = torch.cat([y.reshape(experts * cap, h), y.new_zeros(1, h)])[slot]   # (S, h)
    w = (top_k_weights.reshape(-1) * kept).to(out.dtype).unsqueeze(-1)
    return (out * w).view(tokens, k, h).sum(1).to(hidden.dtype)


def _hf_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-interface signature (``self`` is the model's experts module)."""
    gated = getattr(self, "has_gate", True)
    bias = getattr(self, "has_bias", False)
    up = self.gate_up_proj if gated else self.up_proj
    up_bias = (self.gate_up_proj_bias if gated else self.up_proj_bias) if bias else None
    factor = getattr(self.config, "autoplan_capacity_factor", 1.0)
    return capacity_forward(
        hidden_states, top_k_index, top_k_weights, experts=self.num_experts,
        capacity_factor=factor, up=up, down=self.down_proj, up_bias=up_bias,
        down_bias=self.down_proj_bias if bias else None,
        apply_gate=self._apply_gate if gated else self.act_fn,
        transposed=getattr(self, "is_transposed", False),
        post=self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None,
        ep_group=getattr(self, EP_GROUP_ATTR, None))


#: the names transformers' MoE configs give the routed experts' count and the experts per
#: token (Mixtral and most: num_local_experts / num_experts / n_routed_experts with
#: num_experts_per_tok; Aria and ERNIE 4.5: moe_num_experts with moe_topk / moe_k; Bailing
#: and Kimi: num_experts_per_token; Gemma 4: top_k_experts)
_HF_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_HF_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k",
             "top_k_experts")


def config_value(config, name: str, default=None):
    """``getattr(config, name, default)``, also when reading the attribute raises something
    else than AttributeError (transformers' per-layer configs refuse a global ``head_dim``
    with their own error)."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 -- whatever the config class raises: not there
        return default


def _first_int(config, names: tuple[str, ...]) -> int | None:
    return next((v for v in (config_value(config, a) for a in names)
                 if isinstance(v, int) and not isinstance(v, bool)), None)


def hf_routing(config) -> tuple[int, int] | None:
    """(experts, top-k) of a transformers config that describes a mixture of experts."""
    experts, top_k = _first_int(config, _HF_EXPERTS) or 0, _first_int(config, _HF_TOP_K)
    if experts > 1 and top_k is not None and top_k >= 1:
        return experts, top_k
    return None


def use_capacity_experts(config, capacity_factor: float = 1.0) -> bool:
    """Make a transformers MoE ``config`` build its experts with :func:`capacity_forward`
    (traceable, static shapes); False (config untouched) when it is not an MoE config or
    this transformers has no experts interface."""
    if hf_routing(config) is None or not register_hf_experts():
        return False
    config._experts_implementation = HF_IMPLEMENTATION
    config.autoplan_capacity_factor = float(capacity_factor)
    return True


def register_hf_experts() -> bool:
    """Register :func:`capacity_forward` as transformers' ``"autoplan_capacity"`` experts
    implementation; False when this transformers has no experts interface."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    ALL_EXPERTS_FUNCTIONS.register(HF_IMPLEMENTATION, _hf_experts_forward)
    return True


class MoE(nn.Module):
    """A SwiGLU mixture-of-experts feed-forward layer (Mixtral's; with ``shared`` > 0 also
    DeepSeek's always-on shared experts, Dai et al. 2024, sec. 3).

    Router: ``softmax(x W_r)`` over ``E`` experts, top-``k`` kept and renormalised
    (Mixtral); experts' weights stored as ``(E, 2f, h)`` and ``(E, h, f)`` tensors (the layout
    of transformers' experts modules), so expert parallelism shards dimension 0.
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, *,
                 capacity_factor: float = 1.0, shared: int = 0):
        super().__init__()
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.ep_group = None
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.shared = None
        if shared:
            self.shared = nn.ModuleDict({
                "gate": nn.Linear(hidden, shared * ffn, bias=False),
                "up": nn.Linear(hidden, shared * ffn, bias=False),
                "down": nn.Linear(shared * ffn, hidden, bias=False)})

    def shard_experts(self, group) -> None:
        """Expert parallelism over ``group``: keep this rank's ``E / ep`` experts (dim 0 of
        the expert weights, contiguous blocks: rank ``r`` holds experts ``r E/ep ..``); the
        forward then exchanges tokens by all-to-all (:func:`capacity_forward`)."""
        ep, rank = group.size(), group.rank()
        if self.experts % ep:
            raise ValueError(f"{self.experts} experts do not split over {ep} ranks")
        local = self.experts // ep
        for name in ("gate_up", "down"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[rank * local:(rank + 1) * local]
                                             .clone(), requires_grad=full.requires_grad))
        self.ep_group = group

    @staticmethod
    def _gate(gate_up: torch.Tensor) -> torch.Tensor:
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.router(flat).float().softmax(-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        y = capacity_forward(flat, index, weights, experts=self.experts,
                             capacity_factor=self.capacity_factor, up=self.gate_up,
                             down=self.down, apply_gate=self._gate, ep_group=self.ep_group)
        if self.shared is not None:
            s = self.shared
            y = y + s["down"](F.silu(s["gate"](flat)) * s["up"](flat))
        return y.view(shape)


def set_ep_group(module: nn.Module, group) -> None:
    """Run an experts module (:class:`MoE` or a transformers one) expert-parallel over
    ``group``: its expert weights then hold this rank's ``E / ep`` experts (the caller
    shards them) and tokens travel by all-to-all (:func:`capacity_forward`)."""
    if isinstance(module, MoE):
        module.ep_group = group
    else:
        setattr(module, EP_GROUP_ATTR, group)


def _routing_of(module: nn.Module) -> tuple[int, int] | None:
    """(experts, top-k) of an experts-holding module: the built-in :class:`MoE`, or a
    transformers experts module (``num_experts`` and its config's experts per token)."""
    if isinstance(module, MoE):
        return module.experts, module.top_k
    experts = getattr(module, "num_experts", None)
    config = getattr(module, "config", None)
    top_k = _first_int(config, _HF_TOP_K) if config is not None else None
    if isinstance(experts, int) and isinstance(top_k, int) and experts > 1 and any(
            p.dim() == 3 and p.shape[0] == experts for p in module.parameters(recurse=False)):
        return experts, top_k
    return None


def active_params(model: nn.Module) -> int:
    """Parameters one token uses: all of them, except that of each expert weight (a tensor
    whose first dimension runs over the ``E`` experts) only ``k / E`` count."""
    total = sum(p.numel() for p in model.parameters())
    idle = 0.0
    for module in model.modules():
        routing = _routing_of(module)
        if routing is None:
            continue
        experts, top_k = routing
        for p in module.parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] == experts:
                idle += p.numel() * (1 - top_k / experts)
    return round(total - idle)


def _capacity_factor(module: nn.Module) -> float:
    if isinstance(module, MoE):
        return module.capacity_factor
    return float(getattr(getattr(module, "config", None), "autoplan_capacity_factor", 1.0))


def _hidden(module: nn.Module) -> int:
    """The model width the experts read and write (the all-to-all's row size)."""
    if isinstance(module, MoE):
        return module.down.shape[1]
    down = module.down_proj                       # (E, h, I), or (E, I, h) when transposed
    return down.shape[2] if getattr(module, "is_transposed", False) else down.shape[1]


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE module of a model: what the tracer records of it."""

    experts: int
    top_k: int
    capacity_factor: float
    hidden: int
    params: tuple[str, ...]           # FQNs of its expert weights (dim 0 over the experts)

    def a2a_bytes(self, tokens: int, elem_bytes: int) -> int:
        """One all-to-all's bytes per rank for ``tokens`` tokens (GShard dispatch/combine:
        the ``(E, C, h)`` capacity buffer)."""
        return capacity(tokens, self.experts, self.top_k, self.capacity_factor) \
            * self.experts * self.hidden * elem_bytes


def expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """Every MoE module of ``model`` (the built-in :class:`MoE` and transformers' experts
    modules), with the FQNs of its expert weights."""
    out = []
    for prefix, module in model.named_modules():
        routing = _routing_of(module)
        if routing is None:
            continue
        experts, top_k = routing
        names = tuple(f"{prefix}.{n}" if prefix else n
                      for n, p in module.named_parameters(recurse=False)
                      if p.dim() == 3 and p.shape[0] == experts)
        out.append(ExpertLayer(experts, top_k, _capacity_factor(module), _hidden(module), names))
    return out
