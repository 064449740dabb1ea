"""What the optimizer accepts (parameters, param groups) and its state dict, in ``torch.optim.AdamW``'s format.

The state dict holds ``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, plus ``master`` (the fp32 master weight)
for parameters that are not fp32, so it loads into ``torch.optim.AdamW`` and back, at any number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_gh.superoffload.layout import HostLayout, Slot
from lightning_gh.superoffload.options import validate_hyperparameters

__all__ = ["SHARDED_ALTERNATIVES", "adamw_arguments", "adamw_group_defaults", "check_group", "check_param", "load_into",
           "pack_state_dict"]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# What to use instead when the parameters are already sharded by another strategy (ZeRO-3 style).
SHARDED_ALTERNATIVES = (
    "for ZeRO-3 with the fp32 master weights and AdamW state in host memory use Trainer(strategy='superoffload_fsdp') "
    "(FSDP2 shards the bf16 parameters, ShardedHostAdamW keeps each rank's state on its host; the module calls "
    "fully_shard in configure_model and returns torch.optim.AdamW); for ZeRO-1/2 across GPUs or a model whose bf16 "
    "weights fit one GPU use Trainer(strategy='superoffload'); other frameworks' ZeRO-3 offload (Lightning's "
    "FSDPStrategy(cpu_offload=True), strategy='deepspeed_stage_3_offload') keep their own optimizers")


def _check_not_sharded(p: torch.Tensor) -> None:
    """Refuse parameters an FSDP / DeepSpeed ZeRO-3 wrapper already sharded: the offload pipeline needs each rank's
    whole, local parameters and their gradients as autograd produces them."""
    kind = None
    if type(p).__name__ == "DTensor" or hasattr(p, "device_mesh") and hasattr(p, "placements"):
        kind = "a DTensor (FSDP2 fully_shard / ModelParallelStrategy / FSDPStrategy)"
    elif type(p).__name__ == "FlatParameter" or hasattr(p, "_fsdp_flattened"):
        kind = "an FSDP FlatParameter"
    elif hasattr(p, "ds_id") or hasattr(p, "ds_status"):
        kind = "a DeepSpeed ZeRO-3 partitioned parameter"
    if kind is not None:
        raise TypeError(f"HeterogeneousAdamW got {kind} of shape {tuple(p.shape)}: parameters sharded by "
                        f"another strategy (ZeRO-3) are not supported; {SHARDED_ALTERNATIVES}.")


def check_param(p: Any, known: dict[int, Slot]) -> None:
    """Refuse what the optimizer cannot hold: a non-tensor, a parameter seen before (``known``: by ``id``), an
    unsupported dtype, a sparse or an already sharded parameter."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"HeterogeneousAdamW params must be tensors, got {type(p).__name__}.")
    if id(p) in known:
        raise ValueError("a parameter appears in more than one param group.")
    if p.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"parameter of dtype {p.dtype} is not supported; allowed: float32, bfloat16, float16.")
    if p.is_sparse:
        raise ValueError("sparse parameters are not supported by HeterogeneousAdamW.")
    _check_not_sharded(p)


def check_group(group: dict[str, Any], gi: int) -> None:
    """Refuse AdamW variants the optimizer does not run and check a group's hyper-parameters as
    ``torch.optim.AdamW`` checks its own (a tensor learning rate becomes a float)."""
    for key in ("amsgrad", "maximize", "differentiable"):
        if group.get(key):
            raise ValueError(f"param_groups[{gi}] sets {key}=True; HeterogeneousAdamW supports only plain AdamW.")
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        group["lr"] = lr = float(lr)
    validate_hyperparameters(f"param_groups[{gi}] ", lr, group["betas"], group["eps"], group["weight_decay"])


def adamw_group_defaults() -> dict[str, Any]:
    """The keys torch.optim.AdamW keeps in a param group, so our state_dict loads into it and back."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return dict(probe.defaults)


def adamw_arguments(optimizer: torch.optim.Optimizer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A ``torch.optim.AdamW``'s param groups (the same dict objects: torch's add_param_group keeps the dict it is
    given, so an LR scheduler still bound to the old optimizer, e.g. inside a SequentialLR, writes the learning
    rate the new one reads) and its default hyper-parameters; refuses anything else."""
    decoupled = isinstance(optimizer, torch.optim.Adam) and \
        getattr(optimizer, "defaults", {}).get("decoupled_weight_decay")
    if not (isinstance(optimizer, torch.optim.AdamW) or decoupled):
        raise TypeError(f"HeterogeneousAdamW.from_optimizer needs a torch.optim.AdamW, got "
                        f"{type(optimizer).__name__} (Adam's weight decay is L2, not decoupled).")
    for g in optimizer.param_groups:
        for key in ("amsgrad", "maximize"):
            if g.get(key):
                raise ValueError(f"the AdamW sets {key}=True, which HeterogeneousAdamW does not support.")
    d = optimizer.defaults
    return list(optimizer.param_groups), {"lr": float(d["lr"]), "betas": tuple(d["betas"]), "eps": d["eps"],
                                          "weight_decay": d["weight_decay"]}


def pack_state_dict(param_groups: list[dict[str, Any]], layout: HostLayout,
                    gathered: dict[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The state dict of the parameters in ``param_groups``, from ``layout`` (and, over several ranks, from the
    host state ``gathered`` from every rank, by slot index)."""
    packed_groups = []
    index = 0
    id_of: dict[int, int] = {}
    for g in param_groups:
        pg = {k: v for k, v in g.items() if k != "params"}
        ids = []
        for p in g["params"]:
            id_of[id(p)] = index
            ids.append(index)
            index += 1
        pg["params"] = ids
        packed_groups.append(pg)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for s in layout.slots:
        i = id_of[id(s.param)]
        if s.index in gathered:
            st = {k: v.view(s.param.shape) if k != "step" else v for k, v in gathered[s.index].items()}
            if s.param.dtype == torch.float32:
                del st["master"]
            state[i] = st
        elif layout.built and s.step is not None:
            shape = s.param.shape
            st = {"step": s.step.detach().to("cpu", copy=True), "exp_avg": s.exp_avg.view(shape),
                  "exp_avg_sq": s.exp_avg_sq.view(shape)}
            if s.param.dtype != torch.float32:
                st["master"] = (s.master if s.residency == "host" else s.dev_master).view(shape)
            state[i] = st
        elif s.index in layout.pending:
            state[i] = dict(layout.pending[s.index])
    return {"state": state, "param_groups": packed_groups}


def load_into(param_groups: list[dict[str, Any]], layout: HostLayout, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` (saved by HeterogeneousAdamW or ``torch.optim.AdamW``, any device or dtype): the saved
    groups' hyper-parameters into ``param_groups``, each parameter's state into ``layout``."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                         f"{len(param_groups)}.")
    for i, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(f"param_groups[{i}] has {len(g['params'])} parameters, the loaded one has "
                             f"{len(sg['params'])}.")
    id_map: dict[Any, Slot] = {}
    for gi, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        for p, k in zip(g["params"], sg["params"]):
            id_map[k] = layout.slot_of[id(p)]
        for key, val in sg.items():
            if key not in ("params", "param_names"):
                g[key] = val
        check_group(g, gi)
    for k, st in state_dict["state"].items():
        slot = id_map.get(k)
        if slot is None:
            continue
        clean = {key: torch.as_tensor(v).detach().to("cpu", torch.float32).clone()
                 for key, v in st.items() if key in ("step", "exp_avg", "exp_avg_sq", "master")}
        if "exp_avg" not in clean or "exp_avg_sq" not in clean or "step" not in clean:
            raise ValueError(f"state for parameter {k} lacks step/exp_avg/exp_avg_sq: not an AdamW state.")
        if clean["exp_avg"].numel() != slot.numel:
            raise ValueError(f"state for parameter {k} has {clean['exp_avg'].numel()} elements, the parameter "
                             f"has {slot.numel}.")
        layout.load(slot, clean)
